"""Read-only job listings the service does not offer yet: a queue's jobs by state, paged.

Reads only, through the ORM, never a state change. Each page costs one index seek per state
on ``relay_job_queue_state`` (queue, state, id), whatever the table size: with a state, one
seek of ``limit`` rows; without, the six per-state seeks are merged in id order. Pages are
keyset-paginated on the job id (ULIDs, so id order is creation order).

Proposed to the lead as ``QueueService.list_jobs(queue, state=None, *, limit, after)`` with a
named query per case; this module is the stand-in until then.
"""

from __future__ import annotations

from typing import Any, Literal

from queue_core import errors
from queue_core import validation as v
from queue_core.conf import relay_settings
from queue_core.service import job_view
from queue_core.states import JobState

MAX_LIMIT = 500
StateName = Literal["pending", "ready", "leased", "retrying", "succeeded", "dead"]
_COLUMNS = (
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
)


def list_jobs(
    queue: str, state: str | None = None, *, limit: int = 50, after: str | None = None
) -> dict[str, Any]:
    """Return one page of ``queue``'s jobs in id order.

    Args:
        queue: the queue.
        state: only jobs in this state (None for every state).
        limit: page size, 1..``MAX_LIMIT``.
        after: the previous page's ``next_after`` (a job id), or None for the first page.
    Returns:
        ``{"jobs": [Job, ...], "next_after": str | None}`` (None on the last page).
    Raises:
        InvalidArgument.
    """
    from queue_core.models import Job

    queue = v.queue_name(queue, relay_settings())
    limit = v.integer("limit", limit, lo=1, hi=MAX_LIMIT)
    states = [s.value for s in JobState]
    if state is not None:
        if state not in states:
            raise errors.InvalidArgument(
                f"state: must be one of {', '.join(states)}", field="state"
            )
        states = [state]
    cursor = "" if after is None else v.job_id(after)
    rows: list[dict[str, Any]] = []
    for name in states:
        page = Job.objects.filter(queue=queue, state=name, id__gt=cursor).order_by("id")
        rows.extend(page.values(*_COLUMNS)[:limit])
    rows.sort(key=lambda row: row["id"])
    jobs = [job_view(row) for row in rows[:limit]]
    return {"jobs": jobs, "next_after": jobs[-1]["id"] if len(jobs) == limit else None}
