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
from django.db import connections

from queue_core.clock import FakeClock
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


MINE = ("held", "done", "old0", "old1", "old2", "gone")


def kept_rows(alias: str) -> list[tuple[str, str, int]]:
    """The count rows of this module's queues (the table outlives the tests' flushes)."""
    marks = ", ".join(["%s"] * len(MINE))
    with connections[alias].cursor() as cursor:
        cursor.execute(
            f"SELECT queue, state, n FROM relay_job_count WHERE queue IN ({marks})"
            " ORDER BY queue, state",
            MINE,
        )
        return [tuple(row) for row in cursor.fetchall()]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_the_count_rows_of_purged_and_pruned_jobs_go_with_them(
    service: QueueService, clock: FakeClock, alias: str
) -> None:
    """A review: the triggers only decrement, so a row per (queue, state) ever used stayed at
    zero, and 1,000,000 of them made each submit to a new queue 48 ms. Purge, prune and the
    start-up repair now delete the rows at zero of the queues whose jobs they deleted."""
    held = service.submit("held", 1)["job"]["id"]
    done = service.submit("done", 1)["job"]["id"]
    service.cancel(done)
    service.purge(done)
    assert kept_rows(alias) == [("held", "ready", 1)]
    old = [service.submit(f"old{i}", i)["job"]["id"] for i in range(3)]
    for job_id in old:
        service.cancel(job_id)
    clock.advance(ms=31 * 86_400_000)
    assert service.prune_batch()["cancelled"] == 3
    assert kept_rows(alias) == [("held", "ready", 1)]
    service.cancel(held)
    with connections[alias].cursor() as cursor:  # rows at zero an older Relay left
        cursor.execute("INSERT INTO relay_job_count VALUES ('gone', 'ready', 0)")
    assert service.repair_counts() == []
    assert kept_rows(alias) == [("held", "cancelled", 1)]
    assert service.submit("done", 2)["job"]["queue"] == "done"  # its row comes back
    assert ready_counts(service, "done") == 1
