"""The server's group commit (on the event loop or writer threads) and its reader pool.

* **Group commit** (``GroupCommit``) runs every state-changing call (submit, lease claims,
  renew, ack, fail, release, replay, purge, the reaper's sweeps). On SQLite (one writer per
  file) the event loop runs it itself (``Database``): the writes a loop iteration admitted,
  when they touch at most ``INLINE_MAX_WEIGHT`` jobs, in one transaction; its writer thread
  takes a heavier batch, and every batch while another connection holds the write lock.
  On PostgreSQL ``SHARED_WRITERS`` writer threads, each with its own connection, take calls
  from one queue. A writer thread takes the first queued call, drains up to
  ``GROUP_COMMIT_MAX - 1`` more, and runs them all
  inside ONE ``service.transaction()`` (the storage driver's write transaction): each call
  gets its own SAVEPOINT (the service's own transactions nest too), so one call's error rolls
  back only that call. The batch then COMMITs once, one fsync for all of them (SQLite at
  ``synchronous=FULL``; PostgreSQL at its ``synchronous_commit``), and only then are the
  callers' futures resolved. If the commit fails, every call in the batch gets that error.
  A batch of lease bookkeeping only (claims, the reaper's sweeps, the give-back of undelivered
  leases: calls queued with ``durable=False``) commits without waiting for the disk
  (``Driver.write``'s ``durable``; docs/design-decisions.md, "Leases without their own
  fsync"); one other call in the batch (an ack, a submit) makes the whole batch durable.
  With several writers, two calls in flight at once (from two connections, or pipelined on
  one) may commit in either order; on SQLite they commit in the order they were queued
  (``put_write``; a connection's writes are queued in the order it sent them, also behind
  one that waits for the key table's re-read: ``Requests.start``).
* Where the change feed cannot push (SQLite), the loop polls it every ``WATCH_INTERVAL_S``
  (``wakeups.FeedFollower.poll``) on its own connection, whose
  ``PRAGMA data_version`` changes only when *another* connection commits, so the server's
  own commits never count as foreign (its writer thread's do, and wake the waiters once).
* A small **reader pool** runs read-only calls (ping, inspect, stats, dead_list, the key
  table); each thread has its own connection and WAL lets them read while the writer writes.

``Database`` is what the rest of the server sees: ``write(fn)`` / ``read(fn)`` from the event
loop, ``put_write`` for a write whose future is answered by a callback (the request path,
``requests.Requests.start_write``), ``start``, ``close`` and ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from queue_core import errors
from queue_core.protocol import limits
from queue_core.protocol.wakeups import FeedFollower
from queue_core.service import QueueService
from queue_core.storage.base import WriteLocked

log = logging.getLogger("relay.server")

GROUP_COMMIT_MAX = 256  # calls per writer transaction
WATCH_INTERVAL_S = 0.05  # how often the writer polls a change feed that cannot push
READER_THREADS = 4
# Plus one thread, its own connection, that reads only the key table (``Database.read_keys``):
# behind the reader pool's queue, a stale snapshot waited for every read queued there, and
# every write waits for the snapshot (a review: 32 clients whose reads each waited 2 s for a
# locked table held up every submit and ack of that server for 5-10 s).
# Writer threads (each its own connection and group commit) where the database takes
# concurrent writers (PostgreSQL); SQLite has one.
SHARED_WRITERS = 4
# SQLite: the event loop runs the group commits itself (``Database``), those of up to
# INLINE_MAX_WEIGHT jobs' worth (a few ms); a bigger one goes to the writer thread, so that
# reads and new requests are not held up behind it.
INLINE_WRITES = True
INLINE_MAX_WEIGHT = 32


@dataclasses.dataclass(slots=True)
class Call:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    claims: bool = False  # a lease claim: its batch sweeps due jobs first
    durable: bool = True  # False: lease bookkeeping only, its COMMIT need not wait for the disk
    weight: int = 1  # the jobs it may touch (a batch's length, a lease's max_jobs)
    queues: Sequence[str] = ()  # the queues whose controls rows it locks (a claim's, a control's)
    alone: bool = False  # run in a transaction of its own (a submit that may start a queue)
    jobs: Sequence[str] = ()  # the jobs whose rows it updates (renew, ack, cancel, ...)


def _ordered_locks(
    batch: list[Call], controlled: Callable[[Sequence[str]], bool]
) -> tuple[list[str], list[str]]:
    """What a group commit's first call locks for ``batch``: the queues whose controls rows
    its calls lock, sorted, and of those, the controls ops' (which may insert their row); or
    nothing when fewer than two calls lock any, unless that one's queues are ``controlled``
    (the service's hint) and the batch also updates named jobs.

    A claim locks its queues' controls rows in name order, a controls op its queue's; two
    such calls in one transaction would lock two sets, each in order but not together, and
    another transaction could take them the other way round (PostgreSQL: deadlocks, three
    reviews). All of them are locked first, at once. The order kept is controls rows, then
    job rows: an ack with ``lease_next`` on a capped queue locked its job's row, then the
    queue's controls row, and a batch on another server the other way round (a review: 16
    deadlocks in 15 s).
    """
    locking = [call for call in batch if call.queues]
    if not locking:
        return [], []
    if len(locking) < 2 and not (
        any(call.jobs for call in batch) and controlled(locking[0].queues)
    ):
        return [], []
    hold = sorted({q for call in locking for q in call.queues})
    inserting = sorted({q for call in locking if not call.claims for q in call.queues})
    return hold, inserting


def _ordered_jobs(batch: list[Call]) -> list[str]:
    """The jobs whose rows a group commit's first call locks for ``batch``, sorted: those its
    calls update, when it has two or more calls and each updates named jobs
    (``QueueService.hold_jobs``).

    A batch with any other call locks in call order: a submit binding an idempotency key
    waits on another transaction's insert of that key, and rows locked ahead of it closed a
    cycle with a batch that inserted the key and then waited for them (a review: a deadlock
    where the batch had answered ``IDEMPOTENCY_CONFLICT`` in 0.5 s).
    """
    if len(batch) < 2 or not all(call.jobs for call in batch):
        return []
    return sorted({job for call in batch for job in call.jobs})


def settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():  # the caller went away (cancelled)
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def bare(exc: Exception) -> Exception:
    """``exc`` without its traceback when it is a ``RelayError`` (a refusal with a code, which
    nothing logs with its stack); any other exception keeps it, for the log.

    A traceback caught in ``GroupCommit`` holds the frames it passed, and through their
    ``f_back`` the batch's own frame, whose ``outcomes`` hold the exception: a reference cycle
    that kept each refused request's arguments, the batch and its futures until the cyclic
    collector ran, which counts objects, not bytes. 30 clients sending 1 MB payloads over
    the limit held 600 MiB that way (each refusal kept its payload, twice).
    """
    if isinstance(exc, errors.RelayError):
        return exc.with_traceback(None)
    return exc


def resolve(call: Call, ok: bool, value: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is already closed
        call.loop.call_soon_threadsafe(settle, call.future, ok, value)


def settle_all(settled: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for future, ok, value in settled:
        settle(future, ok, value)


def resolve_all(calls: list[Call], outcomes: list[tuple[bool, Any]]) -> None:
    """Resolve a batch's futures with one wake-up per event loop, not one per call.

    Each ``call_soon_threadsafe`` writes to the loop's self-pipe and makes the writer wait
    for the GIL the woken loop now holds; per call, that was 15% of the writer's time with
    16 workers (py-spy, docs/benchmarking.md).
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
    for call, (ok, value) in zip(calls, outcomes, strict=True):
        by_loop.setdefault(call.loop, []).append((call.future, ok, value))
    for loop, settled in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(settle_all, settled)


STOP = object()


class _Redo(Exception):
    """A flat group commit must be rolled back and run again with savepoints.

    Args:
        fn: the call (or the sweep) that failed.
    """

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__()
        self.fn = fn


class DbThread(threading.Thread):
    """A thread that runs calls from a queue and closes its DB connection on exit."""

    def __init__(self, name: str, calls: queue.SimpleQueue[Any], service: QueueService) -> None:
        super().__init__(name=name, daemon=True)
        self.calls = calls
        self.service = service

    def run(self) -> None:
        try:
            self.serve()
        finally:
            with contextlib.suppress(Exception):
                self.service.close()

    def serve(self) -> None:
        while (call := self.calls.get()) is not STOP:
            try:
                resolve(call, True, call.fn())
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller's coroutine
                resolve(call, False, exc)
                with contextlib.suppress(Exception):
                    self.service.heal()  # a lost connection: the next call opens a new one
            del call  # not kept (its request's arguments) while the thread waits for the next


class GroupCommit:
    """Runs a batch of write calls in one transaction and returns their outcomes (group commit).

    Used by the writer thread(s) and, on SQLite, by the event loop itself (``Database``);
    each instance is used from one thread only (the driver's transaction state is the
    thread's).

    Args:
        service: the service (its ``transaction()`` gives the transaction and savepoints).
        sweep: expires leases and promotes due jobs, returning the queues that got READY
            jobs. Run first in a batch that holds a claim: ``claim`` sweeps too, but does not
            say which queues it made ready, and their waiters must be woken.
        on_ready: called (on the running thread) with the queues ``sweep`` made ready, after
            commit.
        failures: the rate limit of failure log lines.
    """

    def __init__(
        self,
        service: QueueService,
        *,
        sweep: Callable[[], set[str]],
        on_ready: Callable[[set[str]], None],
        failures: limits.Every,
    ) -> None:
        self.service = service
        # A batch runs without a SAVEPOINT per call first (``run``, ``_guarded``): on
        # PostgreSQL each costs round trips, on SQLite ~8% of a lone call's instructions
        # (docs/benchmarking.md).
        self.flat = True
        self.commits = 0  # transactions committed (each holds one or more calls)
        self.failures = failures
        self.sweep = sweep
        self.on_ready = on_ready
        self.first = self._hold_and_sweep  # one object: a round names it (``_Redo.fn``)
        self._hold: list[str] = []  # the queues whose controls ``first`` locks
        self._inserting: list[str] = []  # of those, the controls ops' (they may insert)
        self._jobs: list[str] = []  # the jobs whose rows ``first`` locks, after the controls
        self._sweeps = False  # whether ``first`` sweeps (the batch claims)

    def run(self, batch: list[Call], *, wait: bool = True) -> list[tuple[bool, Any]]:
        """Run ``batch`` in one transaction; return each call's ``(ok, result or exception)``
        once it has committed (a failed BEGIN or COMMIT fails every call).

        The batch first runs without a SAVEPOINT per call (``self.flat``); if a call fails in
        a way that cannot be set apart
        (``_guarded``), that round is rolled back and the batch runs again with savepoints.
        Nothing is visible before the COMMIT, so running the calls again is safe.

        Args:
            wait: False: when another connection holds the write lock, raise at once.
        Raises:
            WriteLocked: ``wait=False`` and the write lock was taken: nothing ran.
        """
        if len(batch) > 1 and any(call.alone for call in batch):
            return self._apart(batch, wait=wait)
        if self.flat:
            try:
                return self._run(batch, flat=True, wait=wait)
            except _Redo as redo:
                if isinstance(redo.__cause__, errors.StoreBusy):
                    # It waited out a lock (RELAY_LOCK_TIMEOUT_MS) or lost a deadlock: it
                    # is answered BUSY, not made to wait a second time.
                    return self._run(
                        batch, flat=False, wait=wait, settled=(redo.fn, redo.__cause__)
                    )
        return self._run(batch, flat=False, wait=wait)

    def _apart(self, batch: list[Call], *, wait: bool) -> list[tuple[bool, Any]]:
        """Run ``batch``'s ``alone`` calls each in a transaction of its own and the others
        together; return the outcomes in ``batch``'s order.

        A submit that may start a queue takes the queue cap's lock (``hold_queue_cap``) on
        PostgreSQL; in a transaction of its own, its holder waits for nothing else. Taken
        between other calls' row locks, it made deadlocks (a review: BUSY answers and calls
        held 1 s under a mixed load).
        """
        outcomes: dict[int, tuple[bool, Any]] = {}
        together = [call for call in batch if not call.alone]
        if together:
            outcomes.update(zip(map(id, together), self.run(together, wait=wait), strict=True))
        for call in batch:
            if call.alone:
                outcomes[id(call)] = self.run([call], wait=wait)[0]
        return [outcomes[id(call)] for call in batch]

    def _run(
        self,
        batch: list[Call],
        *,
        flat: bool,
        wait: bool,
        settled: tuple[Callable[[], Any], BaseException] | None = None,
    ) -> list[tuple[bool, Any]]:
        """Run one round of ``batch``: flat, or with savepoints and the call (or the sweep)
        ``settled`` names answered with its exception, not run."""
        outcomes: list[tuple[bool, Any]] = []
        ready: set[str] = set()
        try:
            # Lease bookkeeping alone need not wait for the disk; anything else in the batch
            # makes it durable (SQLite decides before BEGIN, so the batch says it here).
            durable = claims = False
            for call in batch:  # a loop, not two any(): most batches hold one call
                durable = durable or call.durable
                claims = claims or call.claims
            if not self.service.capabilities.single_writer and (
                len(batch) > 1 or (batch[0].queues and batch[0].jobs)
            ):
                self._hold, self._inserting = _ordered_locks(batch, self.service.controlled)
                self._jobs = _ordered_jobs(batch)
            else:  # SQLite has one writer; one call locks only rows of one kind
                self._hold, self._inserting, self._jobs = [], [], []
            self._sweeps = claims
            with self.service.transaction(savepoints=not flat, durable=durable, wait=wait):
                if claims or self._hold or self._jobs:
                    value: Any
                    swept, value = (
                        (False, settled[1])
                        if settled and settled[0] is self.first
                        else self._guarded(self.first, flat=flat, durable=False)
                    )
                    if swept:
                        ready = value
                    else:  # a lock waited out is one line, not a traceback a batch
                        limits.log_failure(self.failures, "sweep_failed", value)
                if settled:
                    outcomes = [
                        (False, settled[1])
                        if call.fn is settled[0]
                        else self._guarded(call.fn, flat=flat, durable=call.durable)
                        for call in batch
                    ]
                else:
                    outcomes = [
                        self._guarded(call.fn, flat=flat, durable=call.durable) for call in batch
                    ]
            self.commits += 1
        except (_Redo, WriteLocked):
            raise
        except Exception as exc:  # noqa: BLE001 - BEGIN/COMMIT failed: nothing is durable
            limits.log_failure(self.failures, "group_commit_failed", exc)
            outcomes, ready = [(False, bare(exc))] * len(batch), set()
            with contextlib.suppress(Exception):
                self.service.heal()
        if ready:
            self.on_ready(ready)
        return outcomes

    def _hold_and_sweep(self) -> set[str]:
        """A batch's first call: lock the controls rows its calls will lock
        (``QueueService.hold_queue_controls``), then the rows of the jobs they update
        (``QueueService.hold_jobs``), then, when it claims, ``sweep``."""
        if self._hold:
            self.service.hold_queue_controls(self._hold, self._inserting)
        if self._jobs:
            self.service.hold_jobs(self._jobs)
        return self.sweep() if self._sweeps else set()

    def _guarded(
        self, fn: Callable[[], Any], *, flat: bool, durable: bool = True
    ) -> tuple[bool, Any]:
        """Run one call of a batch; return ``(True, result)`` or ``(False, exception)``.

        With savepoints it runs in its own and rolls back alone. Flat (no SAVEPOINT: two
        round trips saved per call on PostgreSQL, two statements on SQLite), a call that fails
        without having changed a row on an intact transaction (a stale token, a bad
        argument) is set apart and the others go on.

        ``durable``: the call's own (its SAVEPOINT says it; the service's write inside says
        its own too).

        Raises:
            _Redo: flat, the call failed after writing or on a statement the database
                refused: the whole round must be rolled back.
        """
        if not flat:
            try:
                # A SAVEPOINT: it rolls back alone.
                with self.service.transaction(durable=durable):
                    return True, fn()
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller
                return False, bare(exc)
        mark = self.service.mark()
        try:
            return True, fn()
        except Exception as exc:
            if not self.service.forgive(mark):
                raise _Redo(fn) from exc
            return False, bare(exc)


class Writer(DbThread):
    """A thread that writes: group commit, plus polling a change feed that cannot push.

    Args:
        calls: the queue ``Call``s arrive on (``STOP`` ends the thread after earlier calls).
        group: runs each batch (``GroupCommit``; this thread's own).
        follower: the feed to poll every ``WATCH_INTERVAL_S`` on this thread's connection
            (``FeedFollower.poll``); None when it pushes by itself or another thread polls.
    """

    def __init__(
        self,
        calls: queue.SimpleQueue[Any],
        group: GroupCommit,
        *,
        follower: FeedFollower | None = None,
        name: str = "relay-writer",
    ) -> None:
        super().__init__(name, calls, group.service)
        self.group = group
        self.follower = follower

    @property
    def commits(self) -> int:
        """Transactions this thread committed."""
        return self.group.commits

    def serve(self) -> None:
        follower = self.follower
        if follower is not None:
            follower.poll()  # the starting position
        next_watch = time.monotonic() + WATCH_INTERVAL_S if follower else None
        while True:
            try:
                # Without a feed to poll, wait for the next call however long it takes.
                wait = None if next_watch is None else max(0.0, next_watch - time.monotonic())
                first = self.calls.get(timeout=wait)
            except queue.Empty:
                first = None
            if first is STOP:
                return
            if first is not None:
                self._commit(first)
                first = None  # not kept (nor its batch) while the thread waits for the next
            if follower is not None and next_watch is not None and time.monotonic() >= next_watch:
                follower.poll()
                next_watch = time.monotonic() + WATCH_INTERVAL_S

    def _commit(self, first: Call) -> None:
        """Run ``first`` and the calls queued behind it (up to ``GROUP_COMMIT_MAX``) as one
        group commit and answer them. A method of its own, so that the batch, its calls and
        their requests' arguments go when it returns: the loop's locals lived on while it
        waited for the next call (up to 256 calls of up to a frame each)."""
        batch = [first]
        while len(batch) < GROUP_COMMIT_MAX:
            try:
                nxt = self.calls.get_nowait()
            except queue.Empty:
                break
            if nxt is STOP:
                self.calls.put(STOP)  # finish this batch, then stop
                break
            batch.append(nxt)
        resolve_all(batch, self.group.run(batch))


class _NoRunningLoop:
    """Run blocking database code on the loop thread: Django refuses a connection where an
    event loop runs (``SynchronousOnlyOperation``), which is right for a coroutine and wrong
    here, where the loop blocks on purpose for the length of one commit. A class, not a
    generator context manager: the loop enters one for every commit."""

    __slots__ = ("_loop",)

    def __enter__(self) -> None:
        self._loop = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(None)

    def __exit__(self, *exc: object) -> None:
        asyncio.events._set_running_loop(self._loop)


class Database:
    """The server's database threads and how the event loop hands them calls.

    On SQLite (one writer per file) the event loop runs each group commit itself
    (``_flush``): the writes a loop iteration admitted go into one transaction, committed
    before their replies are sent, with no thread hand-off in between, when they touch at
    most ``INLINE_MAX_WEIGHT`` jobs (a heavier batch goes to the writer thread, so reads are
    not held up behind it). Two hand-offs per
    request (to the writer thread and back through the loop's self-pipe) cost more server
    CPU than the request's own work on a 2-core machine (docs/benchmarking.md, round 3).
    Redis with ``appendfsync always`` and beanstalkd with ``-f 0`` sync in their event
    loops the same way. The loop never waits for a lock: when another connection holds
    SQLite's write lock (another process, or the writer thread), the batch goes to the
    writer thread, which waits as every writer does. Later writes wait on the loop until the
    thread has answered all it holds, then commit there, so writes still commit in the order
    they were queued, and a heavy batch (a retention prune of ``PRUNE_BATCH`` jobs every
    few seconds) does not leave every later write on the thread while they keep coming.

    Args:
        service: the queue service every thread calls (each thread its own connection).
        failures: the rate limit of failure log lines, shared with the server.
    """

    def __init__(self, service: QueueService, failures: limits.Every) -> None:
        self.service = service
        self.failures = failures
        self.write_calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.read_calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.key_calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.writers: list[Writer] = []
        self.threads: list[DbThread] = []
        self.inline: GroupCommit | None = None  # the event loop's group commit, when inline
        self._closed = False  # close() ran: later writes go to the writer thread
        self._pending: list[Call] = []  # writes for the loop's next group commit
        self._queued = 0  # writes handed to the writer thread and not yet answered
        self._follower: FeedFollower | None = None  # polled on the loop, when inline
        self._watch: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def commits(self) -> int:
        """Write transactions committed so far (group commit: usually fewer than writes)."""
        inline = self.inline.commits if self.inline is not None else 0
        return inline + sum(writer.commits for writer in self.writers)

    def start(
        self,
        *,
        sweep: Callable[[], set[str]],
        on_ready: Callable[[set[str]], None],
        follower: FeedFollower | None,
    ) -> None:
        """Start the writer(s) (one on SQLite, ``SHARED_WRITERS`` where the database takes
        concurrent writers) and ``READER_THREADS`` readers, from the event loop; ``follower``
        (None: the feed pushes) is polled on the loop when it writes inline, else by the first
        writer. ``sweep``, ``on_ready``: as ``GroupCommit``'s."""
        self._loop = asyncio.get_running_loop()
        single = self.service.capabilities.single_writer
        count = 1 if single else SHARED_WRITERS
        if single and INLINE_WRITES:
            self.inline = GroupCommit(
                self.service, sweep=sweep, on_ready=on_ready, failures=self.failures
            )
            self._follower, follower = follower, None
            if self._follower is not None:
                with _NoRunningLoop():
                    self._follower.poll()  # the starting position
                self._watch = self._loop.call_later(WATCH_INTERVAL_S, self._poll_feed)
        self.writers = [
            Writer(
                self.write_calls,
                GroupCommit(self.service, sweep=sweep, on_ready=on_ready, failures=self.failures),
                name="relay-writer" if count == 1 else f"relay-writer-{n}",
                follower=follower if n == 0 else None,
            )
            for n in range(count)
        ]
        readers = [
            DbThread(f"relay-reader-{n}", self.read_calls, self.service)
            for n in range(READER_THREADS)
        ]
        keys = DbThread("relay-keys", self.key_calls, self.service)
        self.threads = [*self.writers, *readers, keys]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        """Let the threads finish the calls queued so far, join them, and answer what is
        still queued ``UNAVAILABLE`` (blocking: run it in a thread, after the loop's
        ``close``)."""
        for _ in self.writers:
            self.write_calls.put(STOP)
        for thread in self.threads:
            if not isinstance(thread, Writer):
                thread.calls.put(STOP)
        for thread in self.threads:
            thread.join()
        for calls in (self.write_calls, self.read_calls, self.key_calls):  # normally empty
            while not calls.empty():
                call = calls.get()
                if call is not STOP:
                    resolve(call, False, errors.Unavailable())

    def close(self) -> None:
        """Event loop: stop polling the feed, run what is pending, close the loop's own
        connection (before ``stop``)."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._pending:
            if self._queued:  # after the writer thread's calls, in order
                pending, self._pending = self._pending, []
                self._to_thread(pending)
            else:
                self._flush()
        self._closed = True
        if self.inline is not None:
            with _NoRunningLoop(), contextlib.suppress(Exception):
                self.service.close()

    def put_write(
        self,
        fn: Callable[[], Any],
        future: asyncio.Future[Any],
        *,
        claims: bool = False,
        durable: bool = True,
        weight: int = 1,
        queues: Sequence[str] = (),
        alone: bool = False,
        jobs: Sequence[str] = (),
    ) -> None:
        """Queue ``fn`` for the next group commit; ``future`` gets its result after COMMIT
        (event-loop thread: the future's loop is the running one).

        Args:
            claims: ``fn`` leases jobs (a lease, an ack's ``lease_next``): its batch sweeps
                due jobs first.
            durable: False: ``fn`` is lease bookkeeping only (``QueueService.claim``,
                ``sweep``, ``release_batch``), which may commit without waiting for the disk
                when the whole batch is (``GroupCommit.run``).
            weight: how many jobs ``fn`` may touch (1 for most calls; a batch's length, a
                lease's ``max_jobs``): a group commit of more than ``INLINE_MAX_WEIGHT``
                runs on the writer thread.
            queues: the queues whose controls rows ``fn`` locks (a claim's, a controls
                op's): a batch of several such calls locks them all first, in name order.
            alone: run ``fn`` in a transaction of its own (``GroupCommit._apart``).
            jobs: the jobs whose rows ``fn`` updates: a batch of several calls, each with
                jobs, locks them all first, in id order (``_ordered_jobs``).
        """
        call = Call(fn, future, future.get_loop(), claims, durable, weight, queues, alone, jobs)
        if self.inline is None or self._closed:
            self.write_calls.put(call)
            return
        self._pending.append(call)
        # While the writer thread holds calls, later ones wait here for it to answer them
        # all (``_answered``), not in its queue: handed there one by one under steady load,
        # the queue never emptied and every write paid two thread hand-offs from then on.
        if len(self._pending) == 1 and not self._queued:
            call.loop.call_soon(self._flush)

    async def write(
        self,
        fn: Callable[[], Any],
        *,
        claims: bool = False,
        durable: bool = True,
        weight: int = 1,
        queues: Sequence[str] = (),
    ) -> Any:
        """Run ``fn`` in the next group commit; return after COMMIT (``put_write``'s
        arguments)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.put_write(fn, future, claims=claims, durable=durable, weight=weight, queues=queues)
        return await future

    async def read(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the reader pool."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.read_calls.put(Call(fn, future, loop))
        return await future

    async def read_keys(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, a read of the key table, on the thread kept for it (never queued
        behind the reader pool's reads)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.key_calls.put(Call(fn, future, loop))
        return await future

    # ------------------------------------------------------------------ inline group commit

    def _flush(self) -> None:
        """Event loop: commit the pending writes in one transaction, then settle them; when
        they weigh more than ``INLINE_MAX_WEIGHT`` or the write lock is taken, hand them to
        the writer thread instead."""
        if self._queued:  # ``_answered`` flushes once the writer thread has answered all
            return
        batch, self._pending = self._pending, []
        if not batch:
            return
        assert self.inline is not None
        if sum(call.weight for call in batch) <= INLINE_MAX_WEIGHT:
            try:
                with _NoRunningLoop():
                    outcomes = self.inline.run(batch, wait=False)
            except WriteLocked:
                pass
            else:
                for call, (ok, value) in zip(batch, outcomes, strict=True):
                    settle(call.future, ok, value)
                return
        self._to_thread(batch)

    def _to_thread(self, calls: list[Call]) -> None:
        """Hand ``calls`` to the writer thread, counting them until each is answered."""
        for call in calls:
            self._queued += 1
            call.future.add_done_callback(self._answered)
            self.write_calls.put(call)

    def _answered(self, future: asyncio.Future[Any]) -> None:
        # A cancelled future (its connection closed) counts too, though its call may still
        # wait in the thread's queue: a later write may then commit before it, which only
        # a write of another connection can be.
        self._queued -= 1
        if not self._queued and self._pending:
            future.get_loop().call_soon(self._flush)  # the writes that waited, on the loop

    def _poll_feed(self) -> None:
        """Event loop, every ``WATCH_INTERVAL_S``: look at the change feed for commits made
        by other connections (``FeedFollower.poll``)."""
        if self._follower is not None:
            with _NoRunningLoop():
                self._follower.poll()
        if self._loop is not None:
            self._watch = self._loop.call_later(WATCH_INTERVAL_S, self._poll_feed)
