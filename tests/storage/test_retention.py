"""Retention (``QueueService.prune``), fake clock, once per storage driver.

The rule under test (docs/failure-model.md, "Retention"): a finished job is deleted once it
finished *more* than its retention ago (one that finished exactly that long ago is kept),
with its attempts, events and task result; its idempotency key is then free again; the
counts ``stats`` reports follow; each transaction deletes at most ``limit`` jobs."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job, JobAttempt, JobEvent
from queue_core.service import QueueService
from relay_tasks.models import TaskResultRecord
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

Factory = Callable[..., dict[str, Any]]
DAY_MS = 86_400_000


def succeeded_job(service: QueueService, leased_job: Factory, **options: Any) -> str:
    lease = leased_job(**options)
    service.ack(lease["job_id"], worker_id="w1", lease_token=lease["lease_token"])
    return str(lease["job_id"])


def test_boundary_exactly_retention_ago_is_kept_one_ms_more_is_pruned(
    service: QueueService, clock: FakeClock, leased_job: Factory
) -> None:
    job_id = succeeded_job(service, leased_job)
    clock.advance(ms=DAY_MS)
    assert service.prune({"succeeded": DAY_MS}) == {"succeeded": 0, "dead": 0, "cancelled": 0}
    assert Job.objects.filter(id=job_id).exists()
    clock.advance(ms=1)
    assert service.prune({"succeeded": DAY_MS}) == {"succeeded": 1, "dead": 0, "cancelled": 0}
    assert not Job.objects.filter(id=job_id).exists()


def test_each_state_has_its_own_retention_and_zero_keeps_forever(
    service: QueueService, clock: FakeClock, leased_job: Factory, dead_job: Factory
) -> None:
    done = succeeded_job(service, leased_job)
    dead = dead_job()["id"]
    clock.advance(ms=10 * DAY_MS)
    assert service.prune({"succeeded": 0, "dead": DAY_MS}) == {
        "succeeded": 0,
        "dead": 1,
        "cancelled": 0,
    }
    assert Job.objects.filter(id=done).exists() and not Job.objects.filter(id=dead).exists()
    assert service.prune({"dead": DAY_MS}) == {
        "succeeded": 0,
        "dead": 0,
        "cancelled": 0,
    }  # absent: kept
    assert Job.objects.filter(id=done).exists()


def test_default_retention_comes_from_the_settings(
    service: QueueService, clock: FakeClock, leased_job: Factory, dead_job: Factory
) -> None:
    done = succeeded_job(service, leased_job)
    dead = dead_job()["id"]
    clock.advance(ms=7 * DAY_MS + 1)  # defaults: 7d succeeded, 30d dead
    assert service.prune() == {"succeeded": 1, "dead": 0, "cancelled": 0}
    clock.advance(ms=23 * DAY_MS)
    assert service.prune() == {"succeeded": 0, "dead": 1, "cancelled": 0}
    assert not Job.objects.filter(id__in=[done, dead]).exists()


def test_live_jobs_are_never_pruned(
    service: QueueService, clock: FakeClock, leased_job: Factory
) -> None:
    leased = leased_job(lease_ms=3_600_000)["job_id"]
    ready = service.submit("default", {"n": 2})["job"]["id"]
    pending = service.submit("default", {"n": 3}, delay_ms=30 * DAY_MS)["job"]["id"]
    clock.advance(ms=2 * DAY_MS)
    assert service.prune({"succeeded": 1, "dead": 1}) == {"succeeded": 0, "dead": 0, "cancelled": 0}
    assert Job.objects.filter(id__in=[leased, ready, pending]).count() == 3


def test_history_and_task_results_go_with_their_jobs(
    service: QueueService, clock: FakeClock, leased_job: Factory, dead_job: Factory
) -> None:
    kept = succeeded_job(service, leased_job)
    dead = dead_job()["id"]
    service.replay(dead)  # an event row
    lease = service.claim(["default"], worker_id="w1", lease_ms=30_000)[0]
    service.fail(dead, worker_id="w1", lease_token=lease["lease_token"], error="x", retryable=False)
    for job_id in (kept, dead):
        TaskResultRecord.objects.create(job_id=job_id, updated_at_ms=clock.now_ms())
    assert JobEvent.objects.filter(job_id=dead).exists()
    assert JobAttempt.objects.filter(job_id=dead).count() == 2
    clock.advance(ms=DAY_MS + 1)
    assert service.prune({"dead": DAY_MS}) == {"succeeded": 0, "dead": 1, "cancelled": 0}
    assert not JobAttempt.objects.filter(job_id=dead).exists()
    assert not JobEvent.objects.filter(job_id=dead).exists()
    assert not TaskResultRecord.objects.filter(job_id=dead).exists()
    assert JobAttempt.objects.filter(job_id=kept).count() == 1
    assert TaskResultRecord.objects.filter(job_id=kept).exists()


def test_batches_are_bounded_and_oldest_go_first(
    service: QueueService, clock: FakeClock, leased_job: Factory
) -> None:
    ids = []
    for _ in range(7):
        ids.append(succeeded_job(service, leased_job))
        clock.advance(ms=1)
    clock.advance(ms=DAY_MS)
    assert service.prune_batch({"succeeded": DAY_MS}, limit=3) == {
        "succeeded": 3,
        "dead": 0,
        "cancelled": 0,
    }
    assert set(Job.objects.values_list("id", flat=True)) == set(ids[3:])
    # prune loops over batches until one comes back short: 3 + 1.
    assert service.prune({"succeeded": DAY_MS}, batch=3) == {
        "succeeded": 4,
        "dead": 0,
        "cancelled": 0,
    }
    assert not Job.objects.exists()


def test_prune_stops_after_max_batches(
    service: QueueService, clock: FakeClock, leased_job: Factory
) -> None:
    for _ in range(5):
        succeeded_job(service, leased_job)
    clock.advance(ms=DAY_MS + 1)
    assert service.prune({"succeeded": DAY_MS}, batch=2, max_batches=2)["succeeded"] == 4
    assert Job.objects.count() == 1


def test_leave_lock_sleeps_its_multiple_of_the_transaction_on_sqlite_only(
    service: QueueService, clock: FakeClock, backend: str
) -> None:
    # SQLite's write lock is not fair: back to back transactions kept a waiting server out for
    # seconds (a hostile review). PostgreSQL's row locks leave other jobs' writers alone.
    began = clock.monotonic()
    clock.advance(ms=20)
    service.leave_lock(began, 1.5)
    assert clock.monotonic() - began == pytest.approx(0.05 if backend == "sqlite" else 0.02)
    began = clock.monotonic()
    clock.advance(ms=20)
    service.leave_lock(began, 0)
    assert clock.monotonic() - began == pytest.approx(0.02)


def test_prune_leaves_the_lock_between_its_batches_for_its_yield_factor(
    service: QueueService,
    clock: FakeClock,
    backend: str,
    leased_job: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for _ in range(5):
        succeeded_job(service, leased_job)
    clock.advance(ms=DAY_MS + 1)
    real, spans = service.prune_batch, []

    def prune_batch(*args: Any, **kwargs: Any) -> dict[str, int]:
        began = clock.monotonic()
        clock.advance(ms=10)  # the batch's work
        deleted = real(*args, **kwargs)
        spans.append((began, clock.monotonic()))
        return deleted

    monkeypatch.setattr(service, "prune_batch", prune_batch)
    assert service.prune({"succeeded": DAY_MS}, batch=2, yield_factor=2)["succeeded"] == 5
    gaps = [later[0] - earlier[1] for earlier, later in itertools.pairwise(spans)]
    assert gaps == pytest.approx([0.02, 0.02] if backend == "sqlite" else [0, 0])


def test_batch_limit_is_shared_between_states(
    service: QueueService, clock: FakeClock, leased_job: Factory, dead_job: Factory
) -> None:
    for _ in range(2):
        succeeded_job(service, leased_job)
        dead_job()
    clock.advance(ms=DAY_MS + 1)
    assert service.prune_batch({"succeeded": DAY_MS, "dead": DAY_MS}, limit=3) == {
        "succeeded": 2,
        "dead": 1,
        "cancelled": 0,
    }


def test_stats_count_right_after_pruning(
    service: QueueService, clock: FakeClock, leased_job: Factory, dead_job: Factory
) -> None:
    for _ in range(3):
        succeeded_job(service, leased_job, queue="q")
    dead_job(queue="q")
    service.submit("q", {"n": 9})
    clock.advance(ms=DAY_MS + 1)
    assert service.count_prunable({"succeeded": DAY_MS, "dead": DAY_MS}) == {
        "succeeded": 3,
        "dead": 1,
        "cancelled": 0,
    }
    service.prune({"succeeded": DAY_MS, "dead": DAY_MS})
    counts = service.stats("q")["queues"]["q"]
    assert (counts["succeeded"], counts["dead"], counts["ready"]) == (0, 0, 1)
    assert service.count_prunable({"succeeded": DAY_MS, "dead": DAY_MS}) == {
        "succeeded": 0,
        "dead": 0,
        "cancelled": 0,
    }


def test_a_pruned_jobs_idempotency_key_is_free_again(
    service: QueueService, clock: FakeClock, leased_job: Factory
) -> None:
    job_id = succeeded_job(service, leased_job, idempotency_key="k")
    clock.advance(ms=60_001)  # inside the 24 h idempotency window
    assert service.submit("default", {"n": 1}, idempotency_key="k")["deduplicated"] is True
    service.prune({"succeeded": 60_000})
    fresh = service.submit("default", {"other": 1}, idempotency_key="k")
    assert fresh["deduplicated"] is False and fresh["job"]["id"] != job_id


@pytest.mark.parametrize(
    ("older_than", "limit"),
    [({"ready": 1}, 10), ({"dead": -1}, 10), ({"dead": 1.5}, 10), ({"dead": 1}, 0)],
)
def test_prune_rejects_bad_arguments(
    service: QueueService, older_than: dict[str, Any], limit: int
) -> None:
    with pytest.raises(errors.InvalidArgument):
        service.prune_batch(older_than, limit=limit)


def test_each_pruned_job_is_reported_to_the_observer_after_commit(
    driver: Any, clock: FakeClock, leased_job: Factory, service: QueueService
) -> None:
    seen: list[tuple[str, str]] = []
    observed = QueueService(driver=driver, clock=clock, observer=lambda e, q: seen.append((e, q)))
    for queue in ("a", "a", "b"):
        succeeded_job(service, leased_job, queue=queue)
    clock.advance(ms=DAY_MS + 1)

    def rolled_back() -> None:
        with observed.transaction():
            observed.prune_batch({"succeeded": DAY_MS})
            raise RuntimeError("roll back")

    with pytest.raises(RuntimeError):
        rolled_back()
    assert seen == [] and Job.objects.count() == 3
    observed.prune_batch({"succeeded": DAY_MS})
    assert sorted(seen) == [("pruned", "a"), ("pruned", "a"), ("pruned", "b")]


def test_an_operators_prune_records_one_event_with_the_counts(
    service: QueueService, clock: FakeClock, leased_job: Factory, dead_job: Factory
) -> None:
    for _ in range(3):
        succeeded_job(service, leased_job)
    dead_job()
    clock.advance(ms=2 * DAY_MS)
    ages = {"succeeded": DAY_MS, "dead": DAY_MS}
    assert service.prune(ages, batch=2, actor="alice") == {
        "succeeded": 3,
        "dead": 1,
        "cancelled": 0,
    }
    events = list(JobEvent.objects.filter(event="pruned").values())
    assert len(events) == 1  # one for the whole run, not one per batch of 2
    assert events[0]["job_id"] == "" and events[0]["actor"] == "alice"
    assert events[0]["detail"] == "succeeded=3 dead=1 cancelled=0"
    assert events[0]["at_ms"] == clock.now_ms()
    assert service.prune(ages, actor="alice") == {"succeeded": 0, "dead": 0, "cancelled": 0}
    assert JobEvent.objects.filter(event="pruned").count() == 1  # nothing went: no event
    assert service.prune_batch(ages) == {"succeeded": 0, "dead": 0, "cancelled": 0}


def test_one_batch_for_an_operator_records_its_own_event_and_retention_none(
    service: QueueService, clock: FakeClock, leased_job: Factory
) -> None:
    first, second = succeeded_job(service, leased_job), succeeded_job(service, leased_job)
    clock.advance(ms=DAY_MS + 1)
    assert service.prune_batch({"succeeded": DAY_MS}, limit=1) == {
        "succeeded": 1,
        "dead": 0,
        "cancelled": 0,
    }
    assert not JobEvent.objects.filter(event="pruned").exists()  # retention: no actor
    assert service.prune_batch({"succeeded": DAY_MS}, limit=1, actor="tcp:bob") == {
        "succeeded": 1,
        "dead": 0,
        "cancelled": 0,
    }
    (event,) = JobEvent.objects.filter(event="pruned")
    assert (event.actor, event.detail) == ("tcp:bob", "succeeded=1 dead=0 cancelled=0")
    assert not Job.objects.filter(id__in=[first, second]).exists()
