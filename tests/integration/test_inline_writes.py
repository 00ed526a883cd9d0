"""The event loop's own group commit on SQLite (``queue_core.protocol.writer.Database``).

The loop never waits for SQLite's write lock: while another connection holds it, writes go to
the writer thread, which waits, and commit in the order they were queued; reads go on. Once the
thread has answered them all, writes run on the loop again.
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from queue_core.protocol import limits, writer
from queue_core.service import QueueService
from tests.integration.test_tcp_server import Client, Running, wait_for


def test_writes_wait_in_order_while_another_connection_holds_the_lock_and_reads_go_on(
    start: Callable[..., Running],
) -> None:
    running = start()
    db = running.server._db
    assert db.inline is not None  # SQLite: the loop commits
    producer, sentinel = Client(running.port), Client(running.port)
    producer.ok("submit", queue="lk", payload={"first": True})
    other = sqlite3.connect(str(connection.settings_dict["NAME"]), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process's writer, say
    try:
        for i in range(3):
            producer.send("submit", req_id=i, queue="lk", payload={"i": i})
        # All three wait, unanswered: the first on the writer thread, the others on the loop
        # behind it (the reaper's sweep may too).
        wait_for(lambda: db._queued >= 1 and db._queued + len(db._pending) >= 3)
        assert sentinel.ok("ping")["pong"] is True  # the loop still serves
        assert sentinel.ok("stats")["totals"]["ready"] == 1
    finally:
        other.execute("ROLLBACK")
        other.close()
    replies = [producer.recv() for _ in range(3)]
    assert [r["id"] for r in replies] == [0, 1, 2]
    assert all(r["ok"] for r in replies), replies
    ids = [r["result"]["job"]["id"] for r in replies]
    assert ids == sorted(ids)  # committed in the order they were read
    wait_for(lambda: db._queued == 0)
    thread_commits, inline_commits = db.writers[0].commits, db.inline.commits
    producer.ok("submit", queue="lk", payload={"after": True})
    assert db.writers[0].commits == thread_commits  # back on the loop
    assert db.inline.commits > inline_commits
    assert sentinel.ok("stats")["totals"]["ready"] == 5
    producer.close()
    sentinel.close()


def test_a_heavy_batch_commits_on_the_writer_thread_and_a_light_one_on_the_loop(
    start: Callable[..., Running],
) -> None:
    running = start()
    db = running.server._db
    assert db.inline is not None
    client = Client(running.port)
    thread_commits = db.writers[0].commits
    heavy = [{"queue": "hv", "payload": {"n": n}} for n in range(writer.INLINE_MAX_WEIGHT + 1)]
    assert len(client.ok("submit_batch", jobs=heavy)["results"]) == len(heavy)
    assert db.writers[0].commits > thread_commits  # off the loop
    wait_for(lambda: db._queued == 0)
    light = heavy[: writer.INLINE_MAX_WEIGHT]
    thread_commits, inline_commits = db.writers[0].commits, db.inline.commits
    assert len(client.ok("submit_batch", jobs=light)["results"]) == len(light)
    assert db.writers[0].commits == thread_commits
    assert db.inline.commits > inline_commits
    client.close()


def test_a_prune_weighs_its_limit(start: Callable[..., Running]) -> None:
    # A prune weighed 1 whatever its limit: one of 10,000 jobs ran on the loop and held every
    # connection's pings for 1.3 s (a hostile review).
    running = start()
    db = running.server._db
    assert db.inline is not None
    client = Client(running.port)
    thread_commits, inline_commits = db.writers[0].commits, db.inline.commits
    client.ok("prune", older_than_ms=1, limit=writer.INLINE_MAX_WEIGHT + 1)
    assert db.writers[0].commits > thread_commits  # off the loop
    wait_for(lambda: db._queued == 0)
    thread_commits, inline_commits = db.writers[0].commits, db.inline.commits
    client.ok("prune", older_than_ms=1, limit=writer.INLINE_MAX_WEIGHT)
    assert db.writers[0].commits == thread_commits
    assert db.inline.commits > inline_commits
    client.close()


def test_writes_that_come_while_the_writer_thread_holds_a_batch_wait_and_then_run_on_the_loop(
    start: Callable[..., Running],
) -> None:
    # They were handed to the writer thread one by one behind it: under steady load its
    # queue never emptied, and after the first retention prune (a heavy batch, every few
    # seconds) every write paid two thread hand-offs (3-5 futex calls a job, December 6).
    running = start()
    db = running.server._db
    assert db.inline is not None and db._loop is not None
    release = threading.Event()
    ran: list[tuple[str, str]] = []

    def heavy() -> None:
        ran.append(("heavy", threading.current_thread().name))
        assert release.wait(15)  # holds the writer thread until the light writes are put

    def light(n: int) -> Callable[[], None]:
        return lambda: ran.append((f"light{n}", threading.current_thread().name))

    async def drive() -> str:
        loop = asyncio.get_running_loop()
        while db._queued or db._pending:  # the reaper's own writes, if any, are done
            await asyncio.sleep(0.001)
        first = loop.create_future()
        db.put_write(heavy, first, weight=writer.INLINE_MAX_WEIGHT + 1)
        await asyncio.sleep(0)  # one loop pass: the flush queued before it hands it over
        assert db._queued >= 1 and not db._pending  # on the writer thread (a sweep may be too)
        lights = []
        for n in range(5):
            lights.append(loop.create_future())
            db.put_write(light(n), lights[-1])
        assert len(db._pending) == 5  # waiting on the loop, not in the thread's queue
        release.set()
        await asyncio.gather(first, *lights)
        return threading.current_thread().name

    try:
        loop_thread = asyncio.run_coroutine_threadsafe(drive(), db._loop).result(30)
    finally:
        release.set()  # a failed check must not hold the writer thread
    assert [name for name, _ in ran] == ["heavy", *(f"light{n}" for n in range(5))]
    assert ran[0][1] != loop_thread  # the heavy batch on the writer thread
    assert {thread for _, thread in ran[1:]} == {loop_thread}  # the rest back on the loop
    assert db._queued == 0 and not db._pending


class _Arguments:
    """Stands for a request's arguments: a weak reference tells when nothing holds them."""


@pytest.mark.parametrize("kind", ["writer", "reader"])
def test_a_database_thread_keeps_nothing_of_its_last_call_while_it_waits(
    service: QueueService, kind: str
) -> None:
    # The read loop's locals kept each connection's last request (December 5); a writer's
    # kept its last batch (up to 256 calls of up to a frame each), a reader its last call,
    # for as long as it waited for the next.
    loop = asyncio.new_event_loop()
    calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
    thread: writer.DbThread
    if kind == "writer":
        group = writer.GroupCommit(
            service,
            sweep=lambda: set(),
            on_ready=lambda queues: None,
            failures=limits.Every(limits.FAILURE_LOG_EVERY_S),
        )
        thread = writer.Writer(calls, group)
    else:
        thread = writer.DbThread("relay-reader-test", calls, service)
    thread.start()
    try:
        arguments = _Arguments()
        gone = weakref.ref(arguments)

        def fn(held: _Arguments = arguments) -> int:
            return service.stats()["totals"]["ready"] + (0 if held else 1)

        future = loop.create_future()
        calls.put(writer.Call(fn, future, loop))
        del arguments, fn
        assert loop.run_until_complete(future) == 0
        del future
        deadline = time.monotonic() + 10
        while gone() is not None:  # the thread lets go just after it answers
            assert time.monotonic() < deadline, "the thread still holds its last call"
            time.sleep(0.01)
        assert thread.is_alive()  # waiting for the next call, not ended
    finally:
        calls.put(writer.STOP)
        thread.join(10)
        loop.close()
