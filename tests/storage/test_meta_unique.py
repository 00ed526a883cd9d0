"""Job metadata and unique-while-active idempotency keys (issue 16, items 6 and 7), at the
service layer with the fake clock, once per storage driver (``backend``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
from django.test.utils import override_settings

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job
from queue_core.service import QueueService
from queue_core.states import TERMINAL_STATES, JobState, is_terminal
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

Factory = Callable[..., dict[str, Any]]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def lease_one(service: QueueService, queue: str = "q") -> dict[str, Any]:
    leases = service.claim([queue], worker_id="w1", lease_ms=30_000)
    assert len(leases) == 1
    return leases[0]


def ids(lease: dict[str, Any]) -> dict[str, Any]:
    return {"worker_id": "w1", "lease_token": lease["lease_token"]}


# -------------------------------------------------------------------- meta


def test_meta_round_trips_through_submit_get_and_lease(service: QueueService) -> None:
    meta = {"traceparent": TRACEPARENT, "tenant": "acme"}
    job = service.submit("q", {"n": 1}, meta=meta)["job"]
    assert job["meta"] == meta
    assert service.get(job["id"])["meta"] == meta
    lease = lease_one(service)
    assert lease["meta"] == meta
    stored = Job.objects.get(id=job["id"]).meta
    assert stored == '{"tenant":"acme","traceparent":"' + TRACEPARENT + '"}'  # canonical JSON


def test_a_job_without_meta_shows_an_empty_map(service: QueueService) -> None:
    job = service.submit("q", {"n": 1})["job"]
    assert job["meta"] == {}
    assert service.submit("q", {"n": 2}, meta={})["job"]["meta"] == {}
    assert Job.objects.get(id=job["id"]).meta is None
    assert [lease["meta"] for lease in service.claim(["q"], worker_id="w1", max_jobs=2)] == [{}, {}]


def test_meta_in_a_batch(service: QueueService) -> None:
    results = service.submit_batch(
        [
            {"queue": "q", "payload": 1, "meta": {"k": "v"}},
            {"queue": "q", "payload": 2},
        ]
    )
    assert [service.get(r["job_id"])["meta"] for r in results] == [{"k": "v"}, {}]


@override_settings(RELAY_MAX_META_KEYS=2, RELAY_MAX_META_KEY_BYTES=4, RELAY_MAX_META_BYTES=40)
@pytest.mark.parametrize(
    ("meta", "field", "words"),
    [
        ("text", "meta", "must be an object"),
        (["a"], "meta", "must be an object"),
        ({"a": "1", "b": "2", "c": "3"}, "meta", "at most 2 keys"),
        ({"abcde": "1"}, "meta", "longer than 4 bytes"),
        ({"éé€": "1"}, "meta", "longer than 4 bytes"),  # 7 UTF-8 bytes, 3 characters
        ({"": "1"}, "meta", "non-empty"),
        ({"a\x00": "1"}, "meta", "NUL"),
        ({"a": 1}, "meta.a", "must be a string"),
        ({"a": None}, "meta.a", "must be a string"),
        ({"a": {"b": "c"}}, "meta.a", "must be a string"),
        ({"a": "x\x00"}, "meta.a", "NUL"),
        ({"a": "\ud800"}, "meta.a", "surrogate"),
        ({"a": "x" * 30, "b": "y"}, "meta", "more than RELAY_MAX_META_BYTES (40)"),
    ],
)
def test_meta_bounds_and_types_are_refused_with_the_field(
    service: QueueService, meta: Any, field: str, words: str
) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        service.submit("q", {"n": 1}, meta=meta)
    assert caught.value.details["field"] == field
    assert words in caught.value.message
    assert not Job.objects.exists()


@override_settings(RELAY_MAX_META_KEYS=2, RELAY_MAX_META_KEY_BYTES=4, RELAY_MAX_META_BYTES=40)
def test_meta_exactly_at_its_bounds_is_accepted(service: QueueService) -> None:
    meta = {"abcd": "x" * 9, "éab": "y" * 10}  # keys of 4 UTF-8 bytes ("éab": 3 characters)
    assert len(orjson.dumps(meta)) == 40
    assert service.submit("q", {"n": 1}, meta=meta)["job"]["meta"] == meta
    with pytest.raises(errors.InvalidArgument):
        service.submit("q", {"n": 1}, meta={"abcd": "x" * 10, "éab": "y" * 10})


def test_a_bad_meta_in_a_batch_names_its_index(service: QueueService) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        service.submit_batch(
            [{"queue": "q", "payload": 1}, {"queue": "q", "payload": 2, "meta": {"a": 5}}]
        )
    assert caught.value.details["field"] == "jobs[1].meta.a"
    assert caught.value.details["index"] == 1
    assert not Job.objects.exists()


def test_meta_counts_in_the_lease_reply_budget(service: QueueService) -> None:
    """A lease takes no more jobs than their payloads and metas fit in one frame."""
    meta = {f"k{i}": "v" * 50 for i in range(16)}  # 16 keys, 1,010 bytes encoded
    assert len(orjson.dumps(meta)) <= 1024
    with override_settings(RELAY_MAX_FRAME_BYTES=8 * 1024, RELAY_MAX_PAYLOAD_BYTES=4096):
        for n in range(6):
            service.submit("q", {"n": n}, meta=meta)
        leases = service.claim(["q"], worker_id="w1", max_jobs=6)
    # Each job costs its payload (7 bytes) + its meta + 1 KiB of overhead: three fit in the
    # 7 KiB of room, where payloads alone would have let all six in.
    assert len(leases) == 3
    assert all(lease["meta"] == meta for lease in leases)


# -------------------------------------------------------- unique while active


def test_terminal_states_helper() -> None:
    assert {s for s in JobState if is_terminal(s)} == set(TERMINAL_STATES)
    assert is_terminal("succeeded") and is_terminal(JobState.DEAD)
    assert not any(is_terminal(s) for s in ("pending", "ready", "leased", "retrying"))


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"unique": "active"}, "needs an idempotency_key"),
        ({"unique": "always", "idempotency_key": "k"}, "must be 'window' or 'active'"),
        ({"unique": 1, "idempotency_key": "k"}, "must be 'window' or 'active'"),
    ],
)
def test_unique_is_checked(service: QueueService, options: dict[str, Any], words: str) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        service.submit("q", {"n": 1}, **options)
    assert caught.value.details["field"] == "unique"
    assert words in caught.value.message


def test_unique_shows_in_the_view(service: QueueService) -> None:
    assert service.submit("q", 1)["job"]["unique"] == "window"
    assert service.submit("q", 2, idempotency_key="a", unique="window")["job"]["unique"] == "window"
    active = service.submit("q", 3, idempotency_key="b", unique="active")["job"]
    assert active["unique"] == "active"
    assert service.get(active["id"])["unique"] == "active"


def test_active_key_dedupes_while_ready_pending_leased_and_retrying(
    service: QueueService, clock: FakeClock
) -> None:
    first = service.submit("q", {"n": 1}, idempotency_key="k", unique="active", delay_ms=1000)
    job_id = first["job"]["id"]

    def again() -> dict[str, Any]:
        return service.submit("q", {"n": 1}, idempotency_key="k", unique="active")

    def state() -> str:
        return str(service.get(job_id)["state"])

    assert state() == "pending" and again()["job"]["id"] == job_id
    clock.advance(ms=1000)
    assert service.promote_due() == ["q"]
    assert state() == "ready" and again()["deduplicated"] is True
    lease = lease_one(service)
    assert state() == "leased" and again()["job"]["id"] == job_id
    service.fail(job_id, **ids(lease), error="boom")
    assert state() == "retrying" and again()["job"]["id"] == job_id
    # Same key, other payload, while active: refused.
    with pytest.raises(errors.IdempotencyConflict):
        service.submit("q", {"n": 2}, idempotency_key="k", unique="active")
    assert Job.objects.count() == 1


def test_active_key_is_freed_when_the_job_succeeds(service: QueueService) -> None:
    first = service.submit("q", {"n": 1}, idempotency_key="k", unique="active")["job"]
    lease = lease_one(service)
    service.ack(first["id"], **ids(lease))
    done = service.get(first["id"])
    assert done["state"] == "succeeded"
    assert done["idempotency_key"] is None and done["unique"] == "active"
    second = service.submit("q", {"n": 1}, idempotency_key="k", unique="active")
    assert second["deduplicated"] is False and second["job"]["id"] != first["id"]
    # The new job holds the key now; a payload it does not have conflicts.
    assert service.submit("q", {"n": 1}, idempotency_key="k")["job"]["id"] == second["job"]["id"]
    with pytest.raises(errors.IdempotencyConflict):
        service.submit("q", {"n": 9}, idempotency_key="k")
    # A repeated ack of the first job changes nothing of the second.
    assert service.ack(first["id"], **ids(lease))["duplicate"] is True
    assert service.get(second["job"]["id"])["idempotency_key"] == "k"


def test_active_key_is_freed_when_the_job_goes_dead_by_fail(
    service: QueueService, clock: FakeClock
) -> None:
    first = service.submit("q", {"n": 1}, idempotency_key="k", unique="active", max_retries=1)
    job_id = first["job"]["id"]
    service.fail(job_id, **ids(lease_one(service)), error="once")
    assert service.get(job_id)["idempotency_key"] == "k"  # retrying: still held
    clock.advance(ms=10 * 60_000)  # the retry comes due, and fails for good
    service.promote_due()
    service.fail(job_id, **ids(lease_one(service)), error="twice")
    assert service.get(job_id)["state"] == "dead"
    second = service.submit("q", {"n": 1}, idempotency_key="k", unique="active")
    assert second["deduplicated"] is False and second["job"]["id"] != job_id


def test_active_key_is_freed_when_a_lost_lease_dead_letters_the_job(
    service: QueueService, clock: FakeClock
) -> None:
    first = service.submit("q", {"n": 1}, idempotency_key="k", unique="active", max_retries=0)
    job_id = first["job"]["id"]
    lease = service.claim(["q"], worker_id="w1", lease_ms=1000)[0]
    clock.advance(ms=999)
    service.sweep()
    assert service.submit("q", {"n": 1}, idempotency_key="k")["job"]["id"] == job_id
    clock.advance(ms=1)  # the lease's expiry, exactly
    service.sweep()
    assert service.get(job_id)["state"] == "dead"
    assert service.submit("q", {"n": 1}, idempotency_key="k")["deduplicated"] is False
    with pytest.raises(errors.LeaseExpired):
        service.ack(job_id, **ids(lease))


def test_a_lost_lease_with_retries_left_keeps_the_key(
    service: QueueService, clock: FakeClock
) -> None:
    job_id = service.submit("q", 1, idempotency_key="k", unique="active")["job"]["id"]
    service.claim(["q"], worker_id="w1", lease_ms=1000)
    clock.advance(ms=1000)
    service.sweep()
    assert service.get(job_id)["state"] == "ready"
    assert service.submit("q", 1, idempotency_key="k", unique="active")["job"]["id"] == job_id


def test_replay_of_a_dead_active_job_does_not_take_the_key_back(service: QueueService) -> None:
    job_id = service.submit("q", 1, idempotency_key="k", unique="active")["job"]["id"]
    service.fail(job_id, **ids(lease_one(service)), error="no", retryable=False)
    newer = service.submit("q", 1, idempotency_key="k", unique="active")["job"]["id"]
    service.replay(job_id)
    assert service.get(job_id)["state"] == "ready"
    assert service.get(job_id)["idempotency_key"] is None
    assert service.submit("q", 1, idempotency_key="k")["job"]["id"] == newer


def test_window_keys_stay_bound_after_the_job_finishes(service: QueueService) -> None:
    """The default (``unique`` left out or ``"window"``) is unchanged: the key outlives the job."""
    for unique in (None, "window"):
        key = f"k-{unique}"
        job_id = service.submit("q", 1, idempotency_key=key, unique=unique)["job"]["id"]
        service.ack(job_id, **ids(lease_one(service)))
        again = service.submit("q", 1, idempotency_key=key, unique="active")
        assert again["deduplicated"] is True and again["job"]["id"] == job_id


def test_active_key_still_ends_with_its_window(service: QueueService, clock: FakeClock) -> None:
    """``active`` only frees a key sooner: an active job past the window frees it too."""
    with override_settings(RELAY_IDEMPOTENCY_WINDOW_MS=60_000):
        job_id = service.submit("q", 1, idempotency_key="k", unique="active")["job"]["id"]
        clock.advance(ms=59_999)
        assert service.submit("q", 1, idempotency_key="k")["job"]["id"] == job_id
        clock.advance(ms=1)
        fresh = service.submit("q", 1, idempotency_key="k")
    assert fresh["deduplicated"] is False and fresh["job"]["id"] != job_id


def test_active_keys_in_a_batch(service: QueueService) -> None:
    results = service.submit_batch(
        [
            {"queue": "q", "payload": 1, "idempotency_key": "k", "unique": "active"},
            {"queue": "q", "payload": 1, "idempotency_key": "k", "unique": "active"},
        ]
    )
    assert [r["deduplicated"] for r in results] == [False, True]
    assert results[0]["job_id"] == results[1]["job_id"]
    service.ack(results[0]["job_id"], **ids(lease_one(service)))
    again = service.submit_batch(
        [{"queue": "q", "payload": 1, "idempotency_key": "k", "unique": "active"}]
    )
    assert again[0]["deduplicated"] is False and again[0]["job_id"] != results[0]["job_id"]


def test_ack_of_an_active_job_costs_one_more_statement_only_for_it(
    service: QueueService, assert_queries: Any
) -> None:
    """The key is freed by one extra UPDATE in the ack's transaction, and only for ``active``
    jobs: other acks run the statements they ran before."""
    plain = service.submit("q", 1)["job"]["id"]
    lease = lease_one(service)
    with assert_queries(sqlite=4, postgresql=4):
        service.ack(plain, **ids(lease))
    active = service.submit("q", 2, idempotency_key="k", unique="active")["job"]["id"]
    lease = lease_one(service)
    with assert_queries(sqlite=5, postgresql=5):
        service.ack(active, **ids(lease))
