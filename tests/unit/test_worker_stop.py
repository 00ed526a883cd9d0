"""The worker's side of cancel and time limits, against the in-memory fake of test_worker.

A real handler thread waits on ``ctx.stop``; the renewer sets it when a renew answers
``stop: "cancelled"`` or ``"timeout"``, or when the lease's ``time_limit_ms`` passes on the
worker's (fake) clock. Then the worker settles the job as the reason says: released after a
cancel (the server ends it CANCELLED), failed with ``timeout`` at its local deadline, nothing
at all when the server already failed it. Synchronised with events and the fake's condition
variable, never with sleeps.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from queue_core.clock import FakeClock
from queue_core.worker import JobContext, JobInterrupted, Worker
from tests.unit.test_worker import WAIT_S, FakeRelay, Running


@pytest.fixture
def stops(relay: FakeRelay) -> dict[str, str]:
    """``{job_id: "cancelled" | "timeout"}``: what the fake's renew answers as ``stop``
    (``"timeout"``: the server failed the attempt, the token is spent)."""
    return relay.renew_stops


@pytest.fixture
def relay() -> FakeRelay:
    return FakeRelay()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_worker(relay: FakeRelay, clock: FakeClock) -> Iterator[Callable[..., Running]]:
    """As test_worker's: a worker on the fake with a 3 s lease (renewed every second)."""
    started: list[Running] = []

    def make(handler: Any, **kwargs: Any) -> Running:
        options: dict[str, Any] = {
            "concurrency": 2,
            "lease_ms": 3_000,
            "wait_ms": 100,
            "shutdown_timeout_ms": 5_000,
            "clock": clock,
            "worker_id": "w1:1",
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


class Waiter:
    """A handler that waits for ``ctx.stop`` and raises ``JobInterrupted`` (or returns, when
    ``finish`` is set), recording the reason it saw."""

    def __init__(self, finish: bool = False) -> None:
        self.started = threading.Event()
        self.reasons: list[str | None] = []
        self.finish = finish

    def __call__(self, payload: Any, ctx: JobContext) -> None:
        self.started.set()
        assert ctx.stop.wait(WAIT_S), "never told to stop"
        self.reasons.append(ctx.stop.reason)
        if not self.finish:
            raise JobInterrupted(f"stopped: {ctx.stop.reason}")


def renew_due(relay: FakeRelay, clock: FakeClock, count: int) -> None:
    """Move the fake clock past a renewal (every lease_ms / 3 = 1 s) until ``count`` renews."""
    clock.advance(seconds=1.1)
    relay.wait_for(lambda: len(relay.calls_of("renew")) >= count, f"{count} renews")


def test_a_cancel_at_renew_interrupts_the_handler_and_releases_the_job(
    relay: FakeRelay, clock: FakeClock, make_worker: Any, stops: dict[str, str]
) -> None:
    handler = Waiter()
    (job_id,) = relay.add({"n": 1})
    running = make_worker(handler)
    assert handler.started.wait(WAIT_S)
    renew_due(relay, clock, 1)
    assert handler.reasons == []  # no stop yet: the handler runs on
    stops[job_id] = "cancelled"
    renew_due(relay, clock, 2)
    relay.wait_for(lambda: len(relay.calls_of("release")) == 1, "the release")
    assert handler.reasons == ["cancelled"]
    assert relay.calls_of("fail") == [] and relay.calls_of("ack") == []
    assert running.worker.counters()["cancelled"] == 1
    running.stop()


def test_a_handler_that_finishes_after_a_cancel_is_acked(
    relay: FakeRelay, clock: FakeClock, make_worker: Any, stops: dict[str, str]
) -> None:
    handler = Waiter(finish=True)
    (job_id,) = relay.add({"n": 1})
    stops[job_id] = "cancelled"
    running = make_worker(handler)
    assert handler.started.wait(WAIT_S)
    renew_due(relay, clock, 1)
    relay.wait_for(lambda: len(relay.calls_of("ack")) == 1, "the ack")
    assert handler.reasons == ["cancelled"]
    running.stop()


def test_the_local_time_limit_interrupts_the_handler_and_fails_with_timeout(
    relay: FakeRelay, clock: FakeClock, make_worker: Any, stops: dict[str, str]
) -> None:
    handler = Waiter()
    with relay.cond:
        relay.ready.append({"job_id": "job_t", "queue": "q", "payload": {}, "time_limit_ms": 500})
        relay.cond.notify_all()
    running = make_worker(handler)
    assert handler.started.wait(WAIT_S)
    clock.advance(ms=499)
    assert not handler.reasons
    clock.advance(ms=1)  # the limit: stop, before any renew was due
    relay.wait_for(lambda: len(relay.calls_of("fail")) == 1, "the fail")
    assert handler.reasons == ["timeout"]
    (fail,) = relay.calls_of("fail")
    assert (fail["error"], fail["retryable"]) == ("timeout", True)
    assert relay.calls_of("release") == [] and relay.calls_of("renew") == []
    assert running.worker.counters()["timed_out"] == 1
    running.stop()


def test_a_handler_that_ignores_its_time_limit_has_its_attempt_ended_at_the_limit(
    relay: FakeRelay, clock: FakeClock, make_worker: Any, stops: dict[str, str]
) -> None:
    # A task body never sees ctx.stop: with a 30 s lease (a renew every 10 s) the attempt of
    # a 3 s limit ended at the renew 10 s in (a Django review). Half a second past the limit
    # the worker renews, which the server answers by failing the attempt.
    gate = threading.Event()
    started = threading.Event()

    def ignores_stop(payload: Any, ctx: JobContext) -> None:
        started.set()
        assert gate.wait(WAIT_S)

    with relay.cond:
        relay.ready.append({"job_id": "job_t", "queue": "q", "payload": {}, "time_limit_ms": 500})
        relay.cond.notify_all()
    stops["job_t"] = "timeout"
    running = make_worker(ignores_stop, lease_ms=30_000)
    assert started.wait(WAIT_S)
    clock.advance(ms=500)  # the limit: ctx.stop, which it ignores
    clock.advance(ms=499)
    assert relay.calls_of("renew") == []
    clock.advance(ms=1)
    relay.wait_for(lambda: len(relay.calls_of("renew")) == 1, "the renew at the limit")
    worker = running.worker
    # The server failed the attempt; the handler runs on in its slot (lease calls notify).
    relay.wait_for(lambda: all(j.timed_out for j in worker._held.values()), "the renew's reply")
    assert worker.held == 1
    gate.set()
    relay.wait_for(lambda: worker.held == 0, "the handler's end")
    running.stop()
    assert relay.calls_of("ack") == relay.calls_of("fail") == []  # its result is dropped
    assert len(relay.calls_of("renew")) == 1  # never renewed again


def test_a_timeout_at_renew_stops_the_handler_and_sends_nothing_more(
    relay: FakeRelay, clock: FakeClock, make_worker: Any, stops: dict[str, str]
) -> None:
    handler = Waiter()
    (job_id,) = relay.add({"n": 1})
    stops[job_id] = "timeout"
    running = make_worker(handler)
    assert handler.started.wait(WAIT_S)
    renew_due(relay, clock, 1)
    relay.wait_for(lambda: running.worker.held == 0, "the slot freed")
    assert handler.reasons == ["timeout"]
    assert relay.calls_of("fail") == relay.calls_of("release") == relay.calls_of("ack") == []
    assert len(relay.calls_of("renew")) == 1  # the job is no longer held: never renewed again
    running.stop()


def test_shutdown_sets_ctx_stop_with_its_reason(
    relay: FakeRelay, clock: FakeClock, make_worker: Any
) -> None:
    handler = Waiter()
    relay.add({"n": 1})
    running = make_worker(handler)
    assert handler.started.wait(WAIT_S)
    running.stop()
    assert handler.reasons == ["shutdown"]
    assert len(relay.calls_of("release")) == 1
