"""Operator endpoints for dead letters: list, replay one or many, purge one or many.

Bulk replay and purge commit ``BULK_CHUNK`` jobs to a transaction, each job in a savepoint of
its own (as the console's bulk actions do), and answer per job, so one job that is no longer
dead does not undo the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from django.http import HttpRequest
from ninja import Router
from ninja.params import P, QueryEx

from queue_api import calls
from queue_api.routers._common import ERRORS
from queue_api.schemas import (
    JobIdsIn,
    JobOut,
    JobPageOut,
    PurgeManyOut,
    PurgeOut,
    ReplayManyOut,
)
from queue_api.security import ApiKey
from queue_core import errors
from queue_core.conf import relay_settings
from queue_core.service import PAGE_MAX_JOBS

router = Router(tags=["dead letters"])


@router.get(
    "/dead",
    response={200: JobPageOut, **ERRORS},
    auth=ApiKey("dead_list"),
    summary="List dead letters",
)
def dead_list(
    request: HttpRequest,
    queue: str | None = None,
    limit: QueryEx[int, P(ge=1, le=PAGE_MAX_JOBS)] = 100,
    after: str | None = None,
) -> dict[str, Any]:
    """Dead jobs (of ``queue`` when given) in id order; ``next_after`` pages on."""
    return calls.run(request, "dead_list", {"queue": queue, "limit": limit, "after": after})


@router.post(
    "/dead/{job_id}/replay",
    response={200: JobOut, **ERRORS},
    auth=ApiKey("dead_retry"),
    summary="Replay a dead letter",
)
def replay(request: HttpRequest, job_id: str) -> dict[str, Any]:
    """Redrive a dead job to ready with a fresh retry budget (history kept)."""
    job: dict[str, Any] = calls.run(request, "dead_retry", {"job_id": job_id})["job"]
    return job


@router.post(
    "/dead/replay",
    response={200: ReplayManyOut, **ERRORS},
    auth=ApiKey("dead_retry"),
    summary="Replay several dead letters",
)
def replay_many(request: HttpRequest, body: JobIdsIn) -> dict[str, Any]:
    """Replay each job; per-job results (``ok`` with the job, or the error). The jobs come
    whole as far as one frame holds them (``RELAY_MAX_FRAME_BYTES``), then ``job`` is null
    (replayed all the same: ``GET /jobs/{id}`` reads it): 1,000 jobs of 256 KiB payloads
    made a 256 MB reply (a review)."""
    room = relay_settings().max_frame_bytes

    def shape(result: dict[str, Any]) -> dict[str, Any]:
        nonlocal room
        room -= len(orjson.dumps(result["job"]))
        return {"job": result["job"] if room >= 0 else None}

    return _each(request, "dead_retry", body.job_ids, shape)


@router.post(
    "/dead/purge",
    response={200: PurgeManyOut, **ERRORS},
    auth=ApiKey("dead_purge"),
    summary="Purge several dead letters",
)
def purge_many(request: HttpRequest, body: JobIdsIn) -> dict[str, Any]:
    """Purge each job; per-job results."""
    return _each(request, "dead_purge", body.job_ids, lambda result: {})


@router.delete(
    "/dead/{job_id}",
    response={200: PurgeOut, **ERRORS},
    auth=ApiKey("dead_purge"),
    summary="Purge a dead letter",
)
def purge(request: HttpRequest, job_id: str) -> dict[str, Any]:
    """Delete a dead job and its history for good (a ``purged`` event records who)."""
    return calls.run(request, "dead_purge", {"job_id": job_id})


def _each(
    request: HttpRequest,
    op: str,
    job_ids: list[str],
    shape: Callable[[dict[str, Any]], dict[str, Any]],
) -> dict[str, Any]:
    """Run ``op`` for each job id (``calls.run_each``: chunks of jobs to a transaction, a
    savepoint each); collect ``ok`` plus ``shape(result)``, or the error, per job."""
    results: list[dict[str, Any]] = []
    done = calls.run_each(request, op, [{"job_id": job_id} for job_id in job_ids])
    for job_id, result in zip(job_ids, done, strict=True):
        if isinstance(result, errors.RelayError):
            error = {"code": result.code, "message": result.message}
            results.append({"job_id": job_id, "ok": False, "error": error})
        else:
            results.append({"job_id": job_id, "ok": True, **shape(result)})
    return {"results": results}
