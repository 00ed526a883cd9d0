"""The NDJSON-over-TCP server: socket I/O and scheduling, nothing else.

Threads and tasks:

* The event loop reads bounded lines, decodes them, and writes one reply line per request.
  It never touches the database. A write (submit, ack, fail, renew, ...) is admitted in the
  read loop and answered from its writer future's callback (``_write_inline``); reads, leases
  and the rest run as one task per request (``_serve_request``).
* One **writer thread** (SQLite: one writer per file; on PostgreSQL ``SHARED_WRITERS``, each
  with its own connection, taking calls from the same queue) runs every state-changing call
  (submit, lease claims, renew, ack, fail, release, replay, purge, the reaper's sweeps). It
  takes the first queued call, drains up to ``GROUP_COMMIT_MAX - 1`` more, and runs them all
  inside ONE ``service.transaction()`` (the storage driver's write transaction): each call
  gets its own SAVEPOINT (the service's own transactions nest too), so one call's error rolls
  back only that call. The batch then COMMITs once, one fsync for all of them (SQLite at
  ``synchronous=FULL``; PostgreSQL at its ``synchronous_commit``), and only then are the
  callers' futures resolved. If the commit fails, every call in the batch gets that error.
  With several writers, two calls in flight at once (from two connections, or pipelined on
  one) may commit in either order; with one, they commit in the order they were read.
* Commits made elsewhere (the HTTP API, a CLI, another server) come from the service's change
  feed (``queue_core.storage.base.ChangeFeed``). On PostgreSQL the feed pushes (LISTEN/NOTIFY,
  from the driver's listener thread); on SQLite the writer polls it between batches (or every
  ``WATCH_INTERVAL_S`` when idle) on its own connection, whose ``PRAGMA data_version`` changes
  only when *another* connection commits, so our own commits never trigger it.
* A small **reader pool** runs read-only calls (ping, inspect, stats, dead_list); each thread
  has its own connection and WAL lets them read while the writer writes.
* The **reaper** task runs ``expire_leases`` + ``promote_due`` on the writer every
  ``RELAY_REAPER_INTERVAL_MS``, or sooner at ``next_due_ms()`` or at a due instant a request
  reported, and after another process commits. Where the change feed pushes (PostgreSQL),
  each pass also asks which waited-on queues have READY jobs and wakes their long-polls: the
  bounded fallback poll, for a wake-up that got lost.
* The **heartbeat** task renews this server's row in the server registry (``server_id``)
  every ``RELAY_SERVER_HEARTBEAT_MS`` through the writer; the row goes at a clean stop.

Long-poll leases subscribe to per-queue ``asyncio.Event``s *before* each claim (so a commit
between the claim and the wait is not missed) and are woken when a commit in this process
makes a job READY in one of their queues, when the reaper promotes or expires jobs there, or
when another process or server commits (wake all). There is no fixed-sleep polling on the
lease path.

SIGTERM/SIGINT (``request_shutdown``): stop accepting, refuse submit/lease with
``UNAVAILABLE``, answer waiting long-polls with ``{"jobs": []}``, keep serving renew, ack,
fail, release and reads until no job is leased or ``shutdown_grace_ms`` has passed, then close
connections and stop the threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from queue_core import auth, errors, metrics
from queue_core.client import format_address
from queue_core.conf import relay_settings
from queue_core.protocol import codec, dispatch, limits
from queue_core.protocol.budget import ReplyBudget
from queue_core.service import PRUNE_BATCH, QueueService, new_server_id
from queue_core.storage import ChangeFeed

log = logging.getLogger("relay.server")

GROUP_COMMIT_MAX = 256  # calls per writer transaction
WATCH_INTERVAL_S = 0.05  # how often the writer polls a change feed that cannot push
READER_THREADS = 4
# Writer threads (each its own connection and group commit) where the database takes
# concurrent writers (PostgreSQL); SQLite has one.
SHARED_WRITERS = 4
DRAIN_CHECK_S = 0.1  # how often the shutdown grace checks for leased jobs
# Retention: a prune batch every RETENTION_EVERY reaper intervals (5 s by default). With a
# backlog, the next batch waits RETENTION_YIELD times as long as the last one took (at least
# RETENTION_BACKLOG_PAUSE_S), so pruning takes at most a third of the writer's time: 500-job
# batches back to back took 75% of it and raised the claim's p99 from 8 ms to 148 ms
# (docs/failure-model.md, "Retention").
RETENTION_EVERY = 5
RETENTION_YIELD = 2
RETENTION_BACKLOG_PAUSE_S = 0.05
CLOSE_WAIT_S = 2.0  # how long a closing connection waits for its in-flight requests
LINGER_S = 1.0  # how long input is discarded after FRAME_TOO_LARGE before closing
# A client that reads no reply for this long is cut off: its unread replies are the only
# memory a connection can pin (at most max_inflight_per_connection of them, each <= 1 frame).
SEND_TIMEOUT_S = 30.0


@dataclasses.dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    claims: bool = False  # a lease claim: its batch sweeps due jobs first


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():  # the caller went away (cancelled)
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _resolve(call: _Call, ok: bool, value: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is already closed
        call.loop.call_soon_threadsafe(_settle, call.future, ok, value)


def _settle_all(settled: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for future, ok, value in settled:
        _settle(future, ok, value)


def _resolve_all(calls: list[_Call], outcomes: list[tuple[bool, Any]]) -> None:
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
            loop.call_soon_threadsafe(_settle_all, settled)


_STOP = object()


class _Redo(Exception):
    """A flat group commit must be rolled back and run again with savepoints."""


class _DbThread(threading.Thread):
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
        while (call := self.calls.get()) is not _STOP:
            try:
                _resolve(call, True, call.fn())
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller's coroutine
                _resolve(call, False, exc)
                with contextlib.suppress(Exception):
                    self.service.heal()  # a lost connection: the next call opens a new one


class _Writer(_DbThread):
    """The one thread that writes: group commit, plus polling a change feed that cannot push.

    Args:
        calls: the queue ``_Call``s arrive on (``_STOP`` ends the thread after earlier calls).
        service: the service (its ``transaction()`` gives the transaction and savepoints).
        sweep: expires leases and promotes due jobs, returning the queues that got READY
            jobs. Run first in a batch that holds a claim: ``claim`` sweeps too, but does not
            say which queues it made ready, and their waiters must be woken.
        on_ready: called (on this thread) with the queues ``sweep`` made ready, after commit.
        on_foreign_commit: called (on this thread) when another connection committed.
        poll: whether to poll the change feed (False when it pushes by itself).
    """

    def __init__(
        self,
        calls: queue.SimpleQueue[Any],
        service: QueueService,
        *,
        sweep: Callable[[], set[str]],
        on_ready: Callable[[set[str]], None],
        on_foreign_commit: Callable[[], None],
        poll: bool,
        name: str = "relay-writer",
        failures: limits.Every | None = None,
    ) -> None:
        super().__init__(name, calls, service)
        # Where a SAVEPOINT costs round trips (several writers: PostgreSQL), a batch runs
        # without one per call first (``_commit``, ``_guarded``).
        self.flat = not service.capabilities.single_writer
        self.commits = 0  # transactions committed (each holds one or more calls)
        self.failures = failures or limits.Every(limits.FAILURE_LOG_EVERY_S)
        self.sweep = sweep
        self.on_ready = on_ready
        self.on_foreign_commit = on_foreign_commit
        self.poll = poll

    def serve(self) -> None:
        feed = self.service.changes() if self.poll else None
        version = self._position(feed, None)
        next_watch = time.monotonic() + WATCH_INTERVAL_S if feed else None
        while True:
            try:
                # Without a feed to poll, wait for the next call however long it takes.
                wait = None if next_watch is None else max(0.0, next_watch - time.monotonic())
                first = self.calls.get(timeout=wait)
            except queue.Empty:
                first = None
            if first is _STOP:
                return
            if first is not None:
                batch = [first]
                while len(batch) < GROUP_COMMIT_MAX:
                    try:
                        nxt = self.calls.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is _STOP:
                        self.calls.put(_STOP)  # finish this batch, then stop
                        break
                    batch.append(nxt)
                self._commit(batch)
            if next_watch is not None and time.monotonic() >= next_watch:
                new = self._position(feed, version)
                if version is not None and new != version:
                    self.on_foreign_commit()
                version = new
                next_watch = time.monotonic() + WATCH_INTERVAL_S

    @staticmethod
    def _position(feed: ChangeFeed | None, old: int | None) -> int | None:
        if feed is None:
            return None
        try:
            return feed.token()
        except Exception:
            log.exception("event=change_feed_failed")
            return old

    def _commit(self, batch: list[_Call]) -> None:
        """Run ``batch`` in one transaction and answer every call once it has committed.

        Where a SAVEPOINT costs round trips (``self.flat``: PostgreSQL) the batch first runs
        without one per call; if a call fails in a way that cannot be set apart
        (``_guarded``), that round is rolled back and the batch runs again with savepoints.
        Nothing is visible before the COMMIT, so running the calls again is safe."""
        if self.flat:
            try:
                self._run(batch, flat=True)
                return
            except _Redo:
                pass
        self._run(batch, flat=False)

    def _run(self, batch: list[_Call], *, flat: bool) -> None:
        outcomes: list[tuple[bool, Any]] = []
        ready: set[str] = set()
        try:
            with self.service.transaction(savepoints=not flat):
                if any(call.claims for call in batch):
                    swept, value = self._guarded(self.sweep, flat=flat)
                    if swept:
                        ready = value
                    else:
                        log.error("event=sweep_failed", exc_info=value)
                outcomes = [self._guarded(call.fn, flat=flat) for call in batch]
            self.commits += 1
        except _Redo:
            raise
        except Exception as exc:  # noqa: BLE001 - BEGIN/COMMIT failed: nothing is durable
            limits.log_failure(self.failures, "group_commit_failed", exc)
            outcomes, ready = [(False, exc)] * len(batch), set()
            with contextlib.suppress(Exception):
                self.service.heal()
        if ready:
            self.on_ready(ready)
        _resolve_all(batch, outcomes)

    def _guarded(self, fn: Callable[[], Any], *, flat: bool) -> tuple[bool, Any]:
        """Run one call of a batch; return ``(True, result)`` or ``(False, exception)``.

        With savepoints it runs in its own and rolls back alone. Flat (no SAVEPOINT, two
        round trips saved per call), a call that fails without having changed a row on an
        intact transaction (a stale token, a bad argument) is set apart and the others go on.

        Raises:
            _Redo: flat, the call failed after writing or on a statement the database
                refused: the whole round must be rolled back.
        """
        if not flat:
            try:
                with self.service.transaction():  # a SAVEPOINT: it rolls back alone
                    return True, fn()
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller
                return False, exc
        mark = self.service.mark()
        try:
            return True, fn()
        except Exception as exc:
            if not self.service.forgive(mark):
                raise _Redo from exc
            return False, exc


class _Notifier:
    """Per-queue wake-up events for waiting long-poll leases (event-loop thread only)."""

    def __init__(self) -> None:
        self._waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)

    def subscribe(self, queues: Iterable[str]) -> asyncio.Event:
        """Return an event set when any of ``queues`` may have a READY job."""
        event = asyncio.Event()
        for name in queues:
            self._waiters[name].add(event)
        return event

    def unsubscribe(self, event: asyncio.Event, queues: Iterable[str]) -> None:
        """Forget ``event``."""
        for name in queues:
            waiters = self._waiters.get(name)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[name]

    def wake(self, queues: Iterable[str]) -> None:
        """Wake every waiter of ``queues``."""
        for name in queues:
            for event in self._waiters.get(name, ()):
                event.set()

    def wake_all(self) -> None:
        """Wake every waiter."""
        self.wake(list(self._waiters))

    def queues(self) -> list[str]:
        """The queues somebody waits on."""
        return list(self._waiters)


@dataclasses.dataclass(eq=False, slots=True)
class _Conn:
    """One client connection (event-loop thread only)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    peer: str
    slots: asyncio.Semaphore  # in-flight requests left
    budget: ReplyBudget  # the server's reply-byte budget
    # Its requests in progress (tasks, or writer futures of inline writes) and reply sends.
    tasks: set[asyncio.Future[Any]] = dataclasses.field(default_factory=set)
    waiting: set[asyncio.Event] = dataclasses.field(default_factory=set)  # its long-polls
    read_task: asyncio.Task[None] | None = None
    gone: bool = False  # the client closed its side: long-polls stop waiting
    eof_sent: bool = False  # we closed our side (after FRAME_TOO_LARGE): nothing more to send
    principal: auth.Principal | None = None  # set by a successful hello
    send_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    unsent: int = 0  # reply bytes reserved or not yet taken by the kernel (ReplyBudget)
    drained_at: float = 0.0  # loop time it last held nothing or gave bytes back
    cut_off: bool = False  # cut by the reply budget
    bad_frames: int = 0  # malformed lines so far
    opened: float = dataclasses.field(default_factory=time.monotonic)
    evicted: bool = False  # closed to make room for a newcomer (never authenticated)

    async def send(self, line: bytes) -> bool:
        """Write one reply line and wait until the socket buffer drains; return whether sent.

        Replies go out one at a time, each after the previous one drained, so at most one
        frame sits in the socket buffer. A client that reads nothing for ``SEND_TIMEOUT_S`` is
        disconnected (``abort``), which frees what its replies hold.
        """
        async with self.send_lock:
            if self.writer.is_closing() or self.eof_sent:
                return False
            self.writer.write(line)
            if not self.writer.transport.get_write_buffer_size():
                # The kernel took the whole line (the usual case): nothing to wait for. A
                # failed write closes the transport, so it is reported as not sent.
                return not self.writer.is_closing()
            return await self._drained()

    async def _drained(self) -> bool:
        """Wait (holding the send turn) for the socket buffer to drain; False if the reader
        was cut off after ``SEND_TIMEOUT_S`` or the connection failed."""
        try:
            await asyncio.wait_for(self.writer.drain(), SEND_TIMEOUT_S)
        except TimeoutError:
            log.info(
                "event=slow_reader_cut peer=%s",
                self.peer,
                extra={"event": "slow_reader_cut", "peer": self.peer},
            )
            self.abort()
            return False
        except ConnectionError as exc:
            log.debug("event=send_failed peer=%s error=%r", self.peer, exc)
            self.gone = True
            return False
        return True

    def reply_soon(self, line: bytes) -> None:
        """Send an inline write's reply, and free its in-flight slot once the kernel has it.

        Written at once when no reply is queued before it (the usual case); otherwise, or for
        the part the kernel did not take, a task waits its turn and the drain as ``send``
        does, so a connection still pins at most ``max_inflight_per_connection`` replies and
        a reader silent for ``SEND_TIMEOUT_S`` is cut off.
        """
        task: asyncio.Future[Any]
        if self.send_lock.locked() or self.writer.transport.get_write_buffer_size():
            task = asyncio.ensure_future(self.send(line))
        elif self.writer.is_closing() or self.eof_sent:  # dropped, as send() drops it
            self.slots.release()
            return
        else:
            self.writer.write(line)
            if not self.writer.transport.get_write_buffer_size():
                self.slots.release()
                return
            task = asyncio.ensure_future(self._drain())
        self.budget.take(self, len(line))  # held until sent or dropped
        self.tasks.add(task)
        task.add_done_callback(self.done)
        task.add_done_callback(lambda _: self.budget.give(self, len(line)))

    async def _drain(self) -> None:
        """Wait, holding the send turn, until a line written by ``reply_soon`` has gone out."""
        async with self.send_lock:
            await self._drained()

    async def close_gracefully(self) -> None:
        """Close our side (FIN), discard what the client still sends for up to ``LINGER_S``,
        then close.

        Closing a socket with unread input makes the kernel send a reset, which also destroys
        replies the client has not read yet (a shutdown while it pipelines requests, an
        oversize frame behind its requests); a client still sending its oversize frame would
        see "connection reset" instead of the error. So the rest is read and thrown away first.
        """
        with contextlib.suppress(Exception):
            if not self.eof_sent and self.writer.can_write_eof():
                self.eof_sent = True
                self.writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await self.reader.read(65536):
                    pass
        self.writer.close()

    def abort(self) -> None:
        """Drop the connection at once, unsent replies included."""
        self.gone = True
        for event in self.waiting:
            event.set()
        self.writer.transport.abort()

    def done(self, task: asyncio.Future[Any]) -> None:
        """Forget a finished request and free its in-flight slot."""
        self.tasks.discard(task)
        self.slots.release()


async def _until_idle(conns: Iterable[_Conn], timeout_s: float | None) -> None:
    """Wait until ``conns`` have no request or reply send in progress, or ``timeout_s`` passes.

    The set is read again after each wait: an inline write's reply may start a send task
    only as its request finishes, and that reply must go out too.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while True:
        # Done ones too: a request is only over once its callbacks (the reply) have run, and
        # they take it out of the set.
        pending = {task for conn in conns for task in conn.tasks}
        remaining = None if deadline is None else deadline - loop.time()
        if not pending or (remaining is not None and remaining <= 0):
            return
        await asyncio.wait(pending, timeout=remaining)


def _reply(request: codec.Request, result: dict[str, Any]) -> bytes:
    """The ok reply line of ``request``.

    Raises:
        FrameTooLarge: the reply would not fit a frame (writes keep theirs small by
            construction and a lease is capped to a frame; a read that grew too large is
            refused: nothing changed).
    """
    line = codec.encode_ok(request.id, result)
    limit = relay_settings().max_frame_bytes
    if len(line) - 1 > limit:
        log.error("event=reply_too_large op=%s bytes=%d", request.op, len(line))
        raise errors.FrameTooLarge(
            f"the reply would be {len(line) - 1} bytes, over the {limit}-byte frame "
            "limit; narrow the request (a queue, a smaller limit)",
            limit_bytes=limit,
        )
    return line


def _error_reply(request: codec.Request, exc: BaseException) -> bytes:
    """The error reply line of ``request`` (a bug is logged and answered ``INTERNAL``)."""
    if isinstance(exc, errors.RelayError):
        metrics.rejected(request.op, exc)
        return codec.encode_error(request.id, exc)
    log.error("event=internal_error op=%s", request.op, exc_info=exc)
    return codec.encode_error(request.id, errors.Internal())


class RelayServer:
    """Serve the NDJSON protocol for one ``QueueService``.

    Args:
        service: the queue service (default ``QueueService()``).
        host: address to bind (default from ``RELAY_ADDRESS``).
        port: port to bind; 0 picks a free one (``port`` holds the bound one once ``ready``
            is set).
        shutdown_grace_ms: after a shutdown request, how long renew/ack/fail/release are still
            served while jobs are leased (default ``RELAY_SHUTDOWN_GRACE_MS``).

    ``serve()`` runs until ``request_shutdown()`` (thread-safe) or SIGTERM/SIGINT asks it to
    stop, then drains and returns. ``ready`` (a ``threading.Event``) is set once listening.
    """

    def __init__(
        self,
        service: QueueService | None = None,
        *,
        host: str | None = None,
        port: int | None = None,
        shutdown_grace_ms: int | None = None,
    ) -> None:
        s = relay_settings()
        default_host, _, default_port = s.address.rpartition(":")
        self.service = service or QueueService()
        self.host = host if host is not None else default_host.strip("[]")
        self.port = port if port is not None else int(default_port)
        self.shutdown_grace_ms = (
            s.shutdown_grace_ms if shutdown_grace_ms is None else shutdown_grace_ms
        )
        self.ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = asyncio.Event()
        self._reap_kick = asyncio.Event()
        self._reap_at = 0.0  # loop time of the next reaper pass
        self._draining = False
        self._conns: set[_Conn] = set()
        self._notifier = _Notifier()
        self._write_calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._read_calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writers: list[_Writer] = []
        self._pushed = False  # the change feed pushes (PostgreSQL): no polling by the writer
        self._max_connections = s.max_connections  # capped to the fd limit in serve()
        self._failures = limits.Every(limits.FAILURE_LOG_EVERY_S)  # rate of failure lines
        self._evictions = limits.Every(limits.FAILURE_LOG_EVERY_S)
        self._budget = ReplyBudget(
            s.max_unsent_bytes_per_connection, s.max_unsent_bytes, self._conns, time.monotonic
        )
        self.server_id = new_server_id()  # its row in the server registry

    @property
    def commits(self) -> int:
        """Write transactions committed so far (group commit: usually fewer than requests)."""
        return sum(writer.commits for writer in self._writers)

    # ------------------------------------------------------------------ lifecycle

    def request_shutdown(self) -> None:
        """Begin the graceful shutdown (safe from any thread and from signal handlers)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)

    async def serve(self, *, handle_signals: bool = False) -> None:
        """Listen, serve until asked to stop, drain, and return.

        Args:
            handle_signals: make SIGTERM and SIGINT call ``request_shutdown`` (main thread
                only).
        Raises:
            OSError: the address cannot be bound.
        """
        self._loop = asyncio.get_running_loop()
        foreign = functools.partial(self._from_thread, self._foreign_commit)
        pushed = self.service.capabilities.push_changes and self.service.changes().subscribe(
            foreign
        )
        self._pushed = pushed
        count = 1 if self.service.capabilities.single_writer else SHARED_WRITERS
        self._writers = [
            _Writer(
                self._write_calls,
                self.service,
                name="relay-writer" if count == 1 else f"relay-writer-{n}",
                sweep=self._sweep,
                on_ready=lambda queues: self._from_thread(self._notifier.wake, queues),
                on_foreign_commit=foreign,
                poll=not pushed and n == 0,
                failures=self._failures,
            )
            for n in range(count)
        ]
        threads: list[_DbThread] = [
            *self._writers,
            *(
                _DbThread(f"relay-reader-{n}", self._read_calls, self.service)
                for n in range(READER_THREADS)
            ),
        ]
        for thread in threads:
            thread.start()
        self._max_connections = limits.connection_cap(relay_settings().max_connections)
        self._loop.set_exception_handler(limits.QuietAcceptErrors())
        try:
            limit = relay_settings().max_frame_bytes + 2
            server = await asyncio.start_server(self._on_connect, self.host, self.port, limit=limit)
        except BaseException:
            await asyncio.to_thread(self._stop_threads, threads)
            raise
        self.port = server.sockets[0].getsockname()[1]
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self.request_shutdown)
        reaper = asyncio.create_task(self._reaper(), name="relay-reaper")
        retention = asyncio.create_task(self._retention(), name="relay-retention")
        await self._heartbeat_once()  # in the registry before the ready line
        heart = asyncio.create_task(self._heartbeat(), name="relay-heartbeat")
        log.info(
            "event=ready host=%s port=%s server_id=%s",
            self.host,
            self.port,
            self.server_id,
            extra={
                "event": "ready",
                "host": self.host,
                "port": self.port,
                "server_id": self.server_id,
            },
        )
        self.ready.set()
        try:
            await self._stop.wait()
            self._draining = True
            server.close()  # stop accepting; open connections stay
            log.info(
                "event=draining grace_ms=%s",
                self.shutdown_grace_ms,
                extra={"event": "draining", "grace_ms": self.shutdown_grace_ms},
            )
            self._notifier.wake_all()  # waiting long-polls answer {"jobs": []}
            await self._grace()
            await self._close_connections(server)
            await server.wait_closed()
        finally:
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self._loop.remove_signal_handler(sig)
            for task in (reaper, heart, retention):
                task.cancel()
            await asyncio.gather(reaper, heart, retention, return_exceptions=True)
            with contextlib.suppress(Exception):  # else it ages out of the registry
                await self._write(functools.partial(self.service.deregister_server, self.server_id))
            await asyncio.to_thread(self._stop_threads, threads)
            log.info("event=stopped", extra={"event": "stopped"})

    def _stop_threads(self, threads: list[_DbThread]) -> None:
        for _ in self._writers:
            self._write_calls.put(_STOP)
        for _ in range(READER_THREADS):
            self._read_calls.put(_STOP)
        for thread in threads:
            thread.join()
        for calls in (self._write_calls, self._read_calls):  # normally empty by now
            while not calls.empty():
                call = calls.get()
                if call is not _STOP:
                    _resolve(call, False, errors.Unavailable())

    async def _grace(self) -> None:
        """Serve renew/ack/fail/release until no job is leased, at most the grace period."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_grace_ms / 1000
        while loop.time() < deadline:
            try:
                stats = await self._read(self.service.stats)
                if stats["totals"].get("leased", 0) == 0:
                    return
            except Exception:
                log.exception("event=drain_stats_failed")
            await asyncio.sleep(min(DRAIN_CHECK_S, max(0.0, deadline - loop.time())))

    async def _close_connections(self, server: asyncio.Server) -> None:
        conns = list(self._conns)
        for conn in conns:
            if conn.read_task is not None:
                conn.read_task.cancel()
        await _until_idle(conns, CLOSE_WAIT_S)
        # Connections close gracefully (``close_gracefully``, at most LINGER_S). Then abort
        # what is left (a client that reads nothing must not hold the shutdown), until every
        # transport is gone: one accepted just before close() may only now reach
        # _on_connect. (Server._active_count counts them; wait_closed() can miss a late one.)
        loop = asyncio.get_running_loop()
        abort_at = loop.time() + LINGER_S + 0.1
        deadline = abort_at + CLOSE_WAIT_S
        while loop.time() < deadline:
            if loop.time() >= abort_at:
                for conn in list(self._conns):
                    conn.abort()
            if not self._conns and not getattr(server, "_active_count", 0):
                break
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ DB calls

    async def _call(
        self, calls: queue.SimpleQueue[Any], fn: Callable[[], Any], *, claims: bool = False
    ) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        calls.put(_Call(fn, future, loop, claims))
        return await future

    async def _write(self, fn: Callable[[], Any], *, claims: bool = False) -> Any:
        """Run ``fn`` on the writer thread, in the next group commit; return after COMMIT."""
        return await self._call(self._write_calls, fn, claims=claims)

    async def _read(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the reader pool."""
        return await self._call(self._read_calls, fn)

    # ------------------------------------------------------------------ wake-ups

    def _from_thread(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(fn, *args)

    def _foreign_commit(self, queue: str | None = None) -> None:
        """Another process committed. With ``queue`` (a server on the same PostgreSQL
        database made jobs READY there): wake that queue's waiters. Without: wake every
        waiter, and let the reaper look now (it may have scheduled a delayed job)."""
        if queue is not None:
            self._notifier.wake([queue])
            return
        self._notifier.wake_all()
        self._schedule_reap(0.0)

    def _schedule_reap(self, delay_s: float) -> None:
        assert self._loop is not None
        at = self._loop.time() + max(0.0, delay_s)
        if at < self._reap_at:
            self._reap_at = at
            self._reap_kick.set()

    def _schedule_due(self, due_at_ms: int) -> None:
        # +1 ms: wake at or just after the instant, never a hair before it.
        self._schedule_reap((due_at_ms - self.service.clock.now_ms() + 1) / 1000)

    def _apply(self, outcome: dispatch.Outcome) -> None:
        self._notifier.wake(outcome.ready_queues)
        if outcome.due_at_ms is not None:
            self._schedule_due(outcome.due_at_ms)

    def _sweep(self) -> set[str]:
        """Writer thread: expire leases, promote due jobs; return the queues made ready."""
        return set(self.service.sweep())

    def _reap_once(self) -> tuple[set[str], int | None]:
        return self._sweep(), self.service.next_due_ms()

    async def _heartbeat_once(self) -> None:
        """Renew this server's row in the registry; log a clock off by more than
        ``RELAY_MAX_CLOCK_SKEW_MS`` (or a failure: the next beat tries again)."""
        register = functools.partial(
            self.service.register_server,
            self.server_id,
            address=format_address(self.host, self.port),
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        try:
            skew = await self._write(register)
        except Exception as exc:  # noqa: BLE001 - the next beat tries again
            limits.log_failure(self._failures, "heartbeat_failed", exc)
            return
        limit = relay_settings().max_clock_skew_ms
        if abs(skew) > limit:
            log.error(
                "event=clock_skew skew_ms=%s limit_ms=%s",
                skew,
                limit,
                extra={"event": "clock_skew", "skew_ms": skew, "limit_ms": limit},
            )

    async def _heartbeat(self) -> None:
        """Renew the registry row every ``RELAY_SERVER_HEARTBEAT_MS`` until cancelled."""
        interval_s = relay_settings().server_heartbeat_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            await self._heartbeat_once()

    async def _reaper(self) -> None:
        """Sweep every ``RELAY_REAPER_INTERVAL_MS``, and at the next due instant if sooner."""
        loop = asyncio.get_running_loop()
        interval_s = relay_settings().reaper_interval_ms / 1000
        while True:
            delay = self._reap_at - loop.time()
            if delay > 0:
                self._reap_kick.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._reap_kick.wait(), delay)
                continue  # re-read _reap_at: a kick may have moved it earlier
            self._reap_at = loop.time() + interval_s
            try:
                queues, due_ms = await self._write(self._reap_once)
            except Exception as exc:  # noqa: BLE001 - the next pass tries again
                limits.log_failure(self._failures, "reaper_failed", exc)
                continue
            if queues:
                log.debug("event=reaped queues=%s", ",".join(sorted(queues)))
                self._notifier.wake(queues)
            if self._pushed and (waited := self._notifier.queues()):
                # The bounded fallback poll (as River's FetchPollInterval): a wake-up pushed
                # by another server could be lost (its listener reconnecting, a connection
                # gone quiet), so each pass asks which waited-on queues have READY jobs (a
                # seek per queue) and wakes their long-polls: one read, not a claim per waiter.
                try:
                    ready = await self._read(functools.partial(self.service.ready_queues, waited))
                except Exception:
                    log.exception("event=fallback_poll_failed")
                    ready = waited
                self._notifier.wake(ready)
            # A due instant still in the past means a sweep hit its row limit: go again now.
            if due_ms is not None and (queues or due_ms > self.service.clock.now_ms()):
                self._schedule_due(due_ms)

    async def _retention(self) -> None:
        """Delete finished jobs past ``RELAY_RETENTION_SUCCEEDED`` / ``RELAY_RETENTION_DEAD``,
        one bounded ``prune_batch`` on the writer at a time (the write lock is held for one
        batch only), every ``RETENTION_EVERY`` reaper intervals; with a backlog, batch after
        batch with a pause of ``RETENTION_YIELD`` times the last batch's time between them.
        Nothing when both are 0."""
        s = relay_settings()
        if not any(s.retention_ms().values()):
            return
        interval_s = RETENTION_EVERY * s.reaper_interval_ms / 1000
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                deleted = await self._write(self.service.prune_batch)
            except Exception as exc:  # noqa: BLE001 - the next pass tries again
                limits.log_failure(self._failures, "retention_failed", exc)
                deleted = {}
            took = loop.time() - started
            if sum(deleted.values()) >= PRUNE_BATCH:  # a backlog: go on, but leave room
                await asyncio.sleep(max(RETENTION_BACKLOG_PAUSE_S, RETENTION_YIELD * took))
            else:
                await asyncio.sleep(interval_s)

    # ------------------------------------------------------------------ connections

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        s = relay_settings()
        peername = writer.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
        conn = _Conn(
            reader, writer, peer, asyncio.Semaphore(s.max_inflight_per_connection), self._budget
        )
        full = len(self._conns) >= self._max_connections
        if full and not self._draining:
            with contextlib.suppress(errors.RelayError):  # no key table now: refuse
                if self._evict_unauthenticated(await self._key_ring()):
                    full = False  # the newcomer takes the slot of one that never said hello
        over_limit = full or self._over_address_cap(peername)
        self._conns.add(conn)  # tracked from the start, so a shutdown can always close it
        try:
            if self._draining or over_limit:
                refusal: errors.RelayError = (
                    errors.Unavailable() if self._draining else errors.TooManyConnections()
                )
                log.debug("event=connection_refused peer=%s code=%s", peer, refusal.code)
                await conn.send(codec.encode_error(None, refusal))
                return
            log.debug("event=connected peer=%s", peer)
            conn.read_task = asyncio.create_task(self._read_loop(conn))
            await asyncio.wait([conn.read_task])
            # Let pipelined requests answer before closing.
            await _until_idle([conn], CLOSE_WAIT_S if self._draining else None)
        except Exception:
            log.exception("event=connection_failed peer=%s", peer)
        finally:
            for task in conn.tasks:
                task.cancel()
            if writer.transport.get_write_buffer_size():
                # A reply's tail may still be buffered (drain() returns at the low-water mark,
                # not at empty), and a client that half-closed is still reading it: give it
                # until the buffer empties, as long as a slow reader gets. What is left then
                # has no reader: drop it.
                await self._flush(conn, CLOSE_WAIT_S if self._draining else SEND_TIMEOUT_S)
            if writer.transport.get_write_buffer_size():
                conn.abort()
            elif conn.read_task is not None:
                await conn.close_gracefully()
            else:
                writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self._conns.discard(conn)  # only now: until closed, a shutdown must see it
            log.debug("event=disconnected peer=%s", peer)

    @staticmethod
    async def _flush(conn: _Conn, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the connection's write buffer to empty."""
        transport = conn.writer.transport
        if transport.is_closing():
            return
        transport.set_write_buffer_limits(high=0)  # drain() now waits for an empty buffer
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(conn.writer.drain(), timeout_s)

    def _evict_unauthenticated(self, ring: auth.KeyRing) -> bool:
        """With API keys on and every slot taken, close the oldest connection that has not
        completed a ``hello`` (it gets ``TOO_MANY_CONNECTIONS``); return whether one was.

        Such a connection can only ping, so holding slots without a key buys nothing: a
        client with a key always gets in, however many keyless connections wait for their
        hello deadline. Authenticated connections are never closed for a newcomer.
        """
        if not ring.required:
            return False
        waiting = [
            c
            for c in self._conns
            if c.read_task is not None
            and not c.gone
            and not c.evicted
            and (c.principal is None or not c.principal.authenticated)
        ]
        if not waiting:
            return False
        victim = min(waiting, key=lambda c: c.opened)
        victim.evicted = victim.gone = True
        held = self._evictions.due("evicted")
        if held is not None:  # one line per 10 s under a flood
            log.info(
                "event=connection_evicted peer=%s held_back=%d",
                victim.peer,
                held,
                extra={"event": "connection_evicted", "peer": victim.peer, "held_back": held},
            )
        refusal = errors.TooManyConnections(
            "the server is at its connection limit and this connection has not authenticated"
        )
        with contextlib.suppress(Exception):
            if not victim.writer.is_closing():
                victim.writer.write(codec.encode_error(None, refusal))
            victim.writer.transport.close()  # at once (after that line), no lingering
        for event in victim.waiting:
            event.set()
        assert victim.read_task is not None
        victim.read_task.cancel()  # its _on_connect then lets it go
        return True

    def _over_address_cap(self, peername: object) -> bool:
        """Whether the peer's address already holds ``RELAY_MAX_CONNECTIONS_PER_ADDRESS``
        connections (0: no cap)."""
        cap = relay_settings().max_connections_per_address
        if not cap or not isinstance(peername, tuple):
            return False
        host = peername[0]
        held = sum(
            1
            for c in self._conns
            if (p := c.writer.get_extra_info("peername")) and isinstance(p, tuple) and p[0] == host
        )
        return held >= cap  # this connection is not in the set yet

    async def _read_loop(self, conn: _Conn) -> None:
        """Read frames until EOF, a timeout or an abuse; serve each one.

        The connection ends (after an error line) when: its first byte cannot begin a JSON
        request (an HTTP request line, a TLS hello: nothing after it runs) or its first line
        is not a request; it sent ``RELAY_MAX_BAD_FRAMES`` malformed lines; no valid request
        came for ``RELAY_IDLE_TIMEOUT_MS`` while none was in progress (malformed lines do
        not count as activity); with API keys on, no successful ``hello`` came within
        ``RELAY_AUTH_TIMEOUT_MS``; or a frame was too large. While it holds more reply bytes
        than its budget (``ReplyBudget``), its next frame is not read.
        """
        s = relay_settings()
        loop = asyncio.get_running_loop()
        idle_s = s.idle_timeout_ms / 1000
        active_at = loop.time()  # the last valid request, or the connect
        try:
            required = (await self._key_ring()).required
        except errors.RelayError:  # the table cannot be read now: requests will say so
            required = False
        auth_by = loop.time() + s.auth_timeout_ms / 1000 if required else None
        head = await self._first_byte(conn, idle_s if auth_by is None else auth_by - loop.time())
        if head is None:
            return
        while True:
            if self._budget.over(conn):
                await self._budget.room(conn)
            authed = auth_by is None or (
                conn.principal is not None and conn.principal.authenticated
            )
            wait_s = active_at + idle_s - loop.time()
            if not authed:
                assert auth_by is not None
                wait_s = min(wait_s, auth_by - loop.time())
            try:
                async with asyncio.timeout(max(wait_s, 0.0)):
                    line = head + await conn.reader.readuntil(b"\n")
            except TimeoutError:
                authed = auth_by is None or (
                    conn.principal is not None and conn.principal.authenticated
                )
                if not authed and loop.time() >= auth_by:  # type: ignore[operator]
                    log.debug("event=auth_timeout peer=%s", conn.peer)
                    refusal: errors.RelayError = errors.Unauthenticated(
                        f"no successful hello within {s.auth_timeout_ms} ms"
                    )
                    await conn.send(codec.encode_error(None, refusal))
                    return
                if loop.time() < active_at + idle_s:  # woken for the hello deadline only
                    continue
                if conn.tasks:  # a request in progress (a long-poll) is not idleness
                    active_at = loop.time()
                    continue
                log.debug("event=idle_timeout peer=%s", conn.peer)
                await conn.send(codec.encode_error(None, errors.Timeout()))
                return
            except asyncio.LimitOverrunError:
                # The reader holds at most the limit: reply and close without reading on.
                limit = s.max_frame_bytes
                exc = errors.FrameTooLarge(
                    f"frame is over the {limit}-byte limit", limit_bytes=limit
                )
                await self._refuse_frame(conn, exc)
                return
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                log.debug("event=eof peer=%s error=%r", conn.peer, exc)
                conn.gone = True
                for event in conn.waiting:
                    event.set()
                return
            first, head = bool(head), b""
            try:
                request = codec.decode_request(line, s.max_frame_bytes)
            except errors.FrameTooLarge as exc:
                await self._refuse_frame(conn, exc)
                return
            except errors.BadFrame as exc:
                conn.bad_frames += 1
                log.debug("event=bad_frame peer=%s error=%s", conn.peer, exc.message)
                if first or conn.bad_frames >= s.max_bad_frames:
                    why = "the first line" if first else f"{conn.bad_frames} malformed lines"
                    exc = errors.BadFrame(f"{exc.message}; closing after {why}")
                    await conn.send(codec.encode_error(codec.request_id_of(line), exc))
                    return
                await conn.send(codec.encode_error(codec.request_id_of(line), exc))
                continue
            active_at = loop.time()
            await conn.slots.acquire()  # at most max_inflight per connection: else stop reading
            inline = self._write_inline(conn, request)
            if inline is not None:  # its reply frees the slot once the kernel has it
                conn.tasks.add(inline)
                inline.add_done_callback(conn.tasks.discard)
                continue
            task = asyncio.create_task(self._serve_request(conn, request))
            conn.tasks.add(task)
            task.add_done_callback(conn.done)
            if request.op == "hello":
                # What follows a hello, even in the same write, runs as the hello leaves the
                # connection: read on only once it is decided.
                await asyncio.wait([task])

    @staticmethod
    async def _first_byte(conn: _Conn, timeout_s: float) -> bytes | None:
        """Read the connection's first byte; None (after an error line, or at EOF) when it
        cannot begin a JSON request: an HTTP request line or a TLS hello ends here, before
        anything runs (a browser's cross-origin POST must not reach the NDJSON body)."""
        try:
            async with asyncio.timeout(timeout_s):
                head = await conn.reader.readexactly(1)
        except TimeoutError:
            await conn.send(codec.encode_error(None, errors.Timeout()))
            return None
        except (asyncio.IncompleteReadError, ConnectionError):
            conn.gone = True
            return None
        if head not in b"{ \t\r":
            log.debug("event=not_ndjson peer=%s first_byte=%r", conn.peer, head)
            refusal = errors.BadFrame("not an NDJSON request: a line must be a JSON object")
            await conn.send(codec.encode_error(None, refusal))
            return None
        return head

    async def _refuse_frame(self, conn: _Conn, exc: errors.FrameTooLarge) -> None:
        """Reply FRAME_TOO_LARGE and answer the requests before it; the connection then
        closes gracefully (``_Conn.close_gracefully``: the rest of the frame is thrown away,
        never buffered)."""
        log.debug("event=frame_too_large peer=%s", conn.peer)
        # The connection ends here: its long-polls stop waiting (a claim that lands now is
        # given back), and the requests it sent before the oversize frame are answered first.
        conn.gone = True
        for event in conn.waiting:
            event.set()
        await conn.send(codec.encode_error(None, exc))
        await _until_idle([conn], CLOSE_WAIT_S)

    async def _serve_request(self, conn: _Conn, request: codec.Request) -> None:
        """Run one request (not an inline write) and send its reply.

        A read reserves a frame of the reply budget before it runs, a lease each time it
        claims (``_lease``); the hold shrinks to the reply's size once it is made, and ends
        when the kernel has it.
        """
        result: dict[str, Any] | None = None
        verb = dispatch.VERBS.get(request.op)
        frame = relay_settings().max_frame_bytes
        held = 0
        try:
            try:
                if verb is not None and verb.kind is dispatch.Kind.READ:
                    await self._budget.reserve(conn, frame)
                    held = frame
                result = await self._execute(conn, request)
                if verb is not None and verb.kind is dispatch.Kind.LEASE and result["jobs"]:
                    held = frame  # _lease kept its claim's hold
                line = _reply(request, result)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an error reply
                line = _error_reply(request, exc)
            self._budget.give(conn, held - len(line))
            held = len(line)
            sent = await conn.send(line)
        finally:
            self._budget.give(conn, held)
        if not sent and request.op == "lease" and result and result.get("jobs"):
            # Never leave jobs leased to a socket that is gone: give them back at once.
            await self._release_unsent(result["jobs"], request.args.get("worker_id") or conn.peer)

    async def _release_unsent(self, leases: list[dict[str, Any]], worker_id: str) -> None:
        for lease in leases:
            release = functools.partial(
                self.service.release,
                lease["job_id"],
                worker_id=worker_id,
                lease_token=lease["lease_token"],
            )
            try:
                await self._write(release)
            except errors.RelayError as exc:
                log.info("event=release_unsent_failed job_id=%s code=%s", lease["job_id"], exc.code)
            else:
                self._notifier.wake([lease["queue"]])

    async def _execute(self, conn: _Conn, request: codec.Request) -> dict[str, Any]:
        verb = dispatch.lookup(request.op)
        if verb.op == "hello":
            return await self._hello(conn, dispatch.validate(verb, request.args))
        ring = None if verb.op in auth.OPEN_OPS else await self._key_ring()
        args, ctx = self._admit(conn, verb, request.args, ring)
        if verb.kind is dispatch.Kind.READ:
            outcome: dispatch.Outcome = await self._read(
                lambda: verb.handler(self.service, args, ctx)
            )
        elif verb.kind is dispatch.Kind.LEASE:
            outcome = await self._lease(conn, verb, args, ctx)
        else:
            outcome = await self._write(lambda: verb.handler(self.service, args, ctx))
            self._apply(outcome)
        metrics.record(outcome.events)  # committed by now
        return outcome.result

    def _admit(
        self,
        conn: _Conn,
        verb: dispatch.Verb,
        raw_args: dict[str, Any],
        ring: auth.KeyRing | None,
    ) -> tuple[dict[str, Any], dispatch.Context]:
        """Check that the connection may run ``verb`` and its arguments; return them cleaned,
        with the request's context. ``ring`` is the key table (None for ping and hello).

        Raises:
            Unauthenticated, PermissionDenied, InvalidArgument, Unavailable (draining).
        """
        if ring is None:
            principal = conn.principal or auth.ANONYMOUS
        else:
            principal = auth.check_session(conn.principal, ring, surface="tcp", peer=conn.peer)
            auth.authorize(principal, verb.op, surface="tcp", peer=conn.peer)
        args = dispatch.validate(verb, raw_args)
        if self._draining and verb.op in dispatch.REFUSED_WHILE_DRAINING:
            raise errors.Unavailable()
        actor = f"tcp:{conn.peer}"
        if principal.authenticated:
            actor = f"{actor} {principal.actor}"[:150]
        return args, dispatch.Context(peer=conn.peer, actor=actor)

    def _write_inline(self, conn: _Conn, request: codec.Request) -> asyncio.Future[Any] | None:
        """Hand a write (submit, ack, fail, renew, ...) to the writer without a task.

        Returns the writer call's future, whose done-callback sends the reply (a refusal is
        answered the same way); or None when the request takes the general path
        (``_serve_request``): not a write, or a key table to re-read first. Both paths answer
        the same; this one spares each write a task and its chain of coroutines (16 single-job
        producers: 123-138 -> 109-120 us of server CPU per job, docs/benchmarking.md).
        """
        verb = dispatch.VERBS.get(request.op)
        if verb is None or verb.kind is not dispatch.Kind.WRITE:
            return None
        ring = auth.cached_ring()
        if ring is None:
            return None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        try:
            args, ctx = self._admit(conn, verb, request.args, ring)
        except errors.RelayError as exc:  # refused here (counted and logged once), answered below
            future.set_exception(exc)
        else:
            call = functools.partial(verb.handler, self.service, args, ctx)
            self._write_calls.put(_Call(call, future, loop))
        future.add_done_callback(functools.partial(self._reply_inline, conn, request))
        return future

    def _reply_inline(
        self, conn: _Conn, request: codec.Request, future: asyncio.Future[Any]
    ) -> None:
        """Answer a ``_write_inline`` call once its commit is durable (event-loop thread)."""
        if future.cancelled():  # the connection is closing
            conn.slots.release()
            return
        try:
            exc = future.exception()
            if exc is None:
                outcome: dispatch.Outcome = future.result()
                self._apply(outcome)
                metrics.record(outcome.events)  # committed by now
                line = _reply(request, outcome.result)
            else:
                line = _error_reply(request, exc)
        except Exception as failure:  # noqa: BLE001 - still answer, and free the slot
            line = _error_reply(request, failure)
        conn.reply_soon(line)

    async def _key_ring(self) -> auth.KeyRing:
        """The key table snapshot; a stale one is re-read in the reader pool, never here.

        Raises:
            Unavailable, StoreBusy: the table could not be read (mapped by the driver, as any
                read: a terminated PostgreSQL connection is not an ``INTERNAL``).
        """
        ring = auth.cached_ring()
        if ring is None:
            ring = await self._read(self._load_ring)
        return ring

    def _load_ring(self) -> auth.KeyRing:
        """Reader thread: read the key table through the driver's read (its error mapping,
        and on PostgreSQL a fresh connection after one was terminated)."""
        with self.service.driver.read():
            return auth.load_ring()

    async def _hello(self, conn: _Conn, args: dict[str, Any]) -> dict[str, Any]:
        """Check an API key and tie it to this connection (a refused key unties the old one)."""
        ring = await self._key_ring()
        conn.principal = None
        principal: auth.Principal = await self._read(
            lambda: auth.authenticate(args["api_key"], surface="tcp", peer=conn.peer, ring=ring)
        )
        conn.principal = principal
        log.debug("event=hello peer=%s prefix=%s", conn.peer, principal.prefix)
        return {**principal.describe(), "server_time_ms": self.service.clock.now_ms()}

    async def _lease(
        self, conn: _Conn, verb: dispatch.Verb, args: dict[str, Any], ctx: dispatch.Context
    ) -> dispatch.Outcome:
        """Claim; when nothing is ready, wait for a wake-up or ``wait_ms``, and claim again.

        Each claim first reserves a frame of the connection's reply budget; an outcome with
        jobs returns still holding it (``_serve_request`` ends the hold).
        """
        loop = asyncio.get_running_loop()
        frame = relay_settings().max_frame_bytes
        deadline = loop.time() + args.get("wait_ms", 0) / 1000
        queues: list[str] = args["queues"]
        while True:
            # Subscribe before claiming, so a commit between the claim and the wait wakes us.
            if conn.gone:  # never lease to a closed socket
                return dispatch.Outcome({"jobs": []})
            event = self._notifier.subscribe(queues)
            conn.waiting.add(event)
            try:
                await self._budget.reserve(conn, frame)
                started = loop.time()
                try:
                    outcome: dispatch.Outcome = await self._write(
                        lambda: verb.handler(self.service, args, ctx), claims=True
                    )
                except BaseException:
                    self._budget.give(conn, frame)
                    raise
                if not outcome.result["jobs"]:
                    self._budget.give(conn, frame)
                metrics.CLAIM_SECONDS.observe(loop.time() - started)
                if conn.gone and outcome.result["jobs"]:
                    # The client closed (EOF) while the claim ran: a normal close still lets
                    # the reply into the kernel, so give the jobs back rather than lease them
                    # to a socket nobody reads.
                    self._budget.give(conn, frame)
                    worker_id = args.get("worker_id") or conn.peer
                    await self._release_unsent(outcome.result["jobs"], worker_id)
                    return dispatch.Outcome({"jobs": []})
                remaining = deadline - loop.time()
                if outcome.result["jobs"] or remaining <= 0 or self._draining or conn.gone:
                    return outcome
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
                if self._draining or conn.gone:
                    return dispatch.Outcome({"jobs": []})
            finally:
                conn.waiting.discard(event)
                self._notifier.unsubscribe(event, queues)
