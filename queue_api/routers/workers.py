"""Worker endpoints with the TCP semantics: lease (bounded long-poll), renew, ack, fail, release.

Every renew, ack, fail and release names the job, the worker id it was leased with and its
lease token, and is fenced exactly as over TCP: a lost lease answers 409 ``LEASE_EXPIRED`` or
``STALE_TOKEN`` and changes nothing.

Long-poll: ``lease`` is an async view. Each claim (a write transaction) runs on the HTTP
side's database threads (``queue_api.pool.run``, connections kept); between claims the request
waits on the event loop, holding no thread, for a wake-up (the TCP server's long-poll design,
``queue_core.protocol.wakeups``: a waiter subscribed to its queues before each claim, woken by
this process's commits and, through the process's one follower of the service's change feed,
by commits made elsewhere), for the next instant a job falls due or a lease expires, or for
``wait_ms`` (at most ``RELAY_MAX_WAIT_MS``) to pass. Under the ASGI worker
(``gunicorn.conf.py``) many long-polls thus cost no worker threads; under WSGI (Django's test
client) the same view runs through ``async_to_sync``.
A client that disconnects mid-wait is not noticed before the next claim; a job leased to it
returns when its lease expires.
"""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpRequest
from ninja import Router

from queue_api import calls, pool
from queue_api.routers._common import ERRORS
from queue_api.schemas import (
    AckBatchIn,
    AckBatchOut,
    AckIn,
    AckOut,
    FailIn,
    FailOut,
    LeaseIdsIn,
    LeaseIn,
    LeasesOut,
    ReleaseOut,
    RenewBatchIn,
    RenewBatchOut,
    RenewIn,
    RenewOut,
)
from queue_api.security import ApiKey, peer_of
from queue_core import auth, metrics
from queue_core.protocol.wakeups import Waiter

router = Router(tags=["workers"])


@router.post(
    "/leases",
    response={200: LeasesOut, **ERRORS},
    auth=ApiKey("lease"),
    summary="Lease ready jobs (long-poll up to wait_ms)",
)
async def lease(request: HttpRequest, body: LeaseIn) -> dict[str, Any]:
    """Lease up to ``max_jobs`` ready jobs from ``queues`` (ready -> leased, attempt + 1).

    Waits up to ``wait_ms`` for a job when none is ready; answers ``{"jobs": []}`` then.
    """
    args = body.dict()
    if args.get("worker_id") is None:
        # Without the port, so the client knows what to send with renew/ack/fail.
        args["worker_id"] = f"http:{request.META.get('REMOTE_ADDR') or 'unknown'}"
    verb, checked = calls.check("lease", args)
    waits = checked.get("wait_ms", 0) > 0
    deadline = time.monotonic() + checked.get("wait_ms", 0) / 1000
    process = calls.wakeups()
    if waits:
        await process.start()
    # The last round's waiter, whether a wake chose any round's, and whether it leaves with
    # jobs: as it leaves, it hands its wake on (Wakeups.leave).
    waiter: Waiter | None = None
    woken = got_jobs = False
    try:
        while True:
            # Subscribe before the claim: a commit after it wakes the wait.
            waiter = process.wakeups.subscribe(checked["queues"])
            try:
                result = await pool.run(_claim, request, verb, checked, waits)
                got_jobs = bool(result["jobs"])
                if got_jobs or time.monotonic() >= deadline:
                    return result
                await waiter.wait(deadline - time.monotonic())
            finally:
                woken = process.wakeups.unsubscribe(waiter) or woken
    finally:
        exhausted = calls.service().exhausted(checked["queues"]) if got_jobs else frozenset()
        process.wakeups.leave(waiter, got_jobs=got_jobs, woken=woken, exhausted=exhausted)


def _claim(request: HttpRequest, verb: Any, checked: dict[str, Any], waits: bool) -> dict[str, Any]:
    """Claim once and return the result; for a long-poll (``waits``), tell the process's
    wake-ups when its queues may next have something to claim (``ProcessWakeups.due_at``:
    a job due, a lease expiring, a rate token), jobs or not: the long-polls left waiting are
    woken then, one a queue, not each at its own timer. The key is checked again first (the
    request may have waited for a thread, or for a job): one revoked meanwhile leases
    nothing.

    Raises:
        Unauthenticated, PermissionDenied: the key was revoked since the request came in.
    """
    auth.still_allowed(
        getattr(request, "auth", None),
        "lease",
        calls.key_ring(),
        surface="http",
        peer=peer_of(request),
    )
    started = time.monotonic()
    outcome = calls.call(request, verb, checked)
    metrics.claim_took(time.monotonic() - started)
    if waits:
        queues = checked["queues"]
        calls.wakeups().due_at(calls.service().next_due_ms(queues), queues)
    result: dict[str, Any] = outcome.result
    return result


def _lease_op(request: HttpRequest, op: str, job_id: str, body: Any) -> dict[str, Any]:
    args = {"job_id": job_id, **body.dict()}
    if args.get("lease_next") is not None:
        args["lease_next"] = _without_nulls(args["lease_next"])
    return calls.run(request, op, args)


def _without_nulls(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: val for k, val in fields.items() if val is not None}


@router.post(
    "/jobs/{job_id}/renew",
    response={200: RenewOut, **ERRORS},
    auth=ApiKey("renew"),
    summary="Extend a lease",
)
def renew(request: HttpRequest, job_id: str, body: RenewIn) -> dict[str, Any]:
    """Move a live lease's expiry to now + ``lease_ms`` (leased -> leased)."""
    return _lease_op(request, "renew", job_id, body)


@router.post(
    "/renewals",
    response={200: RenewBatchOut, **ERRORS},
    auth=ApiKey("renew_batch"),
    summary="Renew several leases",
)
def renew_batch(request: HttpRequest, body: RenewBatchIn) -> dict[str, Any]:
    """Renew 1..100 leases in one commit, each fenced by its own token; each renew's outcome
    is its own (``results``: ``ok`` with ``lease_expires_at_ms`` and ``stop``, or ``error``
    such as ``STALE_TOKEN``)."""
    args = {"renews": [_without_nulls(renew) for renew in body.dict()["renews"]]}
    return calls.run(request, "renew_batch", args)


@router.post(
    "/jobs/{job_id}/ack",
    response={200: AckOut, **ERRORS},
    exclude_unset=True,  # "next" only when lease_next asked for it
    auth=ApiKey("ack"),
    summary="Acknowledge a leased job",
)
def ack(request: HttpRequest, job_id: str, body: AckIn) -> dict[str, Any]:
    """Mark a leased job done (leased -> succeeded); a repeat answers ``duplicate: true``.

    A ``result`` is stored with the job (413 ``FRAME_TOO_LARGE`` over
    ``RELAY_MAX_RESULT_BYTES``: nothing changed, the lease is still held). With
    ``lease_next`` the reply's ``next`` lists jobs leased in the same commit (no wait)."""
    return _lease_op(request, "ack", job_id, body)


@router.post(
    "/acks",
    response={200: AckBatchOut, **ERRORS},
    auth=ApiKey("ack_batch"),
    summary="Acknowledge several leased jobs",
)
def ack_batch(request: HttpRequest, body: AckBatchIn) -> dict[str, Any]:
    """Acknowledge 1..100 leased jobs in one commit, each fenced by its own token; each
    ack's outcome is its own (``results``: ``ok``, or ``error`` such as ``STALE_TOKEN``),
    and ``lease_next`` leases the next jobs in the same commit (``next``)."""
    args: dict[str, Any] = {
        "acks": [_without_nulls(ack) for ack in body.dict()["acks"]],
        "lease_next": None,
    }
    if body.lease_next is not None:
        args["lease_next"] = _without_nulls(body.lease_next.dict())
    return calls.run(request, "ack_batch", args)


@router.post(
    "/jobs/{job_id}/fail",
    response={200: FailOut, **ERRORS},
    exclude_unset=True,  # "next" only when lease_next asked for it
    auth=ApiKey("fail"),
    summary="Report a failed attempt",
)
def fail(request: HttpRequest, job_id: str, body: FailIn) -> dict[str, Any]:
    """Record a failure (leased -> retrying with backoff, or -> dead when none is left)."""
    return _lease_op(request, "fail", job_id, body)


@router.post(
    "/jobs/{job_id}/release",
    response={200: ReleaseOut, **ERRORS},
    auth=ApiKey("release"),
    summary="Give a leased job back",
)
def release(request: HttpRequest, job_id: str, body: LeaseIdsIn) -> dict[str, Any]:
    """Return a leased job to ready without counting a failure (leased -> ready)."""
    return _lease_op(request, "release", job_id, body)
