"""A COMMIT whose answer never reaches the server leaves the outcome unknown, and the server
says so (``OUTCOME_UNKNOWN``) instead of ``UNAVAILABLE``, which promises that nothing changed.

A real ``relay server`` talks to PostgreSQL through a TCP proxy on loopback (a thread here)
that, once armed, forwards the COMMIT of a transaction that inserted a job, waits until
PostgreSQL shows the job committed (read on a connection of its own), then closes both sides
before the answer is passed on: a network failure or a failover just after the commit. Found
by a hostile review: the submit was answered ``UNAVAILABLE`` (retryable) while its job was in
the database, so a producer retrying without an idempotency key made a second job.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from django.db import connections

from queue_core import errors
from queue_core.client import RelayClient
from tests.postgresql.conftest import DATABASES
from tests.procs import Spawner
from tests.storage.conftest import database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

COMMIT = b"Q\x00\x00\x00\x0bCOMMIT\x00"  # the simple-protocol COMMIT psycopg sends


class CommitCutter:
    """A loopback TCP proxy to PostgreSQL that can cut one committed submit's answer."""

    def __init__(self, target: tuple[str, int], dsn: str) -> None:
        self.target = target
        self.dsn = dsn  # a direct connection, to see the commit land
        self.armed = threading.Event()
        self.cut = threading.Event()
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()
        server.close()
        self.loop.run_until_complete(self._end_tasks())
        self.loop.close()

    async def _end_tasks(self) -> None:
        """Cancel the connections still being proxied, and wait for them to end."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        db_r, db_w = await asyncio.open_connection(*self.target)
        hold = asyncio.Event()  # set: the database's answers are no longer passed on

        async def upstream() -> None:
            inserted = False
            with contextlib.suppress(ConnectionError):
                while data := await client_r.read(65536):
                    inserted = inserted or b"INSERT INTO relay_job" in data
                    if COMMIT in data and inserted and self.armed.is_set():
                        self.armed.clear()
                        hold.set()
                        db_w.write(data)
                        await db_w.drain()
                        await asyncio.to_thread(self._wait_committed)
                        self.cut.set()
                        break
                    if COMMIT in data:
                        inserted = False
                    db_w.write(data)
                    await db_w.drain()
            for writer in (client_w, db_w):
                writer.close()

        async def downstream() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await db_r.read(65536):
                    if hold.is_set():
                        continue
                    client_w.write(data)
                    await client_w.drain()
            client_w.close()

        try:
            await asyncio.gather(upstream(), downstream())
        finally:
            for writer in (client_w, db_w):
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    def _wait_committed(self) -> None:
        """Until the submitted job is visible to another session (bounded)."""
        deadline = time.monotonic() + 10
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute("SELECT count(*) FROM relay_job WHERE queue = 'cut'").fetchone()
                if row and row[0]:
                    return
                time.sleep(0.01)  # polling a condition, with a deadline

    def __enter__(self) -> CommitCutter:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def cutter() -> Iterator[CommitCutter]:
    conf = connections["postgresql"].settings_dict
    host, port = conf.get("HOST") or "127.0.0.1", int(conf.get("PORT") or 5432)
    with CommitCutter((host, port), database_url("postgresql")["RELAY_DATABASE_URL"]) as proxy:
        yield proxy


def test_a_commit_whose_answer_is_lost_is_answered_outcome_unknown(
    pg_spawn: Spawner, cutter: CommitCutter
) -> None:
    conf = connections["postgresql"].settings_dict
    user = conf.get("USER") or "postgres"
    via_proxy = f"postgresql://{user}@127.0.0.1:{cutter.port}/{conf['NAME']}"
    _server, port = pg_spawn.server(
        RELAY_DATABASE_URL=via_proxy, RELAY_PG_PREPARED_STATEMENTS="0", PGSSLMODE="disable"
    )
    with RelayClient(f"127.0.0.1:{port}", timeout_s=30) as client:
        client.submit("warm", 1)
        cutter.armed.set()
        with pytest.raises(errors.OutcomeUnknown) as caught:
            client.submit("cut", {"order": 1})
        assert caught.value.retryable
        assert cutter.cut.is_set()
        # The job was committed: the answer said it might have been.
        with psycopg.connect(cutter.dsn) as conn:
            row = conn.execute("SELECT count(*) FROM relay_job WHERE queue = 'cut'").fetchone()
        assert row == (1,)
        # The server serves on, on a new connection.
        deadline = time.monotonic() + 30
        while True:
            try:
                assert client.submit("after", 1)["job"]["state"] == "ready"
                break
            except errors.Unavailable:
                assert time.monotonic() < deadline, "the server never served again"
