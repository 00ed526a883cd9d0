"""``ReplyBudget``: whom the server's budget cuts, with fake connections and a fake clock
(hostile review, round 9: one wake-up of many waiters cut every silent connection, and a
healthy one whose frame waited for a busy writer was cut as if it read nothing)."""

from __future__ import annotations

import dataclasses

from queue_core.protocol.budget import STALL_S, ReplyBudget


@dataclasses.dataclass(eq=False)
class FakeConn:
    peer: str
    unsent: int = 0
    drained_at: float = 0.0
    cut_off: bool = False
    unread: bool = True  # bytes written to it wait for the client
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True

    def backed_up(self) -> bool:
        return self.unread


def budget(conns: list[FakeConn], now: list[float], limit: int = 100) -> ReplyBudget:
    b = ReplyBudget(per_connection=1_000, total=limit, conns=conns, clock=lambda: now[0])
    for conn in conns:
        held, conn.unsent = conn.unsent, 0
        b.take(conn, held)  # at now[0]: drained_at is the start
    return b


def test_it_cuts_the_stalled_connection_holding_most_and_only_it() -> None:
    now = [0.0]
    a, b, c = FakeConn("a", 60), FakeConn("b", 50), FakeConn("c", 40)
    reply = budget([a, b, c], now)
    now[0] = STALL_S
    assert reply._cut_stalled() is None
    assert (a.aborted, a.cut_off, b.aborted, c.aborted) == (True, True, False, False)
    # a's 60 bytes are on their way back: the other 90 fit the limit, so waiters woken
    # before they are back cut no one else.
    assert reply._cut_stalled() is None
    assert reply._cut_stalled() is None
    assert not b.aborted and not c.aborted
    assert reply.cut == 1


def test_a_connection_whose_client_reads_is_not_cut_for_frames_its_claims_hold() -> None:
    now = [0.0]
    # busy: frames reserved for claims queued behind a busy writer, nothing unread;
    # silent: less, but its client leaves written replies unread.
    busy, silent = FakeConn("busy", 90, unread=False), FakeConn("silent", 30)
    reply = budget([busy, silent], now)
    now[0] = STALL_S + 0.5
    assert reply._cut_stalled() is None
    assert silent.aborted and not busy.aborted


def test_nobody_is_cut_before_a_second_without_draining() -> None:
    now = [0.0]
    a, b = FakeConn("a", 70), FakeConn("b", 50)
    reply = budget([a, b], now)
    now[0] = STALL_S / 4
    wait = reply._cut_stalled()
    assert wait is not None and abs(wait - STALL_S * 3 / 4) < 1e-9
    assert not a.aborted and not b.aborted
