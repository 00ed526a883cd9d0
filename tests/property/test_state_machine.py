"""Terminal-state invariants: a hypothesis state machine against QueueService on a real SQLite file.

Random sequences of submit (some with a time limit) / claim / renew / ack / fail / release /
cancel / advance the FakeClock / expire (``service.expire_leases()``) / replay / purge / restart
(``service.recover()`` on a new ``QueueService``) run against the service, next to a plain
dict model of what the documented semantics (docs/failure-model.md, docs/protocol.md) say must
happen. After every step:

* every job row and every attempt row equals the model (state, attempt, failures, lease holder
  and expiry, due time, ready time, outcomes), and ``tests.audit.audit`` finds nothing;
* no transition out of SUCCEEDED; DEAD and CANCELLED are left only by replay or purge; a
  cancelled job is never leased again; ``attempt`` never
  decreases (it counts deliveries and survives replay, which resets ``failures``);
* at most one live lease per job; an accepted ack, fail, renew or release carried the job's
  latest token and a lease that had not expired; every rejection has the documented code.

Examples are kept small (``max_examples``, ``stateful_step_count``) so the test runs in seconds;
``HYPOTHESIS_PROFILE``-style overrides are not needed: raise the numbers locally to dig deeper.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from django.db import connection
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.service import QueueService
from tests.audit import audit
from tests.property.db import reset_tables

QUEUE = "q"
MAX_LEASE_MS = 43_200_000
BACKOFF_BASE_MS = 1_000
BACKOFF_CAP_MS = 4_000
WORKERS = ("w1", "w2", "w3")
# (priority, max_retries, delay_ms, backoff, jitter) of a submitted job.
JOB_SPECS = st.tuples(
    st.sampled_from(["low", "normal", "high"]),
    st.integers(0, 2),
    st.sampled_from([0, 0, 0, 500, 5_000]),
    st.sampled_from(["fixed", "exponential"]),
    st.booleans(),
)
HOW = st.sampled_from(["latest", "latest", "drawn", "intruder"])
TIME_LIMITS = st.sampled_from([None, None, 1_000, 3_000])  # a job's time_limit_ms
ADVANCE_MS = st.sampled_from([1, 499, 500, 999, 1_000, 2_000, 3_000, 60_000, 120_000])


@dataclasses.dataclass
class Token:
    """One delivery (lease) as the model sees it."""

    job_id: str
    token: str
    attempt: int
    worker: str
    # succeeded | failed | lease_expired | released | recovered | cancelled | timeout
    outcome: str | None = None
    failed_to: str | None = None  # what an accepted fail did: retrying | dead | cancelled
    started_at: int = 0


@dataclasses.dataclass
class ModelJob:
    """What the documented semantics say a job's row holds."""

    id: str
    priority: int
    max_retries: int
    backoff: str
    jitter: bool
    state: str
    ready_since: int | None
    available_at: int | None
    attempt: int = 0
    failures: int = 0
    token: str | None = None
    worker: str | None = None
    expires: int | None = None
    dead_reason: str | None = None
    finished: bool = False
    purged: bool = False
    replays: list[int] = dataclasses.field(default_factory=list)  # when it was replayed
    time_limit: int | None = None  # ms one attempt may run
    leased_at: int | None = None
    cancel_requested: bool = False  # cancel_requested_at_ms is set


def bounded_backoff_ms(job: ModelJob, failure: int) -> int:
    """The policy's delay before retry ``failure``, computed with Python's unbounded ints."""
    if job.backoff == "fixed":
        return BACKOFF_BASE_MS
    return min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** (failure - 1))


class QueueMachine(RuleBasedStateMachine):
    """Drive QueueService and a dict model side by side."""

    tokens = Bundle("tokens")
    jobs = Bundle("jobs")

    def __init__(self) -> None:
        super().__init__()
        reset_tables()
        self.clock = FakeClock()
        self.rng = random.Random(7)
        self.service = QueueService(clock=self.clock, rng=self.rng)
        self.model: dict[str, ModelJob] = {}
        self.leases: dict[str, Token] = {}  # by token
        self.seen_attempt: dict[str, int] = {}
        self.seen_state: dict[str, str] = {}
        self.allowed_exits: set[str] = set()  # jobs the current step may move out of DEAD

    # ------------------------------------------------------------------ model helpers

    def now(self) -> int:
        return self.clock.now_ms()

    def promote(self) -> None:
        for job in self.model.values():
            due = job.available_at is not None and job.available_at <= self.now()
            if job.state in ("pending", "retrying") and due:
                job.state, job.ready_since, job.available_at = "ready", job.available_at, None

    def expire_model(self) -> bool:
        """Expire due leases in the model; return whether one went back to READY."""
        back = False
        for job in self.model.values():
            if job.state == "leased" and job.expires is not None and job.expires <= self.now():
                assert job.token is not None
                self.leases[job.token].outcome = "lease_expired"
                job.failures += 1  # a lost lease counts a failure, cancelled or not
                if job.cancel_requested:  # ends CANCELLED
                    job.state, job.finished = "cancelled", True
                    job.token = job.worker = job.expires = None
                    continue
                timed_out = job.time_limit is not None and (
                    job.leased_at is not None and job.expires >= job.leased_at + job.time_limit
                )
                reason = "timeout" if timed_out else "lease expired"
                if job.failures > job.max_retries:
                    job.state, job.dead_reason, job.finished = "dead", reason, True
                else:
                    job.state, job.ready_since, back = "ready", job.expires, True
                job.token = job.worker = job.expires = None
        return back

    def effective(self, job: ModelJob) -> int:
        assert job.ready_since is not None
        return min(3, job.priority + max(0, self.now() - job.ready_since) // 60_000)

    def rejection(self, tok: Token, worker: str) -> type[errors.RelayError]:
        """The documented code for a renew/ack/fail/release that is not accepted."""
        job = self.model[tok.job_id]
        if job.purged:
            return errors.JobNotFound
        current = job.state == "leased" and job.token == tok.token
        if current and job.worker == worker:
            return errors.LeaseExpired  # right lease, but its time is up
        if not current and tok.worker == worker and tok.outcome == "timeout":
            return errors.LeaseExpired  # a renew found it past its time limit
        if (
            not current
            and tok.worker == worker
            and tok.outcome == "lease_expired"
            and job.state != "leased"
        ):
            return errors.LeaseExpired  # expired, and nobody holds the job now
        return errors.StaleToken

    def live(self, tok: Token, worker: str) -> bool:
        job = self.model[tok.job_id]
        return (
            not job.purged
            and job.state == "leased"
            and job.token == tok.token
            and job.worker == worker
            and job.expires is not None
            and self.now() < job.expires
        )

    def accepted_with_latest_token(self, tok: Token) -> None:
        """An accepted lease call carried the job's latest token (the newest delivery)."""
        latest = max(
            (t for t in self.leases.values() if t.job_id == tok.job_id), key=lambda t: t.attempt
        )
        assert tok.token == latest.token and tok.attempt == self.model[tok.job_id].attempt

    def pick(self, tok: Token, how: str) -> tuple[Token, str]:
        """The lease a call names, and the worker making it.

        ``latest``: the job's newest delivery (most likely live); ``drawn``: whichever delivery
        was drawn (often stale); ``intruder``: the drawn one, by another worker.
        """
        if how == "latest":
            tok = max(
                (t for t in self.leases.values() if t.job_id == tok.job_id),
                key=lambda t: t.attempt,
            )
        if how == "intruder":
            return tok, next(w for w in WORKERS if w != tok.worker)
        return tok, tok.worker

    # ------------------------------------------------------------------ rules

    def _submit(self, spec: tuple[str, int, int, str, bool], limit: int | None = None) -> str:
        priority, max_retries, delay_ms, backoff, jitter = spec
        job = self.service.submit(
            QUEUE,
            {"n": len(self.model)},
            priority=priority,
            max_retries=max_retries,
            delay_ms=delay_ms,
            backoff=backoff,
            backoff_base_ms=BACKOFF_BASE_MS,
            backoff_cap_ms=BACKOFF_CAP_MS,
            jitter=jitter,
            time_limit_ms=limit,
        )["job"]
        delayed = delay_ms > 0
        self.model[job["id"]] = ModelJob(
            id=job["id"],
            priority={"low": 0, "normal": 1, "high": 2}[priority],
            max_retries=max_retries,
            backoff=backoff,
            jitter=jitter,
            state="pending" if delayed else "ready",
            ready_since=None if delayed else self.now(),
            available_at=self.now() + delay_ms if delayed else None,
            time_limit=limit,
        )
        assert job["state"] == self.model[job["id"]].state
        assert job["time_limit_ms"] == limit
        return str(job["id"])

    @initialize(
        target=jobs,
        specs=st.lists(JOB_SPECS, min_size=1, max_size=4),
        limits=st.lists(TIME_LIMITS, min_size=4, max_size=4),
    )
    def first_jobs(
        self, specs: list[tuple[str, int, int, str, bool]], limits: list[int | None]
    ) -> Any:
        pairs = zip(specs, limits[: len(specs)], strict=True)
        return multiple(*(self._submit(spec, limit) for spec, limit in pairs))

    @rule(target=jobs, spec=JOB_SPECS, limit=TIME_LIMITS)
    def submit(self, spec: tuple[str, int, int, str, bool], limit: int | None) -> str:
        return self._submit(spec, limit)

    @rule(
        target=tokens,
        worker=st.sampled_from(WORKERS),
        lease_ms=st.sampled_from([1_000, 3_000, 10_000, MAX_LEASE_MS]),
        max_jobs=st.integers(1, 3),
    )
    def claim(self, worker: str, lease_ms: int, max_jobs: int) -> Any:
        leases = self.service.claim([QUEUE], worker_id=worker, max_jobs=max_jobs, lease_ms=lease_ms)
        self.promote()
        self.expire_model()
        ready = [j for j in self.model.values() if j.state == "ready" and not j.purged]
        ready.sort(key=lambda j: (-self.effective(j), j.ready_since, j.id))
        want = ready[:max_jobs]
        assert [lease["job_id"] for lease in leases] == [j.id for j in want]
        toks = []
        for job, lease in zip(want, leases, strict=True):
            job.attempt += 1
            job.state, job.worker = "leased", worker
            job.token, job.expires = lease["lease_token"], self.now() + lease_ms
            job.leased_at = self.now()
            assert not job.cancel_requested  # a cancelled job is never leased again
            assert lease["attempt"] == job.attempt
            assert lease["time_limit_ms"] == job.time_limit
            assert lease["lease_expires_at_ms"] == job.expires
            assert job.token not in self.leases  # a fresh token every time
            tok = Token(job.id, lease["lease_token"], job.attempt, worker, started_at=self.now())
            self.leases[tok.token] = tok
            toks.append(tok)
        return multiple(*toks)

    @rule(
        tok=tokens,
        how=HOW,
        lease_ms=st.sampled_from([1_000, 5_000, MAX_LEASE_MS, MAX_LEASE_MS + 1]),
    )
    def renew(self, tok: Token, how: str, lease_ms: int) -> None:
        tok, worker = self.pick(tok, how)
        if lease_ms > MAX_LEASE_MS:  # the maximum lease bound: refused, nothing changes
            with pytest.raises(errors.InvalidArgument):
                self.service.renew(
                    tok.job_id, worker_id=worker, lease_token=tok.token, lease_ms=lease_ms
                )
            return
        if self.live(tok, worker):
            result = self.service.renew(
                tok.job_id, worker_id=worker, lease_token=tok.token, lease_ms=lease_ms
            )
            self.accepted_with_latest_token(tok)
            job = self.model[tok.job_id]
            assert job.leased_at is not None
            if job.time_limit is not None and self.now() >= job.leased_at + job.time_limit:
                # At the limit: not renewed; the attempt fails with "timeout" (or ends
                # CANCELLED when a cancel was requested).
                assert result["stop"] == "timeout" and result["lease_expires_at_ms"] is None
                self.end_lease(tok, "timeout", retryable=True, outcome="timeout")
                return
            job.expires = self.now() + lease_ms
            assert result["lease_expires_at_ms"] == self.now() + lease_ms
            assert result["stop"] == ("cancelled" if job.cancel_requested else None)
            return
        with pytest.raises(self.rejection(tok, worker)):
            self.service.renew(
                tok.job_id, worker_id=worker, lease_token=tok.token, lease_ms=lease_ms
            )

    @rule(tok=tokens, how=HOW)
    def ack(self, tok: Token, how: str) -> None:
        tok, worker = self.pick(tok, how)
        job = self.model[tok.job_id]
        if self.live(tok, worker):
            result = self.service.ack(tok.job_id, worker_id=worker, lease_token=tok.token)
            self.accepted_with_latest_token(tok)
            assert result["duplicate"] is False
            tok.outcome = "succeeded"
            job.state, job.finished = "succeeded", True
            job.token = job.worker = job.expires = None
        elif not job.purged and tok.outcome == "succeeded" and worker == tok.worker:
            # The reply was lost and the worker repeats its ack: success, nothing changes.
            assert self.service.ack(tok.job_id, worker_id=worker, lease_token=tok.token) == {
                "job_id": tok.job_id,
                "state": "succeeded",
                "duplicate": True,
            }
        else:
            with pytest.raises(self.rejection(tok, worker)):
                self.service.ack(tok.job_id, worker_id=worker, lease_token=tok.token)

    @rule(tok=tokens, how=HOW, retryable=st.booleans())
    def fail(self, tok: Token, how: str, retryable: bool) -> None:
        tok, worker = self.pick(tok, how)
        job = self.model[tok.job_id]
        call = {"worker_id": worker, "lease_token": tok.token, "error": "boom"}
        if self.live(tok, worker):
            result = self.service.fail(tok.job_id, retryable=retryable, **call)
            self.accepted_with_latest_token(tok)
            assert result["duplicate"] is False
            retry_at = self.end_lease(tok, "boom", retryable=retryable, outcome="failed")
            assert result["retry_at_ms"] == retry_at
            assert result["dead_reason"] == (job.dead_reason if job.state == "dead" else None)
            assert result["state"] == job.state
        elif not job.purged and tok.outcome == "cancelled" and worker == tok.worker:
            # A repeat of the fail (or release) that ended a cancelled job: said again.
            result = self.service.fail(tok.job_id, retryable=retryable, **call)
            assert result == {
                "job_id": tok.job_id,
                "state": "cancelled",
                "retry_at_ms": None,
                "dead_reason": None,
                "duplicate": True,
            }
        elif not job.purged and tok.outcome == "failed" and worker == tok.worker:
            # A repeat says again what that failure did, whatever happened to the job since;
            # the retry time and reason only while the job still stands where it left it.
            result = self.service.fail(tok.job_id, retryable=retryable, **call)
            assert result["duplicate"] is True
            assert result["state"] == tok.failed_to
            still = job.attempt == tok.attempt and job.state in ("retrying", "dead")
            retrying = still and tok.failed_to == "retrying"
            assert result["retry_at_ms"] == (job.available_at if retrying else None)
            dead = still and tok.failed_to == "dead"
            assert result["dead_reason"] == (job.dead_reason if dead else None)
        else:
            with pytest.raises(self.rejection(tok, worker)):
                self.service.fail(tok.job_id, retryable=retryable, **call)

    @rule(tok=tokens, how=HOW)
    def release(self, tok: Token, how: str) -> None:
        tok, worker = self.pick(tok, how)
        job = self.model[tok.job_id]
        if self.live(tok, worker):
            result = self.service.release(tok.job_id, worker_id=worker, lease_token=tok.token)
            self.accepted_with_latest_token(tok)
            if job.cancel_requested:
                self.end_lease(tok, "cancelled", retryable=False, outcome="cancelled")
                assert result["state"] == "cancelled"
                return
            assert result["state"] == "ready"
            tok.outcome = "released"
            job.state, job.ready_since = "ready", self.now()
            job.token = job.worker = job.expires = None
        else:
            with pytest.raises(self.rejection(tok, worker)):
                self.service.release(tok.job_id, worker_id=worker, lease_token=tok.token)

    def end_lease(self, tok: Token, error: str, *, retryable: bool, outcome: str) -> int | None:
        """The model of ``QueueService._end_lease``: a live lease failed (fail, or a renew
        past the time limit): CANCELLED when a cancel was requested, else RETRYING or DEAD by
        the job's policy. Returns the retry time (read back: jitter is the service's)."""
        job = self.model[tok.job_id]
        job.token = job.worker = job.expires = None
        if job.cancel_requested:
            tok.outcome = tok.failed_to = "cancelled"
            job.state, job.finished = "cancelled", True
            return None
        tok.outcome = outcome
        job.failures += 1
        if not retryable or job.failures > job.max_retries:
            job.state, job.finished = "dead", True
            kind = "non-retryable" if not retryable else "attempts exhausted"
            job.dead_reason = f"{kind}: {error}"
            tok.failed_to = "dead"
            return None
        retry_at = self.service.get(job.id, history=False)["available_at_ms"]
        assert retry_at is not None
        bounded = bounded_backoff_ms(job, job.failures)
        delay = retry_at - self.now()
        if job.jitter:
            assert 0.5 * bounded - 0.5 <= delay <= bounded
        else:
            assert delay == bounded
        job.state, job.available_at = "retrying", retry_at
        tok.failed_to = "retrying"
        return int(retry_at)

    @rule(job_id=jobs)
    def cancel(self, job_id: str) -> None:
        job = self.model[job_id]
        if job.purged:
            with pytest.raises(errors.JobNotFound):
                self.service.cancel(job_id)
        elif job.state in ("succeeded", "dead", "cancelled"):
            with pytest.raises(errors.JobFinished):
                self.service.cancel(job_id)
        elif job.state == "leased":
            out = self.service.cancel(job_id, actor="ops")
            assert out["cancelled"] is False and out["job"]["state"] == "leased"
            job.cancel_requested = True
        else:
            out = self.service.cancel(job_id, actor="ops")
            assert out["cancelled"] is True and out["job"]["state"] == "cancelled"
            job.state, job.available_at, job.finished = "cancelled", None, True
            job.cancel_requested = True

    @rule(ms=ADVANCE_MS)
    def advance(self, ms: int) -> None:
        """Time passes; leases that run out stay LEASED until a sweep or a claim."""
        self.clock.advance(ms=ms)

    @rule(ms=ADVANCE_MS)
    def expire(self, ms: int) -> None:
        """Time passes, then the reaper's sweep (``expire_leases``)."""
        self.clock.advance(ms=ms)
        queues = self.service.expire_leases()
        assert queues == ([QUEUE] if self.expire_model() else [])

    @rule(job_id=jobs)
    def replay(self, job_id: str) -> None:
        job = self.model[job_id]
        if job.purged:
            with pytest.raises(errors.JobNotFound):
                self.service.replay(job_id)
        elif job.state in ("dead", "cancelled"):
            self.allowed_exits.add(job_id)
            replayed = self.service.replay(job_id, actor="ops")
            job.state, job.failures, job.ready_since = "ready", 0, self.now()
            job.dead_reason, job.finished, job.cancel_requested = None, False, False
            job.replays.append(self.now())
            assert replayed["state"] == "ready" and replayed["attempt"] == job.attempt
        else:
            with pytest.raises(errors.InvalidState):
                self.service.replay(job_id)

    @rule(job_id=consumes(jobs), dead_only=st.booleans())
    def purge(self, job_id: str, dead_only: bool) -> None:
        job = self.model[job_id]
        allowed = ("dead", "cancelled") if dead_only else ("dead", "cancelled", "succeeded")
        if job.purged:
            with pytest.raises(errors.JobNotFound):
                self.service.purge(job_id, dead_only=dead_only)
        elif job.state in allowed:
            self.allowed_exits.add(job_id)
            self.service.purge(job_id, actor="ops", dead_only=dead_only)
            job.purged = True
        else:
            with pytest.raises(errors.InvalidState):
                self.service.purge(job_id, dead_only=dead_only)

    @rule(downtime_ms=st.sampled_from([0, 1, 1_000, 30_000]))
    def restart(self, downtime_ms: int) -> None:
        """A server restart after some downtime: a new service on the same file releases every
        lease at once, even those whose time is not up, without counting a failure."""
        self.clock.advance(ms=downtime_ms)
        self.service = QueueService(clock=self.clock, rng=self.rng)
        leased = [j for j in self.model.values() if j.state == "leased" and not j.purged]
        # A lease whose cancel was requested ends CANCELLED; the others go back to READY.
        assert self.service.recover() == sum(not j.cancel_requested for j in leased)
        for job in leased:
            assert job.token is not None
            self.leases[job.token].outcome = "recovered"
            if job.cancel_requested:
                job.state, job.finished = "cancelled", True
            else:
                job.state, job.ready_since = "ready", self.now()
            job.token = job.worker = job.expires = None

    @precondition(lambda self: any(j.state == "leased" for j in self.model.values()))
    @rule()
    def expire_exactly_at_the_boundary(self) -> None:
        """Move the clock to the earliest expiry: from that instant the lease is over."""
        soonest = min(j.expires for j in self.model.values() if j.expires is not None)
        if soonest > self.now():
            self.clock.set_ms(soonest)

    @precondition(lambda self: any(j.state == "leased" for j in self.model.values()))
    @rule(data=st.data())
    def cancel_a_running_job(self, data: st.DataObject) -> None:
        """Cancel a leased job (the ``cancel`` rule draws any job; this one a running one)."""
        leased = sorted(j.id for j in self.model.values() if j.state == "leased")
        self.cancel(data.draw(st.sampled_from(leased)))

    @precondition(
        lambda self: any(
            j.state == "leased" and j.time_limit is not None for j in self.model.values()
        )
    )
    @rule(early=st.booleans())
    def renew_at_the_time_limit(self, early: bool) -> None:
        """Move the clock to a leased job's time limit (or 1 ms before it) and renew it."""
        limited = [
            j for j in self.model.values() if j.state == "leased" and j.time_limit is not None
        ]
        job = min(limited, key=lambda j: (j.leased_at or 0) + (j.time_limit or 0))
        assert job.leased_at is not None and job.time_limit is not None and job.token
        at = job.leased_at + job.time_limit - (1 if early else 0)
        if at > self.now():
            self.clock.set_ms(at)
        self.renew(self.leases[job.token], "latest", 1_000)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def database_matches_model(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT id, state, attempt, failures, lease_token, leased_by, "
                "lease_expires_at_ms, available_at_ms, ready_since_ms, dead_reason, "
                "finished_at_ms, cancel_requested_at_ms FROM relay_job"
            )
            rows = {r[0]: r[1:] for r in cursor.fetchall()}
            cursor.execute(
                "SELECT job_id, attempt, lease_token, worker_id, outcome FROM relay_attempt"
            )
            attempts = {(r[0], r[1]): r[2:] for r in cursor.fetchall()}
        live_jobs = {j.id: j for j in self.model.values() if not j.purged}
        assert set(rows) == set(live_jobs)
        for job_id, job in live_jobs.items():
            (
                state,
                attempt,
                failures,
                token,
                worker,
                expires,
                available,
                ready,
                reason,
                fin,
                cancel,
            ) = rows[job_id]
            assert (cancel is not None) == job.cancel_requested, job
            assert (state, attempt, failures) == (job.state, job.attempt, job.failures), job
            assert (token, worker, expires) == (job.token, job.worker, job.expires), job
            assert available == job.available_at, job
            if state == "ready":
                assert ready == job.ready_since, job
            assert reason == job.dead_reason and (fin is not None) == job.finished, job
            if expires is not None:  # the maximum lease bound
                assert expires <= self.now() + MAX_LEASE_MS
        want = {
            (t.job_id, t.attempt): (t.token, t.worker, t.outcome)
            for t in self.leases.values()
            if not self.model[t.job_id].purged
        }
        assert attempts == want

    @invariant()
    def terminal_states_hold_and_attempts_never_decrease(self) -> None:
        """Read from the database itself, not from the model."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT id, state, attempt FROM relay_job")
            rows = {r[0]: (r[1], r[2]) for r in cursor.fetchall()}
        for job_id in self.model:
            state, attempt = rows.get(job_id, ("purged", self.seen_attempt.get(job_id, 0)))
            before = self.seen_state.get(job_id)
            if before == "succeeded" and state != "succeeded":
                # Purge deletes a terminal job; nothing else moves a succeeded one.
                assert state == "purged" and job_id in self.allowed_exits, (job_id, state)
            if before in ("dead", "cancelled") and state != before:
                assert job_id in self.allowed_exits, f"{job_id}: {before} -> {state} on its own"
            assert attempt >= self.seen_attempt.get(job_id, 0), job_id
            self.seen_state[job_id] = state
            self.seen_attempt[job_id] = attempt
        self.allowed_exits.clear()

    @invariant()
    def at_most_one_live_lease_and_audit_clean(self) -> None:
        for job in self.model.values():
            open_leases = [
                t for t in self.leases.values() if t.job_id == job.id and t.outcome is None
            ]
            assert len(open_leases) == (1 if job.state == "leased" and not job.purged else 0)
        audit(connection, quick_check=False)


@pytest.mark.slow
@pytest.mark.usefixtures("fast_commits")
def test_queue_state_machine_keeps_terminal_state_invariants() -> None:
    run_state_machine_as_test(
        QueueMachine,
        settings=settings(
            max_examples=200,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )
