"""The pull worker against an in-memory fake client: slots, ack/fail, renewals, shutdown.

No sockets and no database. Time is a FakeClock; threads are synchronised with events and the
fake's condition variable, never with sleeps.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest

from queue_core import errors
from queue_core.client import RelayConnectionError, request_frame
from queue_core.clock import FakeClock
from queue_core.worker import (
    JobContext,
    JobInterrupted,
    NonRetryableError,
    StoredResult,
    TaskJobRefused,
    Worker,
    demo_handler,
    runner,
)
from queue_core.worker.handlers import DemoFailure, is_django_task
from queue_core.worker.runner import (
    _LEASE_GONE,
    ACK_SENDERS,
    MAX_BATCH_BYTES,
    _HeldJob,
    truncate_utf8,
)

WAIT_S = 10.0  # upper bound for anything the test waits on; reached only when a test fails


FRAME_BYTES = 1_048_576  # the clients' default max_frame_bytes


class FakeRelay:
    """A thread-safe in-memory server: every ``connect()`` returns a client onto it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.ready: collections.deque[dict[str, Any]] = collections.deque()
        self.held: dict[str, str] = {}  # job_id -> token
        self.attempts: dict[str, int] = {}  # job_id -> leases so far
        self.max_held = 0
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.lease_errors: list[BaseException] = []
        self.renew_errors: dict[str, BaseException] = {}
        self.silent_renews: set[str] = set()  # a renew of these waits until its deadline
        self.clock: FakeClock | None = None  # advanced by as long as a silent renew waited
        self.slow_renews: dict[str, float] = {}  # a renew of these answers after so many s
        self.renew_stops: dict[str, str] = {}  # a renew of these answers this stop
        self.max_renew_batch: int | None = None  # a larger renew_batch is refused too large
        self.malformed_renews = 0  # the next renew_batch replies hold results of no use
        self.instant_empty = False  # a long-poll is answered at once (a faulty server)
        self.renew_ok: dict[str, Any] = {}  # a renew of these answers this "ok" (once)
        self.lease_extras: list[Any] = []  # put in the next lease reply, after its jobs
        self.lease_gate: threading.Event | None = None
        self.refuse_result: errors.RelayError | None = None  # raised by an ack with a result
        self.old_server = False  # lease_next refused as an unknown argument
        self.retry_at_once = False  # a fail puts its job straight back (no backoff)
        self.clients = 0
        self.next_asks: list[dict[str, Any] | None] = []  # each ack's or fail's lease_next
        self.no_ack_batch = False  # ack_batch refused as an unknown op (an older server)
        self.no_renew_batch = False  # renew_batch refused as an unknown op (an older server)
        self.batch_errors: list[BaseException] = []  # raised by the next ack_batch calls
        self.ack_errors: list[BaseException] = []  # raised by the next ack calls (unbatched)
        self.batch_gate: threading.Event | None = None  # ack_batch waits for it
        self.max_batch: int | None = None  # a larger ack_batch is refused FRAME_TOO_LARGE
        self.malformed_batches = 0  # the next ack_batch replies hold a result that is no object
        self.bad_leases = 0  # the next ack_batch replies with lease_next bring a lease without ids
        self.unanswered_releases = False  # a release waits until its client is closed
        self.ack_gate: threading.Event | None = None  # an ack (unbatched) waits for it
        self.release_gate: threading.Event | None = None  # a release waits for it
        self.at_gate = threading.Semaphore(0)  # released once per call that reached a gate
        self._seq = 0

    def add(self, *payloads: Any, queue: str = "q") -> list[str]:
        ids = []
        with self.cond:
            for payload in payloads:
                self._seq += 1
                job_id = f"job_{self._seq}"
                ids.append(job_id)
                self.ready.append({"job_id": job_id, "queue": queue, "payload": payload})
            self.cond.notify_all()
        return ids

    def connect(self) -> FakeClient:
        with self.cond:
            self.clients += 1
        return FakeClient(self)

    def calls_of(self, op: str) -> list[dict[str, Any]]:
        with self.cond:
            return [args for name, args in self.calls if name == op]

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, WAIT_S), f"timed out waiting for {what}"

    def record(self, op: str, args: dict[str, Any]) -> None:
        self.calls.append((op, args))
        self.cond.notify_all()

    def settle(
        self, op: str, args: dict[str, Any], lease_next: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        with self.cond:
            self.record(op, args)
            self.next_asks.append(lease_next)
            if lease_next is not None and self.old_server:
                raise errors.InvalidArgument("lease_next: unknown argument", field="lease_next")
            if self.held.get(args["job_id"]) != args["lease_token"]:
                raise errors.StaleToken()
            del self.held[args["job_id"]]
            if op == "fail" and self.retry_at_once:
                self.ready.appendleft({"job_id": args["job_id"], "queue": "q", "payload": "again"})
            out: dict[str, Any] = {"job_id": args["job_id"], "state": op, "duplicate": False}
            if lease_next is not None:  # the next jobs, no wait (as the server)
                out["next"] = self.take(lease_next["max_jobs"])
            self.cond.notify_all()
            return out

    def take(self, max_jobs: int) -> list[dict[str, Any]]:
        out = []
        while self.ready and len(out) < max_jobs:
            job = self.ready.popleft()
            attempt = self.attempts[job["job_id"]] = self.attempts.get(job["job_id"], 0) + 1
            # A fresh token for each lease, as the server's: "tok-job_1", then "tok-job_1-2".
            token = f"tok-{job['job_id']}" + (f"-{attempt}" if attempt > 1 else "")
            self.held[job["job_id"]] = token
            out.append({**job, "lease_token": token, "attempt": attempt})
        self.max_held = max(self.max_held, len(self.held))
        return out


class FakeClient:
    """Implements ``WorkerClient`` on a ``FakeRelay``."""

    def __init__(self, relay: FakeRelay) -> None:
        self.relay = relay
        self.closed = threading.Event()

    def lease(
        self,
        queues: Any,
        *,
        worker_id: str,
        max_jobs: int = 1,
        lease_ms: int | None = None,
        wait_ms: int = 0,
    ) -> list[dict[str, Any]]:
        relay = self.relay
        with relay.cond:
            relay.record("lease", {"queues": list(queues), "max_jobs": max_jobs})
            if relay.lease_errors:
                raise relay.lease_errors.pop(0)
        if relay.lease_gate is not None:
            assert relay.lease_gate.wait(WAIT_S)
        with relay.cond:
            if not relay.ready and not relay.instant_empty:
                # The long poll: a short real wait for a job, then an empty answer.
                relay.cond.wait(0.02)
            out = relay.take(max_jobs)
            if out and relay.lease_extras:
                out += relay.lease_extras
                relay.lease_extras = []
            relay.cond.notify_all()
            return out

    def send(self, call: Any, *, deadline: float | None = None) -> Any:
        """The worker sends its renewals this way, each with a deadline."""
        assert call.op in ("renew", "renew_batch"), f"{call.op} sent through send()"
        assert deadline is not None, "a renew without a deadline may wait for good"
        if call.op == "renew":
            return self.renew(**call.args, deadline=deadline)
        if self.relay.no_renew_batch:
            with self.relay.cond:
                self.relay.record("renew_batch", {"refused": "UNKNOWN_OP"})
            raise errors.UnknownOp("unknown op 'renew_batch'", op="renew_batch")
        most = self.relay.max_renew_batch
        if most is not None and len(call.args["renews"]) > most:
            with self.relay.cond:
                self.relay.record("renew_batch", {"refused": "FRAME_TOO_LARGE"})
            raise errors.FrameTooLarge("request frame too large")
        results = self._renew(call.args["renews"], deadline, batch=True)
        with self.relay.cond:
            if self.relay.malformed_renews:
                self.relay.malformed_renews -= 1
                return {"results": [*results[1:], "x"]}  # shifted: not each renew's own
        return {"results": results}

    def renew(
        self,
        job_id: str,
        *,
        worker_id: str,
        lease_token: str,
        lease_ms: int | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        entry = {"job_id": job_id, "lease_token": lease_token, "lease_ms": lease_ms}
        return self._renew([entry], deadline, batch=False)[0]

    def _renew(
        self, entries: list[dict[str, Any]], deadline: float | None, *, batch: bool
    ) -> list[dict[str, Any]]:
        """Renew ``entries`` (``renew``'s arguments), one request: each recorded as a renew
        (and the request as a ``renew_batch`` of their count when ``batch``). In a batch, a
        lease-gone error of one entry answers that entry only; any other error, a silent or a
        slow job fails or holds the whole request."""
        relay = self.relay
        failed: dict[str, BaseException] = {}
        with relay.cond:
            if batch:
                relay.record("renew_batch", {"renews": len(entries)})
            for entry in entries:
                job_id = entry["job_id"]
                relay.record(
                    "renew",
                    {k: entry.get(k) for k in ("job_id", "lease_token", "lease_ms")},
                )
                error = relay.renew_errors.get(job_id)
                if error is not None:
                    if not batch or not isinstance(error, _LEASE_GONE):
                        raise error
                    failed[job_id] = error
            silent = any(e["job_id"] in relay.silent_renews for e in entries)
            relay.silent_renews.difference_update(e["job_id"] for e in entries)
            slow = max((relay.slow_renews.pop(e["job_id"], 0.0) for e in entries), default=0.0)
        if slow and deadline is not None:  # the answer takes this long: past the deadline, none
            self.closed.wait(min(slow, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                raise RelayConnectionError("no reply by the call's deadline", address="127.0.0.1:1")
        if silent:  # a connection gone silent: no answer; the call ends at its deadline
            assert deadline is not None and deadline - time.monotonic() < WAIT_S
            waited = max(0.0, deadline - time.monotonic())
            self.closed.wait(waited)
            if relay.clock is not None:
                relay.clock.advance(seconds=waited)
            raise RelayConnectionError("no reply by the call's deadline", address="127.0.0.1:1")
        out = []
        for entry in entries:
            job_id = entry["job_id"]
            if job_id in failed:
                exc = failed[job_id]
                assert isinstance(exc, errors.RelayError)
                error = {"code": exc.code, "message": exc.message, "retryable": exc.retryable}
                out.append({"job_id": job_id, "ok": False, "error": error})
                continue
            stop = relay.renew_stops.get(job_id)
            expires = 0
            if stop == "timeout":
                with relay.cond:
                    relay.held.pop(job_id, None)  # the server failed the attempt: token spent
                expires = None
            ok: Any = relay.renew_ok.pop(job_id, True)
            out.append({"job_id": job_id, "ok": ok, "lease_expires_at_ms": expires, "stop": stop})
        return out

    def ack(
        self,
        job_id: str,
        *,
        worker_id: str,
        lease_token: str,
        result: Any = None,
        lease_next: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        args = {"job_id": job_id, "worker_id": worker_id, "lease_token": lease_token}
        if result is not None:
            args["result"] = result
            request_frame(0, "ack", args, FRAME_BYTES)  # what the real client refuses to send
            if self.relay.refuse_result is not None:
                with self.relay.cond:
                    self.relay.record("ack", args)
                raise self.relay.refuse_result
        with self.relay.cond:
            if self.relay.ack_errors:
                self.relay.record("ack", args)
                raise self.relay.ack_errors.pop(0)
        _wait_at(self.relay, self.relay.ack_gate)
        return self.relay.settle("ack", args, lease_next)

    def ack_batch(
        self, acks: list[dict[str, Any]], *, lease_next: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        # As the server: each entry fenced by its own token and answered on its own; every
        # entry is recorded as an "ack" too, so counts of acks hold whichever way they went.
        relay = self.relay
        with relay.cond:
            relay.record("ack_batch", {"acks": [dict(a) for a in acks], "lease_next": lease_next})
            if relay.no_ack_batch:
                raise errors.UnknownOp("unknown op 'ack_batch'", op="ack_batch")
            if relay.batch_errors:
                raise relay.batch_errors.pop(0)
        if relay.batch_gate is not None:
            assert relay.batch_gate.wait(WAIT_S)
        with relay.cond:
            if relay.max_batch is not None and len(acks) > relay.max_batch:
                raise errors.FrameTooLarge("the frame is over the 8192-byte limit")
            if relay.malformed_batches:
                relay.malformed_batches -= 1
                return {"results": ["junk"] * len(acks), "next": []}
            relay.next_asks.append(lease_next)
            if lease_next is not None and relay.old_server:
                raise errors.InvalidArgument("lease_next: unknown argument", field="lease_next")
            results: list[dict[str, Any]] = []
            for ack in acks:
                relay.record("ack", dict(ack))
                if relay.held.get(ack["job_id"]) != ack["lease_token"]:
                    stale = errors.StaleToken()
                    error = {"code": stale.code, "message": stale.message, "retryable": False}
                    results.append({"job_id": ack["job_id"], "ok": False, "error": error})
                    continue
                del relay.held[ack["job_id"]]
                results.append(
                    {"job_id": ack["job_id"], "ok": True, "state": "succeeded", "error": None}
                )
            leases = relay.take(lease_next["max_jobs"]) if lease_next is not None else []
            if relay.bad_leases and lease_next is not None:
                relay.bad_leases -= 1
                leases = [{"queue": "q"}]  # no job_id, no lease_token
            relay.cond.notify_all()
            return {"results": results, "next": leases}

    def fail(
        self,
        job_id: str,
        *,
        worker_id: str,
        lease_token: str,
        error: str,
        retryable: bool = True,
        exception_class: str | None = None,
        traceback: str | None = None,
        lease_next: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return self.relay.settle(
            "fail",
            {
                "job_id": job_id,
                "worker_id": worker_id,
                "lease_token": lease_token,
                "error": error,
                "retryable": retryable,
                "exception_class": exception_class,
                "traceback": traceback,
            },
            lease_next,
        )

    def release(self, job_id: str, *, worker_id: str, lease_token: str) -> dict[str, Any]:
        if self.relay.unanswered_releases:  # a server that takes requests and answers none
            assert self.closed.wait(WAIT_S), "a release waited for an answer until the end"
            raise RelayConnectionError("closed by another thread", address="127.0.0.1:1")
        _wait_at(self.relay, self.relay.release_gate)
        return self.relay.settle(
            "release", {"job_id": job_id, "worker_id": worker_id, "lease_token": lease_token}
        )

    def close(self) -> None:
        self.closed.set()
        with self.relay.cond:
            self.relay.record("close", {})


def _wait_at(relay: FakeRelay, gate: threading.Event | None) -> None:
    """Hold a call at ``gate`` (when set up), telling the test it is there."""
    if gate is not None:
        relay.at_gate.release()
        assert gate.wait(WAIT_S), "the gate was never opened"


class Running:
    """A worker running ``run()`` in a thread; ``stop()`` joins it and keeps its exception."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert worker.ready.wait(WAIT_S)

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:
            self.error = exc

    def join(self) -> None:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "worker.run() did not return"

    def stop(self) -> None:
        self.worker.stop()
        self.join()


@pytest.fixture
def relay() -> FakeRelay:
    return FakeRelay()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_worker(relay: FakeRelay, clock: FakeClock) -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def make(handler: Any = demo_handler, **kwargs: Any) -> Running:
        options: dict[str, Any] = {
            "concurrency": 2,
            "lease_ms": 3_000,
            "wait_ms": 100,
            "shutdown_timeout_ms": 5_000,
            "clock": clock,
            "worker_id": "w1:1",
            "max_error_bytes": 4096,
            "max_result_bytes": 65536,
            "rng": random.Random(7),
            "tick_s": 0.005,
        }
        options.update(kwargs)
        running = Running(Worker(relay.connect, ["q"], handler=handler, **options))
        started.append(running)
        return running

    yield make
    for running in started:  # a failed test must not leave a worker polling
        running.worker.stop()
        clock.advance(seconds=3600)
        running.thread.join(WAIT_S)


def test_a_string_of_queues_is_refused_not_split_into_letters(relay: FakeRelay) -> None:
    with pytest.raises(ValueError, match="not a string"):
        Worker(relay.connect, "emails", lease_ms=1_000, max_error_bytes=1, max_result_bytes=1)


def test_holds_at_most_concurrency_jobs(relay: FakeRelay, make_worker: Any) -> None:
    gate = threading.Event()
    relay.add(*({"n": n} for n in range(7)))
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), concurrency=2)
    relay.wait_for(lambda: len(relay.held) == 2, "two jobs leased")
    assert relay.max_held == 2
    gate.set()
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 7, "seven acks")
    running.stop()
    assert relay.max_held == 2
    assert all(call["max_jobs"] <= 2 for call in relay.calls_of("lease"))
    assert running.worker.counters()["acked"] == 7
    assert running.worker.leased == 7
    # One connection for leasing, one for renewing, min(concurrency, 4) for the rest.
    assert relay.clients == 4


@pytest.mark.parametrize("batch_acks", [True, False])
def test_acks_lease_the_next_jobs_for_the_slots_they_free(
    relay: FakeRelay, make_worker: Any, batch_acks: bool
) -> None:
    # One ack per request, or several in an ack_batch: each request asks for the slots it frees.
    gate = threading.Event()
    relay.add(*({"n": n} for n in range(12)))
    running = make_worker(
        lambda payload, ctx: gate.wait(WAIT_S), concurrency=3, batch_acks=batch_acks
    )
    relay.wait_for(lambda: len(relay.held) == 3, "three jobs leased")
    gate.set()
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 12, "twelve acks")
    running.stop()
    assert relay.max_held == 3  # never more than concurrency, acks and lease thread together
    asks = [ask for ask in relay.next_asks if ask is not None]
    assert asks and all(1 <= ask["max_jobs"] <= 3 for ask in asks)
    assert all(ask["queues"] == ["q"] and ask["lease_ms"] == 3_000 for ask in asks)
    counters = running.worker.counters()
    assert counters["acked"] == 12 and counters["leased"] == 12
    # Busy: most jobs came with an ack's reply, not from a lease request.
    assert counters["leased_next"] > 0 and len(relay.calls_of("lease")) < 12
    assert running.worker.held == 0


@pytest.mark.parametrize("batch_acks", [False, True])
def test_an_old_server_without_lease_next_still_gets_every_ack(
    relay: FakeRelay, make_worker: Any, batch_acks: bool
) -> None:
    relay.old_server = True
    relay.add(*({"n": n} for n in range(5)))
    running = make_worker(concurrency=2, batch_acks=batch_acks)
    # A refused single ack is recorded as an ack; a refused ack_batch records none of its acks.
    acks = 5 if batch_acks else 5 + 1
    relay.wait_for(lambda: len(relay.calls_of("ack")) == acks, "five acks (and one refused)")
    running.stop()
    assert running.worker.counters()["acked"] == 5
    asked = sum(ask is not None for ask in relay.next_asks)
    # Asked once, then never (each ack sender may have asked before the first refusal).
    assert 1 <= asked <= (ACK_SENDERS if batch_acks else 1)
    assert running.worker.counters()["leased_next"] == 0


def test_a_failed_job_whose_retry_comes_back_in_its_own_reply_runs_again(
    relay: FakeRelay, make_worker: Any
) -> None:
    relay.retry_at_once = True
    (job_id,) = relay.add("first")
    runs: list[Any] = []

    def handler(payload: Any, ctx: Any) -> None:
        runs.append(payload)
        if payload == "first":
            raise ValueError("boom")

    running = make_worker(handler, concurrency=1)
    relay.wait_for(lambda: bool(relay.calls_of("ack")), "the ack of the retry")
    running.stop()
    assert runs == ["first", "again"]
    assert [c["job_id"] for c in relay.calls_of("fail")] == [job_id]
    assert running.worker.counters()["leased_next"] == 1
    assert running.worker.held == 0


def test_no_lease_next_once_stopping(relay: FakeRelay, make_worker: Any) -> None:
    gate = threading.Event()
    relay.add(*({"n": n} for n in range(4)))
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), concurrency=2)
    relay.wait_for(lambda: len(relay.held) == 2, "two jobs leased")
    running.worker.stop()
    gate.set()
    running.join()
    # Two acks (in one ack_batch or two requests), none asking for more work.
    assert len(relay.calls_of("ack")) == 2
    assert relay.next_asks and all(ask is None for ask in relay.next_asks)
    assert len(relay.ready) == 2


def _wait_queued_acks(worker: Worker, n: int) -> None:
    # The worker's own condition is notified as each ack is queued.
    with worker._acks_cond:
        assert worker._acks_cond.wait_for(lambda: len(worker._acks) == n, WAIT_S)


def _first_of_four_acks_held(
    relay: FakeRelay, make_worker: Any
) -> tuple[Running, list[str], list[threading.Event]]:
    """A worker of 4 slots holding 4 jobs, each finishing when its event is set; job 0 is
    finished and its ``ack_batch`` held in the server (``relay.batch_gate``) on return."""
    relay.batch_gate = threading.Event()
    finish = [threading.Event() for _ in range(4)]
    jobs = relay.add(*({"n": n} for n in range(len(finish))))
    running = make_worker(
        lambda payload, ctx: finish[payload["n"]].wait(WAIT_S), concurrency=len(finish)
    )
    relay.wait_for(lambda: len(relay.held) == len(finish), "every job leased")
    finish[0].set()
    relay.wait_for(lambda: len(relay.calls_of("ack_batch")) == 1, "job 0 sent alone, held")
    return running, jobs, finish


def _acks_while_a_batch_is_in_flight(
    relay: FakeRelay, make_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[Running, list[str]]:
    """A worker of 4 slots (two senders: a batch in flight holds back the next until it has
    2 acks) whose jobs finish one by one while every ``ack_batch`` is held in the server
    (``relay.batch_gate``): job 0 goes alone, jobs 1 and 2 together, job 3 waits for a sender.
    The gate opens on return; the worker and the 4 job ids are returned. Acks are held back
    for as long as the test takes (``HOLD_BACK_*_S``), so the order does not hang on timing."""
    assert ACK_SENDERS == 2
    monkeypatch.setattr(runner, "HOLD_BACK_MIN_S", WAIT_S)
    monkeypatch.setattr(runner, "HOLD_BACK_MAX_S", WAIT_S)
    running, jobs, finish = _first_of_four_acks_held(relay, make_worker)
    assert running.worker._overlap_acks == 2
    finish[1].set()
    _wait_queued_acks(running.worker, 1)  # held back: one batch in flight, one ack queued
    finish[2].set()
    relay.wait_for(lambda: len(relay.calls_of("ack_batch")) == 2, "jobs 1 and 2 sent")
    finish[3].set()
    _wait_queued_acks(running.worker, 1)  # both senders busy
    relay.batch_gate.set()
    return running, jobs


def test_acks_finished_while_a_batch_is_in_flight_go_out_together(
    relay: FakeRelay,
    make_worker: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A batch goes out at once when none is in flight; while one is, the acks queued meanwhile
    # wait until they are half the slots, then share the next request.
    running, jobs = _acks_while_a_batch_is_in_flight(relay, make_worker, monkeypatch)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 4, "every ack")
    running.stop()
    calls = relay.calls_of("ack_batch")
    batches = [[ack["job_id"] for ack in call["acks"]] for call in calls]
    assert batches[:2] == [[jobs[0]], [jobs[1], jobs[2]]]
    assert batches[2:] == [[jobs[3]]]  # sent once a sender was back
    # Each batch asks for the slots it frees: the first batch's job, held until its reply,
    # is not counted twice (held, and promised to its own lease_next) against the second.
    assert [call["lease_next"]["max_jobs"] for call in calls[:2]] == [1, 2]
    assert all(
        ack["worker_id"] == "w1:1" and ack["lease_token"] == f"tok-{ack['job_id']}"
        for call in relay.calls_of("ack_batch")
        for ack in call["acks"]
    )
    assert running.worker.counters()["acked"] == 4
    # Each ack logged once (by its batch's sender), with its attempt and the state it reached.
    acked = [r.__dict__ for r in caplog.records if r.__dict__.get("event") == "acked"]
    assert sorted(r["job_id"] for r in acked) == sorted(jobs)
    assert all(r["state"] == "succeeded" and r["duplicate"] is False for r in acked)
    assert running.worker.held == 0
    senders = running.worker._senders
    assert len(senders) == ACK_SENDERS and not any(t.is_alive() for t in senders)


@pytest.fixture
def logged() -> Iterator[Callable[[str], Logged]]:
    """``logged(event)``: a ``Logged`` handler on the worker's logger, removed at teardown."""
    logger = logging.getLogger("relay.worker")
    handlers: list[Logged] = []

    def add(event: str) -> Logged:
        handler = Logged(event)
        logger.addHandler(handler)
        handlers.append(handler)
        return handler

    yield add
    for handler in handlers:
        logger.removeHandler(handler)


class RenewLog(NamedTuple):
    """The worker's ``renewed``, ``leased`` and ``renew_error`` lines, counted."""

    renewed: Logged
    leased: Logged
    failed: Logged


@pytest.fixture
def renew_log(logged: Callable[[str], Logged], caplog: pytest.LogCaptureFixture) -> RenewLog:
    """``RenewLog`` handlers on the worker's logger, with its DEBUG lines (``renewed``) on."""
    caplog.set_level(logging.DEBUG, logger="relay.worker")
    return RenewLog(logged("renewed"), logged("leased"), logged("renew_error"))


class Logged(logging.Handler):
    """Sets ``seen`` once the worker logs ``event``: it logs a refused ack after handling the
    reply, so a test that stops the worker as soon as the fake server answered raced the
    line (each of two such tests failed once in a full run)."""

    def __init__(self, event: str) -> None:
        super().__init__()
        self.event = event
        self.seen = threading.Event()
        self.count = 0
        self.counted = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == self.event:
            with self.counted:
                self.count += 1
                self.counted.notify_all()
            self.seen.set()

    def wait_count(self, n: int) -> None:
        """Wait until the worker has logged the event ``n`` times."""
        with self.counted:
            ok = self.counted.wait_for(lambda: self.count >= n, WAIT_S)
        assert ok, f"{self.event} logged {self.count} times, not {n}"


def test_a_stale_ack_in_a_batch_is_refused_alone(
    relay: FakeRelay,
    make_worker: Any,
    caplog: pytest.LogCaptureFixture,
    logged: Callable[[str], Logged],
) -> None:
    gate = threading.Event()
    rejected = logged("ack_rejected")
    first, _ = relay.add({"n": 1}, {"n": 2})
    relay.batch_gate = threading.Event()
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), concurrency=2)
    relay.wait_for(lambda: len(relay.held) == 2, "two jobs leased")
    with relay.cond:
        relay.held[first] = "taken-over"  # its lease moved on to another worker
    gate.set()
    relay.wait_for(lambda: len(relay.calls_of("ack_batch")) >= 1, "a batch")
    relay.batch_gate.set()
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 2, "both acks answered")
    assert rejected.seen.wait(WAIT_S), "no ack_rejected line"
    running.stop()
    assert running.worker.counters()["acked"] == 1
    assert relay.held == {first: "taken-over"}  # untouched; the other ack went through
    rejected = [r for r in caplog.records if "event=ack_rejected" in r.getMessage()]
    assert [r.job_id for r in rejected] == [first]  # type: ignore[attr-defined]
    assert len(relay.calls_of("ack")) == 2  # a refused ack is not repeated
    assert running.worker.held == 0


def test_a_batch_lost_in_transit_is_sent_again(relay: FakeRelay, make_worker: Any) -> None:
    relay.batch_errors = [ConnectionError("reset by peer")]
    relay.add({"n": 1})
    running = make_worker(concurrency=2)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 1, "the ack")
    running.stop()
    assert len(relay.calls_of("ack_batch")) == 2  # the lost one, then its repeat
    assert running.worker.counters()["acked"] == 1
    assert relay.held == {}


def test_an_ack_failing_for_a_passing_reason_is_sent_again_while_its_lease_may_be_live(
    relay: FakeRelay, clock: FakeClock, make_worker: Any
) -> None:
    # Three tries in 0.6 s dropped the acks of a 3 s PostgreSQL restart: jobs that had run
    # went DEAD as "lease expired" (a chaos review). Eight failures take 7.2 s of pauses.
    relay.batch_errors = [errors.Unavailable("the database is unreachable")] * 8
    relay.add({"n": 1})
    started = clock.monotonic()
    running = make_worker(concurrency=2, lease_ms=30_000)
    relay.wait_for(lambda: not relay.held, "the ack")
    running.stop()
    assert len(relay.calls_of("ack_batch")) == 9
    assert running.worker.counters()["acked"] == 1
    assert clock.monotonic() - started == pytest.approx(7.2)  # 0.2 + 0.4 + ... + 1.6 s


def test_an_ack_is_abandoned_once_its_lease_has_expired(
    relay: FakeRelay,
    clock: FakeClock,
    make_worker: Any,
    logged: Callable[[str], Logged],
) -> None:
    abandoned = logged("ack_abandoned")
    relay.batch_errors = [errors.StoreBusy()] * 50
    relay.renew_errors["job_1"] = errors.Unavailable("the database is unreachable")
    relay.add({"n": 1})
    running = make_worker(concurrency=2, lease_ms=3_000)
    assert abandoned.seen.wait(WAIT_S), "no ack_abandoned line"
    # Pauses of 0.2, 0.4, 0.6, 0.8 s: the fifth try's pause (1 s) would end past the lease's
    # 3 s, renewed by nothing.
    assert len(relay.calls_of("ack_batch")) == 5
    running.stop()
    assert running.worker.counters()["acked"] == 0


def test_an_ack_refused_for_a_reason_that_does_not_pass_is_not_sent_again(
    relay: FakeRelay, make_worker: Any, logged: Callable[[str], Logged]
) -> None:
    abandoned = logged("ack_abandoned")
    relay.ack_errors = [errors.PermissionDenied("the key was changed to a producer's")]
    relay.add({"n": 1})
    running = make_worker(concurrency=1, lease_ms=30_000)
    assert abandoned.seen.wait(WAIT_S), "no ack_abandoned line"
    running.stop()
    assert len(relay.calls_of("ack")) == 1


def test_a_server_without_ack_batch_gets_one_ack_per_job(
    relay: FakeRelay, make_worker: Any
) -> None:
    relay.no_ack_batch = True
    relay.add(*({"n": n} for n in range(6)))
    running = make_worker(concurrency=2)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 6, "six acks")
    running.stop()
    assert 1 <= len(relay.calls_of("ack_batch")) <= ACK_SENDERS  # refused, then never again
    assert running.worker.counters()["acked"] == 6
    assert relay.held == {}


def test_a_batch_that_hangs_holds_the_acks_behind_it_only_briefly(
    relay: FakeRelay, make_worker: Any
) -> None:
    # A batch in flight holds back the next until it has half the slots' acks, but not for
    # longer than _hold_back_s: a reply that never comes must not stop the others' acks.
    running, jobs, finish = _first_of_four_acks_held(relay, make_worker)
    finish[1].set()  # one ack of the two that would fill a batch
    relay.wait_for(lambda: len(relay.calls_of("ack_batch")) == 2, "job 1 sent beside it")
    assert not relay.batch_gate.is_set()
    batches = [[ack["job_id"] for ack in call["acks"]] for call in relay.calls_of("ack_batch")]
    assert batches == [[jobs[0]], [jobs[1]]]
    relay.batch_gate.set()
    for event in finish[2:]:
        event.set()
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 4, "every ack")
    running.stop()
    assert running.worker.counters()["acked"] == 4
    assert running.worker.held == 0


def test_a_batch_refused_as_too_large_is_sent_again_in_smaller_ones(
    relay: FakeRelay,
    make_worker: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relay.max_batch = 1  # a server with a small frame limit
    running, _ = _acks_while_a_batch_is_in_flight(relay, make_worker, monkeypatch)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 4, "every ack")
    running.stop()
    sizes = [len(call["acks"]) for call in relay.calls_of("ack_batch")]
    assert 2 in sizes  # refused, then its acks went again one per batch
    assert running.worker.counters()["acked"] == 4
    assert relay.held == {}
    assert running.worker._batch_bytes < MAX_BATCH_BYTES
    assert not [r for r in caplog.records if "event=ack_error" in r.getMessage()]


def test_a_batch_refused_whole_for_another_reason_sends_each_ack_alone(
    relay: FakeRelay, make_worker: Any
) -> None:
    relay.batch_errors = [errors.InvalidArgument("acks[1].job_id: bad", field="acks[1].job_id")]
    (job_id,) = relay.add({"n": 1})
    running = make_worker(concurrency=2)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 1, "the ack")
    running.stop()
    assert len(relay.calls_of("ack_batch")) == 1  # refused whole: nothing of it committed
    assert relay.calls_of("ack") == [
        {"job_id": job_id, "worker_id": "w1:1", "lease_token": f"tok-{job_id}"}
    ]
    assert running.worker.counters()["acked"] == 1
    assert relay.held == {}


def test_a_stale_ack_in_a_batch_frees_its_slot_for_the_leases_the_batch_asked_for(
    relay: FakeRelay, make_worker: Any
) -> None:
    gate = threading.Event()
    first, _ = relay.add({"n": 1}, {"n": 2})
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), concurrency=2)
    relay.wait_for(lambda: len(relay.held) == 2, "two jobs leased")
    relay.add({"n": 3}, {"n": 4})  # what the acks' lease_next will bring
    with relay.cond:
        relay.held[first] = "taken-over"
    gate.set()
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 4, "four acks answered")
    running.stop()
    # Without dropping the refused job, a lease brought for its slot found no room and was
    # handed straight back.
    assert relay.calls_of("release") == []
    counters = running.worker.counters()
    assert counters["acked"] == 3 and counters["released"] == 0 and counters["leased"] == 4


def test_a_malformed_batch_reply_is_sent_again_and_gives_its_slots_back(
    relay: FakeRelay, make_worker: Any
) -> None:
    relay.malformed_batches = 1
    relay.add({"n": 1}, {"n": 2})
    running = make_worker(concurrency=2)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 2, "two acks")
    running.stop()
    assert running.worker.counters()["acked"] == 2
    assert relay.held == {}
    assert running.worker._reserved == 0  # no promise of slots left behind
    assert running.worker._free() == 2


def test_an_ack_whose_batch_brings_a_malformed_lease_is_still_answered_once(
    relay: FakeRelay, make_worker: Any
) -> None:
    relay.bad_leases = 1
    settled: list[str] = []
    told = threading.Event()

    class Outcome(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            event = getattr(record, "event", "")
            if event in ("acked", "ack_error", "ack_rejected"):
                settled.append(event)
                told.set()

    watcher = Outcome()
    logging.getLogger("relay.worker").addHandler(watcher)
    try:
        relay.add({"n": 1})
        running = make_worker(concurrency=2)
        assert told.wait(WAIT_S)  # the handler thread heard its ack's answer
        running.stop()
    finally:
        logging.getLogger("relay.worker").removeHandler(watcher)
    assert settled[0] == "acked"  # answered from its entry: the ack committed
    assert len(relay.calls_of("ack_batch")) == 1  # not sent again
    assert running.worker.counters()["acked"] == 1  # counted once
    assert running.worker._reserved == 0 and running.worker.held == 0


def test_an_ack_with_a_result_is_sent_on_its_own(relay: FakeRelay, make_worker: Any) -> None:
    with_result, plain = relay.add({"result": True}, {"result": False})

    def handler(payload: Any, ctx: Any) -> Any:
        return StoredResult({"n": 1}) if payload["result"] else None

    running = make_worker(handler, concurrency=2)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 2, "two acks")
    running.stop()
    batched = [a["job_id"] for call in relay.calls_of("ack_batch") for a in call["acks"]]
    assert batched == [plain]
    (single,) = [a for a in relay.calls_of("ack") if "result" in a]
    assert single["job_id"] == with_result and single["result"] == {"n": 1}


def test_handler_threads_ack_on_separate_connections_at_once(
    relay: FakeRelay, make_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two acks must be in flight together, each on its own client: one shared connection
    # (one request in flight) would serialise every ack of the worker.
    together = threading.Barrier(2, timeout=WAIT_S)
    used: list[int] = []
    ack = FakeClient.ack

    def paired_ack(self: FakeClient, job_id: str, **kwargs: Any) -> dict[str, Any]:
        if len(used) < 2:
            used.append(id(self))
            together.wait()
        return ack(self, job_id, **kwargs)

    monkeypatch.setattr(FakeClient, "ack", paired_ack)
    relay.add({"n": 1}, {"n": 2})
    running = make_worker(concurrency=2, batch_acks=False)  # each ack its own request
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 2, "two acks")
    running.stop()
    assert len(set(used)) == 2
    assert running.worker.counters()["acked"] == 2


def test_acks_a_job_whose_handler_returns(relay: FakeRelay, make_worker: Any) -> None:
    seen: list[tuple[Any, JobContext]] = []
    relay.add({"hello": "world"})
    running = make_worker(lambda payload, ctx: seen.append((payload, ctx)))
    relay.wait_for(lambda: bool(relay.calls_of("ack")), "the ack")
    running.stop()
    assert relay.calls_of("ack") == [
        {"job_id": "job_1", "worker_id": "w1:1", "lease_token": "tok-job_1"}
    ]
    payload, ctx = seen[0]
    assert payload == {"hello": "world"}
    assert (ctx.job_id, ctx.queue, ctx.attempt, ctx.worker_id) == ("job_1", "q", 1, "w1:1")
    assert relay.calls_of("fail") == []
    assert running.worker.acked == 1
    assert running.error is None


def test_fails_with_the_error_cut_to_max_error_bytes(relay: FakeRelay, make_worker: Any) -> None:
    def handler(payload: Any, ctx: JobContext) -> None:
        raise ValueError("é" * 100)  # 200 UTF-8 bytes

    relay.add({})
    running = make_worker(handler, max_error_bytes=51)
    relay.wait_for(lambda: bool(relay.calls_of("fail")), "the fail")
    running.stop()
    (call,) = relay.calls_of("fail")
    assert call["error"] == "é" * 25  # 50 bytes: the 51st would split a character
    assert call["retryable"] is True
    assert call["lease_token"] == "tok-job_1"
    assert running.worker.failed == 1
    assert relay.calls_of("ack") == []


def test_a_stored_result_is_sent_with_the_ack(relay: FakeRelay, make_worker: Any) -> None:
    relay.add({}, {})
    answers = iter([StoredResult({"n": 1}), "ignored: not a StoredResult"])
    running = make_worker(lambda payload, ctx: next(answers), concurrency=1)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 2, "two acks")
    running.stop()
    first, second = relay.calls_of("ack")
    assert first["result"] == {"n": 1}
    assert "result" not in second


def test_a_failure_is_sent_with_its_class_and_the_end_of_its_traceback(
    relay: FakeRelay, make_worker: Any
) -> None:
    def handler(payload: Any, ctx: JobContext) -> None:
        raise ValueError("x" * 500)

    relay.add({})
    running = make_worker(handler, max_result_bytes=300)
    relay.wait_for(lambda: bool(relay.calls_of("fail")), "the fail")
    running.stop()
    (call,) = relay.calls_of("fail")
    assert call["exception_class"] == "builtins.ValueError"
    assert len(call["traceback"].encode()) == 300
    assert call["traceback"] == "x" * 299 + "\n"  # the end: where the message is


def only_fail(relay: FakeRelay, make_worker: Any, handler: Any) -> tuple[dict[str, Any], Running]:
    """Run one job through ``handler`` until the worker fails it, then stop the worker;
    return that fail's call and the stopped worker."""
    relay.add({})
    running = make_worker(handler)
    relay.wait_for(lambda: bool(relay.calls_of("fail")), "the fail")
    running.stop()
    (call,) = relay.calls_of("fail")
    return call, running


def test_a_result_the_server_refuses_fails_the_job_for_good(
    relay: FakeRelay, make_worker: Any
) -> None:
    relay.refuse_result = errors.FrameTooLarge(
        "result is 70000 bytes, over the 65536-byte limit", field="result", limit=65536
    )
    call, running = only_fail(relay, make_worker, lambda payload, ctx: StoredResult("big"))
    assert call["retryable"] is False
    assert call["error"].startswith("the result cannot be stored: result is 70000 bytes")
    assert call["exception_class"] == "queue_core.errors.FrameTooLarge"
    assert running.worker.failed == 1 and running.worker.acked == 0


def _looped(through: str) -> Any:
    """A value that holds itself through a dict or a tuple, or a chain of 100,000 tuples
    (orjson 3.12 and 3.13 crash the process on the last two; the fake's ack encodes as the
    real client does, so this test's process would die too with such an orjson)."""
    if through == "dict":
        looped: Any = {}
        looped["self"] = looped
    elif through == "tuple":
        looped = [1]
        looped.append((looped,))
    else:
        looped = 1
        for _ in range(100_000):
            looped = (looped,)
    return {"r": looped}


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({1, 2}, "set is not a JSON type"),
        (object(), "object is not a JSON type"),
        ({(1, 2): 3}, "is not a string"),
        (2**70, "outside -2**63..2**64-1"),
        (_looped("dict"), "holds itself"),
        (_looped("tuple"), "holds itself"),
        (_looped("chain"), "nested deeper than 256 levels"),
    ],
)
def test_a_result_the_client_cannot_encode_fails_the_job_for_good(
    relay: FakeRelay, make_worker: Any, value: Any, problem: str
) -> None:
    # Refused with no field, the ack was dropped: the lease expired and the job ran again
    # until it died "lease expired", with no error stored; a value holding itself hung the
    # walk, or through a tuple killed the worker with every job it held (hostile reviews).
    call, _ = only_fail(relay, make_worker, lambda payload, ctx: StoredResult(value))
    assert call["retryable"] is False
    assert (
        call["error"].startswith("the result cannot be stored: result") and problem in call["error"]
    )
    assert call["exception_class"] == "queue_core.errors.InvalidArgument"
    assert relay.calls_of("ack") == []


def test_a_result_over_the_clients_frame_limit_fails_the_job_for_good(
    relay: FakeRelay, make_worker: Any
) -> None:
    # The client refuses the ack itself (FRAME_TOO_LARGE, no field): the worker logged
    # ack_error and left the job leased, so it ran again at each lease expiry and died
    # "lease expired" (a review: 1.1 MB and 2 MB results, three runs each).
    call, running = only_fail(relay, make_worker, lambda p, ctx: StoredResult("x" * FRAME_BYTES))
    assert call["retryable"] is False
    assert call["error"].startswith("the result cannot be stored: request is ")
    assert call["exception_class"] == "queue_core.errors.FrameTooLarge"
    assert running.worker.failed == 1 and running.worker.acked == 0
    assert relay.calls_of("ack") == []


def test_a_handler_still_running_when_its_job_comes_back_keeps_its_slot(
    relay: FakeRelay, make_worker: Any
) -> None:
    # A handler ignored its time limit; the server failed the attempt and the retry came back
    # to this worker's free slot. The new lease replaced the old one among the held jobs, so
    # the old handler's thread counted as free: the worker leased more jobs than it had
    # threads, and one sat leased, renewed and never run (a Django review).
    gates = [threading.Event(), threading.Event()]
    started: list[int] = []

    def handler(payload: Any, ctx: JobContext) -> None:
        if payload == "hang":
            with relay.cond:
                started.append(len(started))
                n = len(started) - 1
                relay.cond.notify_all()
            assert gates[n].wait(WAIT_S)

    (job_id,) = relay.add("hang")
    running = make_worker(handler, concurrency=2)
    relay.wait_for(lambda: len(started) == 1, "the first run")
    with relay.cond:  # the server failed it at its time limit: its retry is ready again
        relay.held.pop(job_id)
        relay.ready.append({"job_id": job_id, "queue": "q", "payload": "hang"})
        relay.cond.notify_all()
    relay.wait_for(lambda: len(started) == 2, "the retry running beside it")
    assert running.worker.busy == 2  # both threads taken: nothing more is leased
    (later,) = relay.add({"n": 1})
    gates[0].set()  # the first run ends (its result is refused): its slot frees
    relay.wait_for(lambda: any(a["job_id"] == later for a in relay.calls_of("ack")), "later")
    gates[1].set()
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 2, "the retry's ack")
    running.stop()
    assert running.worker.busy == 0


def test_non_retryable_error_fails_without_retry(relay: FakeRelay, make_worker: Any) -> None:
    relay.add({"fail": True, "error": "bad input", "retryable": False}, {"fail": True})
    running = make_worker()
    relay.wait_for(lambda: len(relay.calls_of("fail")) == 2, "two fails")
    running.stop()
    by_job = {call["job_id"]: call for call in relay.calls_of("fail")}
    assert (by_job["job_1"]["error"], by_job["job_1"]["retryable"]) == ("bad input", False)
    assert (by_job["job_2"]["error"], by_job["job_2"]["retryable"]) == ("demo failure", True)


def test_empty_exception_text_falls_back_to_the_type_name(
    relay: FakeRelay, make_worker: Any
) -> None:
    def handler(payload: Any, ctx: JobContext) -> None:
        raise KeyError

    relay.add({})
    running = make_worker(handler)
    relay.wait_for(lambda: bool(relay.calls_of("fail")), "the fail")
    running.stop()
    assert relay.calls_of("fail")[0]["error"] == "KeyError"


def test_error_text_with_a_lone_surrogate_is_still_reported(
    relay: FakeRelay, make_worker: Any
) -> None:
    # "\ud800" has no UTF-8 form: cutting the text to size raised, and the job stayed leased.
    def handler(payload: Any, ctx: JobContext) -> None:
        raise ValueError(f"bad \ud800 name {payload['n']}")

    relay.add({"n": 1}, {"n": 2})
    running = make_worker(handler, max_error_bytes=15)
    relay.wait_for(lambda: len(relay.calls_of("fail")) == 2, "both fails")
    running.stop()
    errors_sent = sorted(call["error"] for call in relay.calls_of("fail"))
    assert errors_sent == ["bad \\ud800 name", "bad \\ud800 name"]  # escaped, cut to 15 bytes
    assert running.worker.failed == 2 and relay.held == {}


def test_an_exception_whose_text_cannot_be_read_is_still_reported(
    relay: FakeRelay, make_worker: Any
) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    def handler(payload: Any, ctx: JobContext) -> None:
        raise Unprintable

    relay.add({})
    running = make_worker(handler)
    relay.wait_for(lambda: bool(relay.calls_of("fail")), "the fail")
    running.stop()
    assert relay.calls_of("fail")[0]["error"] == "Unprintable (its message could not be read)"


def test_renews_every_third_of_the_lease(
    relay: FakeRelay,
    clock: FakeClock,
    make_worker: Any,
    renew_log: RenewLog,
) -> None:
    renewed, leased = renew_log.renewed, renew_log.leased
    gate = threading.Event()
    relay.add({})
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), lease_ms=3_000)
    leased.wait_count(1)  # held by the worker, its renew timed from clock 0
    assert relay.calls_of("renew") == []
    clock.advance(ms=999)  # not due yet: the first renew is due 1 000 ms after the lease
    clock.advance(ms=1)
    # Logged once its answer is settled, so its next renew is timed from this clock.
    renewed.wait_count(1)
    clock.advance(ms=1_000)
    renewed.wait_count(2)
    assert len(relay.calls_of("renew")) == 2
    assert relay.calls_of("renew")[0] == {
        "job_id": "job_1",
        "lease_token": "tok-job_1",
        "lease_ms": 3_000,
    }
    gate.set()
    relay.wait_for(lambda: bool(relay.calls_of("ack")), "the ack")
    running.stop()
    assert running.worker.renewed == 2


def test_stops_renewing_a_lease_the_server_rejects(
    relay: FakeRelay,
    clock: FakeClock,
    make_worker: Any,
    renew_log: RenewLog,
) -> None:
    renewed, logged_leases = renew_log.renewed, renew_log.leased
    gate = threading.Event()
    relay.add({}, {})
    relay.renew_errors["job_1"] = errors.LeaseExpired()
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), lease_ms=3_000)
    logged_leases.wait_count(2)  # held by the worker, each renew timed from clock 0
    for n in (1, 2, 3):
        clock.advance(ms=1_000)
        # Logged once its answer is settled, so the next is timed from this clock.
        renewed.wait_count(n)
    assert sum(c["job_id"] == "job_2" for c in relay.calls_of("renew")) == 3
    assert [c["job_id"] for c in relay.calls_of("renew")].count("job_1") == 1
    # Both were due together: one request for both, then job_2 alone.
    assert relay.calls_of("renew_batch") == [{"renews": 2}, {"renews": 1}, {"renews": 1}]
    assert running.worker.lost == 1
    gate.set()  # the handler finishes; its ack is attempted (and would be rejected for real)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 2, "both acks")
    running.stop()


def test_a_long_poll_answered_empty_at_once_is_not_asked_again_at_once(
    relay: FakeRelay, make_worker: Any
) -> None:
    # A server answering every long-poll empty at once had the worker ask 9,166 times in 2 s
    # (a review). Asked again only after a pause (real time: the link's), the lease calls
    # come at most every 0.2 s; a loaded machine only spaces them more.
    relay.instant_empty = True
    started = time.monotonic()
    running = make_worker(wait_ms=1_000)
    relay.wait_for(lambda: len(relay.calls_of("lease")) >= 4, "four lease calls")
    assert time.monotonic() - started >= 3 * 0.2 * 0.95
    relay.instant_empty = False
    relay.add({})  # and a job is still leased, run and acked
    relay.wait_for(lambda: bool(relay.calls_of("ack") or relay.calls_of("ack_batch")), "the ack")
    running.stop()


def test_the_leases_due_together_are_renewed_in_one_request(
    relay: FakeRelay,
    clock: FakeClock,
    make_worker: Any,
    renew_log: RenewLog,
) -> None:
    # One request per lease bounded a worker's leases on a slow link: 16 leases of 6 s with
    # replies 400 ms late lost 7 (docs/failure-model.md). Due together, they go together.
    renewed, leased = renew_log.renewed, renew_log.leased
    gate = threading.Event()
    relay.add({}, {}, {}, {})
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), concurrency=4)
    leased.wait_count(4)
    clock.advance(ms=1_000)
    renewed.wait_count(4)
    assert relay.calls_of("renew_batch") == [{"renews": 4}]
    assert sorted(c["job_id"] for c in relay.calls_of("renew")) == [f"job_{n}" for n in range(1, 5)]
    gate.set()
    relay.wait_for(
        lambda: len(relay.calls_of("ack")) + len(relay.calls_of("ack_batch")) >= 1, "acks"
    )
    running.stop()
    assert running.worker.renewed == 4 and running.worker.lost == 0


def test_a_renew_batch_too_large_for_the_server_is_sent_in_halves(
    relay: FakeRelay,
    clock: FakeClock,
    make_worker: Any,
    renew_log: RenewLog,
) -> None:
    # A server with a small RELAY_MAX_FRAME_BYTES: the worker halves its batches at once and
    # keeps them halved; no lease waits for a later round.
    renewed, leased = renew_log.renewed, renew_log.leased
    relay.max_renew_batch = 2
    gate = threading.Event()
    relay.add({}, {}, {}, {})
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), concurrency=4)
    leased.wait_count(4)
    clock.advance(ms=1_000)
    renewed.wait_count(4)
    clock.advance(ms=1_000)
    renewed.wait_count(8)
    assert relay.calls_of("renew_batch") == [
        {"refused": "FRAME_TOO_LARGE"},
        {"renews": 2},
        {"renews": 2},
        {"renews": 2},
        {"renews": 2},
    ]
    gate.set()
    running.stop()
    assert running.worker.lost == 0


def test_a_malformed_renew_batch_reply_is_tried_again(
    relay: FakeRelay,
    clock: FakeClock,
    make_worker: Any,
    renew_log: RenewLog,
) -> None:
    # A faulty server or proxy: the results shifted (job_1 given job_2's), the last no
    # object. Nothing is taken as renewed or lost; both are tried again, the worker runs on.
    renewed, leased, failed = renew_log
    relay.malformed_renews = 1
    gate = threading.Event()
    relay.add({}, {})
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S))
    leased.wait_count(2)
    clock.advance(ms=1_000)
    failed.wait_count(1)
    assert renewed.count == 0 and running.worker.lost == 0
    clock.advance(ms=1_000)  # due again (a renew interval after it was sent)
    renewed.wait_count(2)
    assert relay.calls_of("renew_batch") == [{"renews": 2}, {"renews": 2}]
    # An "ok" that is not true (a string "false") renews nothing: tried again.
    relay.renew_ok["job_1"] = "false"
    failures = failed.count
    clock.advance(ms=1_000)
    failed.wait_count(failures + 1)
    renewed.wait_count(3)  # job_2's
    assert renewed.count == 3
    clock.advance(ms=1_000)
    renewed.wait_count(5)
    gate.set()
    running.stop()
    assert running.worker.lost == 0 and running.error is None


def test_against_a_server_without_renew_batch_each_lease_is_renewed_alone(
    relay: FakeRelay,
    clock: FakeClock,
    make_worker: Any,
    renew_log: RenewLog,
) -> None:
    # A worker upgraded before its server: renew_batch answers UNKNOWN_OP, and the leases
    # are renewed one request each, in the same round, from then on.
    renewed, leased = renew_log.renewed, renew_log.leased
    relay.no_renew_batch = True
    gate = threading.Event()
    relay.add({}, {})
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S))
    leased.wait_count(2)
    clock.advance(ms=1_000)
    renewed.wait_count(2)
    clock.advance(ms=1_000)
    renewed.wait_count(4)
    assert relay.calls_of("renew_batch") == [{"refused": "UNKNOWN_OP"}]
    assert len(relay.calls_of("renew")) == 4  # one request each, two rounds
    # Five minutes on (another server of several addresses, an upgrade): batches again.
    relay.no_renew_batch = False
    clock.advance(seconds=300)
    renewed.wait_count(6)
    assert relay.calls_of("renew_batch")[1:] == [{"renews": 2}]
    gate.set()
    running.stop()
    assert running.worker.lost == 0


def test_a_renew_on_a_silent_connection_is_cut_and_the_other_leases_are_renewed(
    relay: FakeRelay, clock: FakeClock, make_worker: Any
) -> None:
    # One renew waited out the client's 30 s timeout on a connection gone silent: every other
    # lease of the worker expired meanwhile, and another worker ran their jobs beside it (a
    # review). The renew now ends at its deadline, and is tried again on a new connection.
    gate = threading.Event()
    relay.add({}, {})
    relay.silent_renews.add("job_1")
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), lease_ms=3_000)
    relay.wait_for(lambda: len(relay.held) == 2, "both leases")
    clock.advance(ms=1_000)
    relay.wait_for(lambda: len(relay.calls_of("renew")) == 2, "both renews, one cut off")
    clock.advance(ms=1_000)  # the cut renew is due again (within _RENEW_RETRY_S), on a new one
    relay.wait_for(
        lambda: [c["job_id"] for c in relay.calls_of("renew")].count("job_1") == 2,
        "job_1 renewed again",
    )
    assert running.worker.lost == 0 and running.worker.renewed >= 2
    gate.set()
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 2, "both acks")
    running.stop()
    assert running.error is None


def test_a_short_lease_whose_renew_is_lost_is_renewed_again_in_time(
    relay: FakeRelay, clock: FakeClock, make_worker: Any, logged: Callable[[str], Logged]
) -> None:
    # With a 1.5 s lease, a renew cut after 1 s and tried again 0.5 s later went out past the
    # lease's end: LEASE_EXPIRED, and another worker ran the job beside this one (a review).
    # The renew due at 0.5 s has until 1.0 s (a renew interval); cut there, it is tried again
    # at once, with the 0.5 s left. The fake moves this clock on while the renew waits.
    relay.clock = clock
    failed = logged("renew_error")
    gate = threading.Event()
    relay.add({})
    relay.silent_renews.add("job_1")
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), lease_ms=1_500)
    relay.wait_for(lambda: bool(relay.held), "the lease")
    clock.advance(ms=500)
    assert failed.seen.wait(WAIT_S), "the first renew did not end at its deadline"
    relay.wait_for(lambda: running.worker.renewed == 1, "the retry, at once")
    assert clock.monotonic() == pytest.approx(1.0, abs=0.05)  # the lease ends at 1.5
    gate.set()
    relay.wait_for(lambda: bool(relay.calls_of("ack")), "the ack")
    running.stop()
    assert running.worker.lost == 0


def test_a_batchs_deadline_is_not_cut_for_its_soonest_lease(relay: FakeRelay) -> None:
    # A lease about to expire in a batch with others: its renew is refused on its own if late,
    # and the others' renew keeps a renew interval (the soonest lease's 0.1 s cut them all,
    # and on a slow link they were tried again only a second later: a review of this change).
    worker = Worker(relay.connect, ["q"], lease_ms=3_000, max_error_bytes=1, max_result_bytes=1)

    def held(expires_at: float) -> _HeldJob:
        lease: Any = {}
        return _HeldJob("j", "t", "q", 1, None, lease, renew_at=0.0, expires_at=expires_at)

    assert worker._renew_budget([held(10.05), held(12.5)], sent=10.0) == pytest.approx(1.0)
    assert worker._renew_budget([held(10.3)], sent=10.0) == pytest.approx(0.3)
    assert worker._renew_budget([held(9.0)], sent=10.0) == pytest.approx(0.1)  # at least


def test_a_slow_renew_is_not_cut_before_a_renew_interval(
    relay: FakeRelay, clock: FakeClock, make_worker: Any, logged: Callable[[str], Logged]
) -> None:
    # A budget shrinking with the lease's time left cut renews answered in 1.1 s of a 6 s
    # lease, every one logged as failed while the server renewed them (a re-review). Scaled
    # down: a 600 ms lease is renewed every 200 ms, and its renew may take that long.
    failed = logged("renew_error")
    gate = threading.Event()
    relay.add({})
    relay.slow_renews["job_1"] = 0.15  # s of real time before the answer
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), lease_ms=600)
    relay.wait_for(lambda: bool(relay.held), "the lease")
    clock.advance(ms=200)
    relay.wait_for(lambda: running.worker.renewed == 1, "the slow renew, answered")
    gate.set()
    relay.wait_for(lambda: bool(relay.calls_of("ack")), "the ack")
    running.stop()
    assert not failed.seen.is_set()


def test_a_renew_failing_in_an_unforeseen_way_is_tried_again(
    relay: FakeRelay, clock: FakeClock, make_worker: Any
) -> None:
    # An error reply whose details were no object raised TypeError out of the client: the
    # renewer thread died, and no lease of the worker was renewed again (a review).
    gate = threading.Event()
    relay.add({})
    relay.renew_errors["job_1"] = TypeError("details is not a mapping")
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), lease_ms=3_000)
    relay.wait_for(lambda: bool(relay.held), "the lease")
    clock.advance(ms=1_000)
    relay.wait_for(lambda: len(relay.calls_of("renew")) == 1, "the first renew")
    with relay.cond:
        del relay.renew_errors["job_1"]
    clock.advance(ms=1_000)
    relay.wait_for(lambda: running.worker.renewed == 1, "the renew tried again")
    gate.set()
    relay.wait_for(lambda: bool(relay.calls_of("ack")), "the ack")
    running.stop()
    assert running.error is None


def test_a_crash_of_the_renewer_stops_the_worker(
    relay: FakeRelay, clock: FakeClock, make_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A renewer that died left the worker running with no lease renewed again (a review):
    # a bug in its loop now stops the worker, as one in the lease loop does.
    def broken(self: Worker, jobs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Worker, "_renew_due", broken)
    gate = threading.Event()
    relay.add({})
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), lease_ms=3_000)
    relay.wait_for(lambda: bool(relay.held), "the lease")
    clock.advance(ms=1_000)  # the renew is due
    assert running.worker.shutdown_event.wait(WAIT_S), "the worker did not stop"
    gate.set()
    running.join()
    assert isinstance(running.error, errors.Internal)
    assert "renewer crashed: RuntimeError('a bug')" in str(running.error)


@pytest.mark.parametrize(
    "extra",
    [{"queue": "q"}, "job_9", {"job_id": "job_9", "lease_token": None}, {"job_id": 9}],
    ids=["no-ids", "not-an-object", "null-token", "int-id"],
)
def test_a_malformed_lease_in_a_reply_is_logged_and_the_others_run(
    relay: FakeRelay, make_worker: Any, extra: Any, logged: Callable[[str], Logged]
) -> None:
    # One such entry stopped the worker ("INTERNAL: lease loop crashed: KeyError('job_id')"),
    # its good leases neither run nor released (a review).
    bad = logged("bad_leases")
    relay.lease_extras = [extra]
    relay.add({"n": 1})
    running = make_worker(concurrency=2)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 1, "the good lease's ack")
    assert bad.seen.wait(WAIT_S), "no bad_leases line"
    relay.add({"n": 2})
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 2, "the worker leasing on")
    running.stop()
    assert running.error is None
    assert running.worker.leased == 2


def test_a_lease_repeated_in_a_reply_runs_once(
    relay: FakeRelay, make_worker: Any, logged: Callable[[str], Logged]
) -> None:
    # Listed twice (a faulty server or proxy), one lease started two handlers with one token,
    # both acked: the job ran twice at once on one worker (a review).
    repeated = logged("lease_repeated")
    runs: list[Any] = []
    gate = threading.Event()
    relay.lease_extras = [
        {"job_id": "job_1", "queue": "q", "payload": 1, "lease_token": "tok-job_1"}
    ]
    relay.add(1)
    running = make_worker(lambda payload, ctx: runs.append(payload) or gate.wait(WAIT_S))
    assert repeated.seen.wait(WAIT_S), "no lease_repeated line"
    gate.set()
    relay.wait_for(lambda: len(relay.calls_of("ack")) >= 1, "the ack")
    running.stop()
    assert runs == [1]
    assert [c["job_id"] for c in relay.calls_of("ack")] == ["job_1"]
    assert running.worker.leased == 1


def test_stop_waits_for_running_handlers_then_acks(relay: FakeRelay, make_worker: Any) -> None:
    started = threading.Event()

    def handler(payload: Any, ctx: JobContext) -> None:
        started.set()
        assert ctx.shutdown.wait(WAIT_S)  # finishes promptly once asked to stop

    relay.add({})
    running = make_worker(handler)
    assert started.wait(WAIT_S)
    running.stop()
    assert [c["job_id"] for c in relay.calls_of("ack")] == ["job_1"]
    assert relay.calls_of("release") == []


def test_stop_releases_jobs_still_running_at_the_deadline(
    relay: FakeRelay, clock: FakeClock, make_worker: Any
) -> None:
    gate = threading.Event()
    relay.add({}, {}, {})
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), shutdown_timeout_ms=5_000)
    relay.wait_for(lambda: len(relay.held) == 2, "two leases")
    running.worker.stop()
    clock.advance(ms=4_000)  # within the timeout: still waiting for the handlers
    assert running.thread.is_alive()
    assert relay.calls_of("release") == []
    clock.advance(ms=1_001)
    running.join()
    released = sorted(c["job_id"] for c in relay.calls_of("release"))
    assert released == ["job_1", "job_2"]
    assert relay.held == {}
    assert running.worker.released == 2
    assert len(relay.ready) == 1  # the third job was never leased
    gate.set()  # the abandoned handlers return; their results are discarded
    assert relay.calls_of("ack") == []


def test_releases_a_server_never_answers_end_with_their_budget(
    relay: FakeRelay, clock: FakeClock, make_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A review's server took requests and answered none: the shutdown's release waited for
    # a pooled connection, then for its answer, and a 2 s shutdown timeout took 36 s. The
    # releases now go out on a connection of their own, closed when their budget is up.
    monkeypatch.setattr(runner, "_RELEASE_BUDGET_S", 0.2)
    gate = threading.Event()
    relay.add({}, {})
    running = make_worker(lambda payload, ctx: gate.wait(WAIT_S), shutdown_timeout_ms=1_000)
    relay.wait_for(lambda: len(relay.held) == 2, "two leases")
    relay.unanswered_releases = True
    running.worker.stop()
    clock.advance(ms=1_001)
    running.join()  # within WAIT_S: the budget's cut-off, not the fake's own end
    assert running.worker.released == 0 and set(relay.held) == {"job_1", "job_2"}
    gate.set()


def test_jobs_an_ack_brings_while_stopping_are_released_before_the_worker_stops(
    relay: FakeRelay, make_worker: Any, logged: Callable[[str], Logged]
) -> None:
    # A --tasks worker's ack (its handler thread's, with a result) brought jobs after the
    # SIGTERM; their release ran on that thread, which the shutdown does not join: it closed
    # the clients and the process exited, the jobs leased until their leases expired (a
    # Django review: 2 of 4 such jobs in 3 of 7 runs).
    stopped = logged("worker_stopped")
    relay.ack_gate, relay.release_gate = threading.Event(), threading.Event()
    relay.add({"n": 1})
    running = make_worker(lambda payload, ctx: {"done": payload}, concurrency=1)
    assert relay.at_gate.acquire(timeout=WAIT_S), "no ack"  # sent with lease_next
    relay.add({"n": 2})
    running.worker.stop()
    relay.ack_gate.set()  # the ack's lease_next brings job_2, to a worker stopping
    assert relay.at_gate.acquire(timeout=WAIT_S), "job_2 was not released"
    # One bounded look: a loaded machine can only make the unfixed worker pass it, never
    # the fixed one fail it.
    assert not stopped.seen.wait(0.5), "the worker stopped while a release was under way"
    relay.release_gate.set()
    running.join()
    assert relay.held == {}
    assert [c["job_id"] for c in relay.calls_of("release")] == ["job_2"]
    assert running.worker.counters()["released"] == 1


def test_job_interrupted_with_no_stop_asked_for_is_a_failure_not_a_release(
    relay: FakeRelay, make_worker: Any
) -> None:
    # Released, the job came straight back to the same handler: a review's reached attempt
    # 4,712 in 8 s, an attempt row each, and never went dead.
    def handler(payload: Any, ctx: JobContext) -> None:
        raise JobInterrupted("bored")

    call, running = only_fail(relay, make_worker, handler)
    assert call["retryable"] is True
    assert call["error"] == "no stop was asked for: bored"
    assert call["exception_class"] == "queue_core.worker.handlers.JobInterrupted"
    assert relay.calls_of("release") == [] and running.worker.released == 0


def test_interrupted_demo_sleep_releases_the_job(relay: FakeRelay, make_worker: Any) -> None:
    relay.add({"sleep_ms": 60_000})
    running = make_worker()
    relay.wait_for(lambda: bool(relay.held), "the lease")
    running.stop()  # the demo sleep wakes on ctx.shutdown and raises JobInterrupted
    assert [c["job_id"] for c in relay.calls_of("release")] == ["job_1"]
    assert relay.calls_of("fail") == []
    assert running.worker.released == 1


def test_jobs_leased_while_stopping_are_released_unrun(relay: FakeRelay, make_worker: Any) -> None:
    ran: list[Any] = []
    relay.lease_gate = threading.Event()
    relay.add({"x": 1})
    running = make_worker(lambda payload, ctx: ran.append(payload))
    relay.wait_for(lambda: bool(relay.calls_of("lease")), "the lease call")
    running.worker.stop()
    relay.lease_gate.set()  # the long poll returns a job after stop()
    running.join()
    assert ran == []
    assert [c["job_id"] for c in relay.calls_of("release")] == ["job_1"]


def test_connection_errors_while_leasing_back_off_and_recover(
    relay: FakeRelay, clock: FakeClock, make_worker: Any
) -> None:
    relay.lease_errors = [ConnectionRefusedError("refused"), errors.StoreBusy()]
    relay.add({})
    running = make_worker()
    relay.wait_for(lambda: len(relay.calls_of("lease")) == 1, "the first lease call")
    start_s = clock.monotonic()
    # Each backoff waits on the fake clock: move it until the job is acked.
    with relay.cond:
        while not any(op == "ack" for op, _ in relay.calls):
            clock.advance(ms=50)
            relay.cond.wait(0.005)
    assert 0.05 <= clock.monotonic() - start_s <= 1.0  # 100 ms then 200 ms, jittered 50-100%
    running.stop()
    assert running.error is None
    assert len(relay.calls_of("lease")) >= 3


def test_a_non_retryable_lease_error_stops_the_worker(relay: FakeRelay, make_worker: Any) -> None:
    relay.lease_errors = [errors.InvalidArgument("bad queue name")]
    running = make_worker()
    running.join()
    assert isinstance(running.error, errors.InvalidArgument)


def test_rejected_ack_is_logged_not_retried(
    relay: FakeRelay,
    make_worker: Any,
    caplog: pytest.LogCaptureFixture,
    logged: Callable[[str], Logged],
) -> None:
    def handler(payload: Any, ctx: JobContext) -> None:
        with relay.cond:  # the lease moved on while the handler ran
            relay.held[ctx.job_id] = "someone-else"

    rejected = logged("ack_rejected")
    relay.add({})
    log = logging.getLogger("relay.worker")  # "relay" does not propagate to caplog's root
    log.addHandler(caplog.handler)
    try:
        running = make_worker(handler)
        relay.wait_for(lambda: bool(relay.calls_of("ack")), "the ack")
        # Stopping before the reply is handled would race the log line (it once lost).
        assert rejected.seen.wait(WAIT_S), "no ack_rejected line"
        running.stop()
    finally:
        log.removeHandler(caplog.handler)
    assert len(relay.calls_of("ack")) == 1
    assert running.worker.acked == 0
    assert any(getattr(r, "event", None) == "ack_rejected" for r in caplog.records)


def test_worker_id_defaults_to_host_and_pid(relay: FakeRelay) -> None:

    worker = Worker(relay.connect, ["q"], lease_ms=1000, max_error_bytes=10)
    assert worker.worker_id.endswith(f":{os.getpid()}")


@pytest.mark.parametrize(
    "kwargs", [{"concurrency": 0}, {"wait_ms": -1}, {"shutdown_timeout_ms": -1}, {"lease_ms": 0}]
)
def test_rejects_bad_arguments(relay: FakeRelay, kwargs: dict[str, Any]) -> None:
    options: dict[str, Any] = {"lease_ms": 1000, "max_error_bytes": 10, **kwargs}
    with pytest.raises(ValueError, match="must be"):
        Worker(relay.connect, ["q"], **options)


def test_rejects_no_queues(relay: FakeRelay) -> None:
    with pytest.raises(ValueError, match="queue"):
        Worker(relay.connect, [], lease_ms=1000, max_error_bytes=10)


@pytest.mark.parametrize(
    ("text", "limit", "expected"),
    [
        ("abc", 3, "abc"),
        ("abcd", 3, "abc"),
        ("aé", 2, "a"),
        ("aé", 3, "aé"),
        ("", 0, ""),
        ("a\ud800b", 100, "a\\ud800b"),  # a lone surrogate becomes its escape
        ("a\udcff", 4, "a\\ud"),  # the escape is cut like any text
    ],
)
def test_truncate_utf8(text: str, limit: int, expected: str) -> None:
    assert truncate_utf8(text, limit) == expected


def _ctx(shutdown: threading.Event | None = None) -> JobContext:
    return JobContext("job_1", "q", 1, "w", shutdown or threading.Event(), {})


@pytest.mark.parametrize("payload", [None, 3, "text", [1], {}, {"sleep_ms": 0}, {"fail": "yes"}])
def test_demo_handler_succeeds_on_other_payloads(payload: Any) -> None:
    assert demo_handler(payload, _ctx()) is None


def test_demo_handler_failures() -> None:
    with pytest.raises(DemoFailure, match=r"^demo$"):
        demo_handler({"fail": True, "error": "demo"}, _ctx())
    with pytest.raises(NonRetryableError, match=r"^demo$"):
        demo_handler({"fail": True, "error": "demo", "retryable": False}, _ctx())


def test_demo_handler_sleep_is_cut_short_by_shutdown() -> None:
    shutdown = threading.Event()
    shutdown.set()
    with pytest.raises(JobInterrupted):
        demo_handler({"sleep_ms": 60_000}, _ctx(shutdown))


@pytest.mark.parametrize(
    "payload",
    [
        {"task": "app.tasks.send", "args": [], "kwargs": {}, "backend": "default", "priority": 0},
        {"task": "app.tasks.send", "call_json": '{"args": [], "kwargs": {}}', "backend": "x"},
    ],
)
def test_demo_handler_refuses_django_task_jobs(payload: Any) -> None:
    # It used to ack them: the task read SUCCESSFUL and its body never ran.
    with pytest.raises(TaskJobRefused) as caught:
        demo_handler(payload, _ctx())
    assert str(caught.value) == (
        "Django task app.tasks.send needs the task runner: run relay worker --tasks"
    )
    assert isinstance(caught.value, NonRetryableError)


@pytest.mark.parametrize(
    "payload",
    [
        {"task": "x", "args": []},
        {"task": "x", "backend": "b"},
        {"task": 1, "backend": "b", "args": []},
    ],
)
def test_payloads_that_are_not_django_tasks_are_not_refused(payload: Any) -> None:
    assert not is_django_task(payload)
    assert demo_handler(payload, _ctx()) is None


def test_a_log_line_carries_its_fields_and_a_traceback_when_asked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="relay.worker")
    runner._log(logging.INFO, "leased", job_id="j1", attempt=2)
    try:
        raise ValueError("boom")
    except ValueError:
        runner._log(logging.WARNING, "handler_failed", exc_info=True, job_id="j1")
    runner._log(logging.DEBUG, "renewed", job_id="j1")
    leased, failed, renewed = caplog.records
    assert (leased.levelno, leased.getMessage()) == (
        logging.INFO,
        "event=leased job_id=j1 attempt=2",
    )
    assert (leased.event, leased.job_id, leased.attempt) == ("leased", "j1", 2)  # type: ignore[attr-defined]
    assert leased.name == "relay.worker" and leased.funcName == "leased"
    assert leased.exc_info is None and renewed.levelno == logging.DEBUG
    assert failed.exc_info is not None and failed.exc_info[0] is ValueError
    assert "ValueError: boom" in caplog.text
