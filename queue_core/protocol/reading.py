"""The request bytes the TCP server holds: a connection's read-ahead, all of them, and the
lines of the requests in progress.

Per connection, ``FrameReader`` (the ``StreamReader`` every connection reads through) stops
reading its socket once ``READ_AHEAD_BYTES`` of whole lines wait for the read loop; one line
may still take up to the frame limit while it arrives. Per server, ``InputBudget`` counts
every reader's buffered bytes: past ``RELAY_MAX_BUFFERED_REQUEST_BYTES`` connections are cut
off, after a ``TIMEOUT`` error line, until the rest fit: first those whose read loop has taken
no line for ``STALL_S`` while whole lines wait (their client pipelines past its in-flight
slots or leaves its replies unread), then those whose unfinished line began longest ago, at
least ``STALL_S`` ago. Without it, 1,000 connections that each sent a megabyte
without its newline held 1,084 MiB of the server's memory until their idle timeout (a
hostile review); a request line that is still arriving a second after it began is a slow or
hostile client's, as nginx's ``client_header_timeout`` and Redis's query-buffer limit judge.

Request lines count too while their requests run, as what they will decode to
(``line_weight``): a line that weighs more than ``COUNTED_LINE_BYTES`` waits its turn, first
come first served, before it is decoded, until the requests in progress leave it room under
a sixteenth of the limit (``admit``, ``ADMIT_SHARE``: they wait in the writer's queue ahead of
every small request; one may always start when nothing is in progress), and past the
limit a connection with such a request in progress takes no further line (``full``,
``room``). Without it, 30 clients pipelining 1 MB ``submit_batch`` lines faster than the
writer committed them held 978 MiB in requests in progress (up to 64 per connection,
``RELAY_MAX_INFLIGHT_PER_CONNECTION``), and 1 MB lines of empty objects (23 MiB decoded)
2.2 GB.

Everything here runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from queue_core import errors, metrics
from queue_core.protocol import codec

log = logging.getLogger("relay.server")

# Whole frames a connection may have read ahead of its read loop (bytes): past this, with a
# frame complete in the buffer, the socket is not read until the loop catches up.
READ_AHEAD_BYTES = 64 * 1024
STALL_S = 1.0  # past the server's limit, an unfinished line this old gets its connection cut
# Lines that will decode to more than this (``line_weight``) count while their requests run
# (``InputBudget.admit``). Lines up to WEIGHED_LINE_BYTES long are not even weighed (almost
# every request: one length compare): such a line decodes to at most about 18 KiB, and with
# at most 64 in flight per connection (RELAY_MAX_INFLIGHT_PER_CONNECTION) a connection holds
# at most about 1.2 MiB of them. Before lines of 4 KiB were weighed, 200 clients pipelining
# 3,977-byte lines of empty objects held 1.3 GB uncounted (hostile review).
COUNTED_LINE_BYTES = 4096
WEIGHED_LINE_BYTES = 256
# What one JSON object or array costs once decoded, beyond its bytes (an empty dict is 64
# bytes, a list 56, plus the reference that holds it): line_weight's estimate.
DECODED_CONTAINER_BYTES = 72
# The share of RELAY_MAX_BUFFERED_REQUEST_BYTES that counted lines in progress may hold
# (``InputBudget.admit_limit``): with the whole of it, 30 clients pipelining 1 MB batches kept
# 64 MiB queued for the writer ahead of every small request, first come first served.
ADMIT_SHARE = 16


def line_weight(line: bytes) -> int:
    """What a request line will hold in memory once decoded, estimated in bytes: its length,
    plus ``DECODED_CONTAINER_BYTES`` for each object or array it opens (brackets inside
    strings count too: the estimate errs high). A 1 MB batch of payloads like
    ``[{},{},...]`` decodes to 23 MiB of objects: counted by its length alone, 30 clients
    held 2.2 GB while the budget saw 87 MiB (hostile review)."""
    return len(line) + DECODED_CONTAINER_BYTES * (line.count(b"{") + line.count(b"["))


class Owner(Protocol):
    """What the budget needs of a reader's connection (``connection.Conn``)."""

    peer: str

    def write_now(self, line: bytes) -> str | None: ...

    def abort(self) -> None: ...


class FrameReader(asyncio.StreamReader):
    """A ``StreamReader`` that stops reading the socket once whole frames wait in its buffer,
    and reports what it buffers to the server's ``InputBudget``.

    asyncio's reader pauses only past twice its limit (the frame limit), so a client that
    pipelines requests while its read loop waits (for an in-flight slot, or for its reply
    budget) had up to 2 MiB of them buffered in the server, per connection: 160 such clients
    took a server to 688 MiB. Here reading also pauses when more than ``read_ahead`` bytes
    are buffered and at least one frame in them is complete, and resumes once the loop has
    consumed them below that (or when no complete frame is left: one frame may take up to
    the limit, as before). The rest waits in the kernel, where TCP's window holds the client
    back.

    Args:
        limit: the longest line in bytes (the frame limit + its newline).
        budget: the server's count of buffered request bytes.
        read_ahead: bytes of whole frames to buffer at most (``READ_AHEAD_BYTES``).
    """

    # asyncio's StreamReader's own (private) state, the same in CPython 3.8 through 3.14.
    _buffer: bytearray
    _limit: int
    _paused: bool
    _eof: bool
    _exception: BaseException | None
    _waiter: asyncio.Future[None] | None
    _transport: Any  # a transport, or None (uvloop's is no asyncio.ReadTransport)
    _wait_for_data: Callable[[str], Awaitable[None]]

    def __init__(self, limit: int, budget: InputBudget, read_ahead: int = READ_AHEAD_BYTES) -> None:
        super().__init__(limit=limit)
        self._read_ahead = read_ahead
        self.budget = budget
        self.counted = 0  # bytes of the buffer the budget holds
        self.partial_since: float | None = None  # clock time its unfinished line began
        self.consumed_at = budget.clock()  # clock time its read loop last took a line
        self.owner: Owner | None = None  # its connection, once the listener has one
        self.taken = 0  # bytes of its lines whose requests are in progress (InputBudget.started)
        self.waiter: asyncio.Future[None] | None = None  # its read loop's wait for room
        # Its read loop's fast path (``listener.Listener.fast_lines``), while the loop waits
        # for a line: given whole lines as they arrive, it returns how many bytes it started
        # as requests (``ConnProtocol.data_received``). None: every byte goes to the buffer.
        self.fast: Callable[[bytes], int] | None = None
        self.fast_taken = 0  # lines the fast path started
        self.fast_at = 0.0  # loop time (s) it last started one
        budget.readers.add(self)

    def feed_data(self, data: bytes) -> None:  # type: ignore[override]
        # asyncio's own feed_data and _wakeup_waiter, in one call: the buffer, the waiting
        # read woken, and past twice the limit the transport paused whatever it holds.
        assert not self._eof, "feed_data after feed_eof"
        if not data:
            return
        buffer = self._buffer
        buffer.extend(data)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.cancelled():
                waiter.set_result(None)
        if buffer.endswith(b"\n"):
            self.partial_since = None
        elif self.partial_since is None or b"\n" in data:
            self.partial_since = self.budget.clock()  # a line began in ``data``
        size = len(buffer)
        if (
            not self._paused
            and self._transport is not None
            and (size > 2 * self._limit or (size > self._read_ahead and buffer.find(b"\n") >= 0))
        ):
            try:
                self._transport.pause_reading()
            except NotImplementedError:  # as asyncio: a transport that cannot pause
                self._transport = None
            else:
                self._paused = True
        self.budget.recount(self)

    def _maybe_resume_transport(self) -> None:
        # Called by every read after it took bytes from the buffer.
        buffer = self._buffer
        if not buffer:
            self.partial_since = None
        if self.counted != len(buffer):
            self.consumed_at = self.budget.clock()
            self.budget.recount(self)
        if not self._paused or len(buffer) > self._limit:
            return
        if len(buffer) <= self._read_ahead or buffer.find(b"\n") < 0:
            self._paused = False
            self._transport.resume_reading()

    async def readuntil(  # type: ignore[override]  # asyncio's takes any buffer; we, bytes
        self, separator: bytes | tuple[bytes, ...] = b"\n"
    ) -> bytes:
        """``StreamReader.readuntil``, for a newline in fewer steps (the read loop's every
        line); any other separator is asyncio's own. Its errors are asyncio's:
        ``LimitOverrunError`` past the limit (the bytes stay buffered), ``IncompleteReadError``
        at EOF without a newline (the buffer is emptied into it)."""
        if separator != b"\n":
            return await super().readuntil(separator)
        if self._exception is not None:
            raise self._exception
        buffer = self._buffer
        offset = 0
        while True:
            end = buffer.find(b"\n", offset)
            if end >= 0:
                break
            offset = len(buffer)
            if offset > self._limit:
                raise asyncio.LimitOverrunError(
                    "Separator is not found, and chunk exceed the limit", offset
                )
            if self._eof:
                chunk = bytes(buffer)
                buffer.clear()
                raise asyncio.IncompleteReadError(chunk, None)
            await self._wait_for_data("readuntil")
        if end > self._limit:
            raise asyncio.LimitOverrunError(
                "Separator is found, but chunk is longer than limit", end
            )
        line = bytes(buffer[: end + 1])
        del buffer[: end + 1]
        self._maybe_resume_transport()
        return line

    def unread(self, line: bytes) -> None:
        """Put ``line``, which ``readuntil`` returned, back at the head of the buffer: the read
        loop judges it again before it takes it."""
        self._buffer[:0] = line
        self.budget.recount(self)

    def release(self) -> None:
        """Drop what it buffers and leave the budget (its connection ended or was cut)."""
        self._buffer.clear()
        self.partial_since = None
        self.budget.recount(self)
        self.budget.readers.discard(self)


class Ticket:
    """A line counted by ``InputBudget.admit``; ``end`` (idempotent, and a done-callback) gives
    its bytes back."""

    __slots__ = ("budget", "done", "reader", "size")

    def __init__(self, budget: InputBudget, reader: FrameReader, size: int) -> None:
        self.budget = budget
        self.reader = reader
        self.size = size
        self.done = False

    def end(self, _future: object = None) -> None:
        """Its request ended (or never started): give its bytes back, once."""
        if not self.done:
            self.done = True
            self.budget.ended(self.reader, self.size)


class InputBudget:
    """Request bytes buffered by all connections' ``FrameReader``s.

    Args:
        limit: bytes all readers may buffer before the stalled ones are cut
            (``RELAY_MAX_BUFFERED_REQUEST_BYTES``).
        clock: a monotonic clock in seconds (``time.monotonic``).
        admit_limit: estimated bytes of counted lines whose requests may run at once
            (``admit``); None: ``limit``. The server gives a sixteenth of ``limit``
            (``ADMIT_SHARE``): what waits in the writer's queue ahead of a small request.
    """

    def __init__(
        self, limit: int, clock: Callable[[], float], admit_limit: int | None = None
    ) -> None:
        self.limit = limit
        self.admit_limit = limit if admit_limit is None else admit_limit
        self.clock = clock
        self.held = 0  # bytes the readers buffer
        self.in_progress = 0  # bytes of the lines whose requests run
        self.queued = 0  # what they count against admit_limit (``share``)
        self.cut = 0  # connections cut off
        self.readers: set[FrameReader] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._trimming = False
        self._room: list[asyncio.Future[None]] = []  # read loops waiting for room (``room``)
        self._lines: collections.deque[asyncio.Future[None]] = collections.deque()  # ``admit``

    def recount(self, reader: FrameReader) -> None:
        """Take ``reader``'s buffer size again; past the limit, cut stalled connections."""
        size = len(reader._buffer)
        self.held += size - reader.counted
        reader.counted = size
        if self.held > self.limit and self._timer is None and not self._trimming:
            self.trim()

    def started(self, reader: FrameReader, size: int) -> None:
        """A line of ``size`` bytes that ``reader`` delivered now runs as a request."""
        self.in_progress += size
        self.queued += self.share(size)
        reader.taken += size

    def share(self, size: int) -> int:
        """What a line of ``size`` counts against ``admit_limit``: at most half of it, so a
        line heavier than the limit waits only for room, not for every request in progress
        to end. Otherwise each one drained the writer's queue and ran alone: 12 clients
        pipelining small batches beside one sending 5 MB-weight ones committed 170,000 jobs
        in 15 s instead of 440,000 (a review)."""
        return min(size, self.admit_limit // 2)

    def fits(self, size: int) -> bool:
        """Whether a line of ``size`` (estimated) bytes may start now: it keeps the requests
        in progress within ``limit`` and their shares within ``admit_limit``, or none is in
        progress (one always may, so nothing waits forever)."""
        return not self.in_progress or (
            self.in_progress + size <= self.limit
            and self.queued + self.share(size) <= self.admit_limit
        )

    async def admit(self, reader: FrameReader, size: int) -> Ticket:
        """Count a line of ``size`` (estimated) bytes as in progress, once it ``fits``: until
        then its read loop waits, first come first served, and the line is not decoded.
        Each request's end, and each line that starts, lets the first waiting line look again.

        A woken line keeps its place at the head until it has looked: taken out of the queue
        when woken, it left the queue empty for a moment, and lines arriving then went in
        before it; a heavy line was passed over 165 times that way and waited 20 s behind a
        flood of small ones (a review).

        Returns:
            The ``Ticket`` to ``end`` when its request ends (or does not start).
        """
        if self._lines or not self.fits(size):
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            self._lines.append(waiter)
            try:
                while True:
                    await waiter  # only the head is woken (``_wake_line``)
                    if self.fits(size):
                        break
                    waiter = loop.create_future()  # look again at the next end, still first
                    self._lines[0] = waiter
            except asyncio.CancelledError:  # the connection is closing
                woken = waiter.done() and not waiter.cancelled()
                with contextlib.suppress(ValueError):
                    self._lines.remove(waiter)
                if woken:
                    self._wake_line()  # the wake goes to the next line
                raise
            self._lines.popleft()  # its own entry, at the head
            self._wake_line()  # the next may fit too (two ends may have woken it just once)
        self.started(reader, size)
        return Ticket(self, reader, size)

    def _wake_line(self) -> None:
        """Let the first line waiting in ``admit`` look again (it stays first until it has)."""
        if self._lines and not self._lines[0].done():
            self._lines[0].set_result(None)

    def ended(self, reader: FrameReader, size: int, _done: object = None) -> None:
        """The request ``started`` counted has ended (a done-callback: ``_done`` is its
        future); read loops waiting for room look again once there is, and this one's once
        nothing of its own is in progress. (Every waiter has a request in progress, so one
        of these always comes: buffered bytes going down need not wake anyone.)"""
        self.in_progress -= size
        self.queued -= self.share(size)
        reader.taken -= size
        if self._lines:
            self._wake_line()
        if self._room and self.held + self.in_progress <= self.limit:
            self._wake()
        elif not reader.taken and reader.waiter is not None and not reader.waiter.done():
            reader.waiter.set_result(None)  # nothing of its own in progress: it may go on

    def full(self, reader: FrameReader) -> bool:
        """Whether ``reader``'s read loop must wait before it takes another line: the server
        holds more request bytes than its limit, buffered and in progress, and this
        connection has a request in progress (one with none may always start one)."""
        return reader.taken > 0 and self.held + self.in_progress > self.limit

    async def room(self, reader: FrameReader) -> None:
        """Wait until ``full(reader)`` is false (without reading: the client's further lines
        wait in the kernel, where TCP's window holds it back)."""
        loop = asyncio.get_running_loop()
        while self.full(reader):
            waiter: asyncio.Future[None] = loop.create_future()
            self._room.append(waiter)
            reader.waiter = waiter
            try:
                await waiter
            finally:
                reader.waiter = None
                if waiter in self._room:  # cancelled, or woken by its own request's end
                    self._room.remove(waiter)

    def _wake(self) -> None:
        waiters, self._room = self._room, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def trim(self) -> None:
        """Cut the connections whose unfinished line began longest ago, at least ``STALL_S``
        ago, until the rest fit the limit; if some are still over it, look again when the
        next could qualify."""
        self._timer = None
        self._trimming = True  # a cut's release recounts: no trim inside this one
        try:
            self._trim()
        finally:
            self._trimming = False

    def _trim(self) -> None:
        """First the connections whose read loop has taken no line for ``STALL_S`` while
        whole lines wait (it waits for in-flight slots or reply budget its client holds:
        64 long-polls and more lines behind them), longest first; then those whose
        unfinished line began longest ago, at least ``STALL_S`` ago."""
        now = self.clock()
        blocked = sorted(
            (
                r
                for r in self.readers
                if r.owner is not None and r.counted and r._buffer.find(b"\n") >= 0
            ),
            key=lambda r: r.consumed_at,
        )
        partial = sorted(
            (r for r in self.readers if r.partial_since is not None and r.owner is not None),
            key=lambda r: r.partial_since or 0.0,
        )
        wait = STALL_S  # nothing to cut yet: look again in a while
        for since, readers in (("consumed_at", blocked), ("partial_since", partial)):
            for reader in readers:
                if self.held <= self.limit:
                    return
                began = getattr(reader, since)
                if reader not in self.readers or began is None:  # released, or taken since
                    continue
                if now - began < STALL_S:
                    wait = min(wait, STALL_S - (now - began))
                    break
                self._cut(reader)
        if self.held > self.limit:
            self._timer = asyncio.get_running_loop().call_later(wait, self.trim)

    def _cut(self, reader: FrameReader) -> None:
        owner = reader.owner
        assert owner is not None
        self.cut += 1
        metrics.REQUEST_BUFFER_CUTS.inc()
        log.warning(
            "event=request_buffer_cut peer=%s buffered_bytes=%d held_bytes=%d",
            owner.peer,
            reader.counted,
            self.held,
            extra={
                "event": "request_buffer_cut",
                "peer": owner.peer,
                "buffered_bytes": reader.counted,
                "held_bytes": self.held,
            },
        )
        refusal = errors.Timeout(
            f"a request line was still arriving after {STALL_S:g} s while the server's "
            "request buffers were full"
        )
        owner.write_now(codec.encode_error(None, refusal))  # unless replies wait before it
        owner.abort()
        reader.release()
