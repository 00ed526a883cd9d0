"""The NDJSON-over-TCP server: the process that wires the parts together.

A ``RelayServer`` is, in the order a request meets them:

* ``listener.Listener``: accepts connections and reads their frames on the event loop
  (``connection.Conn``: one connection, its reply sending and back-pressure);
* ``requests.Requests``: admits each request and runs it: a write goes straight to the
  writer's next group commit and is answered from its future's callback (the one write
  path, ``Requests.start_write``); reads, hello and leases run as a task each;
* ``writer.Database``: group commit (on the loop on SQLite, writer threads on PostgreSQL) and the
  reader pool;
* ``wakeups.Wakeups``: the waiting long-poll leases by queue, woken by this server's commits
  and, through ``wakeups.FeedFollower``, by commits made elsewhere (the HTTP API uses the
  same two classes, ``wakeups.ProcessWakeups``).

This module is the process around them: start, the signals, the background tasks and the
drain. The tasks:

* The **reaper** runs ``expire_leases`` + ``promote_due`` on the writer every
  ``RELAY_REAPER_INTERVAL_MS``, or sooner at ``next_due_ms()`` or at a due instant a request
  reported, and after another process commits. Where the change feed pushes (PostgreSQL),
  each pass also asks which waited-on queues have READY jobs and wakes their long-polls: the
  bounded fallback poll, for a wake-up that got lost.
* The **heartbeat** renews this server's row in the server registry (``server_id``) every
  ``RELAY_SERVER_HEARTBEAT_MS`` through the writer; the row goes at a clean stop.
* **Retention** prunes finished jobs past their retention, one bounded batch at a time.

SIGTERM/SIGINT (``request_shutdown``): stop accepting, refuse submit/lease with
``UNAVAILABLE``, answer waiting long-polls with ``{"jobs": []}``, keep serving renew, ack,
fail, release and reads until no job is leased or ``shutdown_grace_ms`` has passed, then close
connections and stop the threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import threading
import time

from queue_core import metrics
from queue_core.client import format_address
from queue_core.clock import AnchoredClock
from queue_core.conf import relay_settings
from queue_core.protocol import limits
from queue_core.protocol.budget import ReplyBudget
from queue_core.protocol.connection import Conn
from queue_core.protocol.listener import Listener
from queue_core.protocol.loops import loop_name
from queue_core.protocol.reading import ADMIT_SHARE, InputBudget
from queue_core.protocol.requests import Requests
from queue_core.protocol.wakeups import FeedFollower, Wakeups
from queue_core.protocol.writer import Database
from queue_core.service import PRUNE_BATCH, QueueService, new_server_id

log = logging.getLogger("relay.server")

DRAIN_CHECK_S = 0.1  # how often the shutdown grace checks for leased jobs
# How long a shutdown waits, its connections closed, for the jobs of their undelivered
# replies to be written back READY (``Server._given_back``; 10,000 took 0.33-0.39 s on SQLite,
# one batch at a time: relay_bench.giveback).
GIVE_BACK_WAIT_S = 10.0
# Retention: a prune batch every RETENTION_EVERY reaper intervals (5 s by default). With a
# backlog, the next batch waits RETENTION_YIELD times as long as the last one took (at least
# RETENTION_BACKLOG_PAUSE_S), so pruning takes at most a third of the writer's time: 500-job
# batches back to back took 75% of it and raised the claim's p99 from 8 ms to 148 ms
# (docs/failure-model.md, "Retention").
RETENTION_EVERY = 5
RETENTION_YIELD = 2
RETENTION_BACKLOG_PAUSE_S = 0.05


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
        self.server_id = new_server_id()  # its row in the server registry
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = asyncio.Event()
        self._reap_kick = asyncio.Event()
        self._reap_at = 0.0  # loop time of the next reaper pass
        self._failures = limits.Every(limits.FAILURE_LOG_EVERY_S)  # rate of failure lines
        # This machine's clock's offset from the database's when last reported (AnchoredClock).
        self._host_off_told: int | None = None
        self._conns: set[Conn] = set()
        self._wakeups = Wakeups()
        self._follower = FeedFollower(self.service, self._foreign_commit)
        self._looking: asyncio.Task[None] | None = None  # _look, while it runs
        self._look_again = False  # a commit elsewhere came since _look last read
        self._db = Database(self.service, self._failures)
        budget = ReplyBudget(
            s.max_unsent_bytes_per_connection, s.max_unsent_bytes, self._conns, time.monotonic
        )
        self._requests = Requests(
            self.service, self._db, self._wakeups, budget, self._schedule_due, self._conns
        )
        # Its connection cap is set again in serve(), capped to the fd limit.
        self._listener = Listener(
            self._requests,
            budget,
            self._conns,
            s.max_connections,
            InputBudget(
                s.max_buffered_request_bytes,
                time.monotonic,
                s.max_buffered_request_bytes // ADMIT_SHARE,
            ),
        )

    @property
    def commits(self) -> int:
        """Write transactions committed so far (group commit: usually fewer than requests)."""
        return self._db.commits

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
        pushed = self._follower.push()
        self._db.start(
            sweep=self._sweep,
            on_ready=self._wakeups.wake,
            follower=None if pushed else self._follower,
        )
        self._listener.max_connections = limits.connection_cap(relay_settings().max_connections)
        self._loop.set_exception_handler(limits.QuietAcceptErrors())
        try:
            server = await self._loop.create_server(self._listener.protocol, self.host, self.port)
        except BaseException:
            self._db.close()
            await asyncio.to_thread(self._db.stop)
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
            "event=ready host=%s port=%s server_id=%s loop=%s",
            self.host,
            self.port,
            self.server_id,
            loop_name(self._loop),
            extra={
                "event": "ready",
                "host": self.host,
                "port": self.port,
                "server_id": self.server_id,
                "loop": loop_name(self._loop),
            },
        )
        budget = self._requests.budget

        def gauges() -> tuple[int, int]:
            return len(self._conns), budget.held

        metrics.watch_tcp_server(gauges)
        self.ready.set()
        try:
            await self._stop.wait()
            self._requests.draining = True
            server.close()  # stop accepting; open connections stay
            log.info(
                "event=draining grace_ms=%s",
                self.shutdown_grace_ms,
                extra={"event": "draining", "grace_ms": self.shutdown_grace_ms},
            )
            self._wakeups.wake_all()  # waiting long-polls answer {"jobs": []}
            await self._grace()
            await self._listener.close_all()
            await server.wait_closed()
            await self._given_back()
        finally:
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self._loop.remove_signal_handler(sig)
            for task in (reaper, heart, retention):
                task.cancel()
            await asyncio.gather(reaper, heart, retention, return_exceptions=True)
            with contextlib.suppress(Exception):  # else it ages out of the registry
                await self._db.write(
                    functools.partial(self.service.deregister_server, self.server_id)
                )
            self._db.close()
            await asyncio.to_thread(self._db.stop)
            if metrics.TCP_SERVER.read is gauges:  # not a server started after this one
                metrics.watch_tcp_server(None)
            log.info("event=stopped", extra={"event": "stopped"})

    async def _given_back(self) -> None:
        """Once every connection is closed, wait (at most ``GIVE_BACK_WAIT_S``) for the jobs
        of replies they never delivered to be written back READY (``Requests.given_back``);
        then drop what is left (those jobs wait for restart recovery or their leases'
        expiry) and close the database, which finishes the writes in flight."""
        try:
            await asyncio.wait_for(self._requests.given_back(), GIVE_BACK_WAIT_S)
        except TimeoutError:
            dropped = self._requests.drop_give_backs()
            log.warning(
                "event=give_back_unfinished waited_s=%s dropped_jobs=%s",
                GIVE_BACK_WAIT_S,
                dropped,
                extra={
                    "event": "give_back_unfinished",
                    "waited_s": GIVE_BACK_WAIT_S,
                    "dropped_jobs": dropped,
                },
            )

    async def _grace(self) -> None:
        """Serve renew/ack/fail/release until no job is leased, at most the grace period."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_grace_ms / 1000
        while loop.time() < deadline:
            try:
                stats = await self._db.read(self.service.stats)
                if stats["totals"].get("leased", 0) == 0:
                    return
            except Exception:
                log.exception("event=drain_stats_failed")
            await asyncio.sleep(min(DRAIN_CHECK_S, max(0.0, deadline - loop.time())))

    # ------------------------------------------------------------------ wake-ups, reaper

    def _foreign_commit(self, queue: str | None = None) -> None:
        """Another process committed (any thread). With ``queue`` (a server on the same
        PostgreSQL database made jobs READY there): wake that queue's waiters. Without: wake
        the waiters of the waited-on queues that have a READY job (``_look``), and let the
        reaper look now (it may have scheduled a delayed job)."""
        if queue is not None:
            self._wakeups.wake([queue])
            return
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._foreign_seen)

    def _foreign_seen(self) -> None:
        self._schedule_reap(0.0)
        self._look_again = True
        if self._looking is None:
            self._looking = asyncio.get_running_loop().create_task(self._look())

    async def _look(self) -> None:
        """Wake the waiters of the waited-on queues that have a READY job: one read (a seek a
        queue), not a claim for every waiter of every queue; again while commits came since
        it began. (Waking them all made a claim per long-poll for each commit elsewhere:
        1,000 long-polls on as many queues, 190,000 claims in 20 s; a hostile review.)"""
        try:
            while self._look_again:
                self._look_again = False
                waited = self._wakeups.queues()
                if not waited:
                    continue
                try:
                    ready = await self._db.read(
                        functools.partial(self.service.ready_queues, waited)
                    )
                except Exception as exc:  # noqa: BLE001 - wake them all: each claims and sees
                    limits.log_failure(self._failures, "ready_queues_failed", exc)
                    ready = waited
                self._wakeups.wake(ready)
                self._token_due(waited)
        finally:
            self._looking = None

    def _token_due(self, queues: list[str]) -> None:
        """Have the reaper wake a long-poll when the next token of ``queues`` comes that
        ``ready_queues`` found missing (a token taken by another process, which left no hint
        here: the long-poll waited out its wait_ms; a review)."""
        due = self.service.next_token_ms(queues)
        if due is not None:
            self._schedule_due(due)

    def _schedule_reap(self, delay_s: float) -> None:
        assert self._loop is not None
        at = self._loop.time() + max(0.0, delay_s)
        if at < self._reap_at:
            self._reap_at = at
            self._reap_kick.set()

    def _schedule_due(self, due_at_ms: int) -> None:
        # +1 ms: wake at or just after the instant, never a hair before it.
        self._schedule_reap((due_at_ms - self.service.clock.now_ms() + 1) / 1000)

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
            skew = await self._db.write(register)
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
        clock = self.service.clock
        if isinstance(clock, AnchoredClock):  # its service keeps it (QueueService._reanchor)
            self._report_host_clock(clock)

    def _report_host_clock(self, clock: AnchoredClock) -> None:
        """Log ``event=host_clock_off`` (a warning) when this machine's wall clock is more than
        ``RELAY_MAX_CLOCK_SKEW_MS`` off ``clock`` (the database's time: Relay does not use the
        machine's clock, but an operator wants to know, and other software there may), at the
        first heartbeat and again when the offset moves by more than a step."""
        s = relay_settings()
        off = clock.source.now_ms() - clock.now_ms()  # positive: the machine is ahead
        told = self._host_off_told
        if told is not None and abs(off - told) <= s.clock_step_tolerance_ms:
            return
        self._host_off_told = off
        if abs(off) > s.max_clock_skew_ms:
            log.warning(
                "event=host_clock_off offset_ms=%s limit_ms=%s",
                off,
                s.max_clock_skew_ms,
                extra={
                    "event": "host_clock_off",
                    "offset_ms": off,
                    "limit_ms": s.max_clock_skew_ms,
                },
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
                # Lease bookkeeping: the sweep need not wait for the disk (QueueService.sweep).
                queues, due_ms = await self._db.write(self._reap_once, durable=False)
            except Exception as exc:  # noqa: BLE001 - the next pass tries again
                limits.log_failure(self._failures, "reaper_failed", exc)
                continue
            if queues:
                log.debug("event=reaped queues=%s", ",".join(sorted(queues)))
                self._wakeups.wake(queues)
            if self._follower.pushed and (
                waited := [q for q in self._wakeups.queues() if q not in queues]
            ):
                # The bounded fallback poll (as River's FetchPollInterval): a wake-up pushed
                # by another server could be lost (its listener reconnecting, a connection
                # gone quiet), so each pass asks which waited-on queues have READY jobs (a
                # seek per queue) and wakes their long-polls: one read, not a claim per waiter.
                # Not those the sweep just woke (a rate token's instant woke two a token).
                try:
                    ready = await self._db.read(
                        functools.partial(self.service.ready_queues, waited)
                    )
                except Exception as exc:  # noqa: BLE001 - wake them all; the next pass asks again
                    limits.log_failure(self._failures, "fallback_poll_failed", exc)
                    ready = waited
                self._wakeups.wake(ready)
                self._token_due(waited)
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
                deleted = await self._db.write(self.service.prune_batch, weight=PRUNE_BATCH)
            except Exception as exc:  # noqa: BLE001 - the next pass tries again
                limits.log_failure(self._failures, "retention_failed", exc)
                deleted = {}
            took = loop.time() - started
            if sum(deleted.values()) >= PRUNE_BATCH:  # a backlog: go on, but leave room
                await asyncio.sleep(max(RETENTION_BACKLOG_PAUSE_S, RETENTION_YIELD * took))
            else:
                await asyncio.sleep(interval_s)
