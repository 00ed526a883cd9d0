"""A server frozen inside a transaction (SIGSTOP: a stopped process, a paused VM, a partition
from the database) must not stop the others' sweeps for as long as it stays frozen.

Every claim batch may take the sweep's advisory lock (``pg_try_advisory_xact_lock``), so a
server frozen mid-batch holds it, and its row locks. Frozen between two commands, its session
sits idle in the transaction, and PostgreSQL ends it after
``RELAY_PG_IDLE_IN_TRANSACTION_TIMEOUT_MS``. Frozen in the middle of one (psycopg's
``executemany`` pipelines its rows; a large message goes out in several writes), the session
is not idle: PostgreSQL waits for the rest of the command, and another server ends it after
``RELAY_PG_STUCK_TRANSACTION_MS`` (``end_stuck_sessions``). Either way the other server then
expires the lost lease. Found by a hostile review: before, the state stayed frozen for the
whole 15 s of its run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import connections
from django.db.backends.signals import connection_created
from django.test.utils import override_settings

from queue_core import errors
from queue_core.client import RelayClient
from queue_core.storage.postgresql.driver import PostgresDriver
from tests.audit import audit
from tests.postgresql.conftest import DATABASES, Server, count_sessions, server_sessions
from tests.storage.conftest import database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

Start = Callable[..., list[Server]]


def sweep_lock_holder(url: str, pid: int) -> bool:
    """Whether a session of server ``pid`` holds the sweep's advisory lock now."""
    where = "l.locktype = 'advisory' AND a.application_name LIKE %s"
    return count_sessions(url, where, [server_sessions(pid)], locks=True) > 0


def sessions(url: str) -> list[tuple[Any, ...]]:
    """The test database's sessions: name, state, wait, locks held, the query (diagnostics)."""
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            "SELECT a.pid, a.backend_start, a.xact_start, a.application_name, a.state, "
            "a.wait_event_type, a.wait_event, "
            "now() - a.state_change, (SELECT string_agg(l.locktype || ':' || l.mode, ',') "
            "FROM pg_locks l WHERE l.pid = a.pid AND l.granted), left(a.query, 80) "
            "FROM pg_stat_activity a WHERE a.datname = current_database() "
            "AND a.pid <> pg_backend_pid()"
        ).fetchall()


@pytest.fixture
def loaded() -> Iterator[Callable[[str], threading.Event]]:
    """``loaded(address)``: four threads keep a server's claims going; returns an event set
    at each of their acks (their progress)."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(address: str) -> threading.Event:
        progress = threading.Event()

        def load(n: int) -> None:
            with RelayClient(address, timeout_s=30) as client:
                while not stop.is_set():
                    try:
                        client.submit_batch([{"queue": "busy", "payload": i} for i in range(10)])
                        for lease in client.lease(["busy"], worker_id=f"l{n}", max_jobs=10):
                            client.ack(
                                lease["job_id"], worker_id=f"l{n}", lease_token=lease["lease_token"]
                            )
                            progress.set()
                    except errors.RelayError:
                        pass  # UNAVAILABLE when its frozen session was ended: go on

        threads.extend(threading.Thread(target=load, args=(n,)) for n in range(4))
        for thread in threads:
            thread.start()
        return progress

    yield start
    stop.set()
    for thread in threads:
        thread.join(60)


def test_a_server_frozen_holding_the_sweep_lock_stops_no_other_servers_sweep(
    servers: Start, loaded: Callable[[str], threading.Event]
) -> None:
    env = {
        "RELAY_PG_IDLE_IN_TRANSACTION_TIMEOUT_MS": "1000",
        "RELAY_PG_STUCK_TRANSACTION_MS": "2000",
        "RELAY_MIN_LEASE_MS": "100",
        "RELAY_REAPER_INTERVAL_MS": "200",
    }
    a, b = servers(2, **env)
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    progress = loaded(a.address)
    for _ in range(300):  # freeze a at a moment one of its sessions holds the sweep lock
        progress.clear()
        assert progress.wait(30), "server a stopped serving its load"
        os.kill(a.proc.pid, signal.SIGSTOP)
        if sweep_lock_holder(url, a.proc.pid):
            break
        os.kill(a.proc.pid, signal.SIGCONT)
    else:
        pytest.fail("never froze server a while it held the sweep lock")
    try:
        with RelayClient(b.address, timeout_s=30) as client:
            job_id = client.submit("work", 1)["job"]["id"]
            (lost,) = client.lease(["work"], worker_id="gone", lease_ms=300)
            assert lost["job_id"] == job_id  # and its worker is never heard from again
            started = time.monotonic()
            back = client.lease(["work"], worker_id="w", wait_ms=15_000)
            waited = time.monotonic() - started
            assert [lease["job_id"] for lease in back] == [job_id], (
                f"the lease never expired; sessions: {sessions(url)}"
            )
            assert back[0]["attempt"] == 2
            assert waited < 10, waited
            client.ack(job_id, worker_id="w", lease_token=back[0]["lease_token"])
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    # a lost the frozen session, and serves on with a new one.
    with RelayClient(a.address, timeout_s=30) as client:
        deadline = time.monotonic() + 30
        while True:
            try:
                client.submit("after", 1)
                break
            except errors.Unavailable:
                assert time.monotonic() < deadline, "server a never served again"
    audit(connections["postgresql"], quick_check=False)


def test_a_servers_sessions_get_its_lock_and_idle_limits() -> None:
    """``server_lock`` sets the limits on the connections the process opens from then on,
    whatever the project's own database settings say."""
    driver = PostgresDriver("postgresql")
    try:
        with override_settings(
            RELAY_LOCK_TIMEOUT_MS=1234, RELAY_PG_IDLE_IN_TRANSACTION_TIMEOUT_MS=4321
        ):
            assert driver.server_lock() is None
            connections["postgresql"].close()
            with connections["postgresql"].cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('lock_timeout'), "
                    "current_setting('idle_in_transaction_session_timeout'), "
                    "current_setting('application_name')"
                )
                row: Any = cursor.fetchone()
        assert row[:2] == ("1234ms", "4321ms")
        assert row[2].startswith(f"relay server {os.getpid()} ")
    finally:
        connection_created.disconnect(dispatch_uid="relay.server_limits.postgresql")
        connections["postgresql"].close()


def test_a_stuck_relay_session_mid_command_is_ended_by_another_server(servers: Start) -> None:
    """Deterministic: a session named as a relay server's holds the sweep lock in a
    transaction that the idle limit does not end (here: turned off for it, as for a session
    waiting for the rest of a command). The live server ends it and sweeps."""
    (b,) = servers(1, RELAY_PG_STUCK_TRANSACTION_MS="1000", RELAY_MIN_LEASE_MS="100")
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    # closing(), not the connection's own with: its exit would COMMIT on an ended session.
    with contextlib.closing(
        psycopg.connect(url, application_name="relay server 1 deadbeef")
    ) as stuck:
        stuck.execute("SET idle_in_transaction_session_timeout = 0")
        stuck.execute("SELECT pg_advisory_xact_lock(hashtext('relay.sweep'))")
        (pid,) = stuck.execute("SELECT pg_backend_pid()").fetchone() or (0,)
        with RelayClient(b.address, timeout_s=30) as client:
            job_id = client.submit("work", 1)["job"]["id"]
            (lost,) = client.lease(["work"], worker_id="gone", lease_ms=300)
            assert lost["job_id"] == job_id
            back = client.lease(["work"], worker_id="w", wait_ms=15_000)
            assert [lease["job_id"] for lease in back] == [job_id], sessions(url)
        with psycopg.connect(url, autocommit=True) as conn:
            alive = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
            assert alive.fetchone() == (0,)
    assert "stuck_sessions_ended" in b.proc.stderr_text()


HELD = 8  # jobs whose rows another session holds


def test_a_batch_that_meets_held_rows_waits_out_one_lock_not_one_each(servers: Start) -> None:
    """Acks of rows another session holds, pipelined with submits into one group commit: the
    acks are answered BUSY and the submits committed, after about one lock wait: once a wait
    ran out, the rest of the writer's transactions wait only SHORT_LOCK_WAIT. (Before, each
    held row cost a lock_timeout in turn: 16 of them held a batch 28 s, in a hostile review.)"""
    (a,) = servers(1, RELAY_LOCK_TIMEOUT_MS="2000")
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    with RelayClient(a.address, timeout_s=60) as client:
        for i in range(HELD):
            client.submit("held", i)
        leases = client.lease(["held"], worker_id="w", max_jobs=HELD, lease_ms=600_000)
    assert len(leases) == HELD
    frames = []
    for n, lease in enumerate(leases):
        args = {"job_id": lease["job_id"], "worker_id": "w", "lease_token": lease["lease_token"]}
        frames.append({"id": 2 * n + 1, "op": "ack", "args": args})
        frames.append({"id": 2 * n + 2, "op": "submit", "args": {"queue": "free", "payload": n}})
    with psycopg.connect(url) as holder:
        holder.execute(
            "SELECT id FROM relay_job WHERE id = ANY(%s) FOR UPDATE",
            [[lease["job_id"] for lease in leases]],
        )
        host, port = a.address.split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            started = time.monotonic()
            # One write: the requests share a group commit.
            sock.sendall(b"".join(json.dumps(f).encode() + b"\n" for f in frames))
            replies: dict[int, dict[str, Any]] = {}
            reader = sock.makefile("rb")
            while len(replies) < len(frames):
                reply = json.loads(reader.readline())
                replies[reply["id"]] = reply
            took = time.monotonic() - started
        holder.rollback()
    with psycopg.connect(url) as conn:
        free = conn.execute("SELECT count(*) FROM relay_job WHERE queue = 'free'").fetchone()
        done = conn.execute("SELECT count(*) FROM relay_job WHERE state = 'succeeded'").fetchone()
    submitted = [replies[2 * n + 2] for n in range(HELD)]
    acked = [replies[2 * n + 1] for n in range(HELD)]
    assert all(r["ok"] for r in submitted), submitted
    assert free == (HELD,)
    assert all(not r["ok"] and r["error"]["code"] == "BUSY" for r in acked), acked
    assert done == (0,)
    assert took < HELD * 2 / 2, took  # not a lock_timeout per held row (16 s)


def test_a_busy_relay_session_in_a_long_transaction_is_not_taken_for_stuck(
    servers: Start,
) -> None:
    """A session named as a relay server's runs a statement every 100 ms in one transaction
    for three times the stuck limit (a slow server, or one waiting for locks in turn): it is
    left alone. Only a session that waits for its server with no statement is ended."""
    (b,) = servers(1, RELAY_PG_STUCK_TRANSACTION_MS="1000")
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    with psycopg.connect(url, application_name="relay server 2 cafebabe") as busy:
        busy.execute("SELECT 1")  # the transaction begins
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            busy.execute("SELECT pg_sleep(0.1)")
        busy.execute("SELECT 1")  # the session is still there: this would raise
    with RelayClient(b.address) as client:
        client.ping()
    assert "stuck_sessions_ended" not in b.proc.stderr_text()
