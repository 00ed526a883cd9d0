"""``QueueService.renew_batch`` once per storage driver, with the fake clock: a worker's due
renewals in one transaction, each fenced by its own token as ``renew`` fences one.

The rules under test: a guarded entry's lease is extended to now + its ``lease_ms``; a stale
token, another worker's lease, an expired lease (exactly at its expiry), an unknown job or a
lease length out of range refuses that entry only and changes nothing; a cancel-requested job
is renewed and told ``stop: "cancelled"``; one past its time limit has its attempt failed and
is told ``stop: "timeout"``; a malformed batch is refused whole; two batches naming the same
jobs in opposite orders, at once from two threads, both finish (the entries run in job id
order, so they lock the rows in one order).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job, JobAttempt
from queue_core.service import MAX_BATCH_ACKS, QueueService
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

W1 = "w1"


def lease(service: QueueService, n: int, worker_id: str = W1, **kw: Any) -> list[dict[str, Any]]:
    return service.claim(["q"], worker_id=worker_id, max_jobs=n, **kw)


def fence(held: dict[str, Any], worker_id: str = W1, **extra: Any) -> dict[str, Any]:
    return {
        "job_id": held["job_id"],
        "worker_id": worker_id,
        "lease_token": held["lease_token"],
        **extra,
    }


def expiry(job_id: str) -> int | None:
    return Job.objects.get(pk=job_id).lease_expires_at_ms


def test_each_entry_is_renewed_on_its_own_token_and_a_refusal_is_its_own(
    service: QueueService, clock: FakeClock
) -> None:
    for i in range(6):
        service.submit("q", {"i": i})
    a, b, c = lease(service, 3, lease_ms=10_000)
    (d,) = lease(service, 1, lease_ms=1_000)
    (e,) = lease(service, 1, worker_id="w2", lease_ms=10_000)
    (f,) = lease(service, 1, lease_ms=10_000)
    service.cancel(f["job_id"])
    clock.advance(seconds=1)  # d's lease expires exactly now
    now = clock.now_ms()
    kept = {held["job_id"]: expiry(held["job_id"]) for held in (b, d, e)}
    out = service.renew_batch(
        [
            fence(a, lease_ms=20_000),
            fence(b, lease_token="stale"),
            fence(c, lease_ms=5_000),
            fence(d),
            fence(e),  # leased to w2, renewed in w1's name
            fence(f, lease_ms=5_000),
            fence(b, lease_ms=1),  # under the shortest lease: that entry only
            {"job_id": "job_0000000000000000000000000x", "worker_id": W1, "lease_token": "t"},
        ]
    )["results"]
    assert [(r["job_id"], r["ok"], r["lease_expires_at_ms"], r["stop"]) for r in out] == [
        (a["job_id"], True, now + 20_000, None),
        (b["job_id"], False, None, None),
        (c["job_id"], True, now + 5_000, None),
        (d["job_id"], False, None, None),
        (e["job_id"], False, None, None),
        (f["job_id"], True, now + 5_000, "cancelled"),
        (b["job_id"], False, None, None),
        ("job_0000000000000000000000000x", False, None, None),
    ]
    assert [r["error"]["code"] for r in out if not r["ok"]] == [
        "STALE_TOKEN",
        "LEASE_EXPIRED",
        "STALE_TOKEN",
        "INVALID_ARGUMENT",
        "NOT_FOUND",
    ]
    assert (expiry(a["job_id"]), expiry(c["job_id"])) == (now + 20_000, now + 5_000)
    assert {job_id: expiry(job_id) for job_id in kept} == kept  # refused: unchanged
    assert Job.objects.get(pk=e["job_id"]).leased_by == "w2"


def test_an_entry_past_its_time_limit_fails_its_attempt_and_says_stop(
    service: QueueService, clock: FakeClock
) -> None:
    timed = service.submit("q", 1, time_limit_ms=2_000, max_retries=0)["job"]["id"]
    service.submit("q", 2)
    got = {held["job_id"]: held for held in lease(service, 2, lease_ms=10_000)}
    other = next(job_id for job_id in got if job_id != timed)
    clock.advance(ms=1_999)
    out = service.renew_batch([fence(got[timed]), fence(got[other])])["results"]
    assert [r["stop"] for r in out] == [None, None]  # one ms before the limit: renewed
    clock.advance(ms=1)
    out = service.renew_batch([fence(got[timed]), fence(got[other], lease_ms=10_000)])["results"]
    assert out[0] == {
        "job_id": timed,
        "ok": True,
        "lease_expires_at_ms": None,
        "stop": "timeout",
        "queue": "q",
        "state": "dead",
        "error": None,
    }
    assert (out[1]["ok"], out[1]["lease_expires_at_ms"]) == (True, clock.now_ms() + 10_000)
    job = Job.objects.get(pk=timed)
    assert (job.state, job.last_error) == ("dead", "timeout")
    attempt = JobAttempt.objects.get(job_id=timed, attempt=1)
    assert (attempt.outcome, attempt.error) == ("timeout", "timeout")
    with pytest.raises(errors.LeaseExpired):
        service.ack(timed, worker_id=W1, lease_token=got[timed]["lease_token"])


_BAD = {"job_id": "a", "worker_id": W1, "lease_token": "t"}


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda good: [], "renews"),
        (lambda good: "x", "renews"),
        (lambda good: [good] * (MAX_BATCH_ACKS + 1), "renews"),
        (lambda good: [good, {"job_id": "a", "worker_id": W1}], "renews[1].lease_token"),
        (lambda good: [good, {**_BAD, "result": 1}], "renews[1].result"),
        (lambda good: [good, {**_BAD, "job_id": 5}], "renews[1].job_id"),
        (lambda good: [good, 7], "renews[1]"),
    ],
)
def test_a_malformed_batch_is_refused_whole(
    service: QueueService, make: Callable[[dict[str, Any]], Any], field: str
) -> None:
    service.submit("q", 1)
    (held,) = lease(service, 1, lease_ms=10_000)
    before = expiry(held["job_id"])
    with pytest.raises(errors.InvalidArgument) as refused:
        service.renew_batch(make(fence(held, lease_ms=20_000)))
    assert (
        refused.value.details.get("field", f"renews[{refused.value.details.get('index')}]") == field
    )
    assert expiry(held["job_id"]) == before


def test_two_batches_naming_the_same_jobs_in_opposite_orders_both_finish(
    service: QueueService, clock: FakeClock
) -> None:
    """Rows locked in each batch's own order deadlock on PostgreSQL (one of the two is
    aborted); in job id order they queue. Two threads, each its own service, renew the same
    40 leases 25 times at once, one in order and one reversed."""
    service.submit_batch([{"queue": "q", "payload": i} for i in range(40)])
    held = lease(service, 40, lease_ms=60_000)
    entries = [fence(h, lease_ms=60_000) for h in held]
    start = threading.Barrier(2)
    failures: list[BaseException] = []
    renewed: list[int] = []

    def renew(batch: list[dict[str, Any]]) -> None:
        mine = QueueService(driver=service.driver, clock=clock)
        try:
            start.wait(10)
            for _ in range(25):
                out = mine.renew_batch(batch)["results"]
                renewed.append(sum(r["ok"] for r in out))
        except BaseException as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=renew, args=(entries,)),
        threading.Thread(target=renew, args=(entries[::-1],)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    assert renewed == [40] * 50


def test_a_refused_entry_echoes_only_an_id_that_could_be_one(service: QueueService) -> None:
    """A NUL (no store holds one) or a lone surrogate (no UTF-8 form: no reply can carry it)
    in a refused entry's ``job_id`` was echoed as sent (a review); it is answered as None."""
    service.submit("q", 1)
    (held,) = lease(service, 1, lease_ms=10_000)
    out = service.renew_batch(
        [fence(held, job_id="job_\x00x"), fence(held, job_id="job_\ud800"), fence(held)]
    )["results"]
    assert [(r["job_id"], r["ok"]) for r in out] == [
        (None, False),
        (None, False),
        (held["job_id"], True),
    ]
    assert {r["error"]["code"] for r in out[:2]} == {"INVALID_ARGUMENT"}
