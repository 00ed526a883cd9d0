"""A connection's read deadline (``queue_core.protocol.listener.ReadDeadline``): one timer per
connection, not one per read, and a timeout told apart from any other cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from queue_core.protocol.listener import ReadDeadline


async def _read_one(reader: asyncio.StreamReader, until: float, box: dict[str, Any]) -> str:
    """As ``Listener._read_requests`` reads: the deadline around one ``readuntil``."""
    task = asyncio.current_task()
    assert task is not None
    deadline = box["deadline"] = ReadDeadline(task)
    deadline.start(until)
    try:
        try:
            await reader.readuntil(b"\n")
        finally:
            deadline.reading = False
    except asyncio.CancelledError:
        if not deadline.expired():
            raise
        return "timed out"
    finally:
        deadline.close()
    return "read"


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_a_read_past_its_deadline_times_out_and_the_task_goes_on(loop_factory: str) -> None:
    async def main() -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        box: dict[str, Any] = {}
        task = asyncio.ensure_future(_read_one(asyncio.StreamReader(), loop.time() - 1, box))
        outcome = await task  # nothing is ever fed: only the deadline ends the read
        return outcome, task.cancelling()

    assert _run(main(), loop_factory) == ("timed out", 0)  # the cancellation was withdrawn


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_a_cancellation_from_elsewhere_is_not_taken_for_a_timeout(loop_factory: str) -> None:
    async def main() -> bool:
        loop = asyncio.get_running_loop()
        box: dict[str, Any] = {}
        reader = asyncio.StreamReader()
        task = asyncio.ensure_future(_read_one(reader, loop.time() + 3600, box))
        while "deadline" not in box or not box["deadline"].reading:
            await asyncio.sleep(0)  # until the read waits
        task.cancel()  # an eviction, a shutdown
        with pytest.raises(asyncio.CancelledError):
            await task
        return box["deadline"]._timer is None  # closed: no timer left behind

    assert _run(main(), loop_factory) is True


def test_reads_within_the_deadline_arm_one_timer_between_them() -> None:
    async def main() -> tuple[list[bytes], int]:
        loop = asyncio.get_running_loop()
        armed: list[float] = []
        call_at = loop.call_at

        def counting(when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
            armed.append(when)
            return call_at(when, callback, *args)

        loop.call_at = counting  # type: ignore[method-assign]
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(b"%d\n" % i for i in range(100)))
        task = asyncio.current_task()
        assert task is not None
        deadline = ReadDeadline(task)
        lines = []
        start = loop.time()
        for i in range(100):  # each read moves the deadline later, as a request does
            deadline.start(start + 3600 + i)
            lines.append(await reader.readuntil(b"\n"))
            deadline.reading = False
        deadline.start(start + 1800)  # sooner than the armed timer (a hello deadline): moved
        deadline.close()
        return lines, len(armed)

    lines, armed = asyncio.run(main())
    assert lines == [b"%d\n" % i for i in range(100)]
    assert armed == 2


def test_a_timer_that_fires_early_is_armed_again_for_the_deadline_in_force() -> None:
    async def main() -> tuple[bool, float, float]:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        deadline = ReadDeadline(task)
        deadline.start(loop.time() + 1)
        later = loop.time() + 3600
        deadline.start(later)  # the connection was active: the timer stays where it was
        deadline._fire()  # as the loop runs it at the first deadline, while the task reads
        rearmed = deadline._timer_at
        deadline.reading = False
        deadline.close()
        return task.cancelling() == 0, rearmed, later

    not_cancelled, rearmed, later = asyncio.run(main())
    assert not_cancelled and rearmed == later


def _run(coro: Any, loop_factory: str) -> Any:
    if loop_factory == "uvloop":
        import uvloop

        return asyncio.run(coro, loop_factory=uvloop.new_event_loop)
    return asyncio.run(coro)
