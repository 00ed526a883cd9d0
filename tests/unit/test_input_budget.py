"""``InputBudget`` and ``FrameReader``: which connections the server's request-byte budget
cuts, with fake connections and a fake clock (hostile review, round 10: 1,000 connections
that each sent a megabyte without its newline held 1,084 MiB until their idle timeout)."""

from __future__ import annotations

import asyncio
import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from queue_core.protocol.reading import (
    DECODED_CONTAINER_BYTES,
    STALL_S,
    FrameReader,
    InputBudget,
    line_weight,
)


@dataclasses.dataclass(eq=False)
class FakeOwner:
    peer: str
    aborted: bool = False
    written: bytes = b""

    def write_now(self, line: bytes) -> str | None:
        self.written += line
        return "sent"

    def abort(self) -> None:
        self.aborted = True


def reader(budget: InputBudget, name: str) -> tuple[FrameReader, FakeOwner]:
    r = FrameReader(1024 * 1024, budget)
    r.owner = owner = FakeOwner(name)
    return r, owner


def test_past_the_limit_the_oldest_unfinished_line_a_second_old_is_cut() -> None:
    async def main() -> None:
        now = [0.0]
        budget = InputBudget(limit=100, clock=lambda: now[0])
        old, old_owner = reader(budget, "old")
        young, young_owner = reader(budget, "young")
        whole, whole_owner = reader(budget, "whole")
        old.feed_data(b'{"op":"ping","id":"' + b"a" * 50)  # no newline: unfinished
        now[0] = 0.5
        young.feed_data(b'{"op":"ping","id":"' + b"b" * 50)
        whole.feed_data(b'{"op":"ping"}\n' * 2)
        assert await whole.readline() == b'{"op":"ping"}\n'  # its read loop takes lines
        assert budget.held == 69 * 2 + 14
        assert not old_owner.aborted  # over the limit, but no line is a second old yet
        now[0] = STALL_S
        budget.trim()
        assert old_owner.aborted and b'"TIMEOUT"' in old_owner.written
        assert budget.held == 69 + 14 and budget.cut == 1
        # The rest fit: the young line and the whole lines stay.
        assert not young_owner.aborted and not whole_owner.aborted
        young.release()
        whole.release()
        assert budget.held == 0 and not budget.readers

    asyncio.run(main())


def test_a_read_loop_that_takes_no_line_for_a_second_is_cut_before_a_slow_upload() -> None:
    # Hostile review, round 11: 120 clients each filled their 64 in-flight slots with
    # long-polls and sent 1 MiB lines behind them, whole and so never cut, while a slow but
    # honest upload (a 946 KB batch at 600 KB/s) was cut three times out of three.
    async def main() -> None:
        now = [0.0]
        budget = InputBudget(limit=100, clock=lambda: now[0])
        upload, upload_owner = reader(budget, "upload")
        upload.feed_data(b'{"op":"submit_batch","args":{"jobs":[' + b" " * 40)
        now[0] = 0.2
        blocked, blocked_owner = reader(budget, "blocked")
        blocked.feed_data(b'{"op":"ping","id":1}' + b" " * 50 + b"\n")  # its loop never takes it
        assert not upload_owner.aborted and not blocked_owner.aborted
        now[0] = 1.2
        budget.trim()
        assert blocked_owner.aborted and not upload_owner.aborted
        assert budget.cut == 1
        upload.release()

    asyncio.run(main())


def test_past_the_limit_a_connection_with_a_request_in_progress_waits_for_room() -> None:
    # Lines taken by read loops count while their requests run: 30 clients pipelining 1 MB
    # submits faster than the writer committed them held 978 MiB in requests in progress.
    async def main() -> None:
        budget = InputBudget(limit=100, clock=lambda: 0.0)
        busy, _ = reader(budget, "busy")
        idle, _ = reader(budget, "idle")
        budget.started(busy, 80)
        assert not budget.full(busy) and budget.in_progress == 80  # under the limit
        budget.started(busy, 40)
        assert budget.full(busy)  # over it, with requests of its own in progress
        assert not budget.full(idle)  # none of its own: it may always start one
        waiting = asyncio.ensure_future(budget.room(busy))
        await asyncio.sleep(0)
        assert not waiting.done()
        budget.ended(busy, 80)  # back under the limit: it goes on
        await asyncio.wait_for(waiting, 1)
        assert budget.in_progress == 40 and busy.taken == 40
        busy.release()
        idle.release()

    asyncio.run(main())


def test_a_waiting_connection_goes_on_once_its_own_requests_end() -> None:
    # The server stays over its limit (other clients' requests), but this connection's last
    # request ended: nothing of its own holds bytes, so it may start one more (a sentinel
    # whose read loop had parked right after its lease was cut for a "stalled" line).
    async def main() -> None:
        budget = InputBudget(limit=100, clock=lambda: 0.0)
        mine, _ = reader(budget, "mine")
        other, _ = reader(budget, "other")
        budget.started(other, 500)
        budget.started(mine, 10)
        waiting = asyncio.ensure_future(budget.room(mine))
        await asyncio.sleep(0)
        assert not waiting.done()
        budget.ended(mine, 10)
        await asyncio.wait_for(waiting, 1)
        assert budget.full(other) and not budget.full(mine)
        cancelled = asyncio.ensure_future(budget.room(other))
        await asyncio.sleep(0)
        cancelled.cancel()  # its connection closes while it waits: it leaves the queue
        await asyncio.gather(cancelled, return_exceptions=True)
        assert budget._room == []
        mine.release()
        other.release()

    asyncio.run(main())


def test_a_line_weighs_what_it_will_decode_to() -> None:
    assert line_weight(b'{"op":"ping"}\n') == 14 + DECODED_CONTAINER_BYTES
    objects = b'{"args":{"payload":[' + b",".join([b"{}"] * 1000) + b"]}}\n"
    assert line_weight(objects) == len(objects) + DECODED_CONTAINER_BYTES * 1003


def test_lines_past_the_limit_wait_in_order_and_one_always_may_start() -> None:
    # A counted line is admitted before it is decoded; past the limit it waits, first come
    # first served, and one line may always start when nothing is in progress.
    async def main() -> None:
        budget = InputBudget(limit=100, clock=lambda: 0.0)
        a, _ = reader(budget, "a")
        b, _ = reader(budget, "b")
        c, _ = reader(budget, "c")
        huge = await budget.admit(a, 500)  # nothing in progress: it starts, over the limit
        assert budget.in_progress == 500
        second = asyncio.ensure_future(budget.admit(b, 60))
        third = asyncio.ensure_future(budget.admit(c, 10))
        await asyncio.sleep(0)
        assert not second.done() and not third.done()  # the 10 fits no better: it queued
        huge.end()
        huge.end()  # once only
        assert budget.in_progress == 0
        first_in = await asyncio.wait_for(second, 1)
        last_in = await asyncio.wait_for(third, 1)  # woken as the second started: it fits
        first_in.end()
        last_in.end()
        assert budget.in_progress == 0 and a.taken == b.taken == c.taken == 0
        for r in (a, b, c):
            r.release()

    asyncio.run(main())


def test_lines_in_progress_are_held_to_the_admit_limit_not_the_whole_budget() -> None:
    # What is in progress waits in the writer's queue ahead of every small request: a fifth
    # line of 10 waits at an admit limit of 40, though the budget's 100 would take it.
    async def main() -> None:
        budget = InputBudget(limit=100, clock=lambda: 0.0, admit_limit=40)
        readers = [reader(budget, str(n))[0] for n in range(5)]
        running = [await budget.admit(r, 10) for r in readers[:4]]
        fifth = asyncio.ensure_future(budget.admit(readers[4], 10))
        await asyncio.sleep(0)
        assert not fifth.done() and budget.in_progress == 40
        running.pop(0).end()
        running.append(await asyncio.wait_for(fifth, 1))  # the end made room
        assert budget.in_progress == 40
        for ticket in running:
            ticket.end()
        assert budget.in_progress == 0
        assert InputBudget(limit=100, clock=lambda: 0.0).admit_limit == 100  # the default
        for r in readers:
            r.release()

    asyncio.run(main())


def test_a_line_heavier_than_the_admit_limit_waits_for_room_not_for_an_empty_server() -> None:
    # It counts half the admit limit at most: before, it waited at the head of the line until
    # nothing was in progress, and every line behind it too (a review: 12 pipelining clients
    # beside one heavy one committed 170,000 jobs in 15 s where they had 440,000).
    async def main() -> None:
        budget = InputBudget(limit=100, clock=lambda: 0.0, admit_limit=40)
        readers = [reader(budget, str(n))[0] for n in range(4)]
        small = [await budget.admit(r, 10) for r in readers[:2]]
        heavy = await asyncio.wait_for(budget.admit(readers[2], 50), 1)  # counts 20 of 40
        assert budget.in_progress == 70 and budget.queued == 40
        after = asyncio.ensure_future(budget.admit(readers[3], 10))
        await asyncio.sleep(0)
        assert not after.done()  # the shares are at the admit limit
        small[0].end()
        last = await asyncio.wait_for(after, 1)
        for ticket in (small[1], heavy, last):
            ticket.end()
        assert budget.in_progress == budget.queued == 0
        for r in readers:
            r.release()

    asyncio.run(main())


def test_a_woken_line_keeps_its_place_until_it_has_looked() -> None:
    # Taken out of the queue when woken, it left the queue empty until it ran, and a line
    # arriving then went in first: a heavy line was passed over 165 times (a review).
    async def main() -> None:
        budget = InputBudget(limit=100, clock=lambda: 0.0, admit_limit=40)
        readers = [reader(budget, str(n))[0] for n in range(5)]
        running = [await budget.admit(r, 10) for r in readers[:3]]
        heavy = asyncio.ensure_future(budget.admit(readers[3], 50))  # needs the shares at 20
        await asyncio.sleep(0)
        assert not heavy.done()
        newcomer = asyncio.ensure_future(budget.admit(readers[4], 10))  # it runs first ...
        running.pop().end()  # ... after this wakes the heavy line
        await asyncio.sleep(0)
        assert heavy.done() and not newcomer.done()  # first come, first served
        heavy_ticket = heavy.result()
        heavy_ticket.end()
        (await asyncio.wait_for(newcomer, 1)).end()
        for ticket in running:
            ticket.end()
        assert budget.in_progress == budget.queued == 0 and not budget._lines
        for r in readers:
            r.release()

    asyncio.run(main())


def test_a_woken_line_whose_connection_closes_passes_its_wake_on() -> None:
    async def main() -> None:
        budget = InputBudget(limit=100, clock=lambda: 0.0)
        a, _ = reader(budget, "a")
        b, _ = reader(budget, "b")
        c, _ = reader(budget, "c")
        running = await budget.admit(a, 90)
        closing = asyncio.ensure_future(budget.admit(b, 50))
        waiting = asyncio.ensure_future(budget.admit(c, 50))
        await asyncio.sleep(0)
        running.end()  # wakes b's line ...
        closing.cancel()  # ... whose connection closes before it runs
        await asyncio.gather(closing, return_exceptions=True)
        (await asyncio.wait_for(waiting, 1)).end()  # the wake went on to c: nothing stuck
        assert budget.in_progress == 0
        for r in (a, b, c):
            r.release()

    asyncio.run(main())


def test_a_line_that_began_in_the_latest_data_is_young() -> None:
    # A client pipelining fast sends chunks that end mid-line: each such line began in the
    # chunk, not when the first unfinished line arrived long ago.
    async def main() -> None:
        now = [0.0]
        budget = InputBudget(limit=10_000, clock=lambda: now[0])
        r, _ = reader(budget, "fast")
        r.feed_data(b'{"op":"ping"}\n{"op":')
        assert r.partial_since == 0.0
        now[0] = 5.0
        r.feed_data(b'"ping"}\n{"op":"pi')
        assert r.partial_since == 5.0
        r.feed_data(b'ng"}\n')
        assert r.partial_since is None
        r.release()

    asyncio.run(main())


def test_a_thousand_cuts_in_one_trim_do_not_recurse() -> None:
    # Each cut's release recounts the budget, which trimmed again from inside the trim: one
    # Python frame chain per cut: with 600 stale connections to cut at once, a RecursionError
    # in a transport callback dropped the connection that delivered the data (hostile review).
    async def main() -> None:
        now = [0.0]
        budget = InputBudget(limit=100, clock=lambda: now[0])
        pairs = [reader(budget, f"r{i}") for i in range(1500)]
        # All arrive before any trim (a pending look-again holds the trims off)...
        budget._timer = asyncio.get_running_loop().call_later(3600, lambda: None)
        for r, _ in pairs:
            r.feed_data(b'{"op":"ping","id":"' + b"x" * 10)  # 29 bytes each
        budget._timer.cancel()
        now[0] = STALL_S  # ...and are a second old at it
        budget.trim()
        assert budget.held <= 100
        assert budget.cut == 1500 - 100 // 29
        assert sum(owner.aborted for _, owner in pairs) == budget.cut

    asyncio.run(main())


async def _read_all(r: asyncio.StreamReader, chunks: list[bytes], eof: bool) -> list[object]:
    """Feed ``chunks`` one loop pass apart while a task reads lines; what it read, and how
    it stopped (the exception and what stayed buffered)."""
    got: list[object] = []

    async def read() -> None:
        while True:
            try:
                got.append(await r.readuntil(b"\n"))
            except (asyncio.LimitOverrunError, asyncio.IncompleteReadError) as exc:
                got.append((type(exc).__name__, str(exc), exc.args[1:], bytes(r._buffer)))  # type: ignore[attr-defined]
                return

    task = asyncio.create_task(read())
    for chunk in chunks:
        await asyncio.sleep(0)
        r.feed_data(chunk)
    if eof:
        r.feed_eof()
    else:
        r.feed_data(b"x" * 100)  # past every limit below: the reader must stop
    await asyncio.wait_for(task, 5)
    return got


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"\n")), max_size=8),
    limit=st.integers(1, 20),
    eof=st.booleans(),
)
def test_its_newline_reads_answer_as_asyncios_reader(
    chunks: list[bytes], limit: int, eof: bool
) -> None:
    # ``FrameReader.readuntil`` reads a newline its own way: lines, limit errors and EOF
    # must be asyncio's, byte for byte, whatever the chunks.
    async def both() -> tuple[list[object], list[object]]:
        budget = InputBudget(limit=1 << 30, clock=lambda: 0.0)
        ours = await _read_all(FrameReader(limit, budget), chunks, eof)
        return ours, await _read_all(asyncio.StreamReader(limit=limit), chunks, eof)

    ours, asyncios = asyncio.run(both())
    assert ours == asyncios
