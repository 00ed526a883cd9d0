"""How many reply bytes the TCP server may hold for clients that do not read them.

A reply is held from the moment it is reserved (before a read or a lease claim runs, one
frame's worth) or made (a write's reply) until the kernel has taken it. A client that sends
requests and never reads would otherwise pin up to ``max_inflight_per_connection`` replies of
up to a frame each (16 such connections took a server to 2 GB, issue 13).

After Redis's ``client-output-buffer-limit`` (a hard limit per client) and the back-pressure
of any stream reader:

* **Per connection** (``RELAY_MAX_UNSENT_BYTES_PER_CONNECTION``): a read or lease claim waits
  before it runs until its frame fits the connection's budget (a read, and a lease that will
  not wait, in the read loop, which reads nothing more meanwhile), and the connection's next
  frame is not read while it is over budget. A connection holding nothing may always reserve
  one frame while the server is under its limit, so every client can make progress.
* **Per server** (``RELAY_MAX_UNSENT_BYTES``): past it, a connection that already holds bytes
  waits, and so does one holding nothing unless its client reads what it was sent
  (``Holder.keeps_up``); of the connections whose clients leave written replies unread, the
  one holding the most bytes that has not drained any for ``STALL_S`` is cut off (its replies
  are dropped), one at a time, so one set of silent clients cannot hold the rest up for the
  slow-reader deadline (``SEND_TIMEOUT_S`` in ``connection.py``).

All methods run on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Collection
from typing import Protocol

from queue_core import metrics

log = logging.getLogger("relay.server")

STALL_S = 1.0  # a connection over the server budget that drained nothing for this long is cut


class Holder(Protocol):
    """What the budget needs of a connection (``server._Conn``)."""

    peer: str
    unsent: int  # bytes reserved or unsent
    drained_at: float  # loop time it last had nothing held, or gave bytes back
    cut_off: bool  # cut by the budget: what it holds is on its way back
    turn: asyncio.Lock | None  # its reserves' turn to wait for room (``reserve``)

    def abort(self) -> None: ...

    def keeps_up(self) -> bool:
        """Whether the client reads what reached its socket (little of it waits in the
        kernel)."""
        ...

    def backed_up(self) -> bool:
        """Whether bytes written to it wait for the client to read: the client, not the
        server, holds its replies up."""
        ...


class ReplyBudget:
    """Reply bytes reserved or unsent, per connection and in all.

    Args:
        per_connection: bytes one connection may hold (``RELAY_MAX_UNSENT_BYTES_PER_CONNECTION``).
        total: bytes all connections together may hold before stalled ones are cut
            (``RELAY_MAX_UNSENT_BYTES``).
        conns: the server's live connections (read when looking for one to cut).
        clock: the loop's monotonic clock in seconds (``loop.time``).
    """

    def __init__(
        self,
        per_connection: int,
        total: int,
        conns: Collection[Holder],
        clock: Callable[[], float],
    ) -> None:
        self.per_connection = per_connection
        self.limit = total
        self.held = 0  # bytes held by all connections
        self.cut = 0  # connections cut off for holding too much
        self._conns = conns
        self._clock = clock
        self._changed = asyncio.Event()
        self._scanned = False  # _cut_stalled ran since bytes last came back
        self._rescan_at = math.inf  # clock time the next connection could qualify

    def fits(self, conn: Holder, n: int) -> bool:
        """Whether ``conn`` may hold ``n`` more bytes now.

        A connection holding nothing may take one frame past its own budget, and past the
        server's while its client keeps up (``Holder.keeps_up``): a client that reads is not
        held up by those that do not, while a silent one gets nothing beyond the limit
        (160 of them could each take a frame past it: up to 160 MiB more).
        """
        if conn.unsent == 0:
            return self.held + n <= self.limit or conn.keeps_up()
        return conn.unsent + n <= self.per_connection and self.held + n <= self.limit

    def over(self, conn: Holder) -> bool:
        """Whether ``conn`` holds more than it may: its next frame is not read yet."""
        return conn.unsent > 0 and (conn.unsent > self.per_connection or self.held > self.limit)

    def try_take(self, conn: Holder, n: int) -> bool:
        """Hold ``n`` bytes for ``conn`` if it may hold them now and none of its reserves
        waits; return whether it did (``reserve`` without the wait)."""
        turn = conn.turn
        if (turn is None or not turn.locked()) and self.fits(conn, n):
            self.take(conn, n)
            return True
        return False

    async def reserve(self, conn: Holder, n: int) -> None:
        """Wait until ``conn`` may hold ``n`` more bytes, then hold them.

        A connection's reserves that must wait take turns (``Holder.turn``, first come first
        served), so at most one per connection waits for room: a client pipelining 64 reads
        used to put 64 waiters on every wake-up.
        """
        if self.try_take(conn, n):
            return
        turn = conn.turn
        if turn is None:
            turn = conn.turn = asyncio.Lock()
        async with turn:
            while not self.fits(conn, n):
                await self._wait_for_room()
            self.take(conn, n)

    async def room(self, conn: Holder) -> None:
        """Wait until ``conn`` is no longer over budget (the read loop's back-pressure)."""
        while self.over(conn):
            await self._wait_for_room()

    def take(self, conn: Holder, n: int) -> None:
        """Hold ``n`` bytes for ``conn`` without waiting (a reply already made)."""
        if conn.unsent == 0:
            conn.drained_at = self._clock()
        conn.unsent += n
        self.held += n

    def give(self, conn: Holder, n: int) -> None:
        """Give back ``n`` bytes of ``conn`` (sent, dropped, or reserved but not needed)."""
        if n <= 0:
            if n < 0:
                self.take(conn, -n)
            return
        conn.unsent -= n
        self.held -= n
        conn.drained_at = self._clock()
        self._changed.set()

    async def _wait_for_room(self) -> None:
        """Wait for bytes to come back; over the server budget, cut the worst stalled holder.

        The connections are scanned for one to cut (``_cut_stalled``) once after bytes came
        back and once when the next could qualify, by whichever waiter wakes first, not by
        every waiter on every wake-up: that was connections x waiters of work per returned
        reply, enough to stall the event loop with 160 silent clients.
        """
        event = self._changed
        if event.is_set():
            event = self._changed = asyncio.Event()
            self._scanned = False  # bytes came back since the last scan
        timeout = None
        if self.held > self.limit:
            now = self._clock()
            if not self._scanned or now >= self._rescan_at:
                after = self._cut_stalled()
                self._scanned = True
                self._rescan_at = math.inf if after is None else now + after
            if self._rescan_at != math.inf:
                timeout = max(0.0, self._rescan_at - now)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def _cut_stalled(self) -> float | None:
        """Cut the connection holding most that drained nothing for ``STALL_S`` while its
        client read nothing (``Holder.backed_up``).

        Bytes of connections already cut are on their way back (their sends fail): while the
        rest fit the limit, nobody else is cut, so one wake-up of many waiters cuts one
        connection, not one each. A connection whose bytes are frames reserved for claims
        still queued, behind a busy writer, is waiting for the server, not stalled.

        Returns:
            how long (s) until another could qualify; None after a cut, while the bytes of
            those already cut are enough to bring the total back under the limit, or when
            no connection that was not cut is backed up.
        """
        now = self._clock()
        returning = sum(c.unsent for c in self._conns if c.cut_off)
        if self.held - returning <= self.limit:
            return None
        holders = [c for c in self._conns if c.unsent > 0 and not c.cut_off and c.backed_up()]
        if not holders:
            return None
        stalled = [c for c in holders if now - c.drained_at >= STALL_S]
        if stalled:
            worst = max(stalled, key=lambda c: c.unsent)
            self.cut += 1
            metrics.REPLY_BUDGET_CUTS.inc()
            log.warning(
                "event=reply_budget_cut peer=%s unsent_bytes=%d held_bytes=%d",
                worst.peer,
                worst.unsent,
                self.held,
                extra={
                    "event": "reply_budget_cut",
                    "peer": worst.peer,
                    "unsent_bytes": worst.unsent,
                    "held_bytes": self.held,
                },
            )
            worst.cut_off = True
            worst.abort()
            return None
        return min(STALL_S - (now - c.drained_at) for c in holders)
