"""The chaos run's outcome checker counts leases the server gave back unsent (hardening item 15).

When a lease reply cannot be sent (the worker was killed while its claim ran), the server
releases the lease: the history closes that attempt as ``released`` and the job is delivered
again, which is no duplicate execution. The checker must allow that extra delivery, but only
when the workers' own logs agree that no worker received it. The histories here are built
through the service, as the server builds them; the worker logs are records as
``relay_worker`` writes them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from queue_core.service import QueueService
from tests.chaos.scenario import ChaosResult, Expected, _check_outcome

pytestmark = pytest.mark.django_db(transaction=True)


@dataclasses.dataclass
class _Proc:
    name: str
    records: list[dict[str, Any]]


@dataclasses.dataclass
class _Cluster:
    """What ``_check_outcome`` reads of the chaos cluster: the processes' log records."""

    workers: list[_Proc]
    killed_worker_ids: set[str] = dataclasses.field(default_factory=set)
    servers: list[_Proc] = dataclasses.field(default_factory=list)

    def all_procs(self) -> list[_Proc]:
        return [*self.servers, *self.workers]


def _given_back_unsent(service: QueueService) -> tuple[str, str]:
    """One job: attempt 1 leased to chaos-w0-g1 and given back by the server as it does when
    the reply cannot be sent; attempt 2 leased to chaos-w1-g2 and acked. Return the job id and
    the first lease's token."""
    job_id = service.submit("chaos", {"i": 0, "sleep_ms": 5})["job"]["id"]
    (unsent,) = service.claim(["chaos"], worker_id="chaos-w0-g1")
    service.release(job_id, worker_id="chaos-w0-g1", lease_token=unsent["lease_token"])
    (lease,) = service.claim(["chaos"], worker_id="chaos-w1-g2")
    service.ack(job_id, worker_id="chaos-w1-g2", lease_token=lease["lease_token"])
    return job_id, unsent["lease_token"]


def _check(job_id: str, workers: list[_Proc]) -> ChaosResult:
    result = ChaosResult(jobs=1)
    db = Path(connection.settings_dict["NAME"])
    _check_outcome(_Cluster(workers), db, [job_id], [Expected("succeeded", 1)], result)  # type: ignore[arg-type]
    return result


def test_a_lease_given_back_unsent_is_an_allowed_redelivery(service: QueueService) -> None:
    job_id, _ = _given_back_unsent(service)
    worker = _Proc(
        "chaos-w1-g2",
        [
            {"event": "leased", "job_id": job_id, "attempt": 2},
            {"event": "acked", "job_id": job_id, "attempt": 2},
        ],
    )
    result = _check(job_id, [_Proc("chaos-w0-g1", []), worker])
    assert result.violations == []
    assert (result.released_unsent, result.duplicates, result.allowed_duplicates) == (1, 1, 1)
    assert "released_unsent=1" in result.summary()


def test_a_release_of_a_delivery_a_worker_received_is_a_violation(
    service: QueueService,
) -> None:
    # The server's word alone does not count: chaos-w0-g1 logged receiving attempt 1 and never
    # gave it back, so "released" in the history contradicts the worker.
    job_id, _ = _given_back_unsent(service)
    workers = [
        _Proc("chaos-w0-g1", [{"event": "leased", "job_id": job_id, "attempt": 1}]),
        _Proc(
            "chaos-w1-g2",
            [
                {"event": "leased", "job_id": job_id, "attempt": 2},
                {"event": "acked", "job_id": job_id, "attempt": 2},
            ],
        ),
    ]
    result = _check(job_id, workers)
    assert any("attempt 1: released, but chaos-w0-g1" in v for v in result.violations)
    assert result.released_unsent == 0


def test_a_release_the_worker_logged_is_counted_as_the_workers(service: QueueService) -> None:
    job_id, _ = _given_back_unsent(service)
    workers = [
        _Proc(
            "chaos-w0-g1",
            [
                {"event": "leased", "job_id": job_id, "attempt": 1},
                {"event": "released", "job_id": job_id, "attempt": 1, "reason": "interrupted"},
            ],
        ),
        _Proc(
            "chaos-w1-g2",
            [
                {"event": "leased", "job_id": job_id, "attempt": 2},
                {"event": "acked", "job_id": job_id, "attempt": 2},
            ],
        ),
    ]
    result = _check(job_id, workers)
    assert result.violations == []
    assert (result.released_by_workers, result.released_unsent) == (1, 0)
