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
    looked_again = threading.Event()

    def hear(queue: str | None) -> None:
        if queue is None:  # the listener's "look again" after it connected
            looked_again.set()

    def submit_elsewhere(queue: str) -> None:
        other = QueueService(driver=PostgresDriver("postgresql"))  # another origin
        try:
            other.submit(queue, 1)
        finally:
            other.close()  # this thread's connection

    async def scenario() -> None:
        await process.start()  # subscribes before hear: the listener calls it first
        assert process._thread is None  # it pushes: nothing polls
        service.changes().subscribe(hear)
        assert await asyncio.to_thread(looked_again.wait, 30)
        waiting = process.wakeups.subscribe(["wake-me"])
        elsewhere = process.wakeups.subscribe(["other"])
        await asyncio.to_thread(submit_elsewhere, "wake-me")
        assert await waiting.wait(30)
        assert not elsewhere.event.is_set()
        for waiter in (waiting, elsewhere):
            process.wakeups.unsubscribe(waiter)

    asyncio.run(scenario())
