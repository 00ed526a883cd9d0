"""``connection.Slots``: a connection's in-flight requests, taken without a coroutine while
one is free, waited for by its read loop when none is."""

from __future__ import annotations

import asyncio

from queue_core.protocol.connection import Slots


def test_take_takes_free_slots_only_and_release_gives_one_back() -> None:
    slots = Slots(2)
    assert slots.take() and slots.take()
    assert not slots.take()
    assert slots.free == 0
    slots.release()
    assert slots.take()
    assert not slots.take()


def test_a_wait_ends_at_the_release_that_frees_a_slot_and_takes_it() -> None:
    async def main() -> None:
        slots = Slots(1)
        assert slots.take()
        waiting = asyncio.ensure_future(slots.wait())
        await asyncio.sleep(0)  # one pass of the loop: the wait has begun, nothing is free
        assert not waiting.done()
        slots.release()
        await asyncio.wait_for(waiting, 5)
        assert slots.free == 0  # the waiter took the released slot
        assert not slots.take()

    asyncio.run(main())


def test_a_cancelled_wait_takes_nothing_and_a_later_release_is_kept() -> None:
    async def main() -> None:
        slots = Slots(1)
        assert slots.take()
        waiting = asyncio.ensure_future(slots.wait())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert slots.free == 0
        slots.release()  # nobody waits now: the slot is free for the next take
        assert slots.free == 1
        assert slots.take()

    asyncio.run(main())


def test_a_wait_with_a_free_slot_takes_it_at_once() -> None:
    async def main() -> None:
        slots = Slots(3)
        await asyncio.wait_for(slots.wait(), 5)
        assert slots.free == 2

    asyncio.run(main())
