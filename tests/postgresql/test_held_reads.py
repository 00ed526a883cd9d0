"""Reads that wait on another session's lock fill a server's reader pool; neither a ping nor
a write may wait behind them.

A hostile review held ``LOCK TABLE relay_event`` while 16-40 clients read jobs (``inspect``
reads their history), each read waiting out ``lock_timeout``: a ping, served by the reader
pool, took up to 19.7 s, and every write waited 5-10 s, because a write first needs the key
table's snapshot (read again once a second) and that read queued behind the others. Now a
ping touches no thread and the key table is read on a thread of its own, once for all the
requests that wait for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import pytest

from queue_core import errors
from queue_core.client import RelayClient
from tests.postgresql.conftest import DATABASES, Server, count_sessions, server_sessions
from tests.storage.conftest import database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

Start = Callable[..., list[Server]]

READERS = 16  # clients whose reads wait on the lock: four rounds of the reader pool's 4
ROUNDS = 30  # the sentinel's pings and submits, 0.1 s apart: the 1 s snapshot goes stale


def waiting_on_locks(url: str, server: Server) -> int:
    """How many of ``server``'s sessions wait for a lock now."""
    where = "a.application_name LIKE %s AND a.wait_event_type = 'Lock'"
    return count_sessions(url, where, [server_sessions(server.proc.pid)])


def test_reads_waiting_on_a_lock_hold_up_no_ping_and_no_write(servers: Start) -> None:
    (a,) = servers(1, RELAY_LOCK_TIMEOUT_MS="2000")
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    with RelayClient(a.address, timeout_s=60) as client:
        job_id = client.submit("read", 0)["job"]["id"]
    stop = threading.Event()
    refused: list[str] = []

    def read_history() -> None:
        with RelayClient(a.address, timeout_s=60) as reader:
            for _ in range(20):
                if stop.is_set():
                    return
                try:
                    reader.inspect(job_id)
                except errors.RelayError as exc:
                    refused.append(exc.code)

    pings: list[float] = []
    writes: list[float] = []
    with psycopg.connect(url) as holder:
        holder.execute("LOCK TABLE relay_event IN ACCESS EXCLUSIVE MODE")
        readers = [threading.Thread(target=read_history) for _ in range(READERS)]
        for thread in readers:
            thread.start()
        try:
            deadline = time.monotonic() + 30
            while waiting_on_locks(url, a) < 4:  # the reader pool is full
                assert time.monotonic() < deadline, "the reads never waited on the lock"
            with RelayClient(a.address, timeout_s=60) as sentinel:
                for n in range(ROUNDS):
                    began = time.monotonic()
                    sentinel.ping()
                    pinged = time.monotonic()
                    sentinel.submit("sentinel", n)
                    pings.append(pinged - began)
                    writes.append(time.monotonic() - pinged)
                    stop.wait(0.1)  # pacing: the rounds span the snapshot's 1 s life 3 times
        finally:
            stop.set()
            holder.rollback()
            for thread in readers:
                thread.join(60)
    assert refused and set(refused) == {"BUSY"}, refused  # the reads did wait it out
    assert max(pings) < 1.0, pings  # 6-8 s behind the reads before
    assert max(writes) < 1.0, writes  # the same, waiting for the key table's snapshot


def test_an_authenticated_connections_ping_waits_for_no_key_table(servers: Start) -> None:
    # Before each line of a connection that said hello, the server looked at the key table
    # for a revoke, and waited for a stale snapshot to be read again: with the table locked
    # its pings waited out lock_timeout, 1.9 s each (a second review).
    from queue_core import auth

    key = auth.create_key("w", ["worker"]).key
    (a,) = servers(1, RELAY_LOCK_TIMEOUT_MS="2000")
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    pings: list[float] = []
    with RelayClient(a.address, timeout_s=60, api_key=key) as client:
        client.ping()  # the hello is done
        with psycopg.connect(url) as holder:
            holder.execute("LOCK TABLE relay_api_key IN ACCESS EXCLUSIVE MODE")
            try:
                for _ in range(ROUNDS):  # 3 s at least: the 1 s snapshot goes stale in them
                    began = time.monotonic()
                    client.ping()
                    pings.append(time.monotonic() - began)
                    time.sleep(0.1)  # pacing, not a wait for anything
            finally:
                holder.rollback()
        assert client.lease(["free"], worker_id="w") == []  # served once the table is free
    assert max(pings) < 1.0, pings
