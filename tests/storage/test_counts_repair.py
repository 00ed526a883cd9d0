"""``QueueService.repair_counts``, once per storage driver: the kept counts against the jobs.

An upgrade review ran a Relay older than migration 0008 (which inserts jobs without counting
them: the count trigger was moved into the driver) against a file the current code had
migrated: ``stats`` said 12 ready where 22 were, and after draining them and 5 more submits,
``ready: 0`` (the table held -5) for good. Here the old writer is the ORM, which inserts a row
as such a server did, bypassing the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from queue_core.models import Job
from queue_core.service import QueueService
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

Factory = Callable[..., dict[str, Any]]


def ready_counts(service: QueueService, queue: str) -> int:
    return int(service.stats()["queues"].get(queue, {}).get("ready", 0))


def insert_uncounted(job_id: str, like: str) -> None:
    """A copy of job ``like`` under ``job_id``, inserted as an old server did."""
    job = Job.objects.get(id=like)
    job.pk = job_id
    job.idempotency_key = None
    job.save(force_insert=True)


def test_counts_left_wrong_by_an_old_writer_are_rebuilt(
    service: QueueService, backend: str
) -> None:
    first = service.submit("old", {"n": 0})["job"]["id"]
    for i in range(3):
        insert_uncounted(f"job_uncounted{i}", first)
    assert Job.objects.filter(queue="old", state="ready").count() == 4
    if backend == "postgresql":  # counted from the jobs themselves at each read
        assert ready_counts(service, "old") == 4
        assert service.repair_counts() == []
        return
    assert ready_counts(service, "old") == 1  # the three old inserts are not counted
    # Drained: the kept count goes negative, and stats shows nothing where 4 jobs wait.
    for _ in range(4):
        lease = service.claim(["old"], worker_id="w")[0]
        service.ack(lease["job_id"], worker_id="w", lease_token=lease["lease_token"])
    for i in range(4):
        service.submit("old", {"n": i})
    assert ready_counts(service, "old") == 1  # 4 ready: 1 + 3 not counted, minus 3 acked
    assert service.repair_counts() == [
        {"queue": "old", "state": "ready", "kept": 1, "jobs": 4},
    ]
    assert ready_counts(service, "old") == 4
    assert service.stats()["queues"]["old"]["succeeded"] == 4
    assert service.repair_counts() == []  # once repaired, nothing more to do


def test_counts_that_hold_are_left_alone(service: QueueService, leased_job: Factory) -> None:
    leased_job()
    service.submit("other", {"n": 1}, delay_ms=60_000)
    assert service.repair_counts() == []
