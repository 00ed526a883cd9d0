"""The one long-poll design (``queue_core.protocol.wakeups``): waiters by queue, woken from the
event loop's thread or any other, and a change-feed follower that reports moves only."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from queue_core.protocol.wakeups import FeedFollower, Wakeups


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
