"""The database a crash test's real processes use, on either driver.

``relay_db`` (a fixture of the modules that run on both drivers) points the test's ``spawn``
at SQLite (the test file) or PostgreSQL (the test database of tests/settings.py), and reads
the database from outside as those tests do: ``rows(sql, params)`` with ``%s`` placeholders,
and ``audit()`` (tests/audit.py).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from django.db import connections
from django.test.utils import override_settings

from queue_core.service import QueueService
from queue_core.storage import driver_for
from tests.audit import audit
from tests.procs import Spawner
from tests.storage.conftest import BACKENDS, DATABASES, OneDatabase, database_url

__all__ = ["BACKENDS", "DATABASES", "RelayDb", "relay_db"]  # relay_db: a plugin (tests/conftest.py)


class RelayDb:
    """Read a Relay database from outside its server: SQLite file or PostgreSQL."""

    def __init__(self, backend: str, path: str) -> None:
        self.backend = backend
        self.path = path

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run ``sql`` (``%s`` placeholders) and return its rows as tuples."""
        if self.backend == "sqlite":
            with contextlib.closing(sqlite3.connect(self.path)) as conn:
                return [tuple(r) for r in conn.execute(sql.replace("%s", "?"), params)]
        with connections["postgresql"].cursor() as cursor:
            cursor.execute(sql, params)
            return [tuple(r) for r in cursor.fetchall()]

    @property
    def env(self) -> dict[str, str]:
        """The environment a child process needs to use this database."""
        return database_url(self.backend)

    def service(self) -> QueueService:
        """A ``QueueService`` on this database (the system clock)."""
        return QueueService(
            driver=driver_for("default" if self.backend == "sqlite" else "postgresql")
        )

    def audit(self, *, quick_check: bool = True) -> None:
        """Check every invariant of tests/audit.py (``PRAGMA quick_check`` on SQLite only)."""
        if self.backend == "sqlite":
            audit(self.path, quick_check=quick_check)
        else:
            audit(connections["postgresql"], quick_check=False)


@pytest.fixture(params=BACKENDS)
def relay_db(request: pytest.FixtureRequest, spawn: Spawner) -> Iterator[RelayDb]:
    """The test's database on each driver in turn; ``spawn``'s children use it, and so do the
    ORM reads of the test."""
    backend = str(request.param)
    spawn.env.update(database_url(backend))
    alias = "default" if backend == "sqlite" else "postgresql"
    # RELAY_DATABASE too: the console, the key table and the metrics read Relay's alias.
    with override_settings(DATABASE_ROUTERS=[OneDatabase(alias)], RELAY_DATABASE=alias):
        yield RelayDb(backend, spawn.db_path)


def put_a_copy_in_place(path: str, copy: str) -> None:
    """Back ``path`` up into ``copy`` (sqlite3's backup API), then rename the copy over
    ``path``: another file (inode) at the path, as an operator's restore makes, while whoever
    opened the old one keeps it."""
    with (
        contextlib.closing(sqlite3.connect(path)) as src,
        contextlib.closing(sqlite3.connect(copy)) as dst,
    ):
        src.backup(dst)
    os.replace(copy, path)
