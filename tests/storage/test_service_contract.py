"""Every transition and every rejection of QueueService, fake clock, once per storage driver:
on a real SQLite file and on a real PostgreSQL database (``backend``, tests/storage/conftest.py).

The ORM reads in these tests go to the driver's database through a router the conftest
installs; the few tests that open a transaction or a cursor of their own name ``alias``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from django.db import IntegrityError, connections, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import override_settings

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job, JobAttempt, JobEvent
from queue_core.service import PAGE_FETCH_ROWS, PAGE_MAX_JOBS, QueueService
from queue_core.storage import Driver
from queue_core.storage.base import REPLY_OVERHEAD_BYTES
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

Factory = Callable[..., dict[str, Any]]


def lease_args(lease: dict[str, Any], worker_id: str = "w1") -> dict[str, Any]:
    return {"worker_id": worker_id, "lease_token": lease["lease_token"]}


def row(job_id: str) -> Job:
    return Job.objects.get(id=job_id)


# ------------------------------------------------------------------ submit


def test_submit_creates_ready_job(service: QueueService, clock: FakeClock) -> None:
    result = service.submit("email", {"user_id": 42}, priority="high", max_retries=5)
    job = result["job"]
    assert result["deduplicated"] is False
    assert job["id"].startswith("job_") and len(job["id"]) == 30
    assert job["state"] == "ready" and job["priority"] == "high" and job["max_retries"] == 5
    assert job["created_at_ms"] == job["ready_since_ms"] == clock.now_ms()
    assert row(job["id"]).payload == '{"user_id":42}'


def test_job_ids_sort_in_submission_order(service: QueueService) -> None:
    ids = [service.submit("q", i)["job"]["id"] for i in range(50)]
    assert ids == sorted(ids)


def test_delayed_job_is_pending_and_never_leased_before_due(
    service: QueueService, clock: FakeClock
) -> None:
    job = service.submit("q", {}, delay_ms=5_000)["job"]
    assert job["state"] == "pending" and job["available_at_ms"] == clock.now_ms() + 5_000
    clock.advance(ms=4_999)
    assert service.claim(["q"], worker_id="w") == []
    clock.advance(ms=1)
    leases = service.claim(["q"], worker_id="w")
    assert [lease["job_id"] for lease in leases] == [job["id"]]
    # Aging counts from the due time, not from submission.
    assert row(job["id"]).ready_since_ms == job["available_at_ms"]


def test_run_at_in_the_past_is_due_at_once(service: QueueService, clock: FakeClock) -> None:
    job = service.submit("q", {}, run_at_ms=clock.now_ms() - 60_000)["job"]
    assert job["state"] == "ready"


def test_run_at_in_the_future_is_pending(service: QueueService, clock: FakeClock) -> None:
    job = service.submit("q", {}, run_at_ms=clock.now_ms() + 10)["job"]
    assert job["state"] == "pending"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"delay_ms": -1}, "delay_ms"),
        ({"delay_ms": 31 * 24 * 3600 * 1000}, "delay_ms"),
        ({"delay_ms": 1, "run_at_ms": 1}, "delay_ms"),
        ({"priority": "urgent"}, "priority"),
        ({"priority": True}, "priority"),
        ({"max_retries": -1}, "max_retries"),
        ({"max_retries": 101}, "max_retries"),
        ({"max_retries": "3"}, "max_retries"),
        ({"backoff": "linear"}, "backoff"),
        ({"backoff_base_ms": 10, "backoff_cap_ms": 5}, "backoff_cap_ms"),
        ({"jitter": "yes"}, "jitter"),
        ({"idempotency_key": ""}, "idempotency_key"),
        ({"idempotency_key": "k" * 256}, "idempotency_key"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_submit_rejects_bad_options(
    service: QueueService, options: dict[str, Any], field: str
) -> None:
    with pytest.raises(errors.InvalidArgument) as exc:
        service.submit("q", {}, **options)
    assert exc.value.details["field"] == field
    assert Job.objects.count() == 0


@override_settings(RELAY_MAX_DELAY_MS=600_000)
def test_run_at_beyond_max_delay_is_rejected(service: QueueService, clock: FakeClock) -> None:
    assert service.submit("q", {}, run_at_ms=clock.now_ms() + 600_000)["job"]["state"] == "pending"
    with pytest.raises(errors.InvalidArgument) as exc:
        service.submit("q", {}, run_at_ms=clock.now_ms() + 600_001)
    assert exc.value.details["field"] == "run_at_ms"
    with pytest.raises(errors.InvalidArgument) as exc:
        service.submit_batch(
            [{"queue": "q", "payload": 1}, {"queue": "q", "payload": 2, "run_at_ms": 2**62}]
        )
    assert exc.value.details == {"field": "jobs[1].run_at_ms", "index": 1}
    assert Job.objects.count() == 1


def test_submit_inside_a_failed_atomic_block_is_refused(service: QueueService, alias: str) -> None:
    # Like Django's own cursor: a job "submitted" into a transaction that will roll back
    # would be lost without the producer hearing of it.
    with transaction.atomic(using=alias):
        with (
            pytest.raises(IntegrityError),
            transaction.atomic(using=alias, savepoint=False),
            connections[alias].cursor() as cursor,
        ):
            cursor.execute("INSERT INTO relay_job (id) VALUES (NULL)")
        with pytest.raises(TransactionManagementError):
            service.submit("q", {"x": 1})
    assert Job.objects.count() == 0


def test_database_instrumentation_hooks_see_the_statements(
    service: QueueService, alias: str
) -> None:
    seen: list[str] = []

    def spy(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(" ".join(sql.split()[:3]))
        return execute(sql, params, many, context)

    with connections[alias].execute_wrapper(spy):
        service.submit("q", 1)
        service.submit_batch([{"queue": "q", "payload": 2}, {"queue": "q", "payload": 3}])
    # one execute, one executemany (on SQLite each also adds to relay_job_count)
    assert seen.count("INSERT INTO relay_job") == 2


@pytest.mark.parametrize("name", ["", "-x", "a b", "é", "x" * 129, 7, None])
def test_submit_rejects_bad_queue_names(service: QueueService, name: Any) -> None:
    with pytest.raises(errors.InvalidArgument):
        service.submit(name, {})


@override_settings(RELAY_MAX_PAYLOAD_BYTES=100)
def test_payload_over_limit_is_rejected(service: QueueService) -> None:
    service.submit("q", {"x": "a" * 80})
    with pytest.raises(errors.FrameTooLarge):
        service.submit("q", {"x": "a" * 100})
    assert Job.objects.count() == 1


def test_unencodable_payload_is_rejected(service: QueueService) -> None:
    with pytest.raises(errors.InvalidArgument):
        service.submit("q", {"n": 2**70})


def test_submit_batch_is_all_or_nothing(service: QueueService) -> None:
    results = service.submit_batch([{"queue": "q", "payload": i} for i in range(3)])
    assert [(r["queue"], r["state"], r["deduplicated"]) for r in results] == [
        ("q", "ready", False)
    ] * 3
    stored = Job.objects.filter(id__in=[r["job_id"] for r in results]).order_by("id")
    assert [row.payload for row in stored] == ["0", "1", "2"]
    with pytest.raises(errors.InvalidArgument) as exc:
        service.submit_batch([{"queue": "q", "payload": 1}, {"queue": "bad name", "payload": 2}])
    assert exc.value.details["index"] == 1
    service.submit("q", {"a": 1}, idempotency_key="k")
    with pytest.raises(errors.IdempotencyConflict):
        service.submit_batch(
            [
                {"queue": "q", "payload": 9},
                {"queue": "q", "payload": {"a": 2}, "idempotency_key": "k"},
            ]
        )
    assert Job.objects.count() == 4


def test_submit_batch_entries_name_state_and_due_time(
    service: QueueService, clock: FakeClock
) -> None:
    now = clock.now_ms()
    results = service.submit_batch(
        [{"queue": "q", "payload": 1}, {"queue": "r", "payload": 2, "delay_ms": 5_000}]
    )
    assert [(r["queue"], r["state"], r["available_at_ms"]) for r in results] == [
        ("q", "ready", None),
        ("r", "pending", now + 5_000),
    ]
    assert service.get(results[1]["job_id"])["available_at_ms"] == now + 5_000


def test_a_job_needs_a_payload_that_is_not_null(service: QueueService) -> None:
    # A structural audit: the rule lived in the TCP op's arguments and the HTTP schema only,
    # so a batch entry without a payload (TCP) or with null (HTTP) made a job of null.
    for spec in ({"queue": "q"}, {"queue": "q", "payload": None}):
        with pytest.raises(errors.InvalidArgument) as exc:
            service.submit_batch([{"queue": "q", "payload": 1}, spec])
        assert exc.value.details["field"] == "jobs[1].payload"
        assert "null" in exc.value.message
    with pytest.raises(errors.InvalidArgument) as exc:
        service.submit("q", None)
    assert exc.value.details["field"] == "payload"
    assert Job.objects.count() == 0
    assert service.submit("q", 0)["job"]["payload"] == 0  # falsy values are payloads


@override_settings(RELAY_MAX_BATCH_SUBMIT=2)
def test_submit_batch_is_bounded(service: QueueService) -> None:
    with pytest.raises(errors.InvalidArgument):
        service.submit_batch([{"queue": "q", "payload": i} for i in range(3)])
    with pytest.raises(errors.InvalidArgument):
        service.submit_batch([])


# ------------------------------------------------------------ idempotency


def test_idempotency_key_dedupes_within_window(service: QueueService, clock: FakeClock) -> None:
    first = service.submit("q", {"a": 1, "b": 2}, idempotency_key="k")
    again = service.submit(
        "q", {"b": 2, "a": 1}, idempotency_key="k"
    )  # same payload, key order aside
    assert again["deduplicated"] is True and again["job"]["id"] == first["job"]["id"]
    other_queue = service.submit("other", {"a": 1, "b": 2}, idempotency_key="k")
    assert other_queue["deduplicated"] is False
    assert Job.objects.count() == 2


def test_idempotency_key_with_other_payload_conflicts(service: QueueService) -> None:
    service.submit("q", {"a": 1}, idempotency_key="k")
    with pytest.raises(errors.IdempotencyConflict):
        service.submit("q", {"a": 2}, idempotency_key="k")


def test_idempotency_key_stays_bound_whatever_the_state(
    service: QueueService, leased_job: Factory
) -> None:
    lease = leased_job(idempotency_key="k")
    service.ack(lease["job_id"], **lease_args(lease))
    again = service.submit("default", {"n": 1}, idempotency_key="k")
    assert again["deduplicated"] is True and again["job"]["state"] == "succeeded"


def test_idempotency_key_is_free_after_window(service: QueueService, clock: FakeClock) -> None:
    first = service.submit("q", {"a": 1}, idempotency_key="k")["job"]
    clock.advance(ms=24 * 3600 * 1000 - 1)
    assert service.submit("q", {"a": 1}, idempotency_key="k")["deduplicated"] is True
    clock.advance(ms=1)
    fresh = service.submit("q", {"a": 2}, idempotency_key="k")
    assert fresh["deduplicated"] is False and fresh["job"]["id"] != first["id"]
    assert row(first["id"]).idempotency_key is None


def test_a_batch_binds_its_keys_in_one_order_and_keeps_its_own_fifo(
    service: QueueService, alias: str
) -> None:
    """Keyed jobs of a batch bind their keys sorted by (queue, key), whatever the batch's
    order, so two batches naming the same keys never wait on each other in a cycle; their
    ids, and so their FIFO, still follow the batch."""
    bound: list[str] = []

    def seen(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        keyed = not many and isinstance(params, dict) and params.get("idempotency_key")
        if keyed and "INSERT" in sql.upper():
            bound.append(params["idempotency_key"])
        return execute(sql, params, many, context)

    specs = [
        {"queue": "q", "payload": 0, "idempotency_key": "k3"},
        {"queue": "q", "payload": 1},
        {"queue": "q", "payload": 2, "idempotency_key": "k1"},
        {"queue": "q", "payload": 3, "idempotency_key": "k2"},
        {"queue": "q", "payload": 2, "idempotency_key": "k1"},  # a repeat: the same job
    ]
    with connections[alias].execute_wrapper(seen):
        out = service.submit_batch(specs)
    assert bound == ["k1", "k2", "k3"]
    assert out[4]["deduplicated"] is True and out[4]["job_id"] == out[2]["job_id"]
    ids = [entry["job_id"] for entry in out[:4]]
    assert ids == sorted(ids)
    leased = service.claim(["q"], worker_id="w", max_jobs=10)
    assert [job["job_id"] for job in leased] == ids


def test_batches_naming_the_same_keys_in_opposite_orders_do_not_deadlock(
    service: QueueService, driver: Driver, clock: FakeClock
) -> None:
    """Two threads (two connections: on PostgreSQL, two servers' worth) submit batches of
    the same 20 keys, one in the reverse order of the other (a hostile review: 50 deadlocks
    and 35 lock timeouts in 32 such batches, answered BUSY)."""
    failures: list[BaseException] = []
    start = threading.Barrier(2)

    def producer(reverse: bool) -> None:
        svc = QueueService(driver=driver, clock=clock)
        try:
            for round_ in range(8):
                keys = [f"r{round_}-k{i:02d}" for i in range(20)]
                if reverse:
                    keys.reverse()
                start.wait(30)
                svc.submit_batch([{"queue": "q", "payload": 1, "idempotency_key": k} for k in keys])
        except BaseException as exc:
            failures.append(exc)
            start.abort()
        finally:
            svc.close()

    threads = [threading.Thread(target=producer, args=(r,)) for r in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    assert Job.objects.count() == 8 * 20


def test_purge_releases_the_idempotency_key(service: QueueService, dead_job: Factory) -> None:
    job = dead_job(idempotency_key="k")
    service.purge(job["id"])
    assert service.submit("default", {"other": 1}, idempotency_key="k")["deduplicated"] is False


# ---------------------------------------------------------- claim ordering


def test_claim_prefers_higher_priority_then_fifo(service: QueueService, clock: FakeClock) -> None:
    low = service.submit("q", "low", priority="low")["job"]["id"]
    n1 = service.submit("q", "n1")["job"]["id"]
    n2 = service.submit("q", "n2")["job"]["id"]
    high = service.submit("q", "high", priority="high")["job"]["id"]
    crit = service.submit("q", "crit", priority="critical")["job"]["id"]
    order = [service.claim(["q"], worker_id="w")[0]["job_id"] for _ in range(5)]
    assert order == [crit, high, n1, n2, low]
    assert service.claim(["q"], worker_id="w") == []


def test_aging_lets_an_old_low_job_beat_a_newer_high_job(
    service: QueueService, clock: FakeClock
) -> None:
    low = service.submit("q", "low", priority="low")["job"]["id"]
    clock.advance(ms=2 * 60_000 - 1)  # one whole minute waited: LOW counts as NORMAL
    high = service.submit("q", "high", priority="high")["job"]["id"]
    assert service.claim(["q"], worker_id="w", max_jobs=1)[0]["job_id"] == high
    service.submit("q", "high2", priority="high")
    clock.advance(ms=1)  # two whole minutes: LOW counts as HIGH, and it is older: FIFO wins
    assert service.claim(["q"], worker_id="w")[0]["job_id"] == low


def test_aging_is_capped_at_critical_and_fifo_breaks_ties(
    service: QueueService, clock: FakeClock
) -> None:
    old_low = service.submit("q", "old", priority="low")["job"]["id"]
    clock.advance(seconds=3600)
    crit = service.submit("q", "crit", priority="critical")["job"]["id"]
    # Both are CRITICAL now; the older one goes first.
    assert [service.claim(["q"], worker_id="w")[0]["job_id"] for _ in range(2)] == [old_low, crit]


def test_several_jobs_from_one_queue_come_in_the_order_single_claims_take(
    service: QueueService, clock: FakeClock
) -> None:
    # max_jobs > 1 on one queue is one statement on SQLite (claim_many): the same ranking as
    # a claim of one job at a time (aged class, then FIFO), each job with its own token.
    old_low = service.submit("q", "old_low", priority="low")["job"]["id"]
    clock.advance(ms=2 * 60_000)  # two whole minutes: LOW counts as HIGH, and is oldest
    n1 = service.submit("q", "n1")["job"]["id"]
    high = service.submit("q", "high", priority="high")["job"]["id"]
    crit = service.submit("q", "crit", priority="critical")["job"]["id"]
    n2 = service.submit("q", "n2")["job"]["id"]
    low = service.submit("q", "low", priority="low")["job"]["id"]
    leases = service.claim(["q"], worker_id="w", max_jobs=5)
    assert [lease["job_id"] for lease in leases] == [crit, old_low, high, n1, n2]
    assert len({lease["lease_token"] for lease in leases}) == 5
    for lease in leases:  # each token is the one stored with its own job
        assert service.ack(lease["job_id"], worker_id="w", lease_token=lease["lease_token"])
    assert [lease["job_id"] for lease in service.claim(["q"], worker_id="w", max_jobs=5)] == [low]
    assert service.claim(["q"], worker_id="w", max_jobs=5) == []


def test_claim_several_jobs_across_queues(service: QueueService) -> None:
    a = [service.submit("a", i)["job"]["id"] for i in range(3)]
    b = [service.submit("b", i, priority="high")["job"]["id"] for i in range(2)]
    leases = service.claim(["a", "b"], worker_id="w", max_jobs=4)
    assert [lease["job_id"] for lease in leases] == [*b, *a[:2]]
    assert len({lease["lease_token"] for lease in leases}) == 4


def test_claim_sets_lease_fields_and_history(service: QueueService, clock: FakeClock) -> None:
    job = service.submit("q", {"x": 1})["job"]
    lease = service.claim(["q"], worker_id="w1", lease_ms=10_000)[0]
    assert lease["attempt"] == 1 and lease["payload"] == {"x": 1}
    assert lease["lease_expires_at_ms"] == clock.now_ms() + 10_000
    assert len(lease["lease_token"]) >= 32  # 192 random bits, url-safe
    got = service.get(job["id"])
    assert got["state"] == "leased" and got["leased_by"] == "w1"
    assert "lease_token" not in got
    assert got["history"] == [
        {
            "attempt": 1,
            "worker_id": "w1",
            "started_at_ms": clock.now_ms(),
            "ended_at_ms": None,
            "outcome": None,
            "error": None,
        }
    ]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lease_ms": 999}, "lease_ms"),
        ({"lease_ms": 43_200_001}, "lease_ms"),
        ({"max_jobs": 0}, "max_jobs"),
        ({"max_jobs": 101}, "max_jobs"),
        ({"queues": []}, "queues"),
        ({"queues": [f"q{i}" for i in range(17)]}, "queues"),
        ({"worker_id": ""}, "worker_id"),
    ],
)
def test_claim_rejects_bad_arguments(
    service: QueueService, kwargs: dict[str, Any], field: str
) -> None:
    args: dict[str, Any] = {"queues": ["q"], "worker_id": "w"} | kwargs
    queues = args.pop("queues")
    with pytest.raises(errors.InvalidArgument) as exc:
        service.claim(queues, **args)
    assert exc.value.details["field"] == field


def test_claim_cost_does_not_depend_on_backlog(service: QueueService, assert_queries: Any) -> None:
    service.submit_batch([{"queue": "q", "payload": i} for i in range(200)])
    # SQLite: BEGIN, "anything due?" (nothing is: no sweep), the one-statement claim of one
    # job (which checks for controls itself), attempt, COMMIT. PostgreSQL: BEGIN, the sweep
    # lock with "anything due?", the one-statement claim, attempt, SET LOCAL
    # synchronous_commit = off (a lease need not wait for the disk), COMMIT.
    with assert_queries(sqlite=5, postgresql=6):
        service.claim(["q"], worker_id="w")


def test_claims_in_one_transaction_sweep_once(service: QueueService, assert_queries: Any) -> None:
    """The server's group commit runs several claims in one transaction: only the first
    sweeps (expires leases, promotes due jobs); the others claim straight away."""
    service.submit_batch([{"queue": "q", "payload": i} for i in range(3)])
    # SQLite: BEGIN, the sweep probe once, per claim the one-statement claim and attempt
    # (its savepoints go to sqlite3 directly, uncounted), COMMIT: 1 + 1 + 3 * 2 + 1.
    # PostgreSQL: BEGIN, the sweep probe once, per claim its SAVEPOINT, claim, attempt and
    # RELEASE, COMMIT: 1 + 1 + 3 * 4 + 1.
    with assert_queries(sqlite=9, postgresql=15), service.transaction():
        for _ in range(3):
            with service.transaction():
                assert len(service.claim(["q"], worker_id="w")) == 1


# ------------------------------------------------------- renew/ack/fail


def test_ack_succeeds_once_and_repeats_safely(
    service: QueueService, leased_job: Factory, clock: FakeClock, assert_queries: Any
) -> None:
    lease = leased_job()
    clock.advance(seconds=1)
    # BEGIN, the guarded UPDATE, the attempt's UPDATE, COMMIT.
    with assert_queries(sqlite=4, postgresql=4):
        result = service.ack(lease["job_id"], **lease_args(lease))
    assert result == {
        "job_id": lease["job_id"],
        "state": "succeeded",
        "queue": "default",
        "duplicate": False,
    }
    # The reply was lost; the worker repeats the ack with the same token.
    again = service.ack(lease["job_id"], **lease_args(lease))
    assert again["duplicate"] is True
    job = service.get(lease["job_id"])
    assert job["state"] == "succeeded" and job["finished_at_ms"] == clock.now_ms()
    assert job["history"][0]["outcome"] == "succeeded"


def test_renew_extends_lease_up_to_max(
    service: QueueService, leased_job: Factory, clock: FakeClock
) -> None:
    lease = leased_job(lease_ms=5_000)
    clock.advance(ms=4_999)  # just before expiry
    renewed = service.renew(lease["job_id"], **lease_args(lease), lease_ms=20_000)
    assert renewed["lease_expires_at_ms"] == clock.now_ms() + 20_000
    renewed = service.renew(lease["job_id"], **lease_args(lease), lease_ms=43_200_000)
    assert renewed["lease_expires_at_ms"] == clock.now_ms() + 43_200_000
    with pytest.raises(errors.InvalidArgument):
        service.renew(lease["job_id"], **lease_args(lease), lease_ms=43_200_001)
    assert row(lease["job_id"]).lease_expires_at_ms == clock.now_ms() + 43_200_000


@pytest.mark.parametrize("verb", ["renew", "ack", "fail", "release"])
def test_at_or_after_expiry_is_rejected_as_lease_expired(
    service: QueueService, leased_job: Factory, clock: FakeClock, verb: str
) -> None:
    lease = leased_job(lease_ms=5_000)
    clock.advance(ms=5_000)  # exactly at expiry: the lease is over
    extra = {"error": "x"} if verb == "fail" else {}
    with pytest.raises(errors.LeaseExpired):
        getattr(service, verb)(lease["job_id"], **lease_args(lease), **extra)
    assert row(lease["job_id"]).state == "leased"  # nothing changed; the reaper will expire it
    # After the reaper ran, and nobody leased the job again: still LEASE_EXPIRED.
    service.expire_leases()
    with pytest.raises(errors.LeaseExpired):
        getattr(service, verb)(lease["job_id"], **lease_args(lease), **extra)


@pytest.mark.parametrize("verb", ["renew", "ack", "fail", "release"])
def test_stale_token_after_reassignment_changes_nothing(
    service: QueueService, leased_job: Factory, clock: FakeClock, verb: str
) -> None:
    old = leased_job(lease_ms=5_000)
    clock.advance(ms=5_000)
    new = service.claim(["default"], worker_id="w2")[0]
    assert new["job_id"] == old["job_id"] and new["attempt"] == 2
    before = (row(old["job_id"]).__dict__.copy(), list(JobAttempt.objects.values()))
    extra = {"error": "x"} if verb == "fail" else {}
    with pytest.raises(errors.StaleToken):
        getattr(service, verb)(old["job_id"], **lease_args(old), **extra)
    after = (row(old["job_id"]).__dict__.copy(), list(JobAttempt.objects.values()))
    before[0].pop("_state"), after[0].pop("_state")
    assert before == after
    service.ack(new["job_id"], **lease_args(new, "w2"))


@pytest.mark.parametrize("verb", ["renew", "ack", "fail", "release"])
def test_wrong_worker_or_token_or_job(
    service: QueueService, leased_job: Factory, verb: str
) -> None:
    lease = leased_job()
    extra = {"error": "x"} if verb == "fail" else {}
    call = getattr(service, verb)
    with pytest.raises(errors.StaleToken):
        call(lease["job_id"], worker_id="intruder", lease_token=lease["lease_token"], **extra)
    with pytest.raises(errors.StaleToken):
        call(lease["job_id"], worker_id="w1", lease_token="guess", **extra)
    with pytest.raises(errors.JobNotFound):
        call("job_missing", **lease_args(lease), **extra)
    assert row(lease["job_id"]).state == "leased"


def test_ack_after_restart_recovery_is_stale(service: QueueService, leased_job: Factory) -> None:
    lease = leased_job()
    if not service.capabilities.single_writer:
        # Several servers share the database: a server's start releases nothing, since the
        # lease belongs to a worker that may be served by another server.
        assert service.recover() == 0
        assert service.ack(lease["job_id"], **lease_args(lease))["state"] == "succeeded"
        return
    assert service.recover() == 1
    job = service.get(lease["job_id"])
    assert job["state"] == "ready" and job["failures"] == 0
    assert job["history"][0]["outcome"] == "recovered"
    assert job["events"][0]["event"] == "recovered"
    with pytest.raises(errors.StaleToken):
        service.ack(lease["job_id"], **lease_args(lease))


def test_recover_leaves_terminal_and_waiting_jobs(
    service: QueueService, leased_job: Factory, dead_job: Factory, job_factory: Factory
) -> None:
    done = leased_job()
    service.ack(done["job_id"], **lease_args(done))
    dead = dead_job()
    waiting = job_factory(delay_ms=1000)
    assert service.recover() == 0
    assert [row(j).state for j in (done["job_id"], dead["id"], waiting["id"])] == [
        "succeeded",
        "dead",
        "pending",
    ]


# ---------------------------------------------------------- retry to DEAD


def test_fail_retries_with_backoff_then_dead_letters(
    service: QueueService, job_factory: Factory, clock: FakeClock
) -> None:
    job = job_factory(max_retries=2, backoff="exponential", backoff_base_ms=1000, jitter=False)
    delays = []
    for failure in (1, 2):
        lease = service.claim(["default"], worker_id="w")[0]
        assert lease["attempt"] == failure
        result = service.fail(job["id"], **lease_args(lease, "w"), error=f"boom {failure}")
        assert result["state"] == "retrying"
        delays.append(result["retry_at_ms"] - clock.now_ms())
        assert service.claim(["default"], worker_id="w") == []  # not before the retry is due
        clock.advance(ms=delays[-1])
    assert delays == [1000, 2000]
    lease = service.claim(["default"], worker_id="w")[0]
    result = service.fail(job["id"], **lease_args(lease, "w"), error="boom 3")
    assert result["state"] == "dead" and result["dead_reason"] == "attempts exhausted: boom 3"
    got = service.get(job["id"])
    assert (got["attempt"], got["failures"], got["last_error"]) == (3, 3, "boom 3")
    assert [h["error"] for h in got["history"]] == ["boom 1", "boom 2", "boom 3"]


def test_fixed_backoff_with_jitter_stays_in_bounds(
    service: QueueService, job_factory: Factory, clock: FakeClock
) -> None:
    job_factory(max_retries=50, backoff="fixed", backoff_base_ms=1000, jitter=True)
    seen = set()
    for _ in range(20):
        lease = service.claim(["default"], worker_id="w")[0]
        retry_at = service.fail(lease["job_id"], **lease_args(lease, "w"), error="e")["retry_at_ms"]
        delay = retry_at - clock.now_ms()
        assert 500 <= delay <= 1000
        seen.add(delay)
        clock.advance(ms=delay)
    assert len(seen) > 1


def test_non_retryable_failure_goes_straight_to_dead(
    service: QueueService, leased_job: Factory
) -> None:
    lease = leased_job(max_retries=10)
    result = service.fail(lease["job_id"], **lease_args(lease), error="bad input", retryable=False)
    assert result["state"] == "dead" and result["dead_reason"] == "non-retryable: bad input"


def test_fail_repeated_with_same_token_is_duplicate(
    service: QueueService, leased_job: Factory
) -> None:
    lease = leased_job()
    first = service.fail(lease["job_id"], **lease_args(lease), error="x")
    again = service.fail(lease["job_id"], **lease_args(lease), error="x")
    assert again["duplicate"] is True and again["state"] == first["state"] == "retrying"
    assert again["retry_at_ms"] == first["retry_at_ms"]
    assert row(lease["job_id"]).failures == 1


@override_settings(RELAY_MAX_ERROR_BYTES=10)
def test_error_text_is_bounded(service: QueueService, leased_job: Factory) -> None:
    lease = leased_job()
    with pytest.raises(errors.InvalidArgument):
        service.fail(lease["job_id"], **lease_args(lease), error="é" * 6)  # 12 bytes
    service.fail(lease["job_id"], **lease_args(lease), error="é" * 5)


# --------------------------------------------------------------- expiry


def test_expired_lease_returns_to_ready_and_counts_a_failure(
    service: QueueService, leased_job: Factory, clock: FakeClock
) -> None:
    lease = leased_job(lease_ms=5_000, max_retries=1)
    clock.advance(ms=4_999)
    assert service.expire_leases() == []
    clock.advance(ms=1)
    assert service.expire_leases() == ["default"]
    job = service.get(lease["job_id"])
    assert (job["state"], job["failures"], job["ready_since_ms"]) == (
        "ready",
        1,
        lease["lease_expires_at_ms"],
    )
    assert job["history"][0]["outcome"] == "lease_expired"
    # The second expiry spends the budget: DEAD with the reason.
    second = service.claim(["default"], worker_id="w2", lease_ms=5_000)[0]
    clock.advance(ms=5_000)
    assert service.expire_leases() == []
    job = service.get(second["job_id"])
    assert (job["state"], job["dead_reason"], job["attempt"]) == ("dead", "lease expired", 2)


def test_claim_reclaims_expired_leases_itself(
    service: QueueService, leased_job: Factory, clock: FakeClock
) -> None:
    lease = leased_job(lease_ms=5_000)
    assert service.claim(["default"], worker_id="w2") == []  # still validly leased
    clock.advance(ms=5_000)
    again = service.claim(["default"], worker_id="w2")
    assert again[0]["job_id"] == lease["job_id"] and again[0]["attempt"] == 2


def test_release_gives_job_back_without_a_failure(
    service: QueueService, leased_job: Factory, clock: FakeClock
) -> None:
    lease = leased_job()
    clock.advance(seconds=2)
    assert service.release(lease["job_id"], **lease_args(lease))["state"] == "ready"
    job = service.get(lease["job_id"])
    assert (job["failures"], job["ready_since_ms"]) == (0, clock.now_ms())
    assert job["history"][0]["outcome"] == "released"


def test_next_due_ms_reports_schedule_and_expiry(
    service: QueueService, leased_job: Factory, job_factory: Factory, clock: FakeClock
) -> None:
    assert service.next_due_ms() is None
    leased_job(lease_ms=10_000)
    assert service.next_due_ms() == clock.now_ms() + 10_000
    job_factory(delay_ms=3_000)
    assert service.next_due_ms() == clock.now_ms() + 3_000


# ------------------------------------------------------- replay and purge


def test_replay_resets_budget_keeps_id_attempts_history(
    service: QueueService, dead_job: Factory, clock: FakeClock
) -> None:
    job = dead_job(max_retries=0)
    clock.advance(seconds=5)
    replayed = service.replay(job["id"], actor="alice")
    assert (replayed["id"], replayed["state"], replayed["failures"], replayed["attempt"]) == (
        job["id"],
        "ready",
        0,
        1,
    )
    assert replayed["dead_reason"] is None and replayed["created_at_ms"] == job["created_at_ms"]
    assert replayed["ready_since_ms"] == clock.now_ms()
    lease = service.claim(["default"], worker_id="w")[0]
    assert lease["attempt"] == 2  # the fencing epoch never goes back
    got = service.get(job["id"])
    assert [h["attempt"] for h in got["history"]] == [1, 2]
    assert got["events"][0] | {"at_ms": 0} == {
        "event": "replayed",
        "from_state": "dead",
        "to_state": "ready",
        "at_ms": 0,
        "actor": "alice",
        "detail": None,
    }


def test_replay_twice_changes_once(service: QueueService, dead_job: Factory) -> None:
    job = dead_job()
    service.replay(job["id"], actor="alice")
    with pytest.raises(errors.InvalidState) as exc:
        service.replay(job["id"], actor="bob")
    assert exc.value.details["state"] == "ready"
    assert JobEvent.objects.filter(job_id=job["id"], event="replayed").count() == 1


def test_replay_and_purge_unknown_job(service: QueueService) -> None:
    with pytest.raises(errors.JobNotFound):
        service.replay("job_nope")
    with pytest.raises(errors.JobNotFound):
        service.purge("job_nope")


def test_purge_only_terminal_jobs(
    service: QueueService, dead_job: Factory, leased_job: Factory, job_factory: Factory
) -> None:
    live = leased_job()
    with pytest.raises(errors.InvalidState):
        service.purge(live["job_id"])
    service.ack(live["job_id"], **lease_args(live))
    with pytest.raises(errors.InvalidState):
        service.purge(live["job_id"], dead_only=True)
    assert service.purge(live["job_id"]) == {"job_id": live["job_id"], "purged": True}
    dead = dead_job()
    service.purge(dead["id"], actor="ops", dead_only=True)
    assert not Job.objects.filter(id=dead["id"]).exists()
    assert not JobAttempt.objects.filter(job_id=dead["id"]).exists()
    event = JobEvent.objects.get(job_id=dead["id"], event="purged")
    assert (event.actor, event.from_state) == ("ops", "dead")


# ------------------------------------------------------- stats and listing


def test_stats_counts_by_state_and_oldest_ready_age(
    service: QueueService, job_factory: Factory, leased_job: Factory, clock: FakeClock
) -> None:
    job_factory(queue="a")
    clock.advance(seconds=3)
    job_factory(queue="a")
    job_factory(queue="b", delay_ms=1000)
    leased_job(queue="c")
    stats = service.stats()
    assert (
        stats["queues"]["a"]["ready"] == 2 and stats["queues"]["a"]["oldest_ready_age_ms"] == 3000
    )
    assert (
        stats["queues"]["b"]["pending"] == 1 and stats["queues"]["b"]["oldest_ready_age_ms"] is None
    )
    assert stats["queues"]["c"]["leased"] == 1
    assert stats["totals"] == {
        "pending": 1,
        "ready": 2,
        "leased": 1,
        "retrying": 0,
        "succeeded": 0,
        "dead": 0,
        "cancelled": 0,
    }
    assert list(service.stats("a")["queues"]) == ["a"]


def test_stats_of_one_queue_is_that_queues_part_of_the_whole_read_from_its_rows_alone(
    service: QueueService,
    job_factory: Factory,
    clock: FakeClock,
    alias: str,
) -> None:
    for name in ("a", "b", "c"):
        job_factory(queue=name, priority="high")
        clock.advance(seconds=2)
        job_factory(queue=name)
    job_factory(queue="b")
    done, _ = service.claim(["b"], worker_id="w1", max_jobs=2)  # one acked, one leased
    service.ack(done["job_id"], **lease_args(done))
    service.pause("b")
    service.set_queue_limits("c", max_leased=3)
    for finished in (True, False):
        whole = service.stats(finished=finished)
        one = service.stats("b", finished=finished)
        assert one["queues"] == {"b": whole["queues"]["b"]}
        assert one["totals"] == {
            k: n for k, n in whole["queues"]["b"].items() if k != "oldest_ready_age_ms"
        }
        assert one["controls"] == {"b": whole["controls"]["b"]}
    assert service.stats("nothing-here")["queues"] == {}
    # Every statement that reads jobs or their counts names the queue: none reads them all
    # (a hostile review: 130 ms a call among 20,000 queues).
    seen: list[tuple[str, Any]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append((sql, params))
        return execute(sql, params, many, context)

    with connections[alias].execute_wrapper(record):
        service.stats("b")
    reads = [(sql, params) for sql, params in seen if "relay_job" in sql]
    assert reads and all(params and "b" in dict(params).values() for _, params in reads), reads


def test_stats_pages_queues_by_name_and_totals_count_all(
    service: QueueService, job_factory: Factory
) -> None:
    names = [f"q{i:02d}" for i in range(25)]
    for name in reversed(names):
        job_factory(queue=name)
    first = service.stats(limit=10)
    assert list(first["queues"]) == names[:10] and first["next_after"] == "q09"
    assert first["totals"]["ready"] == 25  # every queue, whatever the page
    second = service.stats(limit=10, after=first["next_after"])
    assert list(second["queues"]) == names[10:20] and second["next_after"] == "q19"
    last = service.stats(limit=10, after=second["next_after"])
    assert list(last["queues"]) == names[20:] and last["next_after"] is None
    exact = service.stats(limit=5, after="q19")  # a page that ends exactly at the end
    assert list(exact["queues"]) == names[20:] and exact["next_after"] is None
    assert service.stats()["next_after"] is None and len(service.stats()["queues"]) == 25
    for bad, field in (
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"after": "not a name"}, "after"),
        ({"after": "q" * 500}, "after"),
    ):
        with pytest.raises(errors.InvalidArgument) as err:
            service.stats(**bad)  # type: ignore[arg-type]
        assert err.value.details["field"] == field


def test_stats_page_fits_one_frame(service: QueueService, job_factory: Factory) -> None:
    for i in range(40):
        job_factory(queue=f"queue-{i:02d}-" + "n" * 100)
    with override_settings(RELAY_MAX_FRAME_BYTES=4096, RELAY_MAX_PAYLOAD_BYTES=1024):
        small = QueueService(driver=service.driver, clock=service.clock)
        seen: list[str] = []
        after = None
        while True:
            page = small.stats(limit=1000, after=after)
            assert len(orjson.dumps(page)) < 4096 - 64
            assert 0 < len(page["queues"]) < 40
            seen += page["queues"]
            if (after := page["next_after"]) is None:
                break
        assert seen == sorted(f"queue-{i:02d}-" + "n" * 100 for i in range(40))


def test_dead_list_pages_by_keyset(service: QueueService, dead_job: Factory) -> None:
    ids = [dead_job(queue="a" if i % 2 else "b")["id"] for i in range(5)]
    page = service.dead_list(limit=2)
    assert [j["id"] for j in page["jobs"]] == ids[:2] and page["next_after"] == ids[1]
    rest = service.dead_list(limit=10, after=page["next_after"])
    assert [j["id"] for j in rest["jobs"]] == ids[2:] and rest["next_after"] is None
    only_a = service.dead_list("a")
    assert [j["id"] for j in only_a["jobs"]] == ids[1::2]
    assert only_a["jobs"][0]["dead_reason"] == "non-retryable: boom"
    with pytest.raises(errors.InvalidArgument) as exc:  # it named job_id (a structural audit)
        service.dead_list(after="j" * 41)
    assert exc.value.details["field"] == "after" and exc.value.message.startswith("after:")


def test_list_jobs_merges_states_by_id_and_pages_by_keyset(
    service: QueueService, job_factory: Factory, dead_job: Factory, leased_job: Factory
) -> None:
    ids = [  # leased and dead first: each leases the oldest READY job of its queue
        leased_job(queue="a")["job_id"],
        dead_job(queue="a")["id"],
        job_factory(queue="a")["id"],
        job_factory(queue="a", delay_ms=5_000)["id"],
        job_factory(queue="b")["id"],
        job_factory(queue="a")["id"],
    ]
    mine = [ids[i] for i in (0, 1, 2, 3, 5)]
    first = service.list_jobs("a", limit=3)
    assert [j["id"] for j in first["jobs"]] == mine[:3] and first["next_after"] == mine[2]
    rest = service.list_jobs("a", limit=3, after=first["next_after"])
    assert [j["id"] for j in rest["jobs"]] == mine[3:] and rest["next_after"] is None
    assert [j["id"] for j in service.list_jobs("a", "ready")["jobs"]] == [ids[2], ids[5]]
    assert [j["state"] for j in service.list_jobs("a", "dead")["jobs"]] == ["dead"]
    for bad in ({"state": "lost"}, {"limit": 0}, {"limit": PAGE_MAX_JOBS + 1}, {"after": "x" * 41}):
        with pytest.raises(errors.InvalidArgument):
            service.list_jobs("a", **bad)  # type: ignore[arg-type]


@override_settings(RELAY_MAX_FRAME_BYTES=60_000, RELAY_MAX_PAYLOAD_BYTES=20_000)
def test_job_pages_read_a_few_rows_at_a_time_and_end_at_one_frame(
    service: QueueService, alias: str
) -> None:
    """A page of ``limit`` 1000 over big payloads used to read all 1000 rows before trimming
    the reply to a frame (one ``dead_list`` of 250 KB payloads: a server at 824 MB)."""
    small = QueueService(driver=service.driver, clock=service.clock)
    ids = [small.submit("q", {"blob": "x" * 15_000, "i": i})["job"]["id"] for i in range(40)]
    for _ in ids:
        lease = small.claim(["q"], worker_id="w")[0]
        small.fail(
            lease["job_id"],
            worker_id="w",
            lease_token=lease["lease_token"],
            error="e",
            retryable=False,
        )
    limits: list[int] = []

    def spy(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "relay_job" in sql and "ORDER BY id" in sql:
            limits.append(params["limit"] if isinstance(params, dict) else params[-1])
        return execute(sql, params, many, context)

    for call in (
        lambda after: small.dead_list(limit=1000, after=after),
        lambda after: small.dead_list("q", limit=1000, after=after),
        lambda after: small.list_jobs("q", limit=1000, after=after),
        lambda after: small.list_jobs("q", "dead", limit=1000, after=after),
    ):
        seen: list[str] = []
        after = None
        while True:
            limits.clear()
            with connections[alias].execute_wrapper(spy):
                page = call(after)
            assert limits and max(limits) <= PAGE_FETCH_ROWS, limits
            assert len(orjson.dumps(page)) <= 60_000 - REPLY_OVERHEAD_BYTES
            assert 0 < len(page["jobs"]) < 4  # three 15 KB jobs fit in 60 KB, not four
            seen += [j["id"] for j in page["jobs"]]
            if (after := page["next_after"]) is None:
                break
        assert seen == ids


def test_schema_rejects_impossible_states(
    service: QueueService, job_factory: Factory, alias: str
) -> None:
    job = job_factory()
    with connections[alias].cursor() as cursor, pytest.raises(IntegrityError, match=r"(?i)check"):
        cursor.execute("UPDATE relay_job SET state = 'leased' WHERE id = %s", [job["id"]])


@override_settings(RELAY_MAX_FRAME_BYTES=20_000, RELAY_MAX_PAYLOAD_BYTES=8_000)
def test_lease_reply_never_outgrows_a_frame(service: QueueService) -> None:
    ids = [service.submit("q", {"blob": "x" * 7_000, "i": i})["job"]["id"] for i in range(5)]
    leases = service.claim(["q"], worker_id="w", max_jobs=5)
    # 2 payloads of ~7 KB plus overhead fit in 20 KB; a third would not.
    assert [lease["job_id"] for lease in leases] == ids[:2]
    untouched = Job.objects.get(id=ids[2])
    assert (untouched.state, untouched.attempt, untouched.lease_token) == ("ready", 0, None)
    assert not JobAttempt.objects.filter(job_id=ids[2]).exists()
    # One oversized-for-the-batch job is always leased on its own.
    assert len(service.claim(["q"], worker_id="w", max_jobs=5)) == 2
    assert len(service.claim(["q"], worker_id="w", max_jobs=5)) == 1


def test_submit_inside_atomic_commits_or_rolls_back_with_the_caller(
    service: QueueService, alias: str
) -> None:
    with transaction.atomic(using=alias):
        kept = service.submit("q", {"kept": True})["job"]["id"]

    def rolled_back() -> None:
        with transaction.atomic(using=alias):
            service.submit("q", {"kept": False})
            raise RuntimeError("caller rolls back")

    with pytest.raises(RuntimeError):
        rolled_back()
    assert list(Job.objects.values_list("id", flat=True)) == [kept]
    # A failed call inside the caller's transaction rolls back alone.
    with transaction.atomic(using=alias):
        service.submit("q", {"a": 1}, idempotency_key="k")
        with pytest.raises(errors.IdempotencyConflict):
            service.submit("q", {"a": 2}, idempotency_key="k")
        service.submit("q", {"b": 1})
    assert Job.objects.count() == 3


def test_repeated_fail_reports_what_that_failure_did(
    service: QueueService, job_factory: Factory, clock: FakeClock
) -> None:
    job = job_factory(max_retries=1, backoff="fixed", backoff_base_ms=10, jitter=False)
    first = service.claim(["default"], worker_id="w1")[0]
    service.fail(job["id"], **lease_args(first), error="e1")
    clock.advance(ms=10)
    second = service.claim(["default"], worker_id="w2")[0]
    service.ack(job["id"], **lease_args(second, "w2"))
    # w1's reply was lost and it repeats its fail after the job succeeded elsewhere.
    again = service.fail(job["id"], **lease_args(first), error="e1")
    assert (again["state"], again["duplicate"], again["retry_at_ms"]) == ("retrying", True, None)

    doomed = job_factory(max_retries=0)
    lease = service.claim(["default"], worker_id="w1")[0]
    service.fail(doomed["id"], **lease_args(lease), error="boom")
    service.replay(doomed["id"])
    service.claim(["default"], worker_id="w2")
    repeat = service.fail(doomed["id"], **lease_args(lease), error="boom")
    assert (repeat["state"], repeat["duplicate"]) == ("dead", True)


def test_queue_names_must_match_whole_pattern(service: QueueService) -> None:
    with pytest.raises(errors.InvalidArgument):
        service.submit("email\n", {})
    with pytest.raises(errors.InvalidArgument):
        service.claim(["email\n"], worker_id="w")


def test_payload_nesting_is_bounded(service: QueueService) -> None:
    deep: Any = []
    for _ in range(64):
        deep = [deep]
    with pytest.raises(errors.InvalidArgument) as exc:
        service.submit("q", deep)
    assert exc.value.details["field"] == "payload"
    ok: Any = []
    for _ in range(63):
        ok = [ok]
    service.submit("q", ok)
    lease = service.claim(["q"], worker_id="w")[0]
    assert lease["payload"] == ok


@override_settings(RELAY_MAX_FRAME_BYTES=40_000, RELAY_MAX_PAYLOAD_BYTES=9_000)
def test_read_replies_fit_one_frame(
    service: QueueService, dead_job: Factory, leased_job: Factory, clock: FakeClock
) -> None:
    import orjson

    ids = [dead_job(payload={"blob": "x" * 8_000, "i": i})["id"] for i in range(8)]
    page = service.dead_list(limit=100)
    assert len(orjson.dumps(page)) <= 40_000
    assert page["next_after"] == page["jobs"][-1]["id"]
    rest = service.dead_list(limit=100, after=page["next_after"])
    assert [j["id"] for j in page["jobs"] + rest["jobs"]] == ids

    job = service.submit("h", {}, max_retries=50, backoff="fixed", backoff_base_ms=0)["job"]
    for _ in range(30):
        lease = service.claim(["h"], worker_id="w")[0]
        service.fail(job["id"], **lease_args(lease, "w"), error="\x01" * 600)
    got = service.get(job["id"])
    assert len(orjson.dumps(got)) <= 40_000
    assert got["history_omitted"] > 0
    assert got["history"][-1]["attempt"] == 30  # the newest attempts are the ones kept
    events = JobEvent.objects.filter(job_id=job["id"]).count()
    assert len(got["history"]) + len(got["events"]) + got["history_omitted"] == 30 + events


@override_settings(RELAY_MAX_FRAME_BYTES=4_000, RELAY_MAX_PAYLOAD_BYTES=1_000)
def test_job_history_reads_only_the_rows_that_could_fit(service: QueueService, alias: str) -> None:
    job = service.submit("h", {}, max_retries=50, backoff="fixed", backoff_base_ms=0)["job"]
    for _ in range(40):
        lease = service.claim(["h"], worker_id="w")[0]
        service.fail(job["id"], **lease_args(lease, "w"), error="e")
    limits: list[int] = []

    def spy(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "FROM relay_attempt" in sql and "LIMIT" in sql:
            limits.append(params["limit"])
        return execute(sql, params, many, context)

    with connections[alias].execute_wrapper(spy):
        got = service.get(job["id"])
    assert limits and limits[0] < 40  # ~1,000 bytes of history: no more than 16 rows could fit
    assert len(orjson.dumps(got)) <= 4_000
    assert [a["attempt"] for a in got["history"]] == list(range(41 - len(got["history"]), 41))
    events = JobEvent.objects.filter(job_id=job["id"]).count()
    assert len(got["history"]) + len(got["events"]) + got["history_omitted"] == 40 + events


def test_after_commit_runs_only_what_committed(service: QueueService, alias: str) -> None:
    driver, ran = service.driver, []

    def register_then_fail(name: str) -> None:
        with driver.write():
            driver.after_commit(lambda: ran.append(name))
            raise RuntimeError

    driver.after_commit(lambda: ran.append("now"))  # no transaction: at once
    with driver.write():
        driver.after_commit(lambda: ran.append("outer"))
        with pytest.raises(RuntimeError):
            register_then_fail("rolled back savepoint")
        assert ran == ["now"]  # nothing before the COMMIT
    assert ran == ["now", "outer"]
    with pytest.raises(RuntimeError):
        register_then_fail("rolled back transaction")
    with transaction.atomic(using=alias):
        with driver.write():
            driver.after_commit(lambda: ran.append("caller committed"))
        assert ran == ["now", "outer"]
    assert ran == ["now", "outer", "caller committed"]


def test_observer_hears_each_expiry_after_commit(
    service: QueueService, leased_job: Factory, clock: FakeClock
) -> None:
    heard: list[tuple[str, str]] = []
    service.observer = lambda event, queue: heard.append((event, queue))
    leased_job(queue="a", lease_ms=5_000, max_retries=1)
    leased_job(queue="b", lease_ms=5_000, max_retries=0)
    clock.advance(ms=5_000)
    service.expire_leases()
    assert sorted(heard) == [("dead", "b"), ("lease_expired", "a"), ("lease_expired", "b")]


def test_batch_with_a_key_repeated_inside_it_dedupes_against_itself(
    service: QueueService,
) -> None:
    results = service.submit_batch(
        [
            {"queue": "q", "payload": 1},
            {"queue": "q", "payload": {"a": 1}, "idempotency_key": "k"},
            {"queue": "q", "payload": 2},
            {"queue": "q", "payload": {"a": 1}, "idempotency_key": "k"},
            {"queue": "q", "payload": 3},
        ]
    )
    assert [r["deduplicated"] for r in results] == [False, False, False, True, False]
    assert results[3]["job_id"] == results[1]["job_id"]
    assert Job.objects.count() == 4
    ids = [r["job_id"] for r in results]
    assert sorted(set(ids)) == sorted(Job.objects.values_list("id", flat=True))


def test_a_batch_conflicting_with_itself_or_a_job_names_the_entry(service: QueueService) -> None:
    # The message named the job the batch's own earlier entry had bound, which its rollback
    # left unmade (inspect: NOT_FOUND), and no conflict said which entry (a review).
    with pytest.raises(errors.IdempotencyConflict) as caught:
        service.submit_batch(
            [
                {"queue": "q", "payload": 0},
                {"queue": "q", "payload": 1, "idempotency_key": "k"},
                {"queue": "q", "payload": 2, "idempotency_key": "k"},
            ]
        )
    assert caught.value.details == {
        "index": 2,
        "field": "jobs[2].idempotency_key",
        "bound_index": 1,
    }
    assert "bound by jobs[1] of this batch" in caught.value.message
    assert Job.objects.count() == 0
    bound = service.submit("q", {"a": 1}, idempotency_key="k")["job"]["id"]
    with pytest.raises(errors.IdempotencyConflict) as caught:
        service.submit_batch(
            [{"queue": "q", "payload": 0}, {"queue": "q", "payload": 2, "idempotency_key": "k"}]
        )
    assert caught.value.details == {
        "index": 1,
        "field": "jobs[1].idempotency_key",
        "job_id": bound,
    }
    assert caught.value.message.startswith("jobs[1]: idempotency key 'k' is bound to " + bound)


def test_nul_characters_are_refused_in_names_and_replaced_in_errors(
    service: QueueService, leased_job: Factory
) -> None:
    # PostgreSQL cannot store NUL in text: both drivers refuse it in identifiers alike, and
    # keep a handler's error message with the NUL replaced.
    lease = leased_job()
    for call in (
        lambda: service.ack(lease["job_id"], worker_id="w\x00", lease_token="t"),
        lambda: service.ack("job\x00", worker_id="w1", lease_token="t"),
        lambda: service.submit("q", 1, idempotency_key="k\x00"),
        lambda: service.dead_list(after="job_\x00"),
    ):
        with pytest.raises(errors.InvalidArgument, match="NUL"):
            call()
    service.fail(lease["job_id"], error="bad\x00byte", retryable=False, **lease_args(lease))
    assert row(lease["job_id"]).last_error == "bad\ufffdbyte"
    assert service.submit("q", {"k\x00": "v\x00"})["job"]["payload"] == {"k\x00": "v\x00"}


# ------------------------------------------- values JSON and the stores cannot hold (#11, #12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=repr)
def test_nan_and_infinity_in_a_payload_are_refused_not_stored_as_null(
    service: QueueService, bad: float
) -> None:
    # orjson writes NaN and ±Infinity as null: {"x": NaN} would be stored as {"x": null}.
    with pytest.raises(errors.InvalidArgument) as exc:
        service.submit("q", {"x": [1, bad]})
    assert exc.value.details == {"field": "payload.x[1]"}
    with pytest.raises(errors.InvalidArgument) as exc:
        service.submit_batch([{"queue": "q", "payload": 1}, {"queue": "q", "payload": {"y": bad}}])
    assert exc.value.details == {"field": "jobs[1].payload.y", "index": 1}
    assert Job.objects.count() == 0
    kept = service.submit("q", {"x": None, "y": 0.5})["job"]["id"]
    assert row(kept).payload == '{"x":null,"y":0.5}'


@pytest.mark.parametrize(
    "options",
    [
        {"delay_ms": float("nan")},
        {"run_at_ms": float("inf")},
        {"max_retries": float("inf")},
        {"backoff_base_ms": float("nan")},
        {"priority": float("nan")},
    ],
    ids=lambda options: next(iter(options)),
)
def test_nan_and_infinity_options_are_refused(
    service: QueueService, options: dict[str, Any]
) -> None:
    with pytest.raises(errors.InvalidArgument) as exc:
        service.submit("q", {}, **options)
    assert exc.value.details["field"] == next(iter(options))
    assert Job.objects.count() == 0


def test_lone_surrogates_are_refused_before_the_store(
    service: QueueService, leased_job: Factory
) -> None:
    # Without the check each of these reached the driver and raised UnicodeEncodeError there.
    lease = leased_job()
    job_id, lone = lease["job_id"], "\ud800"
    refused = {
        "error": lambda: service.fail(job_id, error=f"boom {lone}", **lease_args(lease)),
        "worker_id": lambda: service.ack(job_id, worker_id=lone, lease_token="t"),
        "lease_token": lambda: service.renew(job_id, worker_id="w1", lease_token=lone),
        "job_id": lambda: service.get(f"job_{lone}"),
        "idempotency_key": lambda: service.submit("q", 1, idempotency_key=f"k{lone}"),
        "queue": lambda: service.claim([f"q{lone}"], worker_id="w2"),
        "payload": lambda: service.submit("q", {"a": lone}),
        "actor": lambda: service.replay(job_id, actor=f"admin{lone}"),
    }
    for field, call in refused.items():
        with pytest.raises(errors.InvalidArgument) as exc:
            call()
        assert exc.value.details["field"].startswith(field), field
    assert row(job_id).state == "leased"
    # Nothing was half-done: the lease still settles, and with an escaped text it fails.
    result = service.fail(job_id, error="boom \\ud800", retryable=False, **lease_args(lease))
    assert result["state"] == "dead"
    assert row(job_id).last_error == "boom \\ud800"
    assert Job.objects.count() == 1
