"""The queue overview: per queue the counts by state, oldest ready age, who holds leases now,
its controls (paused, cap, rate), the latest failures, and the live servers.

Five reads, each bounded by an index rather than by the size of the table:

- counts by queue and state, each queue's oldest READY job and the live servers, a page of
  ``QUEUES_PER_PAGE`` queues at a time:
  ``QueueService.stats()`` (the numbers ``relay stats`` prints), one pass over the
  ``(queue, state, id)`` covering index, one over the READY partial index, and the server
  registry (a handful of rows);
- leases held now on the page's queues, grouped by queue and worker: on SQLite a seek per
  queue into its leased rows of the ``(queue, state, id)`` index; at most ``LEASE_GROUPS``
  groups are listed, at most ``WORKERS_PER_QUEUE`` in a queue's line;
- the latest failed attempts: the ``relay_attempt_failed`` partial index (migration 0003),
  newest first, ``RECENT_FAILURES`` rows;
- every paused or limited queue's controls (``QueueService.queue_controls``: the few rows of
  ``relay_queue``), so a paused queue on another page is named on every page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db.models import Count, Min

from queue_core.models import Job, JobAttempt
from queue_core.service import QueueService
from queue_core.states import JobState

RECENT_FAILURES = 25
# Queues on one page of the overview, in name order (``QueueService.stats`` pages them): with
# every queue on one page, 30,000 queues made a 20.6 MB page in 3.8 s (a review).
QUEUES_PER_PAGE = 200
STATES = [s.value for s in JobState]
# Leases now: at most this many (queue, worker) groups listed, of the page's queues only, and
# this many in a queue's line. A worker key can lease each job under a new worker id: 100,500
# groups made a 37 MB overview, 4.5 s to build and 37 s to load in Chromium (a review).
LEASE_GROUPS = 200
WORKERS_PER_QUEUE = 5


@dataclass
class QueueRow:
    """One queue's line in the overview."""

    name: str
    counts: dict[str, int]
    total: int
    oldest_ready_age_ms: int | None
    leases: list[dict[str, Any]] = field(default_factory=list)
    # Workers holding this queue's leases that its line does not name: how many were read,
    # and whether more may hold some (the read stopped at ``LEASE_GROUPS``).
    more_workers: int = 0
    workers_cut: bool = False
    last_failure_at_ms: int | None = None
    # The queue's controls (``QueueService.queue_controls``) when it is paused, capped or
    # rate-limited; None when it runs with none.
    controls: dict[str, Any] | None = None

    @property
    def state_cells(self) -> list[tuple[str, int]]:
        """``(state, count)`` in life order, for the template."""
        return [(state, self.counts.get(state, 0)) for state in STATES]


@dataclass
class Overview:
    """Everything the overview page shows."""

    now_ms: int
    queues: list[QueueRow]
    totals: dict[str, int]
    leases: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    servers: list[dict[str, Any]] = field(default_factory=list)
    # The leases read stopped at ``LEASE_GROUPS`` groups: the page's queues have more.
    leases_cut: bool = False
    # Paging: the page began after this queue (None: the first page); the next begins after
    # ``next_after`` (None: this is the last).
    after: str | None = None
    next_after: str | None = None
    # Every paused or limited queue, whatever the page (name -> its controls): a paused queue
    # on a later page was out of sight (a review).
    controlled: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def paused(self) -> list[str]:
        """The paused queues' names, in name order."""
        return [name for name, c in self.controlled.items() if c.get("paused")]

    @property
    def total_cells(self) -> list[tuple[str, int]]:
        """``(state, count)`` over all queues."""
        return [(state, self.totals.get(state, 0)) for state in STATES]

    @property
    def total_jobs(self) -> int:
        """Every job, all queues and states."""
        return sum(self.totals.values())


def build_overview(
    service: QueueService, after: str | None = None, limit: int = QUEUES_PER_PAGE
) -> Overview:
    """Read the overview's numbers (five indexed reads) for one page of queues.

    Args:
        service: supplies ``stats()`` and the clock the ages are measured against.
        after: the page begins after this queue name (the previous page's ``next_after``).
        limit: queues on the page (``QUEUES_PER_PAGE``); the totals count every queue.
    Raises:
        InvalidArgument: ``after`` is not a queue name.
    """
    stats = service.stats(limit=limit, after=after)
    now = int(stats["server_time_ms"])
    failures: list[dict[str, Any]] = [
        dict(row)
        for row in JobAttempt.objects.using(service.driver.alias)
        .filter(outcome="failed")
        .order_by("-ended_at_ms")
        .values("job_id", "job__queue", "attempt", "worker_id", "ended_at_ms", "error")[
            :RECENT_FAILURES
        ]
    ]
    rows: dict[str, QueueRow] = {}
    for name, q in sorted(stats["queues"].items()):
        counts = {state: int(q.get(state, 0)) for state in STATES}
        rows[name] = QueueRow(
            name=name,
            counts=counts,
            total=sum(counts.values()),
            oldest_ready_age_ms=q.get("oldest_ready_age_ms"),
        )
    # A paused or limited queue is listed even with no jobs, so it can be resumed from here.
    for name, controls in stats.get("controls", {}).items():
        if name not in rows:
            rows[name] = QueueRow(
                name=name, counts=dict.fromkeys(STATES, 0), total=0, oldest_ready_age_ms=None
            )
        rows[name].controls = dict(controls)
    rows = dict(sorted(rows.items()))
    # The expiry range (always true for a leased job) lets a planner take the leased-only
    # partial index instead; with the page's queues, SQLite seeks each one's leased rows.
    leases: list[dict[str, Any]] = [
        dict(row)
        for row in Job.objects.using(service.driver.alias)
        .filter(state=JobState.LEASED, lease_expires_at_ms__gte=0, queue__in=list(rows))
        .values("queue", "leased_by")
        .annotate(
            jobs=Count("id"),
            next_expiry_ms=Min("lease_expires_at_ms"),
            oldest_lease_ms=Min("leased_at_ms"),
        )
        .order_by("queue", "leased_by")[: LEASE_GROUPS + 1]
    ]
    leases_cut = len(leases) > LEASE_GROUPS
    del leases[LEASE_GROUPS:]
    for lease in leases:
        holder = rows[lease["queue"]]  # read for these queues only
        if len(holder.leases) < WORKERS_PER_QUEUE:
            holder.leases.append(lease)
        else:
            holder.more_workers += 1
    if leases_cut:  # the last queue read, and those after it, may have leases not read
        for later in rows.values():
            if later.name >= leases[-1]["queue"] and later.counts.get("leased"):
                later.workers_cut = True
    for failure in failures:
        row = rows.get(failure["job__queue"])
        if row is not None and row.last_failure_at_ms is None:
            row.last_failure_at_ms = failure["ended_at_ms"]
    return Overview(
        now_ms=now,
        queues=list(rows.values()),
        totals={state: int(stats["totals"].get(state, 0)) for state in STATES},
        leases=leases,
        failures=failures,
        servers=list(stats["servers"]),
        leases_cut=leases_cut,
        after=after,
        next_after=stats["next_after"],
        controlled=dict(service.queue_controls()["queues"]),
    )
