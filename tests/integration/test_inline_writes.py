"""The event loop's own group commit on SQLite (``queue_core.protocol.writer.Database``).

The loop never waits for SQLite's write lock: while another connection holds it, writes go to
the writer thread, which waits, and commit in the order they were queued; reads go on. Once the
thread has answered them all, writes run on the loop again.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from django.db import connection

from queue_core.protocol import writer
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
        # All three wait on the writer thread, unanswered (the reaper's sweep may too).
        wait_for(lambda: db._queued >= 3)
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
