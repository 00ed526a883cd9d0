"""Long-poll wake-ups: the one design both the TCP server and the HTTP API use.

A long-poll lease (TCP ``lease`` with ``wait_ms``, HTTP ``POST /api/v1/leases``) does:

1. ``waiter = wakeups.subscribe(queues)`` *before* each claim, so a commit between the claim
   and the wait is not missed;
2. the claim;
3. when it found nothing, ``await waiter.wait(timeout_s)`` (or ``waiter.event``), then
   ``wakeups.unsubscribe(waiter)`` and round again until ``wait_ms`` has passed.

``Wakeups.wake(queues)`` sets the oldest waiter of each queue not woken yet (``n`` of them);
``wake_all()`` sets every waiter (shutdown). Both are safe from any thread (a waiter is set on
its own event loop: directly from that loop's thread, else by one ``call_soon_threadsafe`` per
loop and wake).

One waiter a queue, not all: a wake for one job set every idle long-poll of its queue, and each
ran a claim (a write) for it; 1,000 idle workers made 1,400 claims a job and cut a sentinel
client's throughput by 96% (a hostile review). A woken long-poll claims after the wake, so the
wake is never lost, and as it leaves it hands the wake on (``Wakeups.leave``): to two more
waiters when it got jobs (there may be more: a batch, a sweep; two, so a burst reaches its
waiters in a few rounds, as a tree, not one claim after another; none of a queue its claim
left at its cap or out of rate tokens, ``QueueService.exhausted``) and to one when it leaves
without having claimed since its wake (its connection closed, its time ran out as it was woken).
A chain ends at a claim that found nothing. Who wakes:

* the process's own commits: the TCP server wakes the queues a request made READY
  (``dispatch.Outcome.ready_queues``) and those its reaper swept; the HTTP views do the same
  with their requests' ``ready_queues`` (``ProcessWakeups.poke``);
* commits made elsewhere (another process, another server), through one ``FeedFollower``
  per process following the service's change feed (``queue_core.storage.base.ChangeFeed``):
  on PostgreSQL the feed pushes (LISTEN/NOTIFY: ``FeedFollower.push``, the queue named when
  known); on SQLite it is polled (``FeedFollower.poll``) from one thread whose connection
  never writes for this process's waiters' sake: the TCP server's first writer between
  batches (its own commits do not move its ``data_version``), the HTTP API's
  ``ProcessWakeups`` thread (a connection of its own, so the HTTP side's commits count too).
  A commit whose queue is not known wakes only the waited-on queues that have a READY job a
  claim could take (``QueueService.ready_queues``: one read; not paused, under their cap,
  with a rate token), not a claim for every queue waited on;
* instants: a delayed job due, a lease expiring, a rate-limited queue's next token. The TCP
  server's reaper wakes a waiter of the queues it concerns then; the HTTP side, which has no
  reaper, its ``ProcessWakeups.due_at`` thread.

There is no fixed-sleep polling on the lease path. (The shape follows River's producer:
a LISTEN-driven fetch with a bounded fallback poll, here the TCP reaper's ``ready_queues``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable

from queue_core.errors import StorageLost
from queue_core.protocol import limits
from queue_core.service import QueueService
from queue_core.storage import ChangeFeed

log = logging.getLogger("relay.server")

POLL_INTERVAL_S = 0.05  # how often ProcessWakeups polls a change feed that cannot push
RETRY_S = 0.5  # ProcessWakeups' pause after the feed failed (database down), before again
START_TIMEOUT_S = 10.0  # how long the first waiter waits for ProcessWakeups' first position
# The soonest ProcessWakeups.due_at wakes after it is told (ms): an instant already passed
# that no claim can move (a due job past a sweep's row limit) must not wake claims in a loop.
MIN_PAUSE_MS = 10


class Waiter:
    """One long-poll round's wake-up, bound to the event loop that made it.

    Attributes:
        queues: the queues it waits on.
        event: set when one of them may have a READY job (or the wait must end).
    """

    __slots__ = ("event", "loop", "queues", "woken")

    def __init__(self, queues: Iterable[str]) -> None:
        self.queues = tuple(queues)
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        # Chosen by a wake (under the Wakeups lock; its event is set on its loop soon after).
        self.woken = False

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (seconds, 0 or less: just look); return whether woken."""
        if self.event.is_set():
            return True
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self.event.wait()
        except TimeoutError:
            return False
        return True


def _set_all(waiters: list[Waiter]) -> None:
    for waiter in waiters:
        waiter.event.set()


class Wakeups:
    """The waiting long-polls of one process (or one server), by queue; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # By queue, oldest first (a dict keeps the order its keys came in).
        self._waiters: dict[str, dict[Waiter, None]] = {}

    def subscribe(self, queues: Iterable[str]) -> Waiter:
        """Return a waiter set when any of ``queues`` may have a READY job (event loop only)."""
        waiter = Waiter(queues)
        with self._lock:
            for name in waiter.queues:
                self._waiters.setdefault(name, {})[waiter] = None
        return waiter

    def unsubscribe(self, waiter: Waiter) -> bool:
        """Forget ``waiter``; return whether a wake chose it (no wake can once it is
        forgotten; it may have come as its wait timed out, and the wait then said no)."""
        with self._lock:
            for name in waiter.queues:
                waiters = self._waiters.get(name)
                if waiters is not None:
                    waiters.pop(waiter, None)
                    if not waiters:
                        del self._waiters[name]
            return waiter.woken

    def wake(self, queues: Iterable[str], n: int = 1) -> None:
        """Wake the ``n`` oldest waiters of each of ``queues`` not woken yet (any thread).

        A waiter woken already is passed over: it claims after its wake, hence after this
        commit, or hands its wake on as it leaves (``leave``).
        """
        if not self._waiters:
            # Nobody waits (most commits under load). A lease subscribes before it claims,
            # so one subscribing after this look claims after the commit and sees its jobs.
            return
        found: set[Waiter] = set()
        with self._lock:
            for name in queues:
                taken = 0
                for waiter in self._waiters.get(name, ()):
                    if taken >= n:
                        break
                    if not waiter.woken:
                        waiter.woken = True
                        found.add(waiter)
                        taken += 1
        self._set(found)

    def wake_all(self) -> None:
        """Wake every waiter (any thread)."""
        with self._lock:
            found = {w for waiters in self._waiters.values() for w in waiters}
            for waiter in found:
                waiter.woken = True
        self._set(found)

    def leave(
        self,
        waiter: Waiter | None,
        *,
        got_jobs: bool,
        woken: bool,
        exhausted: frozenset[str] = frozenset(),
    ) -> None:
        """A long-poll ends with ``waiter`` its last (unsubscribed): hand its wake on.

        Args:
            waiter: its last round's waiter (None: it never waited, nothing to hand on).
            got_jobs: it leaves with jobs.
            woken: a wake chose one of its rounds' waiters (``unsubscribe`` says).
            exhausted: queues its claim left at their cap or out of rate tokens
                (``QueueService.exhausted``): a long-poll that got jobs does not hand its
                wake on there (8 long-polls of a queue at 4 jobs/s made 6.5 claims a job over
                TCP; the freed slot or the next token wakes them instead).
        """
        if waiter is None:
            return
        if got_jobs and woken:
            queues = (
                [q for q in waiter.queues if q not in exhausted] if exhausted else waiter.queues
            )
            self.wake(queues, n=2)  # there may be more: wake the next two
        elif waiter.woken and not got_jobs:
            self.wake(waiter.queues)  # woken, but it leaves without a claim since: pass it on

    def queues(self) -> list[str]:
        """The queues somebody waits on."""
        with self._lock:
            return list(self._waiters)

    @staticmethod
    def _set(found: set[Waiter]) -> None:
        if not found:
            return
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        by_loop: dict[asyncio.AbstractEventLoop, list[Waiter]] = {}
        for waiter in found:
            if waiter.loop is here:
                waiter.event.set()
            else:
                by_loop.setdefault(waiter.loop, []).append(waiter)
        for loop, waiters in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits there
                loop.call_soon_threadsafe(_set_all, waiters)


class FeedFollower:
    """Turns a service's change feed into ``on_commit(queue)`` calls (``queue`` None: any).

    Args:
        service: whose ``changes()`` feed to follow.
        on_commit: called on each commit elsewhere (from the feed's listener thread when it
            pushes, else from the thread calling ``poll``); must be thread-safe and quick.
    """

    def __init__(self, service: QueueService, on_commit: Callable[[str | None], None]) -> None:
        self.service = service
        self.on_commit = on_commit
        self.pushed = False
        self._feed: ChangeFeed | None = None
        self._token: int | None = None

    def push(self) -> bool:
        """Subscribe to a feed that pushes (once); return whether it does (else ``poll``)."""
        if not self.pushed and self.service.capabilities.push_changes:
            self.pushed = self.service.changes().subscribe(self.on_commit)
        return self.pushed

    def poll(self) -> bool:
        """Look at the feed once from this thread (always the same one: a SQLite position
        belongs to the thread's connection) and report a move; the first look takes the
        position only. Return False when the feed failed (logged; the position is kept and
        a broken connection closed, so the next look reconnects)."""
        if self._feed is None:
            self._feed = self.service.changes()
        try:
            token = self._feed.token()
        except StorageLost:
            return False  # the driver logged it, once a while: not once a loop pass
        except Exception:
            log.exception("event=change_feed_failed")
            with contextlib.suppress(Exception):
                self.service.heal()
            return False
        if self._token is not None and token != self._token:
            self.on_commit(None)
        self._token = token
        return True

    def forget(self) -> None:
        """Forget the position (after a failure, or on another thread): ``poll`` starts over."""
        self._feed = self._token = None


class ProcessWakeups:
    """A process's ``Wakeups`` fed by its ``FeedFollower`` without a server's writer to poll
    it: the HTTP API's long-polls (``queue_api.calls.wakeups``).

    Where the feed pushes, ``start()`` subscribes once; where it must be polled, a daemon
    thread (``relay-http-wakeups``) polls it every ``POLL_INTERVAL_S`` on a connection of its
    own until ``stop()``. Each (re)start of that thread wakes every waiter: commits made
    while it was away were not seen.

    Without a server's reaper, the instants at which a claim may find what it did not (a
    delayed job due, a lease expiring, a rate-limited queue's next token) are the
    long-polls' own: each claim that comes back empty, or that took a queue's last token,
    tells ``due_at`` its next one, and at that instant a daemon thread
    (``relay-http-due``, started by the first) wakes one waiter of each queue it concerns,
    as the reaper does. A timer per waiter woke them all: 8 long-polls of a queue at 4 jobs
    a second made 13 claims a job, each a write transaction.

    Args:
        service: returns the ``QueueService`` whose change feed to follow.
    """

    def __init__(self, service: Callable[[], QueueService]) -> None:
        self._service = service
        self.wakeups = Wakeups()
        self._lock = threading.Lock()
        self._follower: FeedFollower | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stopping = threading.Event()
        # By queue, the earliest instant (epoch ms) to wake a waiter of it at (``due_at``),
        # and the thread that does, woken when an earlier one comes or it must stop.
        self._due: dict[str, int] = {}
        self._due_changed = threading.Condition()
        self._timer: threading.Thread | None = None
        self._timer_stopping = False
        self._failures = limits.Every(limits.FAILURE_LOG_EVERY_S)

    async def start(self) -> None:
        """Follow the feed if not yet; wait (up to ``START_TIMEOUT_S``) for the first
        position, after which every commit elsewhere wakes the waiters it concerns."""
        service = self._service()
        with self._lock:
            if self._follower is None or self._follower.service is not service:
                self._follower = FeedFollower(service, self._on_commit)
            if self._follower.push():
                return
            if self._thread is None:
                self._stopping.clear()
                self._started.clear()
                self._thread = threading.Thread(
                    target=self._run, args=(self._follower,), name="relay-http-wakeups", daemon=True
                )
                self._thread.start()
            started = self._started
        if not started.is_set():
            await asyncio.to_thread(started.wait, START_TIMEOUT_S)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the polling thread (it closes its connection) and the due instants' thread
        (forgetting them); ``start()`` and ``due_at`` make new ones."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping.set()
            thread.join(timeout_s)
        with self._due_changed:
            timer, self._timer = self._timer, None
            self._timer_stopping = True
            self._due.clear()
            self._due_changed.notify_all()
        if timer is not None:
            timer.join(timeout_s)

    def due_at(self, at_ms: int | None, queues: Iterable[str]) -> None:
        """At ``at_ms`` (epoch ms by the service's clock; None: nothing), wake one waiter of
        each of ``queues`` (any thread): the woken claims and tells its own next instant.
        An instant a queue already has sooner is kept; one passed or sooner than
        ``MIN_PAUSE_MS`` wakes ``MIN_PAUSE_MS`` from now."""
        if at_ms is None:
            return
        at_ms = max(at_ms, self._service().clock.now_ms() + MIN_PAUSE_MS)
        with self._due_changed:
            sooner = False
            for name in queues:
                at = self._due.get(name)
                if at is None or at_ms < at:
                    self._due[name] = at_ms
                    sooner = True
            if not sooner:
                return
            if self._timer is None:
                self._timer_stopping = False
                self._timer = threading.Thread(
                    target=self._run_timer, name="relay-http-due", daemon=True
                )
                self._timer.start()
            self._due_changed.notify_all()

    def _run_timer(self) -> None:
        """The due instants' thread: wake each queue's waiter at its instant, until stopped.
        A failure (the service or its clock raising) is logged (``limits.log_failure``: a
        line each ``FAILURE_LOG_EVERY_S`` at most) and tried again after ``RETRY_S``: the
        thread dying would have left every later instant of the process unwoken, each
        long-poll waiting out its ``wait_ms``."""
        while True:
            try:
                came = self._next_due()
            except Exception as exc:  # noqa: BLE001 - logged, and the thread goes on
                limits.log_failure(self._failures, "due_timer_failed", exc)
                with self._due_changed:
                    if not self._timer_stopping:
                        self._due_changed.wait(RETRY_S)
                continue
            if came is None:
                return
            self.wakeups.wake(came)

    def _next_due(self) -> list[str] | None:
        """Wait for the next instant to come; return the queues whose instant it is (taken out
        of ``_due``), or None once the thread must stop."""
        with self._due_changed:
            while True:
                if self._timer_stopping:
                    return None
                if not self._due:
                    self._due_changed.wait()
                    continue
                now = self._service().clock.now_ms()
                came = [q for q, at in self._due.items() if at <= now]
                if came:
                    for name in came:
                        del self._due[name]
                    return came
                self._due_changed.wait((min(self._due.values()) - now) / 1000)

    def poke(self, queues: Iterable[str]) -> None:
        """This process committed something that made jobs READY in ``queues``: wake them."""
        self.wakeups.wake(queues)

    def _on_commit(self, queue: str | None) -> None:
        if queue is not None:
            self.wakeups.wake([queue])
            return
        # Only the waited-on queues with a READY job: one read, not a claim for each waiter
        # of every queue (300 HTTP long-polls on empty queues made 47,565 claims in 20 s, and
        # cut a sentinel's HTTP throughput by 96%: a hostile review).
        waited = self.wakeups.queues()
        if not waited:
            return
        try:
            service = self._service()
            ready = service.ready_queues(waited)
            due = service.next_due_ms(waited)
        except Exception:  # wake them all: each claims and sees for itself
            log.exception("event=ready_queues_failed")
            ready, due = waited, None
        self.wakeups.wake(ready)
        # A job delayed (or a lease taken) since the waiters last claimed: without a server's
        # reaper only they look at due instants, each told the one it saw when it claimed; at
        # this one they look again. A review's delayed job waited out the long-polls' 15 s.
        self.due_at(due, waited)

    def _run(self, follower: FeedFollower) -> None:
        try:
            while not self._stopping.is_set():
                follower.forget()
                if follower.poll():  # the position
                    self.wakeups.wake_all()  # what committed before it was not seen
                    self._started.set()
                    while not self._stopping.wait(POLL_INTERVAL_S):
                        if not follower.poll():
                            break
                self._stopping.wait(RETRY_S)  # the feed failed (logged): again in a while
        finally:
            follower.forget()
            follower.service.close()
