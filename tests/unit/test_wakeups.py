"""The one long-poll design (``queue_core.protocol.wakeups``): waiters by queue, woken from the
event loop's thread or any other, and a change-feed follower that reports moves only."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

from queue_core.clock import FakeClock
from queue_core.protocol.wakeups import MIN_PAUSE_MS, FeedFollower, ProcessWakeups, Wakeups


def test_wake_sets_only_the_waiters_of_those_queues() -> None:
    asyncio.run(_wake_sets_only_the_waiters_of_those_queues())


async def _wake_sets_only_the_waiters_of_those_queues() -> None:
    wakeups = Wakeups()
    a = wakeups.subscribe(["a"])
    ab = wakeups.subscribe(["a", "b"])
    c = wakeups.subscribe(["c"])
    assert sorted(wakeups.queues()) == ["a", "b", "c"]
    wakeups.wake(["b"])
    assert (a.event.is_set(), ab.event.is_set(), c.event.is_set()) == (False, True, False)
    assert await ab.wait(0) is True
    assert await a.wait(0) is False  # timed out: nothing woke it
    wakeups.wake_all()
    assert a.event.is_set() and c.event.is_set()
    for waiter in (a, ab, c):
        wakeups.unsubscribe(waiter)
    assert wakeups.queues() == []


def test_a_wake_sets_the_oldest_waiter_not_woken_yet_and_leaving_hands_it_on() -> None:
    asyncio.run(_a_wake_sets_the_oldest_waiter_not_woken_yet())


async def _a_wake_sets_the_oldest_waiter_not_woken_yet() -> None:
    wakeups = Wakeups()
    first, second, third, fourth = (wakeups.subscribe(["q"]) for _ in range(4))
    woken = lambda: [w.event.is_set() for w in (first, second, third, fourth)]  # noqa: E731
    wakeups.wake(["q"])
    assert woken() == [True, False, False, False]
    wakeups.wake(["q"])  # the first is woken already: it claims after this commit too
    assert woken() == [True, True, False, False]
    # It leaves with jobs: there may be more, the next two are woken.
    assert wakeups.unsubscribe(first) is True  # unsubscribe says a wake chose it
    wakeups.leave(first, got_jobs=True, woken=True)
    assert woken() == [True, True, True, True]
    # Woken, it leaves without having claimed since: one more is woken.
    fifth = wakeups.subscribe(["q"])
    wakeups.leave(second, got_jobs=False, woken=wakeups.unsubscribe(second))
    assert fifth.event.is_set()
    # A long-poll woken in an earlier round whose last waiter was not: jobs hand it on,
    # none do not (its claim after the wake found nothing).
    last, sixth = wakeups.subscribe(["q"]), wakeups.subscribe(["q"])
    assert wakeups.unsubscribe(last) is False
    wakeups.leave(last, got_jobs=False, woken=True)
    assert not sixth.event.is_set()
    wakeups.leave(last, got_jobs=True, woken=True)
    assert sixth.event.is_set()
    wakeups.leave(None, got_jobs=True, woken=True)  # never waited: nothing to hand on


def test_a_long_poll_that_spent_a_queue_hands_its_wake_on_only_to_its_other_queues() -> None:
    asyncio.run(_spent_queue_is_not_handed_on())


async def _spent_queue_is_not_handed_on() -> None:
    # 8 long-polls of a queue at 4 jobs a second made 6.5 claims a job over TCP: each that
    # got the queue's last token woke two more, which found none.
    wakeups = Wakeups()
    leaving = wakeups.subscribe(["rated", "open"])
    rated, opened = wakeups.subscribe(["rated"]), wakeups.subscribe(["open"])
    wakeups.wake(["rated"])
    assert wakeups.unsubscribe(leaving) is True
    wakeups.leave(leaving, got_jobs=True, woken=True, exhausted=frozenset({"rated"}))
    assert not rated.event.is_set()
    assert opened.event.is_set()
    # Woken, and leaving without a claim since: the wake is passed on, spent or not (the
    # wake came after its queue's last claim).
    again = wakeups.subscribe(["rated"])
    wakeups.wake(["rated"])
    assert rated.event.is_set()  # the oldest not woken
    assert wakeups.unsubscribe(rated) is True
    wakeups.leave(rated, got_jobs=False, woken=True, exhausted=frozenset({"rated"}))
    assert again.event.is_set()


def test_a_wake_from_another_thread_reaches_the_loop() -> None:
    asyncio.run(_a_wake_from_another_thread_reaches_the_loop())


async def _a_wake_from_another_thread_reaches_the_loop() -> None:
    wakeups = Wakeups()
    waiter = wakeups.subscribe(["q"])
    thread = threading.Thread(target=wakeups.wake, args=(["q"],))
    thread.start()
    assert await waiter.wait(10.0) is True  # set by call_soon_threadsafe on this loop
    thread.join()


def test_a_waiter_whose_loop_closed_is_skipped() -> None:
    wakeups = Wakeups()

    async def subscribe() -> None:
        wakeups.subscribe(["q"])

    asyncio.run(subscribe())  # its loop is closed now
    wakeups.wake(["q"])  # no error
    wakeups.wake_all()


class _Feed:
    def __init__(self) -> None:
        self.position = 7
        self.fail = False

    def token(self) -> int:
        if self.fail:
            raise RuntimeError("database gone")
        return self.position


class _Service:
    def __init__(self, feed: _Feed) -> None:
        self.feed = feed
        self.healed = 0

    def changes(self) -> _Feed:
        return self.feed

    def heal(self) -> None:
        self.healed += 1


def test_the_follower_reports_moves_not_its_first_position() -> None:
    feed = _Feed()
    service = _Service(feed)
    seen: list[str | None] = []
    follower = FeedFollower(service, seen.append)  # type: ignore[arg-type]
    assert follower.poll() is True  # the starting position: not a commit
    assert follower.poll() is True
    assert seen == []
    feed.position = 8
    assert follower.poll() is True
    assert seen == [None]
    feed.fail = True
    assert follower.poll() is False  # logged, connection healed, position kept
    assert service.healed == 1
    feed.fail = False
    assert follower.poll() is True
    assert seen == [None]  # 8 again: no move


def test_a_pushing_feed_is_subscribed_once() -> None:
    subscribed: list[Any] = []

    class PushFeed:
        def subscribe(self, fn: Any) -> bool:
            subscribed.append(fn)
            return True

    class PushService:
        class capabilities:  # stands in for Capabilities
            push_changes = True

        def changes(self) -> PushFeed:
            return PushFeed()

    follower = FeedFollower(PushService(), lambda queue: None)  # type: ignore[arg-type]
    assert follower.push() and follower.push()
    assert len(subscribed) == 1


def test_the_http_sides_timer_wakes_one_waiter_a_queue_at_its_instant() -> None:
    asyncio.run(_the_http_sides_timer())


async def _the_http_sides_timer() -> None:
    # Each HTTP long-poll slept until its queue's next instant and claimed then, all of them:
    # 8 of a queue at 4 jobs/s made 13 claims a job. ProcessWakeups.due_at wakes one.
    clock = FakeClock()
    service: Any = SimpleNamespace(clock=clock)
    process = ProcessWakeups(lambda: service)
    first, second = process.wakeups.subscribe(["a"]), process.wakeups.subscribe(["a"])
    other = process.wakeups.subscribe(["b"])
    try:
        process.due_at(clock.now_ms() + 1_000, ["a"])
        process.due_at(clock.now_ms() + 5_000, ["a"])  # later than the one it has: kept
        process.due_at(None, ["b"])  # nothing to wake at
        clock.advance(ms=1_000)
        assert await first.wait(10) is True
        # The timer's one wake set the first only (one list, one call on this loop).
        assert not second.event.is_set() and not other.event.is_set()
        # An instant already passed wakes MIN_PAUSE_MS from now, not at once: one that no
        # claim can move (a due job past a sweep's row limit) would wake claims in a loop.
        process.due_at(clock.now_ms() - 5_000, ["a"])
        assert await second.wait(0.2) is False  # the fake clock has not moved
        clock.advance(ms=MIN_PAUSE_MS)
        assert await second.wait(10) is True
        assert not other.event.is_set()
    finally:
        process.stop()
        for waiter in (first, second, other):
            process.wakeups.unsubscribe(waiter)
    assert process._timer is None


def test_the_http_sides_timer_outlives_a_failure() -> None:
    asyncio.run(_the_http_sides_timer_after_a_failure())


async def _the_http_sides_timer_after_a_failure() -> None:
    # The timer thread died on an exception (the service or its clock raising), and every
    # later instant of the process went unwoken: each long-poll waited out its wait_ms.
    clock = FakeClock()
    service: Any = SimpleNamespace(clock=clock)
    failures = [RuntimeError("the service is not ready")]

    def flaky() -> Any:
        if threading.current_thread().name == "relay-http-due" and failures:
            raise failures.pop()
        return service

    process = ProcessWakeups(flaky)
    waiter = process.wakeups.subscribe(["a"])
    try:
        process.due_at(clock.now_ms() + 1_000, ["a"])
        clock.advance(ms=1_000)
        assert await waiter.wait(10) is True
        assert not failures
    finally:
        process.stop()
        process.wakeups.unsubscribe(waiter)
    assert process._timer is None
