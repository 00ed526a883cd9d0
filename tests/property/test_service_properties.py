"""Properties of leases, retries and ordering, on QueueService with an injected clock.

Hypothesis picks the numbers; the service runs on the real SQLite test file.

* Renewal and expiry boundaries: for any lease length and any moment, a renew strictly before
  the expiry succeeds and moves it to now + the new length (never past the maximum lease); at
  or after the expiry it is refused with ``LEASE_EXPIRED`` and changes nothing; once swept, an
  expired lease is READY again (aging from the expiry instant) with one failure counted.
* Retries to DEAD: exactly ``max_retries + 1`` deliveries, each retry delay within the policy's
  bounds (exactly the bounded delay without jitter, 50-100% of it with), never before it is due;
  a non-retryable failure goes straight to DEAD; lost leases count the same way. The largest
  budget with exponential backoff does not overflow.
* Delayed jobs and aging: a job is never leased before it is due, and jobs come out in order of
  effective priority (base class plus whole minutes waited, capped at CRITICAL), FIFO among
  equals, whatever the mix.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job
from queue_core.service import QueueService
from tests.audit import audit
from tests.property.db import reset_tables

pytestmark = pytest.mark.django_db(transaction=True)

MAX_LEASE_MS = 43_200_000
MAX_DELAY_MS = 30 * 24 * 3600 * 1000
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
def fresh(fast_commits: None) -> Any:
    """A factory of fresh (empty tables, new clock) services for each hypothesis example."""

    def make(seed: int = 0) -> tuple[QueueService, FakeClock]:
        reset_tables()
        clock = FakeClock()
        return QueueService(clock=clock, rng=random.Random(seed)), clock

    return make


def row(job_id: str) -> Job:
    return Job.objects.get(id=job_id)


# ------------------------------------------------------------------ lease boundaries


@SETTINGS
@given(
    lease_ms=st.integers(1_000, 120_000),
    offset_ms=st.integers(0, 240_000),
    renew_ms=st.one_of(st.integers(1_000, 120_000), st.just(MAX_LEASE_MS)),
)
@example(lease_ms=5_000, offset_ms=4_999, renew_ms=1_000)  # just before
@example(lease_ms=5_000, offset_ms=5_000, renew_ms=1_000)  # exactly at
@example(lease_ms=5_000, offset_ms=5_001, renew_ms=1_000)  # just after
def test_renew_succeeds_only_before_expiry_and_expired_leases_return_to_ready(
    fresh: Any, lease_ms: int, offset_ms: int, renew_ms: int
) -> None:
    service, clock = fresh()
    job = service.submit("q", {"n": 1}, max_retries=3)["job"]
    lease = service.claim(["q"], worker_id="w", lease_ms=lease_ms)[0]
    expires = lease["lease_expires_at_ms"]
    assert expires == clock.now_ms() + lease_ms
    clock.advance(ms=offset_ms)
    args = {"worker_id": "w", "lease_token": lease["lease_token"]}
    with pytest.raises(errors.InvalidArgument):  # the maximum lease bound
        service.renew(job["id"], lease_ms=MAX_LEASE_MS + 1, **args)
    if offset_ms < lease_ms:
        renewed = service.renew(job["id"], lease_ms=renew_ms, **args)
        assert renewed["lease_expires_at_ms"] == clock.now_ms() + renew_ms
        assert renewed["lease_expires_at_ms"] <= clock.now_ms() + MAX_LEASE_MS
        assert service.expire_leases() == []
        assert row(job["id"]).state == "leased"
    else:
        before = row(job["id"]).__dict__ | {"_state": None}
        with pytest.raises(errors.LeaseExpired):
            service.renew(job["id"], lease_ms=renew_ms, **args)
        assert row(job["id"]).__dict__ | {"_state": None} == before
        assert service.expire_leases() == ["q"]
        swept = row(job["id"])
        assert (swept.state, swept.failures, swept.ready_since_ms) == ("ready", 1, expires)
        with pytest.raises(errors.LeaseExpired):  # still refused after the sweep
            service.renew(job["id"], lease_ms=renew_ms, **args)
    audit_now()


def audit_now() -> None:
    from django.db import connection

    audit(connection, quick_check=False)


# ------------------------------------------------------------------ retries to DEAD


@SETTINGS
@given(
    max_retries=st.integers(0, 6),
    backoff=st.sampled_from(["fixed", "exponential"]),
    base_ms=st.integers(0, 60_000),
    cap_extra_ms=st.integers(0, 600_000),
    jitter=st.booleans(),
    non_retryable_at=st.one_of(st.none(), st.integers(1, 7)),
    seed=st.integers(0, 2**16),
)
def test_failures_retry_within_policy_bounds_then_dead_letter(
    fresh: Any,
    max_retries: int,
    backoff: str,
    base_ms: int,
    cap_extra_ms: int,
    jitter: bool,
    non_retryable_at: int | None,
    seed: int,
) -> None:
    service, clock = fresh(seed)
    cap_ms = base_ms + cap_extra_ms
    job = service.submit(
        "q",
        {"n": 1},
        max_retries=max_retries,
        backoff=backoff,
        backoff_base_ms=base_ms,
        backoff_cap_ms=cap_ms,
        jitter=jitter,
    )["job"]
    deliveries = 0
    while True:
        leases = service.claim(["q"], worker_id="w")
        assert [lease["job_id"] for lease in leases] == [job["id"]]
        deliveries += 1
        assert leases[0]["attempt"] == deliveries
        retryable = non_retryable_at != deliveries
        result = service.fail(
            job["id"],
            worker_id="w",
            lease_token=leases[0]["lease_token"],
            error=f"boom {deliveries}",
            retryable=retryable,
        )
        if result["state"] == "dead":
            break
        assert result["state"] == "retrying"
        bounded = base_ms if backoff == "fixed" else min(cap_ms, base_ms * 2 ** (deliveries - 1))
        delay = result["retry_at_ms"] - clock.now_ms()
        if jitter:
            assert 0.5 * bounded - 0.5 <= delay <= bounded
        else:
            assert delay == bounded
        if delay > 0:
            clock.advance(ms=delay - 1)
            assert service.claim(["q"], worker_id="w") == []  # never before it is due
            clock.advance(ms=1)
    want = min(max_retries + 1, non_retryable_at or max_retries + 1)
    assert deliveries == want
    dead = row(job["id"])
    assert (dead.attempt, dead.failures, dead.state) == (want, want, "dead")
    reason = "non-retryable" if non_retryable_at == want else "attempts exhausted"
    assert dead.dead_reason == f"{reason}: boom {want}"
    audit_now()


def test_repeated_fail_reports_what_that_failure_did_within_one_millisecond(fresh: Any) -> None:
    service, clock = fresh()
    job = service.submit("q", {"n": 1}, max_retries=3, backoff="fixed", jitter=False)["job"]
    first = service.claim(["q"], worker_id="w")[0]
    args = {"worker_id": "w", "error": "transient"}
    assert service.fail(job["id"], lease_token=first["lease_token"], **args)["state"] == "retrying"
    clock.advance(ms=1_000)
    # Within one millisecond: delivered again, failed for good, replayed by an operator.
    second = service.claim(["q"], worker_id="w")[0]
    service.fail(job["id"], lease_token=second["lease_token"], retryable=False, **args)
    service.replay(job["id"])
    # The first worker never got its reply and repeats its fail: that failure was retried.
    again = service.fail(job["id"], lease_token=first["lease_token"], **args)
    assert again["duplicate"] is True
    assert again["state"] == "retrying"


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16))
def test_largest_budget_with_exponential_backoff_does_not_overflow(fresh: Any, seed: int) -> None:
    """100 retries with the largest base and cap: every delay is the cap, within int64."""
    service, clock = fresh(seed)
    job = service.submit(
        "q",
        {"n": 1},
        max_retries=100,
        backoff="exponential",
        backoff_base_ms=MAX_DELAY_MS,
        backoff_cap_ms=MAX_DELAY_MS,
        jitter=True,
    )["job"]
    for attempt in range(1, 102):
        lease = service.claim(["q"], worker_id="w")[0]
        assert lease["attempt"] == attempt
        result = service.fail(
            job["id"], worker_id="w", lease_token=lease["lease_token"], error="again"
        )
        if attempt == 101:
            assert result["state"] == "dead"
            break
        delay = result["retry_at_ms"] - clock.now_ms()
        assert MAX_DELAY_MS / 2 - 1 <= delay <= MAX_DELAY_MS
        assert result["retry_at_ms"] < 2**63
        clock.advance(ms=delay)
    assert (row(job["id"]).attempt, row(job["id"]).failures) == (101, 101)


@SETTINGS
@given(max_retries=st.integers(0, 4), lease_ms=st.integers(1_000, 60_000))
def test_lost_leases_count_as_failures_and_end_dead(
    fresh: Any, max_retries: int, lease_ms: int
) -> None:
    service, clock = fresh()
    job = service.submit("q", {"n": 1}, max_retries=max_retries)["job"]
    for attempt in range(1, max_retries + 2):
        lease = service.claim(["q"], worker_id=f"w{attempt}", lease_ms=lease_ms)[0]
        assert lease["attempt"] == attempt
        clock.advance(ms=lease_ms)  # the worker crashed: the lease runs out
        service.expire_leases()
    lost = row(job["id"])
    assert (lost.state, lost.attempt, lost.failures) == ("dead", max_retries + 1, max_retries + 1)
    assert lost.dead_reason == "lease expired"
    assert service.claim(["q"], worker_id="w") == []
    audit_now()


# ------------------------------------------------------------------ delayed jobs and aging

JOB = st.tuples(
    st.sampled_from([0, 1, 2, 3]),  # priority class
    st.integers(0, 5 * 60_000),  # ms the clock moves before this submit
    st.sampled_from([0, 0, 0, 1, 30_000, 90_000]),  # delay_ms
)


@SETTINGS
@given(
    jobs=st.lists(JOB, min_size=1, max_size=12),
    later_ms=st.integers(0, 10 * 60_000),
    # 1: SQLite's one-statement claim (claim_one); 3: its heads ranked in Python.
    max_jobs=st.sampled_from([1, 3]),
)
def test_claims_follow_aged_priority_then_fifo_and_never_lease_early(
    fresh: Any, jobs: list[tuple[int, int, int]], later_ms: int, max_jobs: int
) -> None:
    service, clock = fresh()
    model = []  # (id, class, ready_since)
    for priority, wait_ms, delay_ms in jobs:
        clock.advance(ms=wait_ms)
        job = service.submit("q", {"p": priority}, priority=priority, delay_ms=delay_ms)["job"]
        model.append((job["id"], priority, clock.now_ms() + delay_ms))
    clock.advance(ms=later_ms)
    now = clock.now_ms()

    def effective(entry: tuple[str, int, int]) -> int:
        return min(3, entry[1] + (now - entry[2]) // 60_000)

    due = [m for m in model if m[2] <= now]
    due.sort(key=lambda m: (-effective(m), m[2], m[0]))
    got = []
    while leases := service.claim(["q"], worker_id="w", max_jobs=max_jobs):
        got.extend(lease["job_id"] for lease in leases)
    assert got == [m[0] for m in due]  # and nothing that is not yet due
    for job_id, _, due_at in model:
        if due_at > now:
            assert row(job_id).state == "pending"
    audit_now()
