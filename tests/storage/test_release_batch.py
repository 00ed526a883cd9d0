"""``QueueService.release_batch`` once per storage driver, with the fake clock: the server's
give-back of leases whose replies never reached their client, many jobs in one transaction,
each fenced by its own token as ``release`` fences one.

The rules under test: a guarded entry goes READY with its attempt closed ``released``; a stale
token, another worker's lease, an expired lease (exactly at its expiry) or an unknown job
refuses that entry only; a cancel-requested job ends CANCELLED, as ``release`` ends it; a job
named twice is given back once; a malformed batch is refused whole and changes nothing; the
queue counts follow.
"""

from __future__ import annotations

from typing import Any

import pytest

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job, JobAttempt
from queue_core.service import MAX_BATCH_ACKS, QueueService
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

W1 = "w1"


def submit(service: QueueService, n: int, queue: str = "q") -> list[str]:
    return [str(service.submit(queue, {"i": i})["job"]["id"]) for i in range(n)]


def lease(service: QueueService, n: int, worker_id: str = W1, **kw: Any) -> list[dict[str, Any]]:
    return service.claim(["q"], worker_id=worker_id, max_jobs=n, **kw)


def fence(held: dict[str, Any], worker_id: str = W1) -> dict[str, Any]:
    return {"job_id": held["job_id"], "worker_id": worker_id, "lease_token": held["lease_token"]}


def state(job_id: str) -> str:
    return str(Job.objects.get(pk=job_id).state)


def outcomes(job_id: str) -> list[str | None]:
    rows = JobAttempt.objects.filter(job_id=job_id).order_by("attempt")
    return [a.outcome for a in rows]


def test_each_entry_is_released_on_its_own_token_and_a_refusal_is_its_own(
    service: QueueService, clock: FakeClock
) -> None:
    submit(service, 7)
    a, b, c = lease(service, 3)
    (d,) = lease(service, 1, lease_ms=1_000)
    e, f = lease(service, 2, worker_id="w2")
    clock.advance(seconds=1)  # d's lease expires exactly now
    out = service.release_batch(
        [
            fence(a),
            {"job_id": b["job_id"], "worker_id": W1, "lease_token": "stale"},
            fence(c),
            fence(d),
            fence(e),  # leased to w2, given back in w1's name
            fence(f, "w2"),  # another worker's, in its own name: one batch holds both
            {"job_id": "nope", "worker_id": W1, "lease_token": "t"},
        ]
    )
    assert [(r["job_id"], r["ok"]) for r in out] == [
        (a["job_id"], True),
        (b["job_id"], False),
        (c["job_id"], True),
        (d["job_id"], False),
        (e["job_id"], False),
        (f["job_id"], True),
        ("nope", False),
    ]
    assert [r["error"]["code"] for r in out if not r["ok"]] == [
        "STALE_TOKEN",
        "LEASE_EXPIRED",
        "STALE_TOKEN",
        "NOT_FOUND",
    ]
    ok = {"ok": True, "state": "ready", "queue": "q", "error": None}
    assert out[0] == {"job_id": a["job_id"], **ok}
    assert [state(h["job_id"]) for h in (a, b, c, d, e, f)] == [
        "ready",
        "leased",
        "ready",
        "leased",
        "leased",
        "ready",
    ]
    assert outcomes(a["job_id"]) == outcomes(c["job_id"]) == outcomes(f["job_id"]) == ["released"]
    assert outcomes(b["job_id"]) == [None]  # still open
    # A released job is leased again, on a new token; the old one fences nothing.
    again = {j["job_id"]: j for j in lease(service, 3)}
    assert a["job_id"] in again and again[a["job_id"]]["lease_token"] != a["lease_token"]
    with pytest.raises(errors.StaleToken):
        service.ack(a["job_id"], worker_id=W1, lease_token=a["lease_token"])


def test_a_lease_one_ms_before_its_expiry_is_released(
    service: QueueService, clock: FakeClock
) -> None:
    submit(service, 1)
    (a,) = lease(service, 1, lease_ms=1_000)
    clock.advance(ms=999)
    (out,) = service.release_batch([fence(a)])
    assert out["ok"] is True and state(a["job_id"]) == "ready"


def test_a_cancel_requested_job_ends_cancelled_and_a_repeat_is_given_back_once(
    service: QueueService,
) -> None:
    submit(service, 3)
    a, b, c = lease(service, 3)
    service.cancel(b["job_id"])  # leased: its cancel is requested, the worker learns it
    out = service.release_batch([fence(a), fence(b), fence(a), fence(c)])
    assert [(r["ok"], r.get("state")) for r in out] == [
        (True, "ready"),
        (True, "cancelled"),
        (False, None),
        (True, "ready"),
    ]
    assert out[2]["error"]["code"] == "STALE_TOKEN"
    assert out[1] == {
        "job_id": b["job_id"],
        "ok": True,
        "state": "cancelled",
        "queue": "q",
        "error": None,
    }
    assert state(b["job_id"]) == "cancelled" and outcomes(b["job_id"]) == ["cancelled"]
    assert outcomes(a["job_id"]) == ["released"]


def test_the_counts_follow_a_batch(service: QueueService) -> None:
    submit(service, 5)
    held = lease(service, 5)
    service.release_batch([fence(h) for h in held[:3]])
    totals = service.stats()["queues"]["q"]
    assert (totals["ready"], totals["leased"]) == (3, 2)
    assert Job.objects.filter(state="ready").count() == 3


def test_a_malformed_batch_is_refused_whole_and_a_bad_value_only_its_entry(
    service: QueueService,
) -> None:
    submit(service, 2)
    a, b = lease(service, 2)
    for bad in ([], [fence(a)] * (MAX_BATCH_ACKS + 1), [fence(a), "x"], "ab"):
        with pytest.raises(errors.InvalidArgument):
            service.release_batch(bad)  # type: ignore[arg-type]
    assert state(a["job_id"]) == "leased"
    out = service.release_batch(
        [
            {"job_id": "j" * 10_000, "worker_id": W1, "lease_token": "t"},
            {"job_id": a["job_id"], "worker_id": W1},
            fence(b),
        ]
    )
    assert [(r["job_id"], r["ok"]) for r in out] == [
        (None, False),
        (a["job_id"], False),
        (b["job_id"], True),
    ]
    assert [r["error"]["code"] for r in out[:2]] == ["INVALID_ARGUMENT", "INVALID_ARGUMENT"]
    assert state(a["job_id"]) == "leased" and state(b["job_id"]) == "ready"
    # A batch whose every entry is refused commits nothing and says why for each.
    out = service.release_batch(
        [{"job_id": a["job_id"], "worker_id": W1, "lease_token": "stale"}, fence(b)]
    )
    assert [r["error"]["code"] for r in out] == ["STALE_TOKEN", "STALE_TOKEN"]
    assert state(a["job_id"]) == "leased" and outcomes(a["job_id"]) == [None]
