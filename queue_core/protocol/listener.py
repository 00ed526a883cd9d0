"""Accepting TCP connections and reading their frames.

``Listener.on_connect`` (each connection's callback, reading through a
``reading.FrameReader``) admits a connection or refuses it (``TOO_MANY_CONNECTIONS``: over
``RELAY_MAX_CONNECTIONS``, where with API keys on a newcomer takes the slot of the oldest
connection that never said hello, or over ``RELAY_MAX_CONNECTIONS_PER_ADDRESS``;
``UNAVAILABLE`` while draining), then runs its ``read_loop``: bounded lines, decoded, each
handed to ``requests.Requests.start`` once the connection has an in-flight slot (at most
``RELAY_MAX_INFLIGHT_PER_CONNECTION``). The loop enforces the idle, auth and bad-frame limits
and the reply budget's back-pressure; it never touches the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

from queue_core import auth, errors
from queue_core.conf import relay_settings
from queue_core.protocol import codec, connection, dispatch, limits
from queue_core.protocol.budget import ReplyBudget
from queue_core.protocol.connection import CLOSE_WAIT_S, LINGER_S, Conn, Slots, until_idle
from queue_core.protocol.reading import (
    COUNTED_LINE_BYTES,
    WEIGHED_LINE_BYTES,
    FrameReader,
    InputBudget,
    Ticket,
    line_weight,
)
from queue_core.protocol.requests import Requests

log = logging.getLogger("relay.server")


def holds_its_arguments(op: str) -> bool:
    """Whether a request of ``op`` keeps its decoded arguments until it ends: a write, until
    its commit (a read, a lease, hello keep only what they validated, which is small)."""
    verb = dispatch.VERBS.get(op)
    return verb is not None and verb.kind is dispatch.Kind.WRITE


def _host_of(conn: Conn) -> str | None:
    """The IP address ``conn``'s peer connects from (None: not an IP socket)."""
    peer = conn.writer.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) else None


class ReadDeadline:
    """The deadline of a connection's reads, with one timer armed per connection.

    ``asyncio.timeout`` around each read armed and cancelled a timer per request (a
    ``Timeout``, a timer handle and the heap's work): about 35 thousand instructions per
    request, 4.5% of a single submit (callgrind, docs/benchmarking.md, round 8). Here the
    timer stays armed from read to read and is moved only when a deadline comes sooner than
    it; one that fires early (the connection was active since) is armed again for the
    deadline then in force, as a lazy idle timer (nginx's and Go's net deadlines). At the
    deadline it cancels the read task while that task waits in a read, as
    ``asyncio.timeout`` does, and ``expired`` withdraws that cancellation.

    Args:
        task: the task whose reads it bounds (the connection's ``read_loop``).
    """

    __slots__ = ("_fired", "_loop", "_task", "_timer", "_timer_at", "reading", "time", "until")

    def __init__(self, task: asyncio.Task[None]) -> None:
        self._loop = task.get_loop()
        self.time = self._loop.time  # the loop's clock (s)
        self._task = task
        # The read's deadline, loop time (s): ``start`` sets it; the fast path
        # (``Listener.fast_lines``) moves it later, and the armed timer, firing before it,
        # arms itself again.
        self.until = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # loop time the timer fires at
        self._fired = False  # it cancelled the task; not yet withdrawn
        self.reading = False  # the task waits in a read: set around each read

    def start(self, deadline: float) -> None:
        """Before a read: it times out at ``deadline`` (loop time, s); sets ``reading``."""
        self.until = deadline
        self.reading = True
        timer = self._timer
        if timer is None or self._timer_at > deadline:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(deadline, self._fire)
            self._timer_at = deadline

    def _fire(self) -> None:
        self._timer = None
        if not self.reading:
            return  # the next start() arms it again
        if self._loop.time() < self.until:
            self.start(self.until)
            return
        self._fired = True
        self._task.cancel()

    def cancelling(self) -> int:
        """Whether its task is being cancelled (``Task.cancelling``): by this deadline, an
        eviction or a shutdown."""
        return self._task.cancelling()

    def expired(self) -> bool:
        """Once the task's read raised ``CancelledError``: True when this deadline cancelled
        it (the cancellation is withdrawn: the read timed out); False for a cancellation from
        elsewhere (an eviction, a shutdown), which must propagate."""
        if not self._fired:
            return False
        self._fired = False
        return self._task.uncancel() == 0

    def close(self) -> None:
        """Disarm the timer (the connection's reads are over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ConnProtocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, telling the connection when it is reset, by its client or
    by us (``Conn.abort``).

    A reset destroys the replies our kernel had not sent on yet: the client never had them.
    While ``connection_lost`` runs the socket is still open, and the transport closes it
    right after (uvloop's and asyncio's alike), so how much was sent is read as late as it
    can be, and the jobs of the other replies go back at once
    (``Conn.give_back_untransmitted``) rather than when their leases expire.

    Args:
        reader: the connection's reader; its ``owner`` is the connection once it has one.
        on_connect: ``Listener.on_connect``.
    """

    def __init__(self, reader: FrameReader, on_connect: Any) -> None:
        super().__init__(reader, on_connect)
        self.frames = reader

    def data_received(self, data: bytes) -> None:
        # Whole lines go to the read loop's fast path while it waits with nothing buffered;
        # what it does not take is buffered for the loop, as asyncio's protocol does.
        frames = self.frames
        fast = frames.fast
        if fast is not None and not frames._buffer:
            taken = fast(data)
            if taken:
                if taken == len(data):
                    return
                data = data[taken:]
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        owner = self.frames.owner
        # exc None: we closed it (a FIN: the kernel delivers what it holds) or reset it.
        if isinstance(owner, Conn) and (exc is not None or owner.resetting):
            owner.give_back_untransmitted()
        super().connection_lost(exc)


class Listener:
    """The open connections of one server and their read loops (event-loop thread only).

    ``protocol`` is the factory ``loop.create_server`` takes: each connection reads through
    a ``FrameReader`` and starts at ``on_connect``.

    Args:
        requests: serves each decoded request.
        budget: the server's reply-byte budget.
        conns: the set of open connections (shared with the server).
        max_connections: ``RELAY_MAX_CONNECTIONS`` capped to the fd limit.
        input_budget: the request bytes the connections' readers buffer.
    """

    def __init__(
        self,
        requests: Requests,
        budget: ReplyBudget,
        conns: set[Conn],
        max_connections: int,
        input_budget: InputBudget,
    ) -> None:
        self.requests = requests
        self.budget = budget
        self.input = input_budget
        self.conns = conns
        self.max_connections = max_connections
        self.evictions = limits.Every(limits.FAILURE_LOG_EVERY_S)

    def protocol(self) -> asyncio.StreamReaderProtocol:
        """A new connection's protocol (``loop.create_server``'s factory)."""
        limit = relay_settings().max_frame_bytes + 2
        return ConnProtocol(FrameReader(limit, self.input), self.on_connect)

    async def close_all(self) -> None:
        """Stop reading, let requests in progress answer (up to ``CLOSE_WAIT_S``), close."""
        conns = list(self.conns)
        for conn in conns:
            if conn.read_task is not None:
                conn.read_task.cancel()
        await until_idle(conns, CLOSE_WAIT_S)
        # Connections close gracefully (``close_gracefully``, at most LINGER_S). Then abort
        # what is left (a client that reads nothing must not hold the shutdown), until every
        # connection is gone. (This also waited for Server._active_count, which Python 3.13's
        # Server no longer has and uvloop's does not expose: it read 0, so it is gone.)
        loop = asyncio.get_running_loop()
        abort_at = loop.time() + LINGER_S + 0.1
        deadline = abort_at + CLOSE_WAIT_S
        while loop.time() < deadline:
            if loop.time() >= abort_at:
                for conn in list(self.conns):
                    conn.abort()
            if not self.conns:
                break
            await asyncio.sleep(0.01)

    async def on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection from accept to close (its protocol's callback, ``protocol``)."""
        s = relay_settings()
        peername = writer.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
        conn = Conn(reader, writer, peer, Slots(s.max_inflight_per_connection), self.budget)
        if isinstance(reader, FrameReader):
            reader.owner = conn  # the input budget may cut it from here on
        # A send ends when the transport holds nothing more (not at a low-water mark), so a
        # reply reported sent is all with the kernel (``Conn.reached_kernel``).
        writer.transport.set_write_buffer_limits(high=0)
        full = len(self.conns) >= self.max_connections
        if full and not self.requests.draining:
            with contextlib.suppress(errors.RelayError):  # no key table now: refuse
                if self.evict_unauthenticated(await self.requests.key_ring()):
                    full = False  # the newcomer takes the slot of one that never said hello
        over_cap = not full and self.over_address_cap(peername)
        if over_cap and not self.requests.draining and isinstance(peername, tuple):
            with contextlib.suppress(errors.RelayError):  # the same, among its address's own
                ring = await self.requests.key_ring()
                over_cap = not self.evict_unauthenticated(ring, host=peername[0])
        over_limit = full or over_cap
        self.conns.add(conn)  # tracked from the start, so a shutdown can always close it
        try:
            if self.requests.draining or over_limit:
                refusal: errors.RelayError = (
                    errors.Unavailable() if self.requests.draining else errors.TooManyConnections()
                )
                log.debug("event=connection_refused peer=%s code=%s", peer, refusal.code)
                await conn.send(codec.encode_error(None, refusal))
                return
            log.debug("event=connected peer=%s", peer)
            conn.read_task = asyncio.create_task(self.read_loop(conn))
            await asyncio.wait([conn.read_task])
            # Let pipelined requests answer before closing.
            await until_idle([conn], CLOSE_WAIT_S if self.requests.draining else None)
        except Exception:
            log.exception("event=connection_failed peer=%s", peer)
        finally:
            for task in conn.tasks:
                # A task waits on the connection; a write's or lease's future waits on its
                # commit, which runs anyway: left alone, it answers the closed connection as
                # any other (a lease's jobs go back, ``Requests.answer_with_leases``).
                if isinstance(task, asyncio.Task):
                    task.cancel()
            if writer.transport.get_write_buffer_size():
                # A reply may still be buffered (its send cancelled above), and a client that
                # half-closed is still reading it: give it until the buffer empties, as long
                # as a slow reader gets. What is left then has no reader: drop it.
                await conn.flush(
                    CLOSE_WAIT_S if self.requests.draining else connection.SEND_TIMEOUT_S
                )
            dropped = bool(writer.transport.get_write_buffer_size())
            if dropped:
                conn.abort()
            # Cancelled sends: delivered if the flush got their lines to the kernel, lost if
            # it did not or the connection was lost meanwhile (a reset drops the buffer).
            conn.settle_undelivered()
            if not dropped and conn.read_task is not None:
                await conn.close_gracefully()
            elif not dropped:
                writer.close()
            # It re-raises what closed the transport (a fatal error the loop has logged).
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self.conns.discard(conn)  # only now: until closed, a shutdown must see it
            if isinstance(reader, FrameReader):
                reader.release()
            log.debug("event=disconnected peer=%s", peer)

    def evict_unauthenticated(self, ring: auth.KeyRing, host: str | None = None) -> bool:
        """With API keys on and every slot taken (of the server, or of ``host``'s address
        under ``RELAY_MAX_CONNECTIONS_PER_ADDRESS``), close the oldest connection (of that
        address) that has not completed a ``hello``, or whose key was revoked since (it gets
        ``TOO_MANY_CONNECTIONS``); return whether one was.

        Such a connection can only ping, so holding slots without a key buys nothing: a
        client with a key always gets in, however many keyless connections wait for their
        hello deadline. Connections with a live key are never closed for a newcomer.
        """
        if not ring.required:
            return False
        waiting = [
            c
            for c in self.conns
            if c.read_task is not None
            and not c.gone
            and not c.evicted
            and (
                c.principal is None
                or not c.principal.authenticated
                or not ring.is_active(c.principal.prefix)  # its key was revoked since
            )
            and (host is None or _host_of(c) == host)
        ]
        if not waiting:
            return False
        victim = min(waiting, key=lambda c: c.opened)
        victim.evicted = True
        held = self.evictions.due("evicted")
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
        victim.hang_up()
        assert victim.read_task is not None
        victim.read_task.cancel()  # its on_connect then lets it go
        return True

    def over_address_cap(self, peername: object) -> bool:
        """Whether the peer's address already holds ``RELAY_MAX_CONNECTIONS_PER_ADDRESS``
        connections (0: no cap)."""
        cap = relay_settings().max_connections_per_address
        if not cap or not isinstance(peername, tuple):
            return False
        host = peername[0]
        held = sum(1 for c in self.conns if _host_of(c) == host)
        return held >= cap  # this connection is not in the set yet

    async def read_loop(self, conn: Conn) -> None:
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
            required = (await self.requests.key_ring()).required
        except errors.RelayError:  # the table cannot be read now: requests will say so
            required = False
        conn.auth_by = auth_by = loop.time() + s.auth_timeout_ms / 1000 if required else None
        if auth_by is not None and auth_by - loop.time() <= idle_s:
            head = await conn.first_byte(auth_by - loop.time(), self._no_hello())
        else:
            head = await conn.first_byte(idle_s, errors.Timeout())
        if head is None:
            return
        task = asyncio.current_task()
        assert task is not None
        deadline = ReadDeadline(task)
        try:
            await self._read_requests(conn, head, active_at, deadline)
        finally:
            deadline.close()
            if isinstance(conn.reader, FrameReader):
                conn.reader.fast = None  # every byte from here on is buffered

    def fast_lines(
        self,
        conn: Conn,
        framed: FrameReader,
        deadline: ReadDeadline,
        max_frame_bytes: int,
        idle_s: float,
        data: bytes,
    ) -> int:
        """Start the requests of ``data``'s first whole lines as it arrives, while the read
        loop waits for a line with nothing buffered (``ConnProtocol.data_received``); return
        how many bytes of ``data`` it took (0: none).

        Each line passes what the read loop asks of it before it reads it (the reply budget,
        the input budget, a live key) and is decoded and started as the loop starts it. It
        stops at the first line it cannot start so, leaving that line and the rest to the
        loop, which reads them as before: an unfinished line, one longer than
        ``WEIGHED_LINE_BYTES``, one that does not decode, a ``hello``, a connection with no
        free in-flight slot, no reply budget for the frame, or a key that must be read
        again, revoked or missing. The loop's task waking, its stream reader's wait and its
        per-line checks were about 3% of a two-request lease+ack's server instructions and 8%
        of its Python bytecodes, 13% with 16 clients (docs/benchmarking.md, round 13); the
        ceiling server reads in ``Protocol`` callbacks too (``--reader protocol``).

        Args:
            conn, framed, deadline: the connection, its reader and its read loop's deadline.
            max_frame_bytes: ``RELAY_MAX_FRAME_BYTES``.
            idle_s: ``RELAY_IDLE_TIMEOUT_MS`` in seconds: a started line moves the idle
                deadline to that far from now.
        """
        if not deadline.reading or conn.gone or deadline.cancelling():
            return 0  # the loop is not in its read, or its task is being cancelled
        budget, requests = self.budget, self.requests
        start, size = 0, len(data)
        while start < size:
            end = data.find(b"\n", start)
            if end < 0 or end - start >= WEIGHED_LINE_BYTES:
                break
            if budget.over(conn) or (framed.taken and self.input.full(framed)):
                break
            principal = conn.principal
            if principal is not None and principal.authenticated:
                ring = auth.cached_ring()
                if ring is None or not ring.is_active(principal.prefix):
                    break
            elif conn.auth_by is not None:
                break  # it has a hello to make
            try:
                request = codec.decode_request(data[start : end + 1], max_frame_bytes)
            except errors.RelayError:
                break
            if request.op == "hello" or conn.slots.free <= 0:
                break
            held = requests.frame_for(request)
            if held and not budget.try_take(conn, held):
                break
            conn.slots.take()
            requests.start(conn, request, held)  # its reply frees the slot
            framed.fast_taken += 1
            start = end + 1
        if start:
            framed.fast_at = now = deadline.time()
            deadline.until = now + idle_s  # later than before: the loop's line was older
            framed.consumed_at = self.input.clock()
        return start

    @staticmethod
    def _no_hello() -> errors.RelayError:
        """The refusal of a connection that made no successful ``hello`` in time."""
        return errors.Unauthenticated(
            f"no successful hello within {relay_settings().auth_timeout_ms} ms"
        )

    async def _read_requests(
        self,
        conn: Conn,
        head: bytes,
        active_at: float,
        deadline: ReadDeadline,
    ) -> None:
        """``read_loop`` after the first byte (``head``): read, decode and start requests."""
        s = relay_settings()
        loop = asyncio.get_running_loop()
        idle_s = s.idle_timeout_ms / 1000
        reader = conn.reader
        framed = reader if isinstance(reader, FrameReader) else None
        request: codec.Request | None = None
        task: asyncio.Future[Any] | None = None
        fast_seen = 0  # framed.fast_taken when this loop last looked
        while True:
            if self.budget.over(conn):
                await self.budget.room(conn)
            if framed is not None and framed.taken and self.input.full(framed):
                await self.input.room(framed)  # the server holds too many request bytes
            principal = conn.principal
            if principal is not None and principal.authenticated:
                # Revoked: found before each line too, so a connection that only pings is
                # closed unless it says hello with another key (a review's kept their slots).
                # A stale snapshot is read again (on the key thread) but not waited for here:
                # a ping needs none (a review: pings waited out a locked key table, 1.9 s).
                # The connection is checked when the read ends; every other request waits
                # for it anyway.
                ring = auth.cached_ring()
                if ring is None:
                    reading = self.requests.read_ring()
                    if conn.rechecked_by is not reading:  # once a read, however many lines
                        conn.rechecked_by = reading
                        reading.add_done_callback(functools.partial(_recheck, conn, principal))
                elif not ring.is_active(principal.prefix):
                    conn.unauthenticate(revoked=True)
            auth_by = conn.auth_by  # later if it loses its key (Conn.unauthenticate)
            authed = auth_by is None or (
                conn.principal is not None and conn.principal.authenticated
            )
            until = active_at + idle_s
            if not authed:
                assert auth_by is not None
                until = min(until, auth_by)
            deadline.start(until)
            try:
                try:
                    line = head + await conn.reader.readuntil(b"\n")
                finally:
                    deadline.reading = False
            except asyncio.CancelledError:
                if not deadline.expired():
                    raise
                if framed is not None:
                    active_at = max(active_at, framed.fast_at)
                auth_by = conn.auth_by
                authed = auth_by is None or (
                    conn.principal is not None and conn.principal.authenticated
                )
                if not authed and loop.time() >= auth_by:  # type: ignore[operator]
                    log.debug("event=auth_timeout peer=%s", conn.peer)
                    await conn.send(codec.encode_error(None, self._no_hello()))
                    return
                active_at = max(active_at, conn.busy_until)
                if loop.time() < active_at + idle_s:  # woken early (a hello deadline, a
                    continue  # request that ended since): wait on from the later one
                if conn.tasks:  # a request in progress (a long-poll) is not idleness:
                    active_at = loop.time()  # idleness starts again when the last one ends
                    for task in conn.tasks:
                        task.add_done_callback(conn.ended)
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
                await self.refuse_frame(conn, exc)
                return
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                log.debug("event=eof peer=%s error=%r", conn.peer, exc)
                conn.hang_up()
                return
            if framed is not None and framed.fast_taken != fast_seen:
                # The fast path started lines while this read waited: what the loop checked
                # before the read (budgets, the key) is checked again before this line.
                fast_seen = framed.fast_taken
                active_at = max(active_at, framed.fast_at)
                framed.unread(line)
                continue
            first, head = bool(head), b""
            if first and framed is not None:
                # From the second line on, lines that arrive while the loop waits for one
                # may start at once (``fast_lines``).
                framed.fast = functools.partial(
                    self.fast_lines, conn, framed, deadline, s.max_frame_bytes, idle_s
                )
            ticket: Ticket | None = None
            if framed is not None and len(line) > WEIGHED_LINE_BYTES:
                # Counted, as what it will decode to, from before it is decoded until its
                # request ends; past the limit it waits (InputBudget.admit).
                weight = line_weight(line)
                if weight > COUNTED_LINE_BYTES:
                    ticket = await self.input.admit(framed, weight)
            try:
                try:
                    request = codec.decode_request(line, s.max_frame_bytes)
                except errors.FrameTooLarge as exc:
                    await self.refuse_frame(conn, exc)
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
                if ticket is not None and not holds_its_arguments(request.op):
                    # A read or lease keeps little of its line once decoded, and a long-poll
                    # may wait 20 s: it gives its bytes back now (a review padded long-poll
                    # lines with 1 MB of spaces and held every large write back for 18 s).
                    ticket.end()
                    ticket = None
                if not conn.slots.take():  # at most max_inflight per connection: else stop
                    await conn.slots.wait()
                held = self.requests.frame_for(request)
                if held and not self.budget.try_take(conn, held):
                    await self.budget.reserve(conn, held)  # without reading on
                    if conn.gone or conn.writer.is_closing():  # reset meanwhile: run nothing
                        self.budget.give(conn, held)
                        return
                task = self.requests.start(conn, request, held)  # its reply frees the slot
                if ticket is not None:
                    task.add_done_callback(ticket.end)
                    ticket = None  # its request's end ends it
                if request.op == "hello":
                    # What follows a hello, even in the same write, runs as the hello leaves
                    # the connection: read on only once it is decided.
                    await asyncio.wait([task])
            finally:
                if ticket is not None:  # not started: refused, or the connection ends
                    ticket.end()
                # Nothing of this line outlives its request: the next wait (for a line, for
                # room, for admission) would otherwise keep its decoded arguments, and 30
                # connections each kept a 24 MiB batch of objects past its end (865 MiB).
                line = b""
                request = None
                task = None

    async def refuse_frame(self, conn: Conn, exc: errors.FrameTooLarge) -> None:
        """Reply FRAME_TOO_LARGE and answer the requests before it; the connection then
        closes gracefully (``Conn.close_gracefully``: the rest of the frame is thrown away,
        never buffered)."""
        log.debug("event=frame_too_large peer=%s", conn.peer)
        # The connection ends here: its long-polls stop waiting (a claim that lands now is
        # given back), and the requests it sent before the oversize frame are answered first.
        conn.hang_up()
        await conn.send(codec.encode_error(None, exc))
        await until_idle([conn], CLOSE_WAIT_S)


def _recheck(conn: Conn, principal: auth.Principal, reading: asyncio.Future[auth.KeyRing]) -> None:
    """A key snapshot the read loop asked for has been read: when ``conn`` still runs as
    ``principal`` and its key was revoked, it must say ``hello`` again (``unauthenticate``),
    as if the loop had waited for the snapshot (a connection that only pings more than a
    second apart found every snapshot stale, and was never asked: a review)."""
    if reading.cancelled() or reading.exception() is not None:
        return  # the table could not be read: its next request says so
    if conn.principal is principal and not reading.result().is_active(principal.prefix):
        conn.unauthenticate(revoked=True)
