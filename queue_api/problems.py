"""RFC 9457 problem details carrying Relay's error codes.

Every error the HTTP API returns is ``application/problem+json``::

    {"type": "urn:relay:error:STALE_TOKEN", "title": "Stale lease token", "status": 409,
     "detail": "cannot ack job_…: the lease token or worker is not the current lease's",
     "instance": "/api/v1/jobs/job_…/ack", "code": "STALE_TOKEN", "retryable": false,
     "details": {"job_id": "job_…"}}

``code``, ``retryable`` and ``details`` are the same as in a TCP error reply
(``queue_core.errors.error_body``); ``BUSY``, ``UNAVAILABLE``, ``TOO_MANY_CONNECTIONS`` and the
``STORAGE_*`` codes add ``Retry-After``.
"""

from __future__ import annotations

from typing import Any

import orjson
from django.http import HttpRequest, HttpResponse

from queue_core import errors

CONTENT_TYPE = "application/problem+json"
RETRY_AFTER_S = 1

TITLES = {
    "INVALID_ARGUMENT": "Invalid argument",
    "BAD_FRAME": "Malformed request",
    "FRAME_TOO_LARGE": "Request too large",
    "UNKNOWN_OP": "Unknown operation",
    "UNSUPPORTED_MEDIA_TYPE": "Unsupported media type",
    "UNAUTHENTICATED": "Unauthenticated",
    "PERMISSION_DENIED": "Permission denied",
    "NOT_FOUND": "Not found",
    "IDEMPOTENCY_CONFLICT": "Idempotency key conflict",
    "INVALID_STATE": "Invalid state for this transition",
    "LEASE_EXPIRED": "Lease expired",
    "STALE_TOKEN": "Stale lease token",
    "BUSY": "Database busy",
    "UNAVAILABLE": "Unavailable",
    "OUTCOME_UNKNOWN": "Outcome unknown",
    "TOO_MANY_CONNECTIONS": "Too many connections",
    "TIMEOUT": "Timeout",
    "INTERNAL": "Internal error",
    "STORAGE_FULL": "Database disk full",
    "STORAGE_IO": "Database storage error",
    "STORAGE_LOST": "Database file removed or replaced",
}
# Retryable refusals that carry Retry-After.
RETRY_AFTER_CODES = frozenset(
    {"BUSY", "UNAVAILABLE", "TOO_MANY_CONNECTIONS", "STORAGE_FULL", "STORAGE_IO", "STORAGE_LOST"}
)


def problem_body(exc: BaseException, instance: str) -> dict[str, Any]:
    """Return the problem object for ``exc`` (a non-Relay error becomes ``INTERNAL``)."""
    body = errors.error_body(exc)
    code = body["code"]
    status = exc.http_status if isinstance(exc, errors.RelayError) else 500
    problem: dict[str, Any] = {
        "type": f"urn:relay:error:{code}",
        "title": TITLES.get(code, code),
        "status": status,
        "detail": body["message"],
        "instance": instance,
        "code": code,
        "retryable": body["retryable"],
    }
    if "details" in body:
        problem["details"] = body["details"]
    return problem


def problem_response(request: HttpRequest | None, exc: BaseException) -> HttpResponse:
    """Return ``exc`` as an ``application/problem+json`` response."""
    instance = request.path if request is not None else ""
    body = problem_body(exc, instance)
    response = HttpResponse(
        orjson.dumps(body, default=str), status=body["status"], content_type=CONTENT_TYPE
    )
    if body["code"] in RETRY_AFTER_CODES:
        response["Retry-After"] = str(RETRY_AFTER_S)
    if body["status"] == 401:  # RFC 9110 §11.6.1: a 401 names the scheme it wants
        response["WWW-Authenticate"] = 'Bearer realm="relay"'
    return response
