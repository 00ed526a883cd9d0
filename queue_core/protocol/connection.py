"""One client connection: its state, reply sending with back-pressure, and reply lines.

``Conn`` is touched by the event-loop thread only. Replies go out one at a time, each after
the previous one drained, so a client that reads nothing pins at most
``max_inflight_per_connection`` replies (each at most a frame), counted in the server's
``ReplyBudget``, and is cut off after ``SEND_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable, Iterable
from typing import Any

from queue_core import auth, errors, metrics
from queue_core.conf import relay_settings
from queue_core.protocol import codec, limits
from queue_core.protocol.budget import ReplyBudget

log = logging.getLogger("relay.server")

CLOSE_WAIT_S = 2.0  # how long a closing connection waits for its in-flight requests
LINGER_S = 1.0  # how long input is discarded after FRAME_TOO_LARGE before closing
# A client that reads no reply for this long is cut off: its unread replies are the only
# memory a connection can pin (at most max_inflight_per_connection of them, each <= 1 frame).
SEND_TIMEOUT_S = 30.0
# A client whose kernel send queue holds at most this many reply bytes keeps up with its
# replies (``Conn.keeps_up``).
KEEPING_UP_BYTES = 64 * 1024
# Replies that handed out jobs and are with the kernel, perhaps not yet sent on to the client
# (``Conn.in_kernel``): those sent are forgotten each time this many bytes of such replies
# were written since the last look, and those spanning more than IN_KERNEL_MAX_BYTES of the
# connection's output are forgotten oldest first (their jobs' fences take about 2.6 bytes
# of memory a byte of one-job lease replies: a hostile review).
IN_KERNEL_PRUNE_BYTES = 64 * 1024
IN_KERNEL_MAX_BYTES = 1024 * 1024
# SO_LINGER on, with a timeout of 0: closing the socket resets the connection (``Conn.abort``).
RESET_ON_CLOSE = struct.pack("ii", 1, 0)


class Slots:
    """The in-flight requests a connection may still start
    (``RELAY_MAX_INFLIGHT_PER_CONNECTION``): an ``asyncio.Semaphore`` for one waiter, the
    connection's read loop, which takes a free slot without a coroutine (``take``) and waits
    only when none is free (``wait``). The library's semaphore made a coroutine and scanned
    its waiters on every request.

    Args:
        free: slots free at the start.
    """

    __slots__ = ("_waiter", "free")

    def __init__(self, free: int) -> None:
        self.free = free
        self._waiter: asyncio.Future[None] | None = None

    def take(self) -> bool:
        """Take a slot if one is free; False (nothing taken) if none is."""
        if self.free > 0:
            self.free -= 1
            return True
        return False

    async def wait(self) -> None:
        """Take a slot, waiting until one is released (one caller at a time)."""
        while self.free <= 0:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        self.free -= 1

    def release(self) -> None:
        """Give a slot back, waking the waiter."""
        self.free += 1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclasses.dataclass(eq=False, slots=True)
class Conn:
    """One client connection (event-loop thread only)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    peer: str
    slots: Slots  # in-flight requests left
    budget: ReplyBudget  # the server's reply-byte budget
    # Its requests in progress (tasks, or the writer futures of writes) and reply sends.
    tasks: set[asyncio.Future[Any]] = dataclasses.field(default_factory=set)
    waiting: set[asyncio.Event] = dataclasses.field(default_factory=set)  # its long-polls
    # Its writes waiting for the key table's read, in the order they were read, each with
    # the future that ends with its answer (``requests.Requests.start``): a later write
    # queues behind them, so the connection's writes are committed in the order it sent them.
    ring_queue: collections.deque[tuple[Any, Any, asyncio.Future[None]]] = dataclasses.field(
        default_factory=collections.deque
    )
    read_task: asyncio.Task[None] | None = None
    gone: bool = False  # the client closed its side: long-polls stop waiting
    eof_sent: bool = False  # we closed our side (after FRAME_TOO_LARGE): nothing more to send
    principal: auth.Principal | None = None  # set by a successful hello
    key_revoked: bool = False  # it lost its key to a revoke (its refusals say so)
    # The key table's read that will check it for a revoke (``Listener``: one a read).
    rechecked_by: asyncio.Future[Any] | None = None
    # Loop time by which it must hold a key (keys required): RELAY_AUTH_TIMEOUT_MS from its
    # connect, or from when it lost the key it had (``unauthenticate``). None: no deadline.
    auth_by: float | None = None
    # The principal its requests last ran as, and their ``dispatch.Context`` (``admit``).
    context: tuple[Any, Any] | None = None
    send_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    unsent: int = 0  # reply bytes reserved or not yet taken by the kernel (ReplyBudget)
    drained_at: float = 0.0  # loop time it last held nothing or gave bytes back
    cut_off: bool = False  # cut by the reply budget
    turn: asyncio.Lock | None = None  # its reserves' turn to wait for room (ReplyBudget)
    bad_frames: int = 0  # malformed lines so far
    opened: float = dataclasses.field(default_factory=time.monotonic)
    evicted: bool = False  # closed to make room for a newcomer (never authenticated)
    # Loop time the last request that outlived an idle deadline ended (``ended``): the
    # connection is idle only from then on.
    busy_until: float = 0.0
    written: int = 0  # reply bytes handed to the transport so far: the end offset of each
    # Of ``written``, what had reached the kernel when ``abort`` dropped the rest; None
    # before an abort.
    kernel_had: int | None = None
    # Sends cancelled midway (their tasks cancelled as the connection closed): the end offset
    # of each line and what to call should it not reach the kernel after all (``send``'s
    # ``lost``), decided by ``settle_undelivered``.
    undelivered: list[tuple[int, Callable[[], object]]] = dataclasses.field(default_factory=list)
    # Replies that handed out jobs, whole with the kernel but perhaps not yet sent on: the end
    # offset of each and its ``lost``, oldest first (``handed``, ``give_back_untransmitted``).
    in_kernel: collections.deque[tuple[int, Callable[[], object]]] = dataclasses.field(
        default_factory=collections.deque
    )
    # The offset (of ``written``) past which in_kernel is next looked over (``handed``).
    prune_at: int = dataclasses.field(default_factory=lambda: IN_KERNEL_PRUNE_BYTES)
    # Once the connection was reset (ours or the client's): the offset the kernel had sent up
    # to, what the client may have (None: it could not be told); ``handed`` judges late
    # replies by it.
    reset_at: int | None = None
    was_reset: bool = False
    resetting: bool = False  # ``abort`` asked for a reset: its socket closes with one
    forgot: bool = False  # ``handed`` forgot unsent replies past IN_KERNEL_MAX_BYTES

    def unauthenticate(self, *, revoked: bool = False) -> None:
        """Forget the connection's key (refused at a later ``hello``, or ``revoked``): it may
        only ping again, may be evicted for a newcomer, and has ``RELAY_AUTH_TIMEOUT_MS``
        from now to say ``hello`` with another key before it is closed. A connection that
        never held a key keeps the deadline it had. While it holds none after a revoke, its
        requests are refused as revoked, not as missing a key."""
        had = self.principal is not None and self.principal.authenticated
        self.principal = None
        self.key_revoked = revoked
        if had:
            timeout_s = relay_settings().auth_timeout_ms / 1000
            self.auth_by = asyncio.get_running_loop().time() + timeout_s

    async def send(self, line: bytes, lost: Callable[[], object] | None = None) -> bool:
        """Write one reply line and wait until all of it is with the kernel; return whether
        it got there.

        Replies go out one at a time, each after the previous one drained, so at most one
        frame sits in the socket buffer. A client that reads nothing for ``SEND_TIMEOUT_S`` is
        disconnected (``abort``), which frees what its replies hold.

        Args:
            lost: called (once) when this task is cancelled (the connection closing) before
                the line reached the kernel: at once when nothing of it was written yet, else
                when the connection ends with it unsent (``settle_undelivered``). A reply
                that hands out jobs gives them back this way
                (``requests.Requests.give_back``).
        """
        end: int | None = None
        try:
            async with self.send_lock:
                if self.writer.is_closing() or self.eof_sent:
                    return False
                end = self._write(line)
                if self.writer.transport.get_write_buffer_size():
                    if not (await self._drained() and self.reached_kernel(end)):
                        return False
                elif self.writer.is_closing():
                    return False  # a failed write closes the transport: not sent
                # Else the kernel took the whole line at once (the usual case).
                if lost is not None:
                    self.handed(end, lost)
                return True
        except asyncio.CancelledError:
            self.cancelled_send(lost, end)
            raise

    def _write(self, line: bytes) -> int:
        """Hand ``line`` to the transport; return its end offset (``written``)."""
        self.writer.write(line)
        self.written += len(line)
        return self.written

    def reached_kernel(self, end: int) -> bool:
        """Whether every reply byte up to offset ``end`` has gone to the kernel: not when an
        ``abort`` dropped some of them, nor when the connection was lost (a reset) and the
        transport threw its buffer away, what it held then unknown."""
        if self.kernel_had is not None:
            return self.kernel_had >= end
        if self.writer.is_closing():
            return False
        return self.written - self.writer.transport.get_write_buffer_size() >= end

    def cancelled_send(self, lost: Callable[[], object] | None, end: int | None) -> None:
        """A send was cancelled: call ``lost`` now if nothing of its line was written
        (``end`` None); keep it for ``settle_undelivered`` if part is still unsent (the rest
        may yet go out while the connection closes)."""
        if lost is None:
            return
        if end is None:
            lost()
        elif not self.reached_kernel(end):
            self.undelivered.append((end, lost))

    def settle_undelivered(self) -> None:
        """Call ``lost`` for each cancelled send whose line did not all reach the kernel, and
        forget them (``abort``, and the end of the connection)."""
        undelivered, self.undelivered = self.undelivered, []
        for end, lost in undelivered:
            if not self.reached_kernel(end):
                lost()
            else:
                self.handed(end, lost)

    def handed(self, end: int, lost: Callable[[], object]) -> None:
        """A reply that hands out jobs is whole with the kernel, up to offset ``end``
        (``written``): remember its ``lost`` until the kernel has sent all of it on, so a reset
        (``abort``, or the client's) can give its jobs back (``give_back_untransmitted``). A
        send that learns it only after the reset (its task resumed late) is judged at once.

        Each ``IN_KERNEL_PRUNE_BYTES`` of output one reading of the socket (``transmitted``)
        forgets those sent; those spanning more than ``IN_KERNEL_MAX_BYTES`` are forgotten
        oldest first, and the connection then ends as before, with a FIN (``abort``)."""
        if self.was_reset:
            if self.reset_at is not None and end > self.reset_at:
                lost()
            return
        in_kernel = self.in_kernel
        in_kernel.append((end, lost))
        if end >= self.prune_at:
            self.prune_at = end + IN_KERNEL_PRUNE_BYTES
            sent = self.transmitted()
            if sent is not None:
                while in_kernel and in_kernel[0][0] <= sent:
                    in_kernel.popleft()
            while in_kernel and end - in_kernel[0][0] > IN_KERNEL_MAX_BYTES:
                in_kernel.popleft()
                self.forgot = True

    def transmitted(self) -> int | None:
        """The offset (of ``written``) up to which our bytes have left for the client
        (``limits.bytes_transmitted``: acknowledged, or in flight): a reset destroys the
        rest unread. None where it cannot be told (a closed socket, not Linux)."""
        return limits.bytes_transmitted(self.writer.get_extra_info("socket"))

    def give_back_untransmitted(self) -> None:
        """As the connection's socket closes after our reset (``abort``), or the client's
        reset is seen (``listener.ConnProtocol.connection_lost``, just before the transport
        closes the socket): call ``lost`` for each reply the kernel had not all sent on (the
        reset destroys it unread), and forget them all, so a job whose reply never arrives
        does not stay leased until its lease expires.

        What was sent counts as received, acknowledged or not: the client's kernel may hold
        it with its ACK delayed (readable after the reset, and perhaps read before the
        client's own), and a job given back although its client has it would run twice. So
        the jobs of replies sent but lost on the way stay leased, as any lost reply's."""
        if self.was_reset:
            return
        self.was_reset = True
        sent = self.reset_at = self.transmitted()
        in_kernel, self.in_kernel = self.in_kernel, collections.deque()
        if sent is None:
            return  # the socket is gone: what it sent is not known, so nothing goes back
        for end, lost in in_kernel:
            if end > sent:
                lost()

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

    def reply_soon(self, line: bytes, lost: Callable[[], object] | None = None) -> None:
        """Send a write's reply, and free its in-flight slot once the kernel has it.

        Written at once when no reply is queued before it (the usual case); otherwise, or for
        the part the kernel did not take, a task waits its turn and the drain as ``send``
        does, so a connection still pins at most ``max_inflight_per_connection`` replies and
        a reader silent for ``SEND_TIMEOUT_S`` is cut off.

        Args:
            lost: called (once) when the line does not all reach the kernel: dropped, cut
                off, or the connection closing before it went out (``send``). A reply that
                hands out jobs gives them back this way (``requests.Requests.give_back``).
        """
        now = self.write_now(line)
        if now in ("dropped", "sent"):
            if lost is not None:
                if now == "dropped":
                    lost()
                else:
                    self.handed(self.written, lost)
            self.slots.release()
            return
        # Buffered: its end offset is what the transport has been given so far.
        pending = _Pending(self, line, lost, None if now is None else self.written)
        self.budget.take(self, len(line))  # held until sent or dropped
        task = asyncio.ensure_future(pending.send())
        self.tasks.add(task)
        task.add_done_callback(self.done)
        task.add_done_callback(pending.ended)

    def write_now(self, line: bytes) -> str | None:
        """Write ``line`` at once when no reply is queued before it; no task, no wait.

        Returns:
            None: a reply is queued or draining (nothing written: ``send`` it in turn);
            ``"sent"``: the kernel took all of it; ``"dropped"``: the connection is closing or
            we closed our side (nothing written, as ``send`` drops it), or the write failed;
            ``"buffered"``: the kernel took part of it, the rest waits in the transport
            (``drain_written`` waits for it, holding the send turn).
        """
        if self.send_lock.locked() or self.writer.transport.get_write_buffer_size():
            return None
        if self.writer.is_closing() or self.eof_sent:
            return "dropped"
        self._write(line)
        if self.writer.transport.get_write_buffer_size():
            return "buffered"
        # A failed write closes the transport: reported as not sent.
        return "dropped" if self.writer.is_closing() else "sent"

    async def drain_written(
        self, lost: Callable[[], object] | None = None, end: int | None = None
    ) -> bool:
        """Wait, holding the send turn, until a line ``write_now`` buffered has gone out;
        return whether it did (see ``_drained``). ``end``: the line's end offset
        (``written`` just after ``write_now``; default: all written so far); ``lost``: see
        ``send``."""
        end = self.written if end is None else end
        try:
            async with self.send_lock:
                if not (await self._drained() and self.reached_kernel(end)):
                    return False
        except asyncio.CancelledError:
            self.cancelled_send(lost, end)
            raise
        if lost is not None:
            self.handed(end, lost)
        return True

    async def close_gracefully(self) -> None:
        """Close our side (FIN), discard what the client still sends for up to ``LINGER_S``,
        then close.

        Closing a socket with unread input makes the kernel send a reset, which also destroys
        replies the client has not read yet (a shutdown while it pipelines requests, an
        oversize frame behind its requests); a client still sending its oversize frame would
        see "connection reset" instead of the error. So the rest is read and thrown away first.

        A client that has not closed its side by then while replies that hand out jobs still
        wait in our kernel unsent (its window shut: it reads slowly or not at all) is reset
        (``abort``; a FIN still where it forgot replies), and those jobs go back: a reset,
        ours (input unread at the close) or its kernel's (input arriving after it), would
        destroy them unread, and they would stay leased until their leases expired.
        """
        with contextlib.suppress(Exception):
            if not self.eof_sent and self.writer.can_write_eof():
                self.eof_sent = True
                self.writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await self.reader.read(65536):
                    pass
        if self.in_kernel and not self.reader.at_eof():
            sent = self.transmitted()
            if sent is not None and sent < self.in_kernel[-1][0]:
                self.abort()
                return
        self.writer.close()

    def abort(self) -> None:
        """Reset the connection at once (``SO_LINGER`` 0; a FIN once ``handed`` forgot
        replies), unsent replies included, in the transport and in the kernel: cancelled
        sends whose line had not all reached the kernel are reported lost (``send``'s
        ``lost``), a send waiting for the drain learns it from ``reached_kernel``, and the
        jobs of replies the kernel had not sent on go back as the socket closes
        (``give_back_untransmitted``, from the protocol's ``connection_lost``)."""
        self.hang_up()
        if self.kernel_had is None:
            self.kernel_had = self.written - self.writer.transport.get_write_buffer_size()
        self.settle_undelivered()
        # A reset, not a FIN: else the kernel would go on sending what it holds (an orphaned
        # socket) to a client that may read it, and jobs given back would run twice. The
        # give-back waits for ``connection_lost`` (``listener.ConnProtocol``): the transport
        # closes the socket only then, and until it does the kernel goes on sending (a review
        # saw 37-74 KB more a connection, up to 298 jobs read after they went back).
        # A connection that forgot unsent replies (``handed``) closes as before, with a FIN:
        # the kernel goes on sending what it holds, and none of its jobs goes back; a reset
        # would strand the forgotten ones where their client could still have read them.
        # (A closed socket: uvloop's raises ValueError, a negative file descriptor.)
        if not self.forgot:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sock = self.writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET_ON_CLOSE)
            self.resetting = True
        self.writer.transport.abort()

    def backed_up(self) -> bool:
        """Whether reply bytes wait in the transport for the client to read (``ReplyBudget``:
        only such a connection is cut for holding the server's budget)."""
        return bool(self.writer.transport.get_write_buffer_size())

    def keeps_up(self) -> bool:
        """Whether the client reads what it was sent: the kernel holds at most
        ``KEEPING_UP_BYTES`` of it unsent or unacknowledged (Linux ``SIOCOUTQ``). Asked only
        over the server budget (``ReplyBudget.fits``): a client that left a megabyte of
        replies in the kernel takes no frame beyond it. True where it cannot be told."""
        queued = limits.kernel_queue(self.writer.get_extra_info("socket"), termios.TIOCOUTQ)
        return queued is None or queued <= KEEPING_UP_BYTES

    def ended(self, task: asyncio.Future[Any]) -> None:
        """A request that was in progress at an idle deadline ended: idleness counts from now
        (``listener.Listener._read_requests``)."""
        self.busy_until = asyncio.get_running_loop().time()

    def done(self, task: asyncio.Future[Any]) -> None:
        """Forget a finished request and free its in-flight slot."""
        self.tasks.discard(task)
        self.slots.release()

    def hang_up(self) -> None:
        """The connection ends: its long-polls stop waiting (a claim that lands now is given
        back, ``requests.Requests.lease``)."""
        self.gone = True
        for event in self.waiting:
            event.set()

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the connection's write buffer to empty."""
        transport = self.writer.transport
        if transport.is_closing():
            return
        # drain() waits for an empty buffer: the listener set the high-water mark to 0.
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(self.writer.drain(), timeout_s)

    async def first_byte(self, timeout_s: float, late: errors.RelayError) -> bytes | None:
        """Read the connection's first byte within ``timeout_s`` (seconds); None (after an
        error line: ``late`` when none came in time, the idle ``Timeout`` or, with API keys
        on and the hello deadline first, ``Unauthenticated``; or at EOF) when it cannot begin
        a JSON request: an HTTP request line or a TLS hello ends here, before anything runs (a
        browser's cross-origin POST must not reach the NDJSON body)."""
        try:
            async with asyncio.timeout(timeout_s):
                head = await self.reader.readexactly(1)
        except TimeoutError:
            await self.send(codec.encode_error(None, late))
            return None
        except (asyncio.IncompleteReadError, ConnectionError):
            self.gone = True
            return None
        if head not in b"{ \t\r":
            log.debug("event=not_ndjson peer=%s first_byte=%r", self.peer, head)
            refusal = errors.BadFrame("not an NDJSON request: a line must be a JSON object")
            await self.send(codec.encode_error(None, refusal))
            return None
        return head


@dataclasses.dataclass(slots=True)
class _Pending:
    """A reply ``Conn.reply_soon`` could not write whole at once, sent in its turn by a task.

    Attributes:
        conn: the connection; its reply budget holds ``len(line)`` until ``ended``.
        line: the reply.
        lost: see ``Conn.reply_soon``: called when it does not all reach the kernel, also
            when the task is cancelled (the connection closing) before it ran.
        end: ``Conn.write_now`` already put part of it in the transport: its end offset
            (``Conn.written``); None when nothing of it was written yet.
    """

    conn: Conn
    line: bytes
    lost: Callable[[], object] | None
    end: int | None
    started: bool = False

    async def send(self) -> None:
        self.started = True
        conn = self.conn
        if self.end is not None:
            sent = await conn.drain_written(self.lost, self.end)
        else:
            sent = await conn.send(self.line, self.lost)
        if not sent and self.lost is not None:
            self.lost()

    def ended(self, task: asyncio.Future[Any]) -> None:
        self.conn.budget.give(self.conn, len(self.line))
        if task.cancelled() and not self.started:  # cancelled before it ran: as send would
            self.conn.cancelled_send(self.lost, self.end)


async def until_idle(conns: Iterable[Conn], timeout_s: float | None) -> None:
    """Wait until ``conns`` have no request or reply send in progress, or ``timeout_s`` passes.

    The set is read again after each wait: a write's reply may start a send task
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


def reply_line(request: codec.Request, result: dict[str, Any]) -> bytes:
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


def error_line(request: codec.Request, exc: BaseException) -> bytes:
    """The error reply line of ``request`` (a bug is logged and answered ``INTERNAL``)."""
    if isinstance(exc, errors.RelayError):
        metrics.rejected(request.op, exc)
        return codec.encode_error(request.id, exc)
    log.error("event=internal_error op=%s", request.op, exc_info=exc)
    return codec.encode_error(request.id, errors.Internal())
