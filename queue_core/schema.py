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
import errno
import fcntl
import functools
import logging
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from django.db import connections

from queue_core.errors import StorageIO

log = logging.getLogger("relay.store")

APP = "queue_core"
RELAY_APPS = (APP, "relay_tasks")
# pg_advisory_lock's key for migrations: "relaymig" as a 64-bit integer.
PG_MIGRATION_LOCK = int.from_bytes(b"relaymig", "big") - (1 << 63)


class Problem(NamedTuple):
    """Why a database cannot be served by this code.

    Attributes:
        newer: it holds migrations of ``queue_core`` or ``relay_tasks`` this code does not
            have (a newer Relay migrated it); otherwise it is behind (unapplied migrations).
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
    known = set(executor.loader.graph.nodes)
    newer = sorted(
        f"{app}.{name}"
        for app, name in executor.loader.applied_migrations
        if app in RELAY_APPS and (app, name) not in known
    )
    if newer:
        return Problem(
            True,
            f"was migrated by a newer Relay ({', '.join(newer[:5])}); "
            "run that version or a later one (going back is not supported)",
        )
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if plan:
        names = ", ".join(f"{m.app_label}.{m.name}" for m, _ in plan[:5])
        database = "" if alias == "default" else f" --database {alias}"
        return Problem(
            False,
            f"has {len(plan)} unapplied migration(s) ({names}); run `relay migrate{database}` "
            f"(manage.py migrate{database}) first",
        )
    return None


class MigrationRefused(Exception):
    """A server serves the SQLite file: it migrates the file itself at its start."""


@contextlib.contextmanager
def migration_lock(
    alias: str = "default", options: Mapping[str, object] | None = None
) -> Iterator[None]:
    """Hold the database's migration lock while migrating.

    PostgreSQL: a transaction-level advisory lock (``pg_advisory_xact_lock``) taken on a
    connection of its own, whose transaction stays open while the migrations run on Django's
    connection and ends (releasing it) when they end or the process dies. A transaction, not a
    session lock, so a pooler in transaction mode (PgBouncer) keeps that connection on one
    backend for as long as it is held (a review: a session lock there was taken and released
    on different backends, and left held); waited for without Relay's ``lock_timeout``
    (2 s: a review's second migrate gave up at 3.4 s behind a 3-million-job upgrade).

    SQLite (a file; not for ``--plan`` or ``--check``, which change nothing): a file with
    more than one name is refused (``one_name``); then, always, the turn (``_one_migration``:
    a lock on one byte of the file, which it makes empty when it is not there yet), waited
    for, so two migrations take turns (a review: with Relay's migrations applied and Django's
    own not, three of four migrates at once failed on duplicate rows). Then, when Relay's own
    migrations would run (``relay_changes``: ``migrate``'s ``options``; None for a plain
    ``migrate``; always for a new file), the file's
    ``flock`` taken shared, without waiting, so it is refused while a server holds it
    exclusively (``SqliteDriver.server_lock``), and a server starting meanwhile waits for it.
    A starting ``relay server`` takes the turn before its file and keeps it until its own
    migration at start has ended (``take_server_turn``), so a server holding the file while
    this holds the turn has migrated it, before this read the file's migrations. A process that
    serves the file (that server migrating) holds both already. The descriptor is kept open
    after: closing one would drop the POSIX locks SQLite holds on the file in this process.
    Other databases, and SQLite in memory: nothing.

    Raises:
        MigrationRefused: a server serves the SQLite file.
        StorageIO: the SQLite file has more than one name (hard links: ``one_name``).
    """
    if connections[alias].vendor == "postgresql":
        with _pg_lock(alias):
            yield
        return
    name = _sqlite_file(alias)
    if name is None:
        yield
        return
    from queue_core.storage.sqlite.driver import one_name, serves

    path = Path(name)
    if serves(name):  # this process's server migrating its file at its start: its turn
        with _TURNS.pop(os.path.realpath(name), None) or _one_migration(name, server=True):
            yield
        return
    options = options or {}
    if options.get("plan") or options.get("check_unapplied"):
        yield  # changes nothing
        return
    try:
        one_name(path.stat())
    except FileNotFoundError:
        pass  # a new file: made by the turn
    except StorageIO as exc:
        raise StorageIO(f"database {name}: {exc.message}") from None
    # The turn first, then the file: a starting server takes them in the same order and keeps
    # the turn until its own migration has ended, so a server that holds the file while this
    # holds the turn has migrated it and serves (a third review: a migrate that looked between
    # a starting server taking its file and taking its turn exited 4).
    with _one_migration(name) as kept:
        # None: nothing can write the file (no folder, a read-only one), and the migration
        # says so itself if it must.
        shared: int | None = None  # the descriptor holding the file's flock shared
        if kept is not None and relay_changes(alias, options):
            # Relay's migrations would change it (a new file, which the turn made empty: all
            # of them): refused while a server serves it, and a server starting meanwhile
            # waits. One that holds the file now has migrated it since it took the turn
            # first, and relay_changes looked after that (a review: bin/http's migrate,
            # started with a server on a new file, exited 4 in 3 of 5 tries).
            try:
                fcntl.flock(kept, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise MigrationRefused(
                    f"a relay server is serving {name}; it migrates the file itself when it "
                    "starts: stop it (then run `relay migrate`, or start the new server)"
                ) from None
            shared = kept
        try:
            yield
        finally:
            if shared is not None:
                fcntl.flock(shared, fcntl.LOCK_UN)  # before the turn ends: a server waits for both


_TURNS: dict[str, contextlib.ExitStack] = {}  # file (real path) -> the turn its server holds


def take_server_turn(alias: str) -> None:
    """``relay server``, before it takes its SQLite file (``SqliteDriver.server_lock``), takes
    the migration turn, waiting for a ``relay migrate`` that holds it, and keeps it until its
    own migration at start has ended (``migration_lock`` lets it go, or ``end_server_turn``):
    a ``relay migrate`` meanwhile waits for the turn, then finds the file migrated, rather
    than exiting 4 while the server is about to migrate it. The same order as a migrate's
    (turn, then file), so neither waits for the other's second lock while holding its first.
    Only the command takes it: a server embedded elsewhere (the tests' own) that never
    migrates would keep it for the life of its process."""
    name = _sqlite_file(alias)
    if name is None:
        return
    turn = contextlib.ExitStack()
    turn.enter_context(_one_migration(name, server=True))
    _TURNS[os.path.realpath(name)] = turn


def end_server_turn(alias: str) -> None:
    """Let go of the turn ``take_server_turn`` took, if it is still held."""
    name = _sqlite_file(alias)
    turn = None if name is None else _TURNS.pop(os.path.realpath(name), None)
    if turn is not None:
        turn.close()


# The byte of a SQLite database file whose lock is the migration turn: far past any file's
# end and the bytes SQLite locks itself (from 1 GiB, PENDING_BYTE, up by 512).
TURN_BYTE = 1 << 62
# struct flock of x86-64 and aarch64 Linux: l_type, l_whence, l_start, l_len, l_pid.
_FLOCK = struct.Struct("hhxxxxqqixxxx")


# Open-file-description locks (Linux 3.15+): elsewhere (macOS) the turn is the folder's
# flock, which every database of the folder shares.
_OFD = hasattr(fcntl, "F_OFD_SETLKW")


@contextlib.contextmanager
def _one_migration(name: str, *, server: bool = False) -> Iterator[int | None]:
    """Hold the turn: one migration of a SQLite file at a time, by a write lock on one byte
    of the file itself (``TURN_BYTE``), an open-file-description lock (``F_OFD_SETLKW``)
    that ends with its process, at ``kill -9`` too; yield the file's kept descriptor
    (``_kept_fd``; None when the file cannot be opened for writing, and no turn is taken:
    nothing can change it, and the migration says so itself if it must). A file not made
    yet is made, empty (SQLite takes it for a new database), readable by its owner alone.

    The file's own ``flock`` is taken shared so a server waits for every migration; two
    migrations under it both ran their plan, and the second failed on what the first had
    just applied. The second now waits here and finds nothing left to do. A server starting
    on its file takes the turn too (``server``: it logs its wait; ``take_server_turn``): a
    review's ``relay migrate`` with nothing of Relay's left to apply, which takes no hold on
    the file, applied Django's own migrations at once with a server starting beside it (8 of
    9 tries). Hostile reviews shaped where the turn lives: a lock file beside the database
    could not always be made (a name too long for it, a read-only folder: then migrations
    ran without a turn) or removed (the migration failed after it had run); a lock on the
    folder held up every database in it, and any user who could read the folder could hold
    it. Only a process that may write the file can take this one (one that may read it
    could hold a read lock on the byte against it, as it can SQLite's own locks: so a file
    made here is 0600, and the units set ``UMask=0077``). Threads of one process take turns
    on a lock of their own first (they share the descriptor). Without open-file-description
    locks (not Linux), the folder's ``flock`` is the turn.
    """
    fd = _kept_fd(name)
    if fd is None:
        yield None
        return
    real = os.path.realpath(name)
    with _KEPT_LOCK:
        in_process = _TURN_THREADS.setdefault(real, threading.Lock())
    with in_process, contextlib.ExitStack() as held:
        if _OFD:
            take: Callable[..., None] = functools.partial(_turn_lock, fd, fcntl.F_WRLCK)
            held.callback(_turn_lock, fd, fcntl.F_UNLCK, wait=False)
        else:
            folder = os.open(os.path.dirname(real), os.O_RDONLY)
            held.callback(os.close, folder)  # a folder's descriptor: no lock of the file's
            take = functools.partial(_folder_lock, folder)
        try:
            take(wait=False)
        except (BlockingIOError, PermissionError):
            if server:
                log.info(
                    "event=waiting_for_migration db=%s",
                    name,
                    extra={"event": "waiting_for_migration"},
                )
            else:
                print(f"waiting for another migration of {name} to end", file=sys.stderr)
            take(wait=True)
        yield fd


def _turn_lock(fd: int, kind: int, *, wait: bool) -> None:
    """Lock (``F_WRLCK``) or unlock (``F_UNLCK``) ``TURN_BYTE`` of the file ``fd`` has open.

    Raises:
        BlockingIOError, PermissionError: ``wait`` False and another process holds it.
    """
    command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    fcntl.fcntl(fd, command, _FLOCK.pack(kind, os.SEEK_SET, TURN_BYTE, 1, 0))


def _folder_lock(folder: int, *, wait: bool) -> None:
    """The turn without open-file-description locks: the folder's ``flock``.

    Raises:
        BlockingIOError: ``wait`` False and another process holds it.
    """
    fcntl.flock(folder, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)


def _kept_fd(name: str) -> int | None:
    """A descriptor of the SQLite file ``name`` opened for reading and writing (made empty,
    0600, when missing), kept open until the process ends and used again by every later
    turn of this process on the same file: closing one would drop the POSIX locks SQLite
    holds on the file in this process, and a new one per migration leaked one a call (a
    hostile review: 100 migrations in one process held 100 more). None when the file cannot
    be opened for writing (no such folder; a read-only file, folder or file system).

    Raises:
        StorageIO: it cannot be opened for another reason (out of descriptors, say), which
            would otherwise run the migration without a turn.
    """
    real = os.path.realpath(name)
    with _KEPT_LOCK:
        fd = _KEPT_FDS.get(real)
        if fd is not None and _names(fd, real):
            return fd
        if fd is not None and os.fstat(fd).st_nlink == 0:
            # Its file was deleted (a test suite's database made again, say): no process can
            # open it again, so no lock on it matters now (a fourth review: one descriptor
            # kept per deleted file, its disk space never freed).
            os.close(fd)
        try:
            fd = os.open(real, os.O_RDWR | os.O_CREAT, 0o600)
        except (FileNotFoundError, PermissionError):
            return None
        except OSError as exc:
            if exc.errno == errno.EROFS:
                return None
            raise StorageIO(f"cannot open {name} for its migration turn: {exc}") from exc
        _KEPT_FDS[real] = fd  # a replaced file's, still named elsewhere, stays open unused
        return fd


def _names(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file ``fd`` has open."""
    try:
        at_path = os.stat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)


_KEPT_LOCK = threading.Lock()
_KEPT_FDS: dict[str, int] = {}  # real path -> its kept descriptor (``_kept_fd``)
_TURN_THREADS: dict[str, threading.Lock] = {}  # real path -> the turn among this process's threads


@contextlib.contextmanager
def _pg_lock(alias: str) -> Iterator[None]:
    """``pg_advisory_xact_lock`` on a connection of its own, for the block (see above)."""
    connection = connections[alias]
    with connection.wrap_database_errors:  # Django's errors, as its own connection raises
        locker = connection.get_new_connection(connection.get_connection_params())
    try:
        with locker.cursor() as cursor:  # opens the transaction that holds the lock
            cursor.execute("SET LOCAL lock_timeout = 0")
            cursor.execute("SET LOCAL statement_timeout = 0")
            cursor.execute("SET LOCAL idle_in_transaction_session_timeout = 0")
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [PG_MIGRATION_LOCK])
        yield
    finally:
        with contextlib.suppress(Exception):
            locker.rollback()
        with contextlib.suppress(Exception):
            locker.close()


def relay_changes(alias: str, options: Mapping[str, object]) -> bool:
    """Whether ``migrate`` with ``options`` (not ``--plan`` or ``--check``, which change
    nothing: ``migration_lock`` looks at them first) may apply or unapply Relay's migrations
    on ``alias``: a named app of Relay's (forwards or backwards: a review unapplied 0016 to
    0011 under a live server), or no app named and Relay's behind."""
    app = options.get("app_label")
    if app:
        return app in RELAY_APPS
    return _relay_behind(alias)


def _relay_behind(alias: str) -> bool:
    """Whether ``queue_core`` or ``relay_tasks`` have migrations not applied on ``alias``."""
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connections[alias])
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return any(migration.app_label in RELAY_APPS for migration, _ in plan)


def _sqlite_file(alias: str) -> str | None:
    """The ``NAME`` of ``alias`` when it is a SQLite file on disk (not ``:memory:`` or a
    memory URI); None for another database."""
    connection = connections[alias]
    name = str(connection.settings_dict.get("NAME") or "")
    if connection.vendor != "sqlite" or not name or name == ":memory:" or "mode=memory" in name:
        return None
    return name
