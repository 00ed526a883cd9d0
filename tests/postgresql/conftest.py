"""PostgreSQL-only tests on the test database of tests/settings.py (migrated by pytest-django):
the claim's plan, and several real ``relay server`` processes with real workers and sockets.

``servers(n, **env)`` starts ``n`` servers on free loopback ports and returns them with their
addresses; the ORM reads of these tests go to the PostgreSQL database. Every process is killed
at teardown. Without PostgreSQL these tests fail at set-up: they never skip.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from django.test.utils import override_settings

from tests.procs import Proc, Spawner, spawner
from tests.storage.conftest import (
    DATABASES,
    OneDatabase,
    _postgresql_connections_closed,
    database_url,
)

# _postgresql_connections_closed: the session fixture that ends the change feeds' listener
# connections before the test database is dropped (autouse, from tests/storage).
__all__ = ["DATABASES", "Server", "_postgresql_connections_closed"]


@dataclass
class Server:
    """A running ``relay_server`` process and its ``127.0.0.1:PORT``."""

    proc: Proc
    address: str


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
