"""Whether a database's migrations are this code's, and one migration at a time per database.

An upgrade review found three ways a database and the code running on it fell out of step:

* two ``relay migrate`` runs at once on one PostgreSQL database (each server's unit runs one
  before its start): one failed halfway and left ``django_migrations`` rows twice;
* ``relay migrate`` on a SQLite file a server was serving (the server migrates the file at
  its start, so this only happens with other code: an older server left running), after
  which that server's inserts were not counted (``QueueService.repair_counts``);
* the HTTP API on a database not yet migrated (500 ``INTERNAL`` for every submit), and an
  older Relay on a database a newer one had migrated (``INTERNAL`` for ``stats`` once a job
  was CANCELLED, pauses ignored).

``problem`` names the last two for the processes that serve (``relay server``, the HTTP API's
start); ``migration_lock`` serialises migrations (``relay migrate``, ``manage.py migrate``).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from django.db import connections

APP = "queue_core"
# pg_advisory_lock's key for migrations: "relaymig" as a 64-bit integer.
PG_MIGRATION_LOCK = int.from_bytes(b"relaymig", "big") - (1 << 63)


class Problem(NamedTuple):
    """Why a database cannot be served by this code.

    Attributes:
        newer: it holds migrations of ``queue_core`` this code does not have (a newer Relay
            migrated it); otherwise it is behind (unapplied migrations).
        message: one line, e.g. ``has 2 unapplied migration(s) (...); run `relay migrate` ...``.
    """

    newer: bool
    message: str


def problem(alias: str = "default") -> Problem | None:
    """Why the database of ``alias`` cannot be served by this code, or None when its
    migrations are exactly this code's.

    Raises:
        django.db.DatabaseError: the database cannot be read.
    """
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connections[alias])
    known = {name for app, name in executor.loader.graph.nodes if app == APP}
    newer = sorted(
        name for app, name in executor.loader.applied_migrations if app == APP and name not in known
    )
    if newer:
        return Problem(
            True,
            f"was migrated by a newer Relay ({', '.join(f'{APP}.{n}' for n in newer[:5])}); "
            "run that version or a later one (going back is not supported)",
        )
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if plan:
        names = ", ".join(f"{m.app_label}.{m.name}" for m, _ in plan[:5])
        return Problem(
            False,
            f"has {len(plan)} unapplied migration(s) ({names}); run `relay migrate` "
            "(manage.py migrate) first",
        )
    return None


class MigrationRefused(Exception):
    """A server serves the SQLite file: it migrates the file itself at its start."""


@contextlib.contextmanager
def migration_lock(alias: str = "default") -> Iterator[None]:
    """Hold the database's migration lock while migrating.

    SQLite: the server's own lock (an exclusive ``flock`` on the file,
    ``SqliteDriver.server_lock``), taken without waiting, when Relay has migrations left to
    apply there (a project's own migrations beside a serving ``relay server`` are left
    alone); a process that already serves the file (``relay server`` migrating at its start)
    holds it already. PostgreSQL: a
    session advisory lock (``pg_advisory_lock``), waited for, so a second ``relay migrate``
    starts once the first ended and finds nothing left to do. Other databases, and SQLite in
    memory: nothing.

    Raises:
        MigrationRefused: a server serves the SQLite file.
    """
    connection = connections[alias]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [PG_MIGRATION_LOCK])
        try:
            yield
        finally:
            with contextlib.suppress(Exception), connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [PG_MIGRATION_LOCK])
        return
    name = str(connection.settings_dict.get("NAME") or "")
    if connection.vendor != "sqlite" or not _a_file(name):
        yield
        return
    from queue_core.storage.sqlite.driver import serves

    if serves(name):
        yield
        return
    path = Path(name)
    if not path.exists() or not _relay_behind(alias):
        yield  # a new file (nothing serves it yet), or nothing of Relay's to change
        return
    with open(path, "rb") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MigrationRefused(
                f"a relay server is serving {name}; it migrates the file itself when it "
                "starts: stop it (then run `relay migrate`, or start the new server)"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _relay_behind(alias: str) -> bool:
    """Whether ``queue_core`` or ``relay_tasks`` have migrations not applied on ``alias``."""
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connections[alias])
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return any(migration.app_label in (APP, "relay_tasks") for migration, _ in plan)


def _a_file(name: str) -> bool:
    """Whether a SQLite ``NAME`` is a file on disk (not ``:memory:`` or a memory URI)."""
    return bool(name) and name != ":memory:" and "mode=memory" not in name
