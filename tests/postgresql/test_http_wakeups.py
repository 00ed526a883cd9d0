"""The HTTP API's long-poll wake-ups on PostgreSQL (``wakeups.ProcessWakeups``, the TCP
server's design): the LISTEN feed pushes, so no polling thread starts, and a commit by another
server wakes the waiters of the queue it made ready, not the others."""

from __future__ import annotations

import asyncio
import threading

import pytest

from queue_core.protocol.wakeups import ProcessWakeups
from queue_core.service import QueueService
from queue_core.storage import driver_for
from queue_core.storage.postgresql.driver import PostgresDriver
from tests.postgresql.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


def test_a_commit_by_another_server_wakes_the_http_waiters_of_its_queue() -> None:
    service = QueueService(driver=driver_for("postgresql"))
    process = ProcessWakeups(lambda: service)
    flushed = threading.Event()

    def hear(queue: str | None) -> None:
        if queue == "flush":
            flushed.set()

    def submit_elsewhere(queue: str) -> None:
        other = QueueService(driver=PostgresDriver("postgresql"))  # another origin
        try:
            other.submit(queue, 1)
        finally:
            other.close()  # this thread's connection

    async def scenario() -> None:
        await process.start()
        assert process._thread is None  # it pushes: nothing polls
        feed = service.changes()
        feed.subscribe(hear)
        # Once LISTEN is on, the listener calls every subscriber once with None ("look
        # again", waking every waiter), then takes notifications in order: a commit heard
        # after that says the look-again is over (waiting for it to reach ``hear`` raced
        # with the connection: hear could subscribe after it).
        assert await asyncio.to_thread(feed.connected.wait, 30)
        await asyncio.to_thread(submit_elsewhere, "flush")
        assert await asyncio.to_thread(flushed.wait, 30)
        waiting = process.wakeups.subscribe(["wake-me"])
        elsewhere = process.wakeups.subscribe(["other"])
        await asyncio.to_thread(submit_elsewhere, "wake-me")
        assert await waiting.wait(30)
        assert not elsewhere.event.is_set()
        for waiter in (waiting, elsewhere):
            process.wakeups.unsubscribe(waiter)

    asyncio.run(scenario())
