"""Serving one request of a TCP connection: admit, run, answer.

``Requests.start(conn, request)`` is the one entry (the read loop calls it for each decoded
request, holding one of the connection's in-flight slots). By the op's kind
(``queue_core.protocol.ops.Kind``):

* **WRITE** (submit, renew, ack, fail, release, dead_retry, dead_purge): ``start_write`` is
  the one place that runs a write and answers it. It admits the request (``admit``: session,
  scope, arguments, draining), queues the handler for the writer's next group commit
  (``writer.Database.put_write``) and answers from the future's done-callback
  (``answer_write``: wake the queues it made ready, count its metrics, send the reply with
  ``Conn.reply_soon``). No task and no coroutine per write (16 single-job producers: 123-138
  -> 109-120 us of server CPU per job, docs/benchmarking.md). Only when the key table must
  be re-read first does a small task read it, then call ``start_write`` the same way.
* **READ** (ping, inspect, stats, dead_list) and **hello**: a task (``serve``) runs the
  handler in the reader pool and sends the reply.
* **LEASE**: one that will not wait (no ``wait_ms``) runs as a write does (``start_lease``:
  admitted, its claim queued for the next group commit, answered from the future's
  done-callback, ``answer_write``) while the key table is cached; otherwise, and with
  ``wait_ms``, a task (``serve``) claims, and waits for a wake-up (``wakeups.Wakeups``) and
  claims again (``lease``), reserving a frame before each claim.

Every reply holds bytes of the server's ``ReplyBudget`` until the kernel has it. A read and
a lease that will not wait hold a frame from before they start (``frame_for``): the read
loop waits for it, so a client whose replies are not read has its next requests wait in its
socket, not as tasks (160 such clients had 10,500 tasks waiting; about 400 after).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
from collections.abc import Callable, Collection
from typing import Any

from queue_core import auth, errors, metrics
from queue_core import validation as v
from queue_core.conf import relay_settings
from queue_core.protocol import codec, dispatch, limits
from queue_core.protocol.budget import ReplyBudget
from queue_core.protocol.connection import Conn, error_line, reply_line
from queue_core.protocol.wakeups import Waiter, Wakeups
from queue_core.protocol.writer import SHARED_WRITERS, Database
from queue_core.service import MAX_BATCH_ACKS, QueueService

log = logging.getLogger("relay.server")

# Jobs given back in one write (``Requests.give_back``): ``release_batch``'s most.
GIVE_BACK_BATCH = MAX_BATCH_ACKS
# Give-back writes in flight at once at shutdown (``Requests.given_back``): one per
# PostgreSQL writer thread; on SQLite the one writer takes them in one transaction.
GIVE_BACK_FLUSH = SHARED_WRITERS


class Requests:
    """Runs the requests of every connection of one server (event-loop thread only).

    Args:
        service: the queue service.
        db: the server's database threads.
        wakeups: the server's long-poll waiters.
        budget: the server's reply-byte budget.
        on_due: called with an epoch-ms instant a request scheduled a job for (the reaper
            promotes it then).
        conns: the server's open connections (``RELAY_MAX_CONNECTIONS_PER_KEY`` counts a
            key's among them).

    Attributes:
        draining: set by the server at shutdown: submit and lease are refused
            (``UNAVAILABLE``) and waiting long-polls answer ``{"jobs": []}``.
    """

    def __init__(
        self,
        service: QueueService,
        db: Database,
        wakeups: Wakeups,
        budget: ReplyBudget,
        on_due: Callable[[int], None],
        conns: Collection[Conn] = (),
    ) -> None:
        self.service = service
        self.conns = conns  # the server's open connections (a key's cap counts them)
        self._capped_keys = limits.Every(limits.FAILURE_LOG_EVERY_S)  # refusals' log lines
        self.db = db
        self.wakeups = wakeups
        self.budget = budget
        self.on_due = on_due
        self.draining = False
        # The key table's read in flight, shared by every request that found the snapshot
        # stale, and ``auth.invalidations()`` when it began (``key_ring``).
        self._ring_read: tuple[asyncio.Future[auth.KeyRing], int] | None = None
        # Whether a write names the queues whose controls it locks (``_locked_queues``):
        # only where several writers run at once (PostgreSQL) must a batch order them.
        self.orders_locks = not service.capabilities.single_writer
        # Jobs to give back (``{"job_id", "worker_id", "lease_token", "queue"}``), gathered
        # until the loop's next pass (``give_back``), and the future each call returned; then
        # their batches, written one at a time (``_release_next``; ``GIVE_BACK_FLUSH`` at once
        # when ``_flushing``, at shutdown), each with the futures its end answers.
        self._giving: list[dict[str, Any]] = []
        self._given: list[asyncio.Future[Any]] = []
        self._releases: collections.deque[_Release] = collections.deque()
        self._releasing = 0  # batches written and not answered yet
        self._flushing = False
        self._idle: list[asyncio.Future[None]] = []

    @staticmethod
    def frame_for(request: codec.Request) -> int:
        """Reply bytes ``request`` must hold before it starts (``start``'s ``held``): a
        frame for a read, a hello or a lease that will not wait, else 0."""
        verb = dispatch.VERBS.get(request.op)
        if verb is None or verb.kind is dispatch.Kind.WRITE:
            return 0
        if verb.kind is dispatch.Kind.LEASE and request.args.get("wait_ms"):
            return 0  # a long-poll reserves before each claim (``lease``)
        return relay_settings().max_frame_bytes

    def start(self, conn: Conn, request: codec.Request, held: int = 0) -> asyncio.Future[Any]:
        """Start serving ``request`` (its in-flight slot is held); return what answers it,
        tracked in ``conn.tasks`` (the slot is freed once its reply is with the kernel).
        A connection's writes are queued for commit in the order they are started, also
        behind one that waits for the key table (``_write_after_ring``).

        Args:
            held: reply-budget bytes already held for it (``frame_for``), from here on its
                own to give back.
        """
        verb = dispatch.VERBS.get(request.op)
        if verb is not None and verb.kind is dispatch.Kind.WRITE:
            ring = auth.cached_ring()
            if ring is not None and not conn.ring_queue:
                return self.start_write(conn, request, verb, ring)
            return self._write_after_ring(conn, request, verb)
        if verb is not None and verb.kind is dispatch.Kind.LEASE:
            started = self.start_lease(conn, request, verb, held)
            if started is not None:
                return started
        hold = _Hold(held)
        task = asyncio.create_task(self.serve(conn, request, hold))
        conn.tasks.add(task)
        task.add_done_callback(conn.done)
        # What the task holds goes back when it ends, also if cancelled before it ran.
        task.add_done_callback(functools.partial(self._unhold, conn, hold))
        return task

    def _unhold(self, conn: Conn, hold: _Hold, task: asyncio.Future[Any]) -> None:
        self.budget.give(conn, hold.n)

    # ------------------------------------------------------------------ writes

    def start_write(
        self, conn: Conn, request: codec.Request, verb: dispatch.Verb, ring: auth.KeyRing
    ) -> asyncio.Future[Any]:
        """Admit a write and queue it for the next group commit; return its future, whose
        done-callback (``answer_write``) sends the reply (a refusal is answered the same way)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            args, ctx = self.admit(conn, verb, request.args, ring)
        except errors.RelayError as exc:  # refused here (counted and logged once), answered below
            future.set_exception(exc.with_traceback(None))
        else:
            handler: Callable[[], dispatch.Outcome]
            handler = functools.partial(verb.handler, self.service, args, ctx)
            leases_next = "lease_next" in args
            locks = self.orders_locks and (leases_next or verb.op in dispatch.CONTROLS)
            if leases_next:
                handler = functools.partial(self._unless_draining, verb, args, ctx)
            # With lease_next the batch sweeps first, as a lease's does (whom to wake).
            self.db.put_write(
                handler,
                future,
                claims=leases_next,
                weight=_weight(args),
                queues=_locked_queues(verb, args) if locks else (),
                # The queue cap's lock is taken alone, never among other calls' row locks.
                alone=self.orders_locks and self.service.may_start_queues(_submitted(verb, args)),
                jobs=_updated_jobs(verb, args) if self.orders_locks else (),
            )
        conn.tasks.add(future)  # until its reply is written (``answer_write``)
        future.add_done_callback(functools.partial(self.answer_write, conn, request))
        return future

    def start_lease(
        self, conn: Conn, request: codec.Request, verb: dispatch.Verb, held: int
    ) -> asyncio.Future[Any] | None:
        """Start a lease that will not wait as ``start_write`` starts a write; None when
        ``serve`` must run it instead.

        Taken here: no ``wait_ms`` (or 0), the key table cached and the connection open. The
        frame the read loop held for it (``held``, ``frame_for``) stays held until the claim
        commits (``_claimed``), so a client that reads nothing is held to its budget as
        ``lease`` holds it. The key is checked in the same loop pass the claim is queued in,
        as a write's is. No task and no coroutine.
        """
        if request.args.get("wait_ms") or conn.gone or not held:
            return None
        ring = auth.cached_ring()
        if ring is None:
            return None
        s = relay_settings()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        try:
            args, ctx = self.admit(conn, verb, request.args, ring)
        except errors.RelayError as exc:  # refused here, answered below
            future.set_exception(exc.with_traceback(None))
        else:
            self.db.put_write(
                functools.partial(verb.handler, self.service, args, ctx),
                future,
                claims=True,
                durable=s.durable_leases,
                weight=_weight(args),
                queues=_locked_queues(verb, args) if self.orders_locks else (),
            )
        conn.tasks.add(future)  # until its reply is written (``answer_write``)
        future.add_done_callback(functools.partial(self._claimed, conn, request, held, loop.time()))
        return future

    def _claimed(
        self,
        conn: Conn,
        request: codec.Request,
        held: int,
        started: float,
        future: asyncio.Future[Any],
    ) -> None:
        """A claim ``start_lease`` queued has committed or failed: give back the frame it
        held (the reply holds its own bytes from here), time it, and answer
        (``answer_write``). One done-callback, not three: each is a pass of the loop's
        ready queue. The answer runs whatever the first two do, as its own callback did."""
        try:
            self.budget.give(conn, held)
            if not future.cancelled() and future.exception() is None:
                metrics.claim_took(asyncio.get_running_loop().time() - started)
        finally:
            self.answer_write(conn, request, future, key="jobs")

    def _write_after_ring(
        self, conn: Conn, request: codec.Request, verb: dispatch.Verb
    ) -> asyncio.Future[None]:
        """Queue a write behind the key table's read (not cached) and behind the writes of
        its connection already waiting for it (``conn.ring_queue``); return a future that
        ends once it is answered.

        The table is read on the key thread, which caches it before the loop hears of it: a
        later write started then found it cached and was queued for commit before the
        waiting ones (a review: 0-5 of a connection's pipelined submits a 10 s run committed
        out of order, a new key table read a second). One task a connection starts them all,
        in order, in one step.
        """
        answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        conn.ring_queue.append((request, verb, answered))
        conn.tasks.add(answered)
        answered.add_done_callback(conn.tasks.discard)
        if len(conn.ring_queue) == 1:
            task = asyncio.ensure_future(self._start_after_ring(conn))
            conn.tasks.add(task)
            task.add_done_callback(conn.tasks.discard)
            task.add_done_callback(functools.partial(_unqueue, conn))
        return answered

    async def _start_after_ring(self, conn: Conn) -> None:
        """Read the key table, then start ``conn.ring_queue``'s writes as ``start_write``
        does, oldest first, emptying it (a refusal of the read answers each of them)."""
        waiting = conn.ring_queue
        try:
            ring = await self.key_ring()
        except Exception as exc:  # noqa: BLE001 - answered as any refusal
            while waiting:
                request, _, answered = waiting.popleft()
                conn.reply_soon(error_line(request, exc))
                answered.set_result(None)
            return
        while waiting:
            request, verb, answered = waiting.popleft()
            future = self.start_write(conn, request, verb, ring)
            future.add_done_callback(functools.partial(_settle_answered, answered))

    def answer_write(
        self,
        conn: Conn,
        request: codec.Request,
        future: asyncio.Future[Any],
        *,
        key: str = "next",
    ) -> None:
        """Answer a write once its commit is durable, or a lease ``start_lease`` ran once its
        claim has committed (event-loop thread). ``key``: the result's member that holds the
        leases it hands out (``answer_with_leases``): an ack's ``next``, a lease's ``jobs``.
        The request leaves ``conn.tasks`` once its reply is written (or handed to a send
        task, which ``conn.tasks`` holds from then)."""
        try:
            if future.cancelled():  # the connection is closing
                conn.slots.release()
                return
            try:
                exc = future.exception()
                if exc is None:
                    outcome: dispatch.Outcome = future.result()
                    self.apply(outcome)
                    metrics.record(outcome.events)  # committed by now
                    if outcome.result.get(key):
                        self.answer_with_leases(conn, request, outcome.result, key)
                        return
                    line = reply_line(request, outcome.result)
                else:
                    line = error_line(request, exc)
            except Exception as failure:  # noqa: BLE001 - still answer, and free the slot
                line = error_line(request, failure)
            conn.reply_soon(line)
        finally:
            conn.tasks.discard(future)

    def _unless_draining(
        self, verb: dispatch.Verb, args: dict[str, Any], ctx: dispatch.Context
    ) -> dispatch.Outcome:
        """Writer thread: run an ack, fail or ack_batch with ``lease_next``; once the server
        drains (read as the call runs) it hands out no new leases: the ack or fail itself goes
        on and answers ``"next": []``."""
        if not self.draining:
            return verb.handler(self.service, args, ctx)
        rest = {k: val for k, val in args.items() if k != "lease_next"}
        outcome = verb.handler(self.service, rest, ctx)
        outcome.result["next"] = []
        return outcome

    def answer_with_leases(
        self,
        conn: Conn,
        request: codec.Request,
        result: dict[str, Any],
        key: str,
    ) -> None:
        """Answer a request whose reply hands out leases (``result[key]``: a ``lease``'s
        ``jobs``, or the ``next`` of an ack, fail or ack_batch with ``lease_next``).

        When the connection is already gone (the client closed, or it is closing after an
        oversize frame), the jobs go back at once and the reply, if it can still go out,
        carries none (``[]``), as ``lease`` answers a connection gone during its claim; when
        the reply does not all reach the kernel (``Conn.reply_soon``'s ``lost``), they go
        back too (``give_back``) rather than strand until their leases expire.
        """
        leases: list[dict[str, Any]] = result[key]
        worker_id = _next_worker_id(request.args, conn.peer)
        if conn.gone:
            self.give_back(leases, worker_id)
            conn.reply_soon(reply_line(request, {**result, key: []}))
            return
        lost = functools.partial(self.give_back, _fences(leases), worker_id)
        conn.reply_soon(reply_line(request, result), lost)

    def apply(self, outcome: dispatch.Outcome) -> None:
        """Wake the long-polls of the queues a commit made ready; schedule a due instant."""
        if outcome.ready_queues:
            self.wakeups.wake(outcome.ready_queues)
        if outcome.due_at_ms is not None:
            self.on_due(outcome.due_at_ms)

    # ------------------------------------------------------------------ reads, hello, lease

    async def serve(self, conn: Conn, request: codec.Request, hold: _Hold) -> None:
        """Run one read, hello or lease and send its reply.

        A read runs holding the frame of the reply budget its read loop held for it
        (``hold``, ``frame_for``); a lease reserves one each time it claims (``lease``). The
        hold shrinks to the reply's size once it is made; ``start`` gives it back when this
        task ends, the reply with the kernel or dropped.
        """
        result: dict[str, Any] | None = None
        verb = dispatch.VERBS.get(request.op)
        frame = relay_settings().max_frame_bytes
        if hold.n and verb is not None and verb.kind is dispatch.Kind.LEASE:
            self.budget.give(conn, hold.n)  # ``lease`` reserves before each claim
            hold.n = 0
        try:
            result = await self.execute(conn, request)
            if verb is not None and verb.kind is dispatch.Kind.LEASE and result["jobs"]:
                hold.n = frame  # lease kept its claim's hold
            line = reply_line(request, result)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error reply
            line = error_line(request, exc)
        self.budget.give(conn, hold.n - len(line))
        hold.n = len(line)
        lost = None
        if request.op == "lease" and result and result.get("jobs"):
            # Never leave jobs leased to a socket that is gone: give them back at once.
            worker_id = _next_worker_id(request.args, conn.peer)
            lost = functools.partial(self.give_back, _fences(result["jobs"]), worker_id)
        result = None  # only the line waits for the client (a page's objects did too)
        sent = await conn.send(line, lost)
        if not sent and lost is not None:
            await lost()

    async def execute(self, conn: Conn, request: codec.Request) -> dict[str, Any]:
        """Run a read, hello or lease; return its wire result.

        Raises:
            RelayError: refused (``admit``) or failed.
        """
        verb = dispatch.lookup(request.op)
        if verb.op == "hello":
            return await self.hello(conn, dispatch.validate(verb, request.args))
        ring = None if verb.op in auth.OPEN_OPS else await self.key_ring()
        args, ctx = self.admit(conn, verb, request.args, ring)
        if verb.op in dispatch.ON_LOOP:  # touches no table: never behind the reader pool
            outcome: dispatch.Outcome = verb.handler(self.service, args, ctx)
        elif verb.kind is dispatch.Kind.READ:
            outcome = await self.db.read(lambda: verb.handler(self.service, args, ctx))
        else:
            outcome = await self.lease(conn, verb, args, ctx)
        metrics.record(outcome.events)  # committed by now
        return outcome.result

    def admit(
        self,
        conn: Conn,
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
            try:
                principal = auth.check_session(
                    conn.principal, ring, surface="tcp", peer=conn.peer, revoked=conn.key_revoked
                )
            except errors.Unauthenticated:
                # Revoked (now or before): evictable, and closed unless it says hello.
                held = conn.principal is not None and conn.principal.authenticated
                conn.unauthenticate(revoked=held or conn.key_revoked)
                raise
            auth.authorize(principal, verb.op, surface="tcp", peer=conn.peer)
        args = dispatch.validate(verb, raw_args)
        if self.draining and verb.op in dispatch.REFUSED_WHILE_DRAINING:
            raise errors.Unavailable()
        known = conn.context  # the same for each request while the principal is
        if known is None or known[0] is not principal:
            actor = f"tcp:{conn.peer}"
            if principal.authenticated:
                actor = f"{actor} {principal.actor}"[:150]
            known = conn.context = (principal, dispatch.Context(peer=conn.peer, actor=actor))
        return args, known[1]

    async def key_ring(self) -> auth.KeyRing:
        """The key table snapshot; a stale one is read again on the database's key thread
        (``Database.read_keys``), never here, once for every request that waits for it (one
        read begun before a revoke in this process is not shared after it).

        Raises:
            Unavailable, StoreBusy: the table could not be read (mapped by the driver, as any
                read: a terminated PostgreSQL connection is not an ``INTERNAL``).
        """
        ring = auth.cached_ring()
        if ring is not None:
            return ring
        # Shielded: a waiter cancelled (its connection closing) leaves the others' read be.
        return await asyncio.shield(self.read_ring())

    def read_ring(self) -> asyncio.Future[auth.KeyRing]:
        """Start reading the key table on the key thread, unless a read begun since the last
        revoke in this process is under way; return that read."""
        began = auth.invalidations()
        if self._ring_read is None or self._ring_read[0].done() or self._ring_read[1] != began:
            read = functools.partial(auth.read_ring, self.service.driver)
            reading = asyncio.ensure_future(self.db.read_keys(read))
            reading.add_done_callback(_retrieved)  # its waiters may all have gone
            self._ring_read = (reading, began)
        return self._ring_read[0]

    async def hello(self, conn: Conn, args: dict[str, Any]) -> dict[str, Any]:
        """Check an API key and tie it to this connection (a refused key unties the old one)."""
        ring = await self.key_ring()
        if auth.may_be_newer(ring, args["api_key"]):  # made since the snapshot? read again
            ring = await asyncio.shield(self.read_ring())
        conn.unauthenticate()
        principal: auth.Principal = await self.db.read(
            lambda: auth.authenticate(args["api_key"], surface="tcp", peer=conn.peer, ring=ring)
        )
        self._within_key_cap(conn, principal)
        conn.principal = principal
        log.debug("event=hello peer=%s prefix=%s", conn.peer, principal.prefix)
        return {**principal.describe(), "server_time_ms": self.service.clock.now_ms()}

    def _within_key_cap(self, conn: Conn, principal: auth.Principal) -> None:
        """Refuse ``principal``'s key on ``conn`` when its other open connections already
        number ``RELAY_MAX_CONNECTIONS_PER_KEY`` (0: no cap), as PostgreSQL refuses a role
        past its ``CONNECTION LIMIT``: authenticated connections are never evicted for a
        newcomer, so without it one key could hold every slot of the server.

        Raises:
            TooManyConnections: the key holds its cap (``details.limit``); the connection
                stays open without a key, as after any refused ``hello``.
        """
        cap = relay_settings().max_connections_per_key
        if not cap or not principal.authenticated or principal.prefix is None:
            return
        held = sum(
            1
            for c in self.conns
            if c is not conn
            and not c.gone
            and c.principal is not None
            and c.principal.prefix == principal.prefix
        )
        if held < cap:
            return
        unlogged = self._capped_keys.due(principal.prefix)
        if unlogged is not None:  # one line per key per 10 s under a flood
            log.warning(
                "event=key_connection_cap peer=%s prefix=%s limit=%s held_back=%s",
                conn.peer,
                principal.prefix,
                cap,
                unlogged,
                extra={
                    "event": "key_connection_cap",
                    "prefix": principal.prefix,
                    "limit": cap,
                    "held_back": unlogged,
                },
            )
        raise errors.TooManyConnections(
            f"API key {principal.prefix} already holds {held} connections, its limit "
            "(RELAY_MAX_CONNECTIONS_PER_KEY); close one first",
            limit=cap,
        )

    async def lease(
        self, conn: Conn, verb: dispatch.Verb, args: dict[str, Any], ctx: dispatch.Context
    ) -> dispatch.Outcome:
        """Claim; when nothing is ready, wait for a wake-up or ``wait_ms``, and claim again.

        Each claim first reserves a frame of the connection's reply budget; an outcome with
        jobs returns still holding it (``serve`` ends the hold).
        """
        loop = asyncio.get_running_loop()
        frame = relay_settings().max_frame_bytes
        wait_ms = args.get("wait_ms", 0)
        deadline = loop.time() + wait_ms / 1000
        # The last round's waiter, whether a wake chose any round's, and whether it leaves
        # with jobs: as it leaves, it hands its wake on (Wakeups.leave).
        waiter: Waiter | None = None
        woken = got_jobs = False
        try:
            while True:
                if conn.gone:  # never lease to a closed socket
                    return dispatch.Outcome({"jobs": []})
                # Subscribe before claiming, so a commit between the claim and the wait wakes us
                # (a lease that will not wait needs no wake-up).
                waiter = self.wakeups.subscribe(args["queues"]) if wait_ms > 0 else None
                if waiter is not None:
                    conn.waiting.add(waiter.event)
                try:
                    await self.budget.reserve(conn, frame)
                    if conn.gone:  # it went while this waited for its budget: claim nothing
                        self.budget.give(conn, frame)
                        return dispatch.Outcome({"jobs": []})
                    started = loop.time()
                    try:
                        # The key again before each claim: admission ran before the reserve and
                        # any wait, so a key revoked since leases nothing (UNAUTHENTICATED).
                        ring = await self.key_ring()
                        auth.still_allowed(
                            conn.principal, verb.op, ring, surface="tcp", peer=conn.peer
                        )
                        outcome: dispatch.Outcome = await self._claim(conn, verb, args, ctx)
                    except BaseException:
                        self.budget.give(conn, frame)
                        raise
                    if outcome.due_at_ms is not None:
                        # A rate-limited queue's next token: the reaper wakes a waiter then.
                        self.on_due(outcome.due_at_ms)
                    if not outcome.result["jobs"]:
                        self.budget.give(conn, frame)
                    metrics.claim_took(loop.time() - started)
                    if conn.gone and outcome.result["jobs"]:
                        # The client closed (EOF) while the claim ran: a normal close still lets
                        # the reply into the kernel, so give the jobs back rather than lease them
                        # to a socket nobody reads.
                        self.budget.give(conn, frame)
                        worker_id = _next_worker_id(args, conn.peer)
                        await self.give_back(outcome.result["jobs"], worker_id)
                        return dispatch.Outcome({"jobs": []})
                    remaining = deadline - loop.time()
                    got_jobs = bool(outcome.result["jobs"])
                    if got_jobs or remaining <= 0 or self.draining or conn.gone:
                        return outcome
                    if waiter is not None:
                        await waiter.wait(remaining)
                    if self.draining or conn.gone:
                        return dispatch.Outcome({"jobs": []})
                finally:
                    if waiter is not None:
                        conn.waiting.discard(waiter.event)
                        woken = self.wakeups.unsubscribe(waiter) or woken
        finally:
            self.wakeups.leave(
                waiter,
                got_jobs=got_jobs,
                woken=woken,
                exhausted=self.service.exhausted(args["queues"]) if got_jobs else frozenset(),
            )

    async def _claim(
        self, conn: Conn, verb: dispatch.Verb, args: dict[str, Any], ctx: dispatch.Context
    ) -> dispatch.Outcome:
        """Run one claim of ``lease`` in the next group commit and return its outcome.

        Cancelled while the claim waits for the writer (its connection closing at shutdown,
        the writer busy past the close's wait), the claim is abandoned: if it has not run
        yet it claims nothing, and jobs it claimed all the same go back (``give_back``),
        never leased to a request nobody answers.
        """
        abandoned = False

        def claim() -> dispatch.Outcome:
            if abandoned:
                return dispatch.Outcome({"jobs": []})
            return verb.handler(self.service, args, ctx)

        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.db.put_write(
            claim,
            future,
            claims=True,
            durable=relay_settings().durable_leases,
            weight=_weight(args),
            queues=_locked_queues(verb, args) if self.orders_locks else (),
        )
        try:
            outcome: dispatch.Outcome = await asyncio.shield(future)
        except asyncio.CancelledError:
            abandoned = True
            worker_id = _next_worker_id(args, conn.peer)
            future.add_done_callback(functools.partial(self._claimed_for_nobody, worker_id))
            raise
        return outcome

    def _claimed_for_nobody(self, worker_id: str, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            jobs = future.result().result["jobs"]
            if jobs:
                self.give_back(jobs, worker_id)

    def give_back(self, leases: list[dict[str, Any]], worker_id: str) -> asyncio.Future[Any]:
        """Give back jobs leased to ``worker_id`` in a reply that cannot be sent, and wake
        their queues.

        Never waits (a task being cancelled can call it too). The jobs of every call in one
        pass of the loop are gathered, whatever their workers, cut into batches of
        ``GIVE_BACK_BATCH`` and written one batch at a time (``QueueService.release_batch``:
        one guarded statement for a batch, each job fenced by its own token and worker), so
        other requests queue behind one batch at most. A reset connection may hold a thousand
        replies of one job each: given back one write per job, all queued at once, 10
        connections reset together with 1,000 jobs each held another client's requests up
        to 643 ms on SQLite and 3.9 s on PostgreSQL; now 29 and 20 ms (medians,
        ``relay_bench.giveback``). Once the connections are closed at shutdown
        (``given_back``), several batches go at once.

        The writes need not wait for the disk (``durable=False``, as a lease's): a give-back
        a crash loses leaves its job LEASED to a reply nobody read, until restart recovery
        (SQLite) or its lease's expiry, as before any give-back; a later durable commit makes
        it durable too (the log is written in order).

        An entry refused (the lease expired or was taken meanwhile) is logged, and so is a
        batch that failed whole. Returns a future that ends when the last batch of its pass is
        answered (or dropped: ``drop_give_backs``).
        """
        loop = asyncio.get_running_loop()
        if not self._given:
            loop.call_soon(self._give_back_now)
        self._giving.extend({**lease, "worker_id": worker_id} for lease in leases)
        done: asyncio.Future[Any] = loop.create_future()
        self._given.append(done)
        return done

    async def given_back(self) -> None:
        """At shutdown, once no connection is left (no other request to keep waiting): write
        the batches left ``GIVE_BACK_FLUSH`` at a time, and return once every job
        ``give_back`` was handed has been written (or dropped)."""
        self._flushing = True
        self._release_next()
        if self._given or self._releases or self._releasing:
            idle: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle.append(idle)
            await idle

    def drop_give_backs(self) -> int:
        """Drop the batches not yet written (the shutdown's wait ran out): their jobs stay
        LEASED until restart recovery (SQLite) or their leases' expiry. Returns how many."""
        dropped = 0
        while self._releases:
            release = self._releases.popleft()
            dropped += len(release.leases)
            _answer(release.given)
        self._release_next()
        return dropped

    def _give_back_now(self) -> None:
        """Cut the jobs ``give_back`` gathered in a pass into batches, the futures of that
        pass answered with its last batch, and write them (``_release_next``)."""
        giving, self._giving = self._giving, []
        given, self._given = self._given, []
        batches = [
            _Release(giving[at : at + GIVE_BACK_BATCH], [])
            for at in range(0, len(giving), GIVE_BACK_BATCH)
        ]
        if batches:
            batches[-1].given.extend(given)
            self._releases.extend(batches)
        else:  # no call named a job
            _answer(given)
        self._release_next()

    def _release_next(self) -> None:
        """Write the next batch of give-backs unless one is in flight (``GIVE_BACK_FLUSH``
        when flushing). With none left, wake ``given_back``."""
        most = GIVE_BACK_FLUSH if self._flushing else 1
        while self._releases and self._releasing < most:
            self._releasing += 1
            release = self._releases.popleft()
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            write = functools.partial(self.service.release_batch, release.leases)
            self.db.put_write(write, future, durable=False, weight=len(release.leases))
            future.add_done_callback(functools.partial(self._given_back, release))
        if not (self._releases or self._releasing or self._given):
            _answer(self._idle)
            self._idle = []

    def _given_back(self, release: _Release, future: asyncio.Future[Any]) -> None:
        try:
            self._judge_release(release.leases, future)
        finally:
            _answer(release.given)
            self._releasing -= 1
            self._release_next()

    def _judge_release(self, leases: list[dict[str, Any]], future: asyncio.Future[Any]) -> None:
        """Log what a batch of give-backs refused, and wake the queues of the jobs it gave
        back."""
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            ids = " ".join(lease["job_id"] for lease in leases)
            if isinstance(exc, errors.RelayError):
                log.info("event=release_unsent_failed code=%s job_ids=%s", exc.code, ids)
            else:
                log.error("event=release_unsent_failed job_ids=%s", ids, exc_info=exc)
            return
        queues = set()
        for entry in future.result():
            if entry["ok"]:
                queues.add(entry["queue"])
            else:
                log.info(
                    "event=release_unsent_failed job_id=%s code=%s",
                    entry["job_id"],
                    entry["error"]["code"],
                )
        if queues:
            self.wakeups.wake(sorted(queues))


@dataclasses.dataclass(slots=True)
class _Release:
    """One write of ``Requests.give_back``: its jobs (``{"job_id", "worker_id",
    "lease_token", "queue"}``, at most ``GIVE_BACK_BATCH``) and the futures its end
    answers."""

    leases: list[dict[str, Any]]
    given: list[asyncio.Future[Any]]


def _answer(futures: list[Any]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


@dataclasses.dataclass(slots=True)
class _Hold:
    """Reply-budget bytes a ``serve`` task holds (``n``), given back when the task ends."""

    n: int


def _fences(leases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What ``Requests.give_back`` needs of leased jobs (id, token, queue), without their
    payloads: kept while their reply waits for its client."""
    return [
        {"job_id": j["job_id"], "lease_token": j["lease_token"], "queue": j["queue"]}
        for j in leases
    ]


def _locked_queues(verb: dispatch.Verb, args: dict[str, Any]) -> list[str]:
    """The queues whose controls rows a write locks (``put_write``'s ``queues``): those a
    lease or a ``lease_next`` claims from, or the queue a controls op changes; none for a
    request its handler will refuse (checked as it checks them: a list of 100,000 names must
    not make its batch's first statement lock by all of them)."""
    s = relay_settings()
    try:
        if verb.op in dispatch.CONTROLS:
            return [v.queue_name(args.get("queue"), s)]
        spec = args.get("lease_next")
        return v.queue_list(spec.get("queues") if isinstance(spec, dict) else args.get("queues"), s)
    except errors.InvalidArgument:
        return []


# The ops whose entries each update a job: the argument holding the entries.
_BATCHES = {"ack_batch": "acks", "renew_batch": "renews"}


def _updated_jobs(verb: dispatch.Verb, args: dict[str, Any]) -> list[str]:
    """The jobs whose rows a write updates (``put_write``'s ``jobs``): the ``job_id`` of a
    renew, ack, fail, release, cancel, replay or purge, the entries' of an ``ack_batch`` or
    ``renew_batch``; values that ``validation.job_id`` refuses (not strings, too long, a NUL:
    PostgreSQL refused the batch's lock statement for it), and the entries of a batch over
    ``MAX_BATCH_ACKS``, are the handler's to refuse, and lock nothing."""
    if (name := _BATCHES.get(verb.op)) is not None:
        entries = args.get(name)
        if not isinstance(entries, list) or len(entries) > MAX_BATCH_ACKS:
            return []
        ids = [entry.get("job_id") for entry in entries if isinstance(entry, dict)]
    else:
        ids = [args.get("job_id")]
    return [job_id for job_id in map(v.plausible_job_id, ids) if job_id is not None]


def _submitted(verb: dispatch.Verb, args: dict[str, Any]) -> list[Any]:
    """The queue names a submit or batch submit names, unchecked (none for another op)."""
    if verb.op == "submit":
        return [args.get("queue")]
    if verb.op == "submit_batch" and isinstance(jobs := args.get("jobs"), list):
        return [job.get("queue") for job in jobs if isinstance(job, dict)]
    return []


def _unqueue(conn: Conn, task: asyncio.Future[None]) -> None:
    """The task starting ``conn.ring_queue``'s writes was cancelled (the connection is
    closing, its read loop ended), perhaps before it ran: free their slots, end them."""
    if not task.cancelled():
        return  # it emptied the queue itself
    waiting = conn.ring_queue
    while waiting:
        _, _, answered = waiting.popleft()
        conn.slots.release()
        answered.cancel()


def _settle_answered(answered: asyncio.Future[None], _future: asyncio.Future[Any]) -> None:
    """A write queued behind the key table's read has been answered (``_write_after_ring``)."""
    if not answered.done():
        answered.set_result(None)


def _weight(args: dict[str, Any]) -> int:
    """How many jobs a request's write may touch (``writer.Database.put_write``'s ``weight``):
    a batch's length (``jobs``, ``acks``, ``renews``), plus a lease's or a ``lease_next``'s
    ``max_jobs``, or a ``prune``'s ``limit`` (an argument the handler will refuse counts as
    1). A prune weighed 1 whatever its limit ran inline on the event loop: 10,000 jobs held
    every ping of every connection for 1.3 s (a hostile review)."""
    weight = 1
    if "jobs" in args or "acks" in args or "renews" in args or "lease_next" in args:
        batch = args.get("jobs") or args.get("acks") or args.get("renews")
        if isinstance(batch, list) and batch:
            weight = len(batch)
        spec = args.get("lease_next")
        if isinstance(spec, dict):
            more = spec.get("max_jobs", 1)
            weight += more if isinstance(more, int) and more > 0 else 1
    max_jobs = args.get("max_jobs", args.get("limit"))  # a prune is the only write with a limit
    if isinstance(max_jobs, int) and max_jobs > weight:
        weight = max_jobs
    return weight


def _next_worker_id(args: dict[str, Any], peer: str) -> str:
    """The worker id the jobs of a ``lease`` (its own) or of a ``lease_next`` (its own, else
    the ack's or the first ack's of a batch) were leased to, else the peer's; used to release
    them when the reply cannot be sent."""
    spec = args.get("lease_next")
    if isinstance(spec, dict) and isinstance(spec.get("worker_id"), str):
        return str(spec["worker_id"])
    if isinstance(args.get("worker_id"), str):
        return str(args["worker_id"])
    acks = args.get("acks")
    if isinstance(acks, list) and acks and isinstance(acks[0], dict):
        return str(acks[0].get("worker_id") or peer)
    return peer


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a shared future's exception as seen (no "never retrieved" log line when every
    waiter was cancelled first)."""
    if not future.cancelled():
        future.exception()
