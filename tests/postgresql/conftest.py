"""PostgreSQL-only tests on the test database of tests/settings.py (migrated by pytest-django):
the claim's plan, and several real ``relay server`` processes with real workers and sockets.

``servers(n, **env)`` starts ``n`` servers on free loopback ports and returns them with their
addresses; the ORM reads of these tests go to the PostgreSQL database. Every process is killed
at teardown. Without PostgreSQL these tests fail at set-up: they never skip.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from django.test.utils import override_settings

from queue_core.service import QueueService
from queue_core.storage import driver_for
from tests.procs import Proc, Spawner, spawner
from tests.storage.conftest import (
    DATABASES,
    OneDatabase,
    _postgresql_connections_closed,
    database_url,
)

# _postgresql_connections_closed: the session fixture that ends the change feeds' listener
# connections before the test database is dropped (autouse, from tests/storage).
__all__ = [
    "DATABASES",
    "Server",
    "_postgresql_connections_closed",
    "count_sessions",
    "deadlocks",
    "server_sessions",
]


def count_sessions(url: str, where: str, params: Sequence[Any] = (), *, locks: bool = False) -> int:
    """How many sessions ``a`` (``pg_stat_activity``) of the test database match ``where``
    now; with ``locks``, how many of their granted locks ``l`` (``pg_locks``) do."""
    rows = (
        "pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid AND l.granted"
        if locks
        else ("pg_stat_activity a")
    )
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {rows} WHERE a.datname = current_database() AND {where}",
            params,
        ).fetchone()
    return int(row[0]) if row else 0


def server_sessions(pid: int) -> str:
    """The ``application_name`` pattern of relay server ``pid``'s sessions (for ``LIKE``)."""
    return f"relay server {pid} %"


def deadlocks(url: str) -> int:
    """The deadlocks PostgreSQL has counted in the test database so far."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


@dataclass
class Server:
    """A running ``relay_server`` process and its ``127.0.0.1:PORT``."""

    proc: Proc
    address: str


@pytest.fixture
def pg_service(transactional_db: None) -> QueueService:
    """A QueueService on the PostgreSQL test database (alias ``postgresql``), system clock."""
    return QueueService(driver=driver_for("postgresql"))


@pytest.fixture
def pg_spawn(transactional_db: None) -> Iterator[Spawner]:
    """A Spawner whose children use the PostgreSQL test database (``RELAY_DATABASE_URL``)."""
    with (
        override_settings(
            DATABASE_ROUTERS=[OneDatabase("postgresql")], RELAY_DATABASE="postgresql"
        ),
        tempfile.TemporaryDirectory() as folder,
        spawner(f"{folder}/unused.db") as s,
    ):
        yield s


@pytest.fixture
def servers(pg_spawn: Spawner) -> Callable[..., list[Server]]:
    """``servers(n, **env)``: start ``n`` relay servers on the PostgreSQL test database."""

    def start(n: int, **env: str) -> list[Server]:
        started = []
        for _ in range(n):
            proc, port = pg_spawn.server(**database_url("postgresql"), **env)
            started.append(Server(proc, f"127.0.0.1:{port}"))
        return started

    return start
