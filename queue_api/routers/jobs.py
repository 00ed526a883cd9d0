"""Producer and read endpoints: submit, batch submit, read a job, list jobs, stats; and the
operator's cancel of one job."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from ninja import Router, Status
from ninja.params import HeaderEx, P, QueryEx

from queue_api import calls
from queue_api.routers._common import ERRORS
from queue_api.schemas import (
    BatchIn,
    BatchOut,
    CancelOut,
    JobDetailOut,
    JobPageOut,
    ResultOut,
    StatsOut,
    SubmitIn,
    SubmitOut,
)
from queue_api.security import ApiKey
from queue_core import errors, types
from queue_core.service import PAGE_MAX_JOBS

router = Router(tags=["jobs"])


def _location(job_id: str) -> str:
    return f"/api/v1/jobs/{job_id}"


def header_text(value: str, name: str) -> str:
    """A header's value as the UTF-8 text its client sent.

    WSGI (PEP 3333) and Django's ASGI handler give each byte of a header as the Latin-1
    character of that byte, so a UTF-8 key read as it came was stored as other text
    (``ключ`` as ``ÐºÐ»Ñ...``), and the same key in a body or over TCP made a second job
    (hostile review).

    Raises:
        InvalidArgument: the bytes are not UTF-8.
    """
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise errors.InvalidArgument(f"{name}: not UTF-8 text", field=name) from None


@router.post(
    "/queues/{queue}/jobs",
    response={201: SubmitOut, 200: SubmitOut, **ERRORS},
    auth=ApiKey("submit"),
    summary="Submit a job",
)
def submit(
    request: HttpRequest,
    response: HttpResponse,
    queue: str,
    body: SubmitIn,
    idempotency_key: HeaderEx[str | None, P(alias="Idempotency-Key")] = None,
) -> Status[dict[str, Any]]:
    """Create a job in ``queue`` (201), or answer an idempotent resubmit with its job (200).

    The idempotency key may come in the body or as the ``Idempotency-Key`` header (both must
    then agree). Same key and same payload within the window: the existing job, 200,
    ``deduplicated: true``. Same key, other payload: 409 ``IDEMPOTENCY_CONFLICT``.
    """
    args = body.dict()
    if idempotency_key is not None:
        idempotency_key = header_text(idempotency_key, "Idempotency-Key")
        in_body = args.get("idempotency_key")
        # A header arrives without its outer spaces and tabs (RFC 9110 section 5.5): the
        # same key in the body keeps them.
        if in_body is None:
            args["idempotency_key"] = idempotency_key
        elif not isinstance(in_body, str) or in_body.strip(" \t") != idempotency_key:
            raise errors.InvalidArgument(
                "idempotency_key: the body and the Idempotency-Key header differ",
                field="idempotency_key",
            )
    result = calls.run(request, "submit", {"queue": queue, **args})
    response["Location"] = _location(result["job"]["id"])
    return Status(200 if result["deduplicated"] else 201, result)


@router.post(
    "/jobs/batch",
    response={201: BatchOut, 200: BatchOut, **ERRORS},
    auth=ApiKey("submit_batch"),
    summary="Submit several jobs in one transaction",
)
def submit_batch(request: HttpRequest, body: BatchIn) -> Status[dict[str, Any]]:
    """Create 1..RELAY_MAX_BATCH_SUBMIT jobs, all or none (201 when any job is new, else 200).

    A bad job fails the whole batch with 422 and ``details.index`` naming it.
    """
    jobs = [job.dict() for job in body.jobs]
    result = calls.run(request, "submit_batch", {"jobs": [_compact(job) for job in jobs]})
    created = any(not item["deduplicated"] for item in result["results"])
    return Status(201 if created else 200, result)


def _compact(spec: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in spec.items() if value is not None}


@router.get(
    "/jobs/{job_id}",
    response={200: JobDetailOut, **ERRORS},
    auth=ApiKey("inspect"),
    summary="Read a job with its history",
)
def get_job(request: HttpRequest, job_id: str) -> dict[str, Any]:
    """Return the job: state, attempts, lease holder and expiry, history with errors, events."""
    job: dict[str, Any] = calls.run(request, "inspect", {"job_id": job_id})["job"]
    return job


@router.post(
    "/jobs/{job_id}/cancel",
    response={200: CancelOut, **ERRORS},
    auth=ApiKey("cancel"),
    summary="Cancel a job",
)
def cancel(request: HttpRequest, job_id: str) -> dict[str, Any]:
    """Cancel a job: ready, pending or retrying ones at once (``cancelled: true``); a leased
    one is marked and its worker stops it at its next renew (``cancelled: false``). A finished
    job answers 409 ``JOB_FINISHED``. The cancel is recorded with who asked."""
    return calls.run(request, "cancel", {"job_id": job_id})


@router.get(
    "/jobs/{job_id}/result",
    response={200: ResultOut, **ERRORS},
    auth=ApiKey("result"),
    summary="Read a job with its result",
)
def get_result(request: HttpRequest, job_id: str) -> dict[str, Any]:
    """Return the job (as ``GET /jobs/{job_id}``), the result its worker sent with the ack
    (``return_value``) and the structured errors sent with its fails (``errors``)."""
    return calls.run(request, "result", {"job_id": job_id})


@router.get(
    "/queues/{queue}/result",
    response={200: ResultOut, **ERRORS},
    auth=ApiKey("result"),
    summary="Read a job with its result, by its idempotency key",
)
def get_result_by_key(request: HttpRequest, queue: str, idempotency_key: str) -> dict[str, Any]:
    """As ``GET /jobs/{job_id}/result``, for the job submitted to ``queue`` with
    ``idempotency_key`` (a query parameter), while the key stays bound to it."""
    return calls.run(request, "result", {"queue": queue, "idempotency_key": idempotency_key})


@router.get(
    "/queues/{queue}/jobs",
    response={200: JobPageOut, **ERRORS},
    auth=ApiKey("list_jobs"),
    summary="List a queue's jobs (keyset pagination)",
)
def list_jobs(
    request: HttpRequest,
    queue: str,
    state: types.JobState | None = None,
    limit: QueryEx[int, P(ge=1, le=PAGE_MAX_JOBS)] = 50,
    after: str | None = None,
) -> dict[str, Any]:
    """Jobs of ``queue`` (in ``state`` when given) in id order, ``limit`` at a time.

    Pass the page's ``next_after`` as ``after`` for the next page; ``null`` means the end. A
    page ends early rather than pass ``RELAY_MAX_FRAME_BYTES`` of JSON. Operator scope.
    """
    return calls.service().list_jobs(queue, state, limit=limit, after=after)


@router.get(
    "/stats",
    response={200: StatsOut, **ERRORS},
    auth=ApiKey("stats"),
    summary="Counts by queue and state",
)
def stats(
    request: HttpRequest,
    queue: str | None = None,
    limit: int | None = None,
    after: str | None = None,
) -> dict[str, Any]:
    """Jobs by queue and state, with each queue's oldest ready age (all queues, or ``queue``).

    Queues come ``limit`` at a time (default and most 1000) in name order; pass the page's
    ``next_after`` as ``after`` for the next page (``null``: the last). Totals count all.
    """
    return calls.run(request, "stats", {"queue": queue, "limit": limit, "after": after})
