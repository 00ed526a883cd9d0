"""Cancel and time limits (issue 16, items 3 and 4) in ``QueueService``, fake clock, once per
storage driver.

Cancel: a waiting job (ready, pending, retrying) becomes CANCELLED at once and is never leased
again; a leased one is marked, its renew says ``stop: "cancelled"``, and its worker's fail or
release (or the lease's expiry) ends it CANCELLED, while an ack still succeeds it and still
needs the live lease (fencing); a finished job is refused with ``JOB_FINISHED``. Cancelled
jobs are purged, pruned and replayed like dead letters, and counted by ``stats``.

Time limit: renew extends the lease 1 ms before ``leased_at + time_limit_ms`` and refuses at
that instant exactly, failing the attempt with reason ``timeout`` under the retry policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test.utils import override_settings

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job, JobAttempt, JobEvent
from queue_core.service import QueueService
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

Factory = Callable[..., dict[str, Any]]
W1 = "w1"


def ids(lease: dict[str, Any], worker_id: str = W1) -> dict[str, Any]:
    return {"worker_id": worker_id, "lease_token": lease["lease_token"]}


def lease_of(service: QueueService, queue: str = "q", **kw: Any) -> dict[str, Any]:
    leases = service.claim([queue], worker_id=W1, **kw)
    assert len(leases) == 1
    return leases[0]


# ---------------------------------------------------------------------------- cancel


def test_cancel_a_ready_job_makes_it_cancelled_and_never_leased(
    service: QueueService, clock: FakeClock
) -> None:
    job = service.submit("q", {"n": 1})["job"]
    clock.advance(ms=5)
    out = service.cancel(job["id"], actor="alice")
    assert out["cancelled"] is True
    assert out["job"]["state"] == "cancelled"
    assert out["job"]["cancel_requested_at_ms"] == clock.now_ms()
    assert out["job"]["finished_at_ms"] == clock.now_ms()
    assert service.claim(["q"], worker_id=W1) == []
    event = JobEvent.objects.get(job_id=job["id"])
    assert (event.event, event.from_state, event.to_state, event.actor) == (
        "cancelled",
        "ready",
        "cancelled",
        "alice",
    )


def test_cancel_a_pending_and_a_retrying_job(service: QueueService, clock: FakeClock) -> None:
    pending = service.submit("q", 1, delay_ms=60_000)["job"]
    assert service.cancel(pending["id"])["job"]["state"] == "cancelled"
    retrying = service.submit("q", 2, max_retries=3, backoff="fixed", jitter=False)["job"]
    lease = lease_of(service)
    service.fail(retrying["id"], **ids(lease), error="boom")
    assert service.get(retrying["id"])["state"] == "retrying"
    out = service.cancel(retrying["id"])["job"]
    assert (out["state"], out["available_at_ms"]) == ("cancelled", None)
    clock.advance(ms=3_600_000)  # past every due time: neither comes back
    assert service.promote_due() == []
    assert service.claim(["q"], worker_id=W1) == []


@pytest.mark.parametrize("finish", ["ack", "dead", "cancelled"])
def test_cancel_of_a_finished_job_is_refused_with_job_finished(
    service: QueueService, finish: str
) -> None:
    job = service.submit("q", 1)["job"]
    if finish == "cancelled":
        service.cancel(job["id"])
    else:
        lease = lease_of(service)
        if finish == "ack":
            service.ack(job["id"], **ids(lease))
        else:
            service.fail(job["id"], **ids(lease), error="x", retryable=False)
    state = service.get(job["id"])["state"]
    with pytest.raises(errors.JobFinished) as caught:
        service.cancel(job["id"])
    assert caught.value.code == "JOB_FINISHED"
    assert caught.value.details == {"job_id": job["id"], "state": state}
    assert service.get(job["id"])["state"] == state


def test_cancel_of_a_missing_job(service: QueueService) -> None:
    with pytest.raises(errors.JobNotFound):
        service.cancel("job_nope")


def test_cancel_of_a_leased_job_marks_it_and_the_renew_says_stop(
    service: QueueService, clock: FakeClock
) -> None:
    job = service.submit("q", 1)["job"]
    lease = lease_of(service, lease_ms=10_000)
    assert service.renew(job["id"], **ids(lease))["stop"] is None
    clock.advance(ms=100)
    out = service.cancel(job["id"], actor="bob")
    assert out["cancelled"] is False
    assert out["job"]["state"] == "leased"
    assert out["job"]["cancel_requested_at_ms"] == clock.now_ms()
    first = clock.now_ms()
    clock.advance(ms=100)
    again = service.cancel(job["id"])  # idempotent: the first instant stays, one event
    assert again["job"]["cancel_requested_at_ms"] == first
    assert list(JobEvent.objects.values_list("event", "actor")) == [("cancel_requested", "bob")]
    renewed = service.renew(job["id"], **ids(lease), lease_ms=10_000)
    # The lease is still extended, so the handler has time to stop.
    assert renewed == {
        "job_id": job["id"],
        "lease_expires_at_ms": clock.now_ms() + 10_000,
        "stop": "cancelled",
    }


@pytest.mark.parametrize("how", ["fail", "release"])
def test_the_worker_stopping_after_a_cancel_ends_the_job_cancelled(
    service: QueueService, clock: FakeClock, how: str
) -> None:
    job = service.submit("q", 1, max_retries=5)["job"]
    lease = lease_of(service)
    service.cancel(job["id"])
    clock.advance(ms=10)
    if how == "fail":
        out = service.fail(job["id"], **ids(lease), error="stopped: cancelled")
        assert out["state"] == "cancelled" and out["retry_at_ms"] is None
        # A repeated fail with the same token answers the same, as a duplicate.
        again = service.fail(job["id"], **ids(lease), error="stopped: cancelled")
        assert again["state"] == "cancelled" and again["duplicate"] is True
    else:
        assert service.release(job["id"], **ids(lease))["state"] == "cancelled"
    view = service.get(job["id"])
    assert view["state"] == "cancelled"
    assert view["failures"] == 0  # a cancel is not a failure
    assert view["finished_at_ms"] == clock.now_ms()
    assert view["history"][-1]["outcome"] == "cancelled"
    assert service.claim(["q"], worker_id=W1) == []


def test_ack_after_a_cancel_request_succeeds_and_still_obeys_fencing(
    service: QueueService, clock: FakeClock
) -> None:
    job = service.submit("q", 1)["job"]
    lease = lease_of(service, lease_ms=5_000)
    service.cancel(job["id"])
    # Fencing: another worker or a wrong token is still refused.
    with pytest.raises(errors.StaleToken):
        service.ack(job["id"], worker_id="w2", lease_token=lease["lease_token"])
    with pytest.raises(errors.StaleToken):
        service.ack(job["id"], worker_id=W1, lease_token="x" * 32)
    out = service.ack(job["id"], **ids(lease))
    assert out["state"] == "succeeded"
    assert service.get(job["id"])["state"] == "succeeded"


def test_ack_after_a_cancel_request_and_an_expired_lease_is_refused(
    service: QueueService, clock: FakeClock
) -> None:
    job = service.submit("q", 1, max_retries=5)["job"]
    lease = lease_of(service, lease_ms=5_000)
    service.cancel(job["id"])
    clock.advance(ms=5_000)
    assert service.expire_leases() == []  # not back to READY: cancelled
    assert service.get(job["id"])["state"] == "cancelled"
    with pytest.raises(errors.LeaseExpired):
        service.ack(job["id"], **ids(lease))


def test_cancelled_jobs_are_counted_purged_replayed_and_pruned(
    service: QueueService, clock: FakeClock
) -> None:
    a = service.submit("q", 1)["job"]["id"]
    b = service.submit("q", 2)["job"]["id"]
    c = service.submit("q", 3)["job"]["id"]
    for job_id in (a, b, c):
        service.cancel(job_id)
    stats = service.stats("q")
    assert stats["queues"]["q"]["cancelled"] == 3
    assert stats["totals"]["cancelled"] == 3
    assert service.stats(finished=False)["queues"]["q"]["cancelled"] == 3
    assert service.list_jobs("q", "cancelled")["jobs"][0]["id"] == a
    # replay: back to READY with the cancel request cleared; leased again, no stop.
    replayed = service.replay(a, actor="carol")
    assert (replayed["state"], replayed["cancel_requested_at_ms"]) == ("ready", None)
    lease = lease_of(service)
    assert lease["job_id"] == a
    assert service.renew(a, **ids(lease))["stop"] is None
    # purge (the dead_purge op's kind too: not succeeded)
    assert service.purge(b, dead_only=True) == {"job_id": b, "purged": True}
    # prune: as old as dead letters may get (RELAY_RETENTION_DEAD)
    day = 86_400_000
    clock.advance(ms=day)
    assert service.prune({"cancelled": day}) == {"succeeded": 0, "dead": 0, "cancelled": 0}
    clock.advance(ms=1)
    assert service.count_prunable({"cancelled": day}) == {
        "succeeded": 0,
        "dead": 0,
        "cancelled": 1,
    }
    assert service.prune({"cancelled": day}) == {"succeeded": 0, "dead": 0, "cancelled": 1}
    assert not Job.objects.filter(id=c).exists()
    assert service.stats("q")["queues"]["q"]["cancelled"] == 0


def test_default_retention_of_cancelled_jobs_is_the_dead_one(
    service: QueueService, clock: FakeClock
) -> None:
    job_id = service.submit("q", 1)["job"]["id"]
    service.cancel(job_id)
    clock.advance(ms=30 * 86_400_000)
    assert service.prune()["cancelled"] == 0
    clock.advance(ms=1)
    assert service.prune()["cancelled"] == 1


def test_recovery_at_server_start_ends_a_cancel_requested_lease_cancelled(
    service: QueueService,
) -> None:
    if not service.capabilities.single_writer:
        assert service.recover() == 0
        return
    cancelled = service.submit("q", 1)["job"]["id"]
    kept = service.submit("q", 2)["job"]["id"]
    service.claim(["q"], worker_id=W1, max_jobs=2)
    service.cancel(cancelled)
    assert service.recover() == 1
    assert service.get(cancelled)["state"] == "cancelled"
    assert service.get(kept)["state"] == "ready"


# ---------------------------------------------------------------------- time limits


def test_time_limit_boundary_exact_to_the_ms(service: QueueService, clock: FakeClock) -> None:
    job = service.submit("q", 1, time_limit_ms=5_000, max_retries=2, jitter=False)["job"]
    assert job["time_limit_ms"] == 5_000
    lease = lease_of(service, lease_ms=2_000)
    assert lease["time_limit_ms"] == 5_000
    leased_at = clock.now_ms()
    clock.advance(ms=1_500)
    assert service.renew(job["id"], **ids(lease), lease_ms=4_000)["stop"] is None
    clock.advance(ms=leased_at + 4_999 - clock.now_ms())  # 1 ms before the limit: extended
    out = service.renew(job["id"], **ids(lease), lease_ms=2_000)
    assert out == {"job_id": job["id"], "lease_expires_at_ms": leased_at + 6_999, "stop": None}
    clock.advance(ms=1)  # at the limit: refused, the attempt fails with "timeout"
    out = service.renew(job["id"], **ids(lease), lease_ms=2_000)
    assert out["stop"] == "timeout" and out["lease_expires_at_ms"] is None
    view = service.get(job["id"])
    assert (view["state"], view["failures"], view["last_error"]) == ("retrying", 1, "timeout")
    attempt = JobAttempt.objects.get(job_id=job["id"], attempt=1)
    assert (attempt.outcome, attempt.error) == ("timeout", "timeout")
    # Its token is spent: a late ack or renew is refused as expired, with the reason.
    with pytest.raises(errors.LeaseExpired) as caught:
        service.ack(job["id"], **ids(lease))
    assert caught.value.details["reason"] == "timeout"
    with pytest.raises(errors.LeaseExpired):
        service.renew(job["id"], **ids(lease))


def test_time_limit_with_no_retries_left_dead_letters(
    service: QueueService, clock: FakeClock
) -> None:
    job = service.submit("q", 1, time_limit_ms=1_000, max_retries=0)["job"]
    lease = lease_of(service)
    clock.advance(ms=1_000)
    assert service.renew(job["id"], **ids(lease))["stop"] == "timeout"
    view = service.get(job["id"])
    assert (view["state"], view["last_error"]) == ("dead", "timeout")


def test_time_limit_counts_from_each_lease(service: QueueService, clock: FakeClock) -> None:
    job = service.submit("q", 1, time_limit_ms=1_000, max_retries=1, jitter=False)["job"]
    first = lease_of(service)
    clock.advance(ms=1_000)
    assert service.renew(job["id"], **ids(first))["stop"] == "timeout"
    clock.advance(ms=3_600_000)
    second = lease_of(service)
    assert second["attempt"] == 2
    clock.advance(ms=999)
    assert service.renew(job["id"], **ids(second))["stop"] is None


def test_a_hung_worker_past_its_limit_expires_with_reason_timeout(
    service: QueueService, clock: FakeClock
) -> None:
    timed = service.submit("q", 1, time_limit_ms=3_000, max_retries=1)["job"]["id"]
    plain = service.submit("q", 2, max_retries=1)["job"]["id"]
    service.claim(["q"], worker_id=W1, max_jobs=2, lease_ms=3_000)
    clock.advance(ms=3_000)
    service.expire_leases()
    assert service.get(timed)["last_error"] == "timeout"
    assert service.get(plain)["last_error"] == "lease expired"


def test_no_time_limit_renews_forever_and_bad_limits_are_refused(
    service: QueueService, clock: FakeClock
) -> None:
    job = service.submit("q", 1)["job"]
    assert job["time_limit_ms"] is None
    lease = lease_of(service, lease_ms=2_000)
    for _ in range(5):
        clock.advance(ms=1_000)
        assert service.renew(job["id"], **ids(lease), lease_ms=2_000)["stop"] is None
    for bad in (0, -1, True, "5s", 31 * 86_400_000):
        with pytest.raises(errors.InvalidArgument) as caught:
            service.submit("q", 1, time_limit_ms=bad)
        assert caught.value.details["field"] == "time_limit_ms"


def test_per_queue_default_time_limit_from_the_settings(service: QueueService) -> None:
    with override_settings(RELAY_QUEUE_TIME_LIMITS="slow=2h, fast=500ms"):
        assert service.submit("fast", 1)["job"]["time_limit_ms"] == 500
        assert service.submit("slow", 1)["job"]["time_limit_ms"] == 7_200_000
        assert service.submit("other", 1)["job"]["time_limit_ms"] is None
        # The job's own limit wins; a batch takes the defaults too.
        assert service.submit("fast", 1, time_limit_ms=9)["job"]["time_limit_ms"] == 9
        entry = service.submit_batch([{"queue": "fast", "payload": 1}])[0]
        assert service.get(entry["job_id"])["time_limit_ms"] == 500
    with override_settings(RELAY_QUEUE_TIME_LIMITS={"fast": "1s"}):
        assert service.submit("fast", 1)["job"]["time_limit_ms"] == 1_000


def test_timeout_after_a_cancel_request_ends_cancelled(
    service: QueueService, clock: FakeClock
) -> None:
    job = service.submit("q", 1, time_limit_ms=1_000, max_retries=3)["job"]
    lease = lease_of(service)
    service.cancel(job["id"])
    clock.advance(ms=1_000)
    assert service.renew(job["id"], **ids(lease))["stop"] == "timeout"
    assert service.get(job["id"])["state"] == "cancelled"
    # The attempt ended as the worker's own fail after the cancel would end it (cancelled,
    # error "timeout"): a late fail is answered as that fail's repeat, a late ack refused.
    late = service.fail(job["id"], **ids(lease), error="timeout")
    assert (late["state"], late["duplicate"]) == ("cancelled", True)
    with pytest.raises(errors.StaleToken):
        service.ack(job["id"], **ids(lease))
