"""Replay, purge and cancel many jobs from the console, through ``QueueService`` one job at a
time.

Every change goes through ``QueueService.replay`` / ``purge`` / ``cancel``, which guard the
state (compare-and-set) and record who did it in the job's events. For speed, ``BulkRunner``
groups ``CHUNK`` calls into one ``QueueService.transaction()``: each call becomes a
SAVEPOINT that rolls back alone when the service refuses it, the group commit the TCP server
uses. The write lock is held for one chunk at a time (5-12 ms for 50 replays) and then left to
other writers as long again (``QueueService.bulk_chunk``: SQLite's lock is not fair, and back
to back chunks kept a waiting server out), so workers keep claiming while an operator replays
100,000 dead letters.

A run stops after ``time_budget_s`` and reports what is left, so one HTTP request never
outlives the server's timeout; running the action again continues where it stopped, since
handled jobs no longer match. It stops the same way at a chunk a database error failed (BUSY
at BEGIN or COMMIT, a lost connection, a storage fault), naming the error; a call refused
BUSY alone (its row locked by another transaction) rolls back alone and the run goes on.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from queue_admin.display import iso_ms
from queue_core.errors import (
    InvalidArgument,
    InvalidState,
    JobFinished,
    JobNotFound,
    OutcomeUnknown,
    RelayError,
    StoreBusy,
)
from queue_core.models import JobEvent
from queue_core.service import BULK_CHUNK, QueueService
from queue_core.states import JobState

log = logging.getLogger("relay.admin")

CHUNK = BULK_CHUNK
TIME_BUDGET_S = 20.0
# How many job ids a message names per kind of outcome; the rest are counted.
EXAMPLES = 5


class Op(enum.StrEnum):
    """The operator transitions."""

    REPLAY = "replay"
    PURGE = "purge"
    CANCEL = "cancel"

    @property
    def past(self) -> str:
        """``replayed`` / ``purged`` / ``cancelled``."""
        return {"replay": "replayed", "purge": "purged", "cancel": "cancelled"}[self.value]


@dataclass
class Skipped:
    """A job the service refused, and why in words an operator can act on."""

    job_id: str
    reason: str


@dataclass
class Outcome:
    """What one run did: done ids, refusals by kind, and what it did not get to."""

    op: Op
    done: list[str] = field(default_factory=list)
    # Another operator (or another tab) got there first.
    raced: list[Skipped] = field(default_factory=list)
    # Not in a state this operation applies to (e.g. replay of a READY job).
    refused: list[Skipped] = field(default_factory=list)
    missing: list[Skipped] = field(default_factory=list)
    # Its row stayed locked by another transaction past RELAY_LOCK_TIMEOUT_MS, or a deadlock
    # chose it (PostgreSQL; BUSY): its call rolled back alone, the rest of the chunk went on.
    locked: list[Skipped] = field(default_factory=list)
    # Cancel of a LEASED job: marked, its worker stops it at its next renew (also in ``done``).
    requested: list[str] = field(default_factory=list)
    # Stopped by the time budget or a database error before reaching these.
    remaining: int = 0
    # What stopped the run at a chunk's BEGIN or COMMIT, or at a call that doomed its chunk
    # (a lost connection, a storage fault): that chunk was not applied, except that after
    # OUTCOME_UNKNOWN it may have been.
    stopped: RelayError | None = None

    @property
    def attempted(self) -> int:
        """Jobs the run asked the service about."""
        return (
            len(self.done)
            + len(self.raced)
            + len(self.refused)
            + len(self.missing)
            + len(self.locked)
        )


def chunked(ids: Iterable[str], size: int = CHUNK) -> Iterator[list[str]]:
    """Split ids into lists of at most ``size``."""
    chunk: list[str] = []
    for job_id in ids:
        chunk.append(job_id)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class BulkRunner:
    """Apply replay, purge or cancel to chunks of job ids through the service.

    Args:
        service: the QueueService to call (its ``transaction()`` holds each chunk).
        actor: recorded in each job's events as who did it (the operator's username).
        time_budget_s: stop starting new chunks after this many seconds.
        monotonic: clock for the budget (injectable for tests).
    """

    def __init__(
        self,
        service: QueueService,
        *,
        actor: str,
        time_budget_s: float = TIME_BUDGET_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.actor = actor
        self.time_budget_s = time_budget_s
        self.monotonic = monotonic

    def run(
        self, op: Op, chunks: Iterable[list[str]], *, dead_only: bool = False, total: int = 0
    ) -> Outcome:
        """Apply ``op`` to every id of ``chunks``, one transaction per chunk.

        Args:
            op: replay or purge.
            chunks: lists of job ids; read lazily, so a caller may page through a query.
            dead_only: for purge, refuse SUCCEEDED jobs too (the dead-letter list).
            total: how many ids the caller expects, to report ``remaining`` when stopped.
        Returns:
            The Outcome; ``remaining`` > 0 when the budget ran out or a database error stopped
            the run (``stopped``). It raises no ``RelayError``: the operator is told what the
            chunks before the error did.
        """
        outcome = Outcome(op)
        deadline = self.monotonic() + self.time_budget_s
        for chunk in chunks:
            if self.monotonic() > deadline:
                outcome.remaining = max(total - outcome.attempted, 1)
                break
            part = Outcome(op)
            try:
                with self.service.bulk_chunk(), self.service.transaction():
                    for job_id in chunk:
                        self._one(op, job_id, part, dead_only=dead_only)
            except RelayError as exc:
                # BEGIN or COMMIT found the database locked past the retry budget (BUSY), or
                # the connection or the storage failed: the whole chunk rolled back, so none
                # of its jobs changed; after OUTCOME_UNKNOWN it may have been kept.
                outcome.stopped = exc
                outcome.remaining = max(total - outcome.attempted, len(chunk))
                break
            outcome.done += part.done
            outcome.requested += part.requested
            outcome.raced += part.raced
            outcome.refused += part.refused
            outcome.missing += part.missing
            outcome.locked += part.locked
        self._explain_races(outcome)
        log.info(
            "event=admin_%s actor=%s done=%d raced=%d refused=%d missing=%d locked=%d "
            "remaining=%d stopped=%s",
            op.value,
            self.actor,
            len(outcome.done),
            len(outcome.raced),
            len(outcome.refused),
            len(outcome.missing),
            len(outcome.locked),
            outcome.remaining,
            outcome.stopped.code if outcome.stopped else None,
        )
        return outcome

    def _one(self, op: Op, job_id: str, outcome: Outcome, *, dead_only: bool) -> None:
        try:
            if op is Op.REPLAY:
                self.service.replay(job_id, actor=self.actor)
            elif op is Op.CANCEL:
                if not self.service.cancel(job_id, actor=self.actor)["cancelled"]:
                    outcome.requested.append(job_id)
            else:
                self.service.purge(job_id, actor=self.actor, dead_only=dead_only)
        except JobFinished as exc:
            outcome.refused.append(Skipped(job_id, f"it is {exc.details.get('state', '?')}"))
            return
        except InvalidState as exc:
            state = str(exc.details.get("state", "?"))
            if op is Op.REPLAY and state != JobState.DEAD:
                outcome.raced.append(Skipped(job_id, f"it is {state}"))
            else:
                outcome.refused.append(Skipped(job_id, f"it is {state}"))
            return
        except JobNotFound:
            outcome.missing.append(Skipped(job_id, "no such job"))
            return
        except InvalidArgument as exc:
            outcome.missing.append(Skipped(job_id, exc.message))
            return
        except StoreBusy:
            # Its row's lock wait ran out (or a deadlock chose it): its SAVEPOINT rolled back
            # and the chunk goes on, as the HTTP API's bulk routes answer BUSY for that job.
            outcome.locked.append(Skipped(job_id, "held by another transaction"))
            return
        outcome.done.append(job_id)

    def _explain_races(self, outcome: Outcome) -> None:
        """Name who got there first, from the job's latest operator event.

        A replay refused because the job is no longer DEAD is a race only when someone
        replayed it; otherwise it is a plain refusal (it was never dead). A purge of a job
        that no longer exists is a race when a ``purged`` event names who did it. A cancel
        refused because the job had finished is a plain refusal.
        """
        if outcome.op is Op.CANCEL:
            return
        event = "replayed" if outcome.op is Op.REPLAY else "purged"
        pool = outcome.raced if outcome.op is Op.REPLAY else outcome.missing
        latest: dict[str, dict[str, Any]] = {}
        for ids in chunked((item.job_id for item in pool), 500):
            rows = (
                JobEvent.objects.using(self.service.driver.alias)
                .filter(job_id__in=ids, event=event)
                .order_by("job_id", "id")
                .values("job_id", "actor", "at_ms")
            )
            latest.update((row["job_id"], dict(row)) for row in rows)  # the last one wins
        raced: list[Skipped] = []
        others: list[Skipped] = []
        for item in pool:
            last = latest.get(item.job_id)
            if last is None:
                others.append(item)
                continue
            who = last["actor"] or "the CLI or API"
            at = iso_ms(last["at_ms"])
            note = f"{event} by {who} at {at}"
            if outcome.op is Op.REPLAY:
                note += f"; {item.reason} now"
            raced.append(Skipped(item.job_id, note))
        outcome.raced = raced
        if outcome.op is Op.REPLAY:
            outcome.refused = others + outcome.refused
        else:
            outcome.missing = others


def describe(outcome: Outcome, noun: str = "job") -> list[tuple[str, str]]:
    """Messages for the operator: ``[(level, text)]`` with level success, warning or error."""
    op = outcome.op
    messages: list[tuple[str, str]] = []

    def plural(n: int) -> str:
        return f"{n:,} {noun}{'' if n == 1 else 's'}"

    def names(items: list[Skipped]) -> str:
        shown = "; ".join(f"{s.job_id} ({s.reason})" for s in items[:EXAMPLES])
        more = len(items) - EXAMPLES
        return shown + (f"; and {more:,} more" if more > 0 else "")

    if op is Op.CANCEL and outcome.done:
        now = len(outcome.done) - len(outcome.requested)
        if now:
            messages.append(("success", f"Cancelled {plural(now)}."))
        if outcome.requested:
            n = len(outcome.requested)
            messages.append(
                (
                    "success",
                    f"Asked the workers of {plural(n)} to stop: "
                    f"{'it is' if n == 1 else 'they are'} running, and "
                    f"end{'s' if n == 1 else ''} cancelled at the worker's next lease renewal "
                    "(or succeeded, if the handler finishes first).",
                )
            )
    elif outcome.done:
        messages.append(("success", f"{op.past.capitalize()} {plural(len(outcome.done))}."))
    elif not outcome.remaining:
        messages.append(("warning", f"Nothing was {op.past}."))
    if outcome.raced:
        n = len(outcome.raced)
        verb = "was" if n == 1 else "were"
        messages.append(
            (
                "warning",
                f"{plural(n)} {verb} already {op.past}: {names(outcome.raced)}.",
            )
        )
    if outcome.refused:
        n = len(outcome.refused)
        what = {
            Op.REPLAY: "not dead or cancelled",
            Op.PURGE: "not finished (or not dead)",
            Op.CANCEL: "finished already",
        }[op]
        verb = "is" if n == 1 else "are"
        messages.append(
            (
                "warning",
                f"{plural(n)} {verb} {what} and {verb} left alone: {names(outcome.refused)}.",
            )
        )
    if outcome.missing:
        n = len(outcome.missing)
        messages.append(("warning", f"{plural(n)} not found: {names(outcome.missing)}."))
    if outcome.locked:
        n = len(outcome.locked)
        verb = "was" if n == 1 else "were"
        messages.append(
            (
                "warning",
                f"{plural(n)} {verb} locked by another transaction and left alone: "
                f"{names(outcome.locked)}. Run the action again.",
            )
        )
    stopped = outcome.stopped
    if isinstance(stopped, StoreBusy):
        messages.append(
            (
                "error",
                "The database stayed busy, so the last batch was not applied "
                f"({outcome.remaining:,} left). Run the action again.",
            )
        )
    elif isinstance(stopped, OutcomeUnknown):
        messages.append(
            (
                "error",
                "The database connection was lost while the last batch committed: it may or "
                f"may not have been applied ({outcome.remaining:,} left, that batch included). "
                "Run the action again; jobs it changed no longer match.",
            )
        )
    elif stopped is not None:
        messages.append(
            (
                "error",
                f"The database failed ({stopped.code}: {stopped.message}), so the last batch "
                f"was not applied ({outcome.remaining:,} left). Run the action again.",
            )
        )
    elif outcome.remaining:
        messages.append(
            (
                "warning",
                f"Stopped after the time limit with about {outcome.remaining:,} left; "
                "run the action again to continue.",
            )
        )
    return messages
