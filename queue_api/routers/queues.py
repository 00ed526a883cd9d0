"""Operator endpoints for queue controls: pause, resume, limits (``QueueService`` through the
op table, as the TCP ops ``pause``, ``resume``, ``set_queue_limits``, ``queue_controls``)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router
from ninja.params import P, QueryEx

from queue_api import calls
from queue_api.routers._common import ERRORS
from queue_api.schemas import QueueControlsListOut, QueueControlsOut, QueueLimitsIn
from queue_api.security import ApiKey

router = Router(tags=["queues"])


@router.get(
    "/queues/controls",
    response={200: QueueControlsListOut, **ERRORS},
    auth=ApiKey("queue_controls"),
    summary="List controlled queues",
)
def controls(
    request: HttpRequest,
    limit: QueryEx[int, P(ge=1, le=1000)] = 1000,
    after: str | None = None,
) -> dict[str, Any]:
    """The paused, capped or rate-limited queues' controls, a page in name order; pass
    ``next_after`` as ``after`` for the next."""
    return calls.run(request, "queue_controls", {"limit": limit, "after": after})


@router.get(
    "/queues/{queue}/controls",
    response={200: QueueControlsOut, **ERRORS},
    auth=ApiKey("queue_controls"),
    summary="Read a queue's controls",
)
def queue_controls(request: HttpRequest, queue: str) -> dict[str, Any]:
    """One queue's controls (the defaults when nobody set any)."""
    result: dict[str, Any] = calls.run(request, "queue_controls", {"queue": queue})
    return dict(result["queues"][queue])


@router.post(
    "/queues/{queue}/pause",
    response={200: QueueControlsOut, **ERRORS},
    auth=ApiKey("pause"),
    summary="Pause a queue",
)
def pause(request: HttpRequest, queue: str) -> dict[str, Any]:
    """Lease nothing more from the queue (submits still accepted, leased jobs finish)."""
    return calls.run(request, "pause", {"queue": queue})


@router.post(
    "/queues/{queue}/resume",
    response={200: QueueControlsOut, **ERRORS},
    auth=ApiKey("resume"),
    summary="Resume a queue",
)
def resume(request: HttpRequest, queue: str) -> dict[str, Any]:
    """Lease from the queue again; its waiting long-polls wake."""
    return calls.run(request, "resume", {"queue": queue})


@router.put(
    "/queues/{queue}/limits",
    response={200: QueueControlsOut, **ERRORS},
    auth=ApiKey("set_queue_limits"),
    summary="Set a queue's limits",
)
def limits(request: HttpRequest, queue: str, body: QueueLimitsIn) -> dict[str, Any]:
    """Cap the queue's leased jobs (all workers) and/or its jobs started per second."""
    return calls.run(request, "set_queue_limits", {"queue": queue, **body.model_dump()})
