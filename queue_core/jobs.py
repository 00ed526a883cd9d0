"""The job's wire shape, built in one place for every surface.

``job_view`` turns a ``relay_job`` row into the ``types.Job`` object that TCP replies, the
HTTP API (``queue_api.schemas.JobOut`` is built from ``types.Job``), the tasks backend and
the CLI show; the service calls it for every job it returns, a new one included.
``JOB_COLUMNS`` are the columns it reads: each driver's ``queries.sql`` writes
``{job_columns}`` where a statement selects a job, and ``storage.base.load_queries`` puts
this list there, so the SELECT lists cannot drift from the view.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from queue_core import types
from queue_core.states import Priority

JOB_COLUMNS = (
    "id",
    "queue",
    "state",
    "priority",
    "payload",
    "idempotency_key",
    "attempt",
    "failures",
    "max_retries",
    "backoff",
    "backoff_base_ms",
    "backoff_cap_ms",
    "jitter",
    "created_at_ms",
    "available_at_ms",
    "ready_since_ms",
    "leased_by",
    "lease_expires_at_ms",
    "finished_at_ms",
    "last_error",
    "dead_reason",
    "unique_scope",
    "meta",
    "cancel_requested_at_ms",
    "time_limit_ms",
)
"""The ``relay_job`` columns ``job_view`` reads, in the order the SELECT lists name them."""

PRIORITY_NAMES = tuple(p.name.lower() for p in sorted(Priority))
"""Priority names by their stored number (0 = ``low``)."""

_DECODE: Any = object()  # job_view's default: decode the row's payload

# The columns of a job just inserted that its insert does not set.
_FRESH = {
    "attempt": 0,
    "failures": 0,
    "leased_by": None,
    "lease_expires_at_ms": None,
    "finished_at_ms": None,
    "last_error": None,
    "dead_reason": None,
    "cancel_requested_at_ms": None,
}


def meta_of(text: str | None) -> dict[str, str]:
    """A job's ``meta`` map from its stored JSON text (``{}`` when the column is NULL)."""
    return orjson.loads(text) if text else {}


def job_view(row: Mapping[str, Any], *, payload: Any = _DECODE) -> types.Job:
    """Shape a job row as the wire's Job object (never includes the lease token).

    Args:
        row: a mapping with every name in ``JOB_COLUMNS``: ``priority`` as its number,
            ``payload`` and ``meta`` as their stored JSON text (``meta`` may be NULL),
            ``jitter`` as 0/1 or a bool, ``unique_scope`` as ``"active"`` or NULL, instants
            in epoch ms.
        payload: the payload already decoded, when the caller has it (a fresh submit);
            by default ``row["payload"]`` is decoded.
    Returns:
        ``types.Job`` (without ``history`` and ``events``, which ``QueueService.get`` adds).
    Raises:
        KeyError: a column is missing.
    """
    return {
        "id": row["id"],
        "queue": row["queue"],
        "state": row["state"],
        "priority": PRIORITY_NAMES[row["priority"]],
        "payload": orjson.loads(row["payload"]) if payload is _DECODE else payload,
        "attempt": row["attempt"],
        "failures": row["failures"],
        "max_retries": row["max_retries"],
        "retry_policy": {
            "backoff": row["backoff"],
            "base_ms": row["backoff_base_ms"],
            "cap_ms": row["backoff_cap_ms"],
            "jitter": bool(row["jitter"]),
        },
        "idempotency_key": row["idempotency_key"],
        "created_at_ms": row["created_at_ms"],
        "available_at_ms": row["available_at_ms"],
        "ready_since_ms": row["ready_since_ms"],
        "leased_by": row["leased_by"],
        "lease_expires_at_ms": row["lease_expires_at_ms"],
        "finished_at_ms": row["finished_at_ms"],
        "last_error": row["last_error"],
        "dead_reason": row["dead_reason"],
        "unique": row["unique_scope"] or "window",
        "meta": meta_of(row["meta"]),
        "cancel_requested_at_ms": row["cancel_requested_at_ms"],
        "time_limit_ms": row["time_limit_ms"],
    }


def new_job_view(row: Mapping[str, Any], *, created_at_ms: int, payload: Any) -> types.Job:
    """The view of a job just inserted from ``row`` (the ``insert_job`` parameters).

    Args:
        row: the inserted columns (``id``, ``queue``, ``state``, ``priority``, the retry
            policy, ``idempotency_key``, ``unique_scope``, ``meta``, ``available_at_ms``,
            ``ready_since_ms``, ``time_limit_ms``).
        created_at_ms: the insert's instant, epoch ms.
        payload: the payload as submitted (not re-decoded from its stored text).
    """
    return job_view({**_FRESH, **row, "created_at_ms": created_at_ms}, payload=payload)


def lease_view(row: Mapping[str, Any], lease_expires_at_ms: int) -> types.Lease:
    """Shape a row the claim returned as the wire's Lease object (the job and its token).

    Args:
        row: ``id``, ``queue``, ``payload`` (stored JSON text), ``attempt``, ``priority`` (its
            number), ``lease_token``, ``failures``, ``max_retries``, ``created_at_ms``,
            ``meta`` (stored JSON text or NULL; the lease carries it as a map, ``{}`` for none).
            ``time_limit_ms`` (ms, or None).
        lease_expires_at_ms: the expiry the claim set, epoch ms.
    """
    return {
        "job_id": row["id"],
        "queue": row["queue"],
        "payload": orjson.loads(row["payload"]),
        "attempt": row["attempt"],
        "priority": PRIORITY_NAMES[row["priority"]],
        "lease_token": row["lease_token"],
        "lease_expires_at_ms": lease_expires_at_ms,
        "failures": row["failures"],
        "max_retries": row["max_retries"],
        "created_at_ms": row["created_at_ms"],
        "meta": meta_of(row["meta"]),
        "time_limit_ms": row["time_limit_ms"],
    }


def batch_entry(
    job_id: str, queue: str, state: str, available_at_ms: int | None, deduplicated: bool
) -> types.BatchEntry:
    """One ``submit_batch`` result: the job's id and where it stands."""
    return {
        "job_id": job_id,
        "queue": queue,
        "state": state,  # type: ignore[typeddict-item]
        "available_at_ms": available_at_ms,
        "deduplicated": deduplicated,
    }
