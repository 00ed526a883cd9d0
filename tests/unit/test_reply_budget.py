"""``ReplyBudget``: whom the server's budget cuts, with fake connections and a fake clock
(hostile review, round 9: one wake-up of many waiters cut every silent connection, and a
healthy one whose frame waited for a busy writer was cut as if it read nothing)."""

from __future__ import annotations

import asyncio
import dataclasses

from prometheus_client import REGISTRY

from queue_core.protocol.budget import STALL_S, ReplyBudget


@dataclasses.dataclass(eq=False)
class FakeConn:
    peer: str
    unsent: int = 0
    drained_at: float = 0.0
    cut_off: bool = False
    turn: asyncio.Lock | None = None
    unread: bool = True  # bytes written to it wait for the client
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True

    def backed_up(self) -> bool:
        return self.unread

    def keeps_up(self) -> bool:
        return not self.unread


def budget(conns: list[FakeConn], now: list[float], limit: int = 100) -> ReplyBudget:
    b = ReplyBudget(per_connection=1_000, total=limit, conns=conns, clock=lambda: now[0])
    for conn in conns:
        held, conn.unsent = conn.unsent, 0
        b.take(conn, held)  # at now[0]: drained_at is the start
    return b


def metrics_cuts() -> float:
    return REGISTRY.get_sample_value("relay_reply_budget_cuts_total") or 0.0


def test_it_cuts_the_stalled_connection_holding_most_and_only_it() -> None:
    cuts_before = metrics_cuts()
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
    assert metrics_cuts() == cuts_before + 1  # relay_reply_budget_cuts_total


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


def test_over_the_server_budget_only_a_client_that_reads_takes_a_frame_past_it() -> None:
    # Any connection holding nothing used to take one frame past the server's limit: 160
    # silent clients held 160 MiB beyond it. Now only one whose client reads what it was
    # sent (its kernel send queue nearly empty) may; a silent one waits like the rest.
    now = [0.0]
    hog = FakeConn("hog", 100)
    reader, silent = FakeConn("reader", unread=False), FakeConn("silent")
    reply = budget([hog, reader, silent], now)
    assert reply.fits(reader, 50)
    assert not reply.fits(silent, 50)
    reply.give(hog, 60)
    assert reply.fits(silent, 50)  # under the limit, it may


def test_one_returned_reply_scans_the_connections_once_however_many_wait() -> None:
    # Every waiter used to scan every connection for one to cut on every wake-up
    # (connections x waiters per returned reply): 160 silent clients stalled the loop.
    async def main() -> tuple[int, int]:
        now = [0.0]
        busy = FakeConn("busy", 110, unread=False)  # over the limit, but its client reads
        # Holding nothing, their clients silent: each waits for the total to fall.
        waiters = [FakeConn(f"w{i}") for i in range(50)]
        reply = budget([busy, *waiters], now)
        scans: list[float | None] = []
        cut_stalled = reply._cut_stalled

        def counted() -> float | None:
            scans.append(result := cut_stalled())
            return result

        reply._cut_stalled = counted  # type: ignore[method-assign]
        tasks = [asyncio.create_task(reply.reserve(w, 1)) for w in waiters]
        await settle()
        first = len(scans)
        reply.give(busy, 1)  # bytes came back: all wake, none fits yet
        await settle()
        again = len(scans) - first
        assert not any(task.done() for task in tasks)
        reply.give(busy, 109)  # room for everyone
        await asyncio.gather(*tasks)
        return first, again

    assert asyncio.run(main()) == (1, 1)


async def settle() -> None:
    """Run the loop until every ready task has run (no timers involved)."""
    for _ in range(10):
        await asyncio.sleep(0)
