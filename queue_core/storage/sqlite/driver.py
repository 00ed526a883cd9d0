"""The SQLite driver: the embedded, first-class single-node store.

``write()`` opens ``BEGIN IMMEDIATE`` (SQLite takes the write lock up front, so two claimers
can never both read a job as READY and both lease it), or a SAVEPOINT when already inside one,
which lets the server run many requests in one transaction (group commit) while each request
still rolls back alone. Statements are the named blocks of ``queries.sql`` beside this file.

One writer at a time is what makes the claim simple here: read the head of each base class,
rank them in Python, lease by id; no row locks to skip. It is also why one server serves a
file (``server_lock``) and releases every lease at its start.

Django keeps SQLite in autocommit and issues ``BEGIN`` itself inside ``transaction.atomic()``,
so outside a caller's ``atomic()`` this driver issues its own ``BEGIN IMMEDIATE``; inside one
it is a SAVEPOINT of the caller's transaction (tests use ``django_db(transaction=True)``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import random
import re
import sqlite3
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, NoReturn

import orjson
from django.db import DatabaseError, OperationalError, connections, transaction
from django.db.backends.signals import connection_created

from queue_core.clock import Clock, SystemClock
from queue_core.conf import relay_settings
from queue_core.errors import (
    InvalidArgument,
    OutcomeUnknown,
    RelayError,
    StorageFull,
    StorageIO,
    StorageLost,
    StoreBusy,
)
from queue_core.states import effective_priority
from queue_core.storage.base import (
    REPLY_OVERHEAD_BYTES,
    AlreadyServed,
    Capabilities,
    ClaimRequest,
    SqlTx,
    WriteLocked,
    column_names,
    load_queries,
    run_callbacks,
)
from queue_core.storage.sqlite import wal

log = logging.getLogger("relay.store")

QUERIES = load_queries("queue_core.storage.sqlite")
_PARAM_RE = re.compile(r"%\((\w+)\)s")


def named_style(sql: str) -> str:
    """Spell Django's ``%(name)s`` placeholders as sqlite3's ``:name`` (and ``%%`` as ``%``)."""
    return _PARAM_RE.sub(r":\1", sql).replace("%%", "%")


# The same statements in sqlite3's own parameter style, for the raw cursor.
NAMED_QUERIES = {name: named_style(sql) for name, sql in QUERIES.items()}
# How long a bulk chunk waits for another process's turn (``SqliteDriver.bulk_turn``), s.
BULK_TURN_WAIT_S = 2.0
MAINTAIN_EVERY_S = 0.25  # how often maintain() looks at the write-ahead log's size
MAX_CHECKPOINT_BACKOFF_S = 2.0  # the longest pause between checkpoints readers held up
SYNCHRONOUS_NORMAL = 1  # PRAGMA synchronous: a commit appends to the log without an fsync


def _is_busy(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


# ----------------------------------------------------------------- storage faults (items 7, 8)

# SQLite's primary result codes that mean the storage, not the statement, failed.
_READONLY_CODES = frozenset(
    {sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM, sqlite3.SQLITE_NOLFS}
)
# An I/O error with less than this free beside the file is the disk being full: SQLite reports
# a full disk as SQLITE_FULL when a write fails, but as SQLITE_IOERR when it cannot size its
# shared-memory file (at start, say).
FULL_BELOW_BYTES = 1024 * 1024
FAULT_LOG_INTERVAL_S = 10.0  # one log line per fault code per this many seconds
_IDENTITY_ATTR = "_relay_file_identity"  # on Django's connection: (path, (st_dev, st_ino))


def _free_bytes(path: str) -> int | None:
    with contextlib.suppress(OSError):
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        return st.f_bavail * st.f_frsize
    return None


def storage_fault(exc: BaseException, path: str) -> RelayError | None:
    """Relay's error for a storage failure under a SQLite call; None for any other error.

    Args:
        exc: what the call raised: a ``sqlite3.Error``, or Django's wrapper of one.
        path: the database file (its free space tells a full disk from other I/O errors).
    Returns:
        ``StorageFull`` (``SQLITE_FULL``, or ``SQLITE_IOERR`` with under ``FULL_BELOW_BYTES``
        free), ``StorageIO`` (other I/O errors; a read-only or unopenable file, folder or file
        system), or None (corruption, constraint errors, bugs: they keep their own paths).
    """
    if isinstance(exc, RelayError):  # mapped already
        return None
    cause = exc if isinstance(exc, sqlite3.Error) else exc.__cause__
    code = getattr(cause, "sqlite_errorcode", None)
    if not isinstance(code, int):
        return None
    primary = code & 0xFF
    said = f"(SQLite: {cause})"
    if primary == sqlite3.SQLITE_IOERR:
        free = _free_bytes(path)
        if free is not None and free < FULL_BELOW_BYTES:
            primary = sqlite3.SQLITE_FULL
        else:
            return StorageIO(f"the database storage failed an I/O operation {said}")
    if primary == sqlite3.SQLITE_FULL:
        return StorageFull(
            f"the database's disk is full {said}: nothing was written; writes resume once "
            "space is freed"
        )
    if primary in _READONLY_CODES:
        return StorageIO(
            f"the database cannot be written: its file, folder or file system is read-only "
            f"or out of reach {said}"
        )
    return None


def commit_fault(exc: BaseException) -> OutcomeUnknown | None:
    """``OutcomeUnknown`` for an I/O error raised by ``COMMIT`` itself; None for any other.

    Such an error (``SQLITE_IOERR_FSYNC``, a failed write of a frame or of the log's index)
    may come after the commit frame reached the write-ahead log: SQLite rolls the transaction
    back in this process, but the frame is in the file, and a restart before the next write
    takes its place recovers it as committed. So it is not ``StorageIO``'s "nothing was
    written". A full disk (``SQLITE_FULL``) fails the write of a frame, and the commit frame
    is written last: that one stays ``StorageFull`` (``storage_fault``).

    Args:
        exc: what ``COMMIT`` raised (a ``sqlite3.Error`` or Django's wrapper of one).
    """
    cause = exc if isinstance(exc, sqlite3.Error) else exc.__cause__
    code = getattr(cause, "sqlite_errorcode", None)
    if not isinstance(code, int) or code & 0xFF != sqlite3.SQLITE_IOERR:
        return None
    return OutcomeUnknown(
        f"the database's storage failed an I/O operation while committing (SQLite: {cause}): "
        "the change may or may not have been made"
    )


def os_fault(exc: OSError) -> RelayError:
    """Relay's error for an ``OSError`` opening the database file."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"the disk holding the database is full ({exc.strerror})")
    return StorageIO(f"cannot open the database file for writing ({exc.strerror})")


def _file_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # gone, or not a path (":memory:")
        return None
    return (st.st_dev, st.st_ino)


def one_name(st: os.stat_result) -> None:
    """Refuse a database file with more than one name (hard links; ``st``: its ``stat``).

    SQLite keeps the write-ahead log and its index beside the name a process opened, so two
    processes that open one file by two names write two logs over one file, and a commit of
    one can be lost to the other (SQLite's "How To Corrupt An SQLite Database File", section
    2.5: multiple links to the same file). A hostile review ran two migrations by two hard
    links at once: both applied every migration. A symbolic link is one name: SQLite
    resolves it.

    Raises:
        StorageIO: the file has more than one hard link, or is a directory (whose links
            are its entries: a review's ``relay --db <dir>`` was told it had 2 names).
    """
    if stat.S_ISDIR(st.st_mode):
        raise StorageIO("it is a directory, not a database file")
    if st.st_nlink > 1:
        raise StorageIO(
            f"the file has {st.st_nlink} names (hard links): SQLite keeps a write-ahead log "
            "per name, so processes that open it by different names lose each other's "
            "commits; give it one name (a symbolic link is fine)"
        )


def _remember_file(sender: Any, connection: Any, **kwargs: Any) -> None:
    """On each new connection to Relay's SQLite database: refuse a file with two names
    (``one_name``: the connection is closed, ``StorageIO`` raised; not in the process that
    serves it, which checked before it took the file, so that a link made later does not stop
    a live server), note which file it opened (its device and inode), and bound its
    write-ahead log (``journal_size_limit``)."""
    s = relay_settings()
    if connection.vendor != "sqlite" or connection.alias != s.database:
        return
    path = str(connection.settings_dict["NAME"])
    try:
        st: os.stat_result | None = os.stat(path)
    except (OSError, ValueError):  # gone, or not a path (":memory:")
        st = None
    if st is not None and st.st_nlink > 1 and not serves(path):  # a server checked at start
        connection.close()
        try:
            one_name(st)
        except StorageIO as exc:
            raise StorageIO(f"database {path}: {exc.message}") from None
    identity = None if st is None else (st.st_dev, st.st_ino)  # one stat for both
    setattr(connection, _IDENTITY_ATTR, (path, identity) if identity else None)
    limit = int(s.sqlite_wal_limit_bytes)
    connection.connection.execute(f"PRAGMA journal_size_limit={limit}").fetchall()


def watch_connections() -> None:
    """Install ``_remember_file`` on Django's ``connection_created`` (``QueueCoreConfig.ready``)."""
    connection_created.connect(_remember_file, dispatch_uid="relay-sqlite-file")


# The files the servers of this process hold (``SqliteDriver.server_lock``): path -> (its
# (st_dev, st_ino), the lock's handle: serving ends when it is closed, the StorageLost maker).
_SERVED: dict[str, tuple[tuple[int, int], IO[bytes], Callable[[str], StorageLost]]] = {}


def _migrating(handle: IO[bytes]) -> bool:
    """Whether the file's ``flock`` is held shared (by migrations), not by a server: a shared
    lock can be taken beside it. Any shared lock taken here is let go at once."""
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(handle, fcntl.LOCK_UN)
    return True


def serves(path: str) -> bool:
    """Whether this process serves (holds the server lock of) the file at ``path``."""
    identity = _file_identity(path)
    return identity is not None and any(
        served[0] == identity and not served[1].closed for served in _SERVED.values()
    )


class ServedFile:
    """Mixed into the ``sqlite3.Connection`` class Django connects with (the ``factory`` of
    ``sqlite3.connect``, set in the database's ``OPTIONS`` by ``server_lock``): in a server,
    no connection, whatever opens it (the driver, a reader thread's ORM query, an API key's
    ``touch``), is opened onto a file put in place of the one served.

    Opening one reads the file and its ``-shm`` (Django's ``init_command`` sets
    ``journal_mode=WAL``). On a file put in the served one's place, SQLite sees a new inode
    with a ``-shm`` it takes for its own: POSIX locks never conflict within one process, so
    it truncates that ``-shm`` (``strace``: ``ftruncate(fd, 3)``) while this process's older
    connections map it (a thread reading through one then dies of ``SIGBUS``), and on close
    writes the served file's log into the new file and deletes the log (a hostile review
    corrupted a restored backup that way through an API key's ``touch``). The path is checked
    before the open and again after it (one ``os.stat`` each, per new connection); a swap
    between the two checks and back again is not seen.

    Raises:
        StorageLost: the path is gone or names another file than the one served.
    """

    def __init__(self, database: Any, *args: Any, **kwargs: Any) -> None:
        path = os.fspath(database) if isinstance(database, (str, os.PathLike)) else None
        served = _SERVED.get(str(path)) if path is not None else None
        if served is not None and served[1].closed:
            _SERVED.pop(str(path), None)
            served = None
        if served is not None and _file_identity(str(path)) != served[0]:
            raise served[2](f"{path} is gone or is another file than the one served")
        super().__init__(database, *args, **kwargs)  # type: ignore[call-arg]
        if served is not None and _file_identity(str(path)) != served[0]:
            self.close()  # type: ignore[attr-defined]
            raise served[2](f"{path} was replaced while a connection opened it")


def _served_factory(factory: type[sqlite3.Connection]) -> type[sqlite3.Connection]:
    """``factory`` with ``ServedFile`` mixed in (once)."""
    if issubclass(factory, ServedFile):
        return factory
    return type(f"Served{factory.__name__}", (ServedFile, factory), {})


class _FaultLog:
    """One log line per fault code per ``FAULT_LOG_INTERVAL_S`` (with how many it stood for),
    and one when writes succeed again."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        self.failing = False  # read without the lock on every commit: a hint, not a count

    def fault(self, err: RelayError, cause: BaseException) -> None:
        now = self.clock.monotonic()
        with self._lock:
            self.failing = True
            last = self._last.get(err.code)
            if last is not None and now - last < FAULT_LOG_INTERVAL_S:
                self._quiet[err.code] = self._quiet.get(err.code, 0) + 1
                return
            self._last[err.code] = now
            more = self._quiet.pop(err.code, 0)
        log.error(
            "event=storage_fault code=%s error=%s repeats=%d",
            err.code,
            cause,
            more,
            extra={
                "event": "storage_fault",
                "code": err.code,
                "error": str(cause),
                "repeats": more,
            },
        )

    def ok(self) -> None:
        with self._lock:
            if not self.failing:
                return
            self.failing = False
            self._last.clear()
            quiet, self._quiet = self._quiet, {}
        log.info(
            "event=storage_recovered unlogged_faults=%d",
            sum(quiet.values()),
            extra={"event": "storage_recovered", "unlogged_faults": sum(quiet.values())},
        )


class _Overflow(Exception):
    """Rolls back the savepoint of a claim whose payload would overflow the lease reply."""


# The statements that insert jobs. Beside each, the same transaction adds the new rows to
# relay_job_count, one upsert per queue and state however many rows (migration 0008: a per-row
# trigger made batch submits about a third slower); updates and deletes keep their triggers.
def _size(row: dict[str, Any]) -> int:
    """The bytes a leased row's payload and meta take in the reply (before the overhead)."""
    return len(row["payload"].encode()) + (len(row["meta"].encode()) if row["meta"] else 0)


_JOB_INSERTS = frozenset({"insert_job", "insert_job_keyed"})


class SqliteTx(SqlTx):
    """``Tx`` on SQLite (see ``queue_core.storage.base.Tx``)."""

    def __init__(self, cursor: Any, driver: SqliteDriver) -> None:
        super().__init__(
            cursor,
            cursor.cursor,  # Django's SQLiteCursorWrapper: a sqlite3.Cursor
            QUERIES,
            NAMED_QUERIES,
            sqlite3.Cursor.execute,
            sqlite3.Cursor.executemany,
        )
        self._driver = driver
        self._conn: sqlite3.Connection = cursor.cursor.connection

    def plain(self, sql: str) -> None:
        """Run one of the transaction's own statements (BEGIN, COMMIT, ROLLBACK) as the
        others run: on the sqlite3 connection inside Django's error translation, or through
        Django's cursor while it records queries or has an ``execute_wrapper``."""
        if self._django:
            self._cursor.execute(sql)
            return
        try:
            self._conn.execute(sql)
        except Exception:
            with self._errors:  # Django's error translation, entered for an error only
                raise

    def _live(self) -> None:
        """Refuse a statement once SQLite has rolled the transaction back (a full disk or an
        I/O error in an earlier statement): outside a transaction it would commit on its own.
        Its callers call it only when the connection is outside a transaction.

        Raises:
            StorageFull, StorageIO: the fault that rolled it back (see ``_rolled_back``).
        """
        if not self._conn.in_transaction and self._driver._local.depth:
            raise self._driver._rolled_back()

    def _execute(self, name: str, params: Mapping[str, Any]) -> Any:
        if not self._conn.in_transaction:
            self._live()
        return super()._execute(name, params)

    def _fetch(self, name: str, params: Mapping[str, Any], first: bool) -> Any:
        """Run query ``name`` on the sqlite3 cursor and fetch its rows, the statement and the
        fetch inside one error translation (``SqlTx`` enters it twice): ``(description, row
        or None)`` when ``first`` (the rest drained, so RETURNING statements complete), else
        ``(description, rows)``."""
        if not self._conn.in_transaction:
            self._live()
        if self._db.needs_rollback:  # what validate_no_broken_transaction() checks, inline
            self._db.validate_no_broken_transaction()
        raw = self._raw
        try:
            self._execute_raw(raw, self._raw_queries[name], params)  # not Django's override
            got = raw.fetchone() if first else raw.fetchall()
            if first and got is not None:
                raw.fetchall()
        except Exception:
            with self._errors:  # Django's error translation, entered for an error only
                raise
        return raw.description, got

    def one(self, name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        if self._django:
            row = super().one(name, params)
        else:
            description, got = self._fetch(name, params or {}, True)
            row = None if got is None else dict(zip(column_names(description), got, strict=True))
        if row is not None and name in _JOB_INSERTS:
            self._count_one(params or {})
        return row

    def all(self, name: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        if self._django:
            return super().all(name, params)
        description, rows = self._fetch(name, params or {}, False)
        if not rows:
            return []
        cols = column_names(description)
        return [dict(zip(cols, row, strict=True)) for row in rows]

    def run(self, name: str, params: Mapping[str, Any] | None = None) -> int:
        n = super().run(name, params)
        if n and name in _JOB_INSERTS:
            self._count_one(params or {})
        return n

    def many(self, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        if not self._conn.in_transaction:
            self._live()
        super().many(name, rows)
        if name in _JOB_INSERTS:  # no ON CONFLICT: every row went in, or this raised
            self._count_inserted(rows)

    def _count_inserted(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Add ``rows`` (``insert_job`` parameters) to ``relay_job_count``, in this
        transaction: a savepoint rolled back takes both away."""
        added = Counter((row["queue"], row["state"]) for row in rows)
        for (queue, state), n in added.items():
            super().run("count_added", {"queue": queue, "state": state, "n": n})

    def _count_one(self, row: Mapping[str, Any]) -> None:
        """``_count_inserted`` for one row (a single submit: no ``Counter``)."""
        super().run("count_added", {"queue": row["queue"], "state": row["state"], "n": 1})

    def claim(self, request: ClaimRequest) -> list[dict[str, Any]]:
        """Lease the best READY jobs: the heads of each base class of each queue (one index
        seek each on ``relay_job_ready``), ranked by aged class, then FIFO, then leased by id.

        Once the next job could overflow the reply, it is claimed inside a savepoint and the
        claim undone if it does.
        """
        limit = request.limit
        now = request.now_ms
        limits = request.queue_limits or [limit] * len(request.queues)
        heads: list[tuple[int, int, str, str]] = []
        for name, most in zip(request.queues, limits, strict=True):
            for r in self.all("ready_heads", {"queue": name, "limit": most}):
                eff = effective_priority(r["priority"], r["ready_since_ms"], now)
                heads.append((-eff, r["ready_since_ms"], r["id"], name))
        heads.sort()
        room = dict(zip(request.queues, limits, strict=True))
        rows: list[dict[str, Any]] = []
        used = 0
        for _, _, job_id, name in heads:
            if len(rows) >= limit:
                break
            if room[name] <= 0:  # this queue gave what its cap and rate allow
                continue
            room[name] -= 1
            token = request.new_token()  # only for jobs there are: an empty claim makes none
            params = {
                "job_id": job_id,
                "token": token,
                "worker_id": request.worker_id,
                "now_ms": now,
                "expires_ms": request.expires_ms,
            }
            if rows and used + request.payload_cap_bytes + REPLY_OVERHEAD_BYTES > (
                request.room_bytes
            ):
                row = self._claim_if_fits(params, request.room_bytes - used)
                if row is None:
                    break
            else:
                row = self.one("claim_by_id", params)
            if row is None:  # pragma: no cover - the write lock makes this impossible
                continue
            used += _size(row) + REPLY_OVERHEAD_BYTES
            row["lease_token"] = token
            rows.append(row)
        return rows

    def claim_unless_controlled(self, request: ClaimRequest) -> list[dict[str, Any]] | None:
        """``claim``, unless a queue it names has controls (None): one primary-key seek per
        queue on relay_queue first, in this process (cheaper than a second claim path).

        One job from one queue (a lease or ``lease_next`` of ``max_jobs`` 1: the clients'
        default, and ``relay worker``'s when an ack frees one slot) is one statement,
        ``claim_one``, with the seek inside; several from one queue are one statement too,
        ``claim_many``. Only an empty answer asks whether controls were the reason. Their
        tokens are drawn before the statement, one per job asked for, so an empty claim
        draws them too (``ClaimRequest.new_token``, ``new_tokens``)."""
        if len(request.queues) == 1 and request.limit == 1:
            queue = request.queues[0]
            token = request.new_token()
            row = self.one(
                "claim_one",
                {
                    "queue": queue,
                    "token": token,
                    "worker_id": request.worker_id,
                    "now_ms": request.now_ms,
                    "expires_ms": request.expires_ms,
                },
            )
            if row is not None:
                row["lease_token"] = token
                return [row]
            return None if self.one("queue_has_controls", {"queue": queue}) else []
        if len(request.queues) == 1:
            # Several jobs from one queue (relay worker's lease_next): one statement too,
            # claim_many, with the seek inside; its tokens are drawn before it, one per job
            # wanted, and each row comes back with its own.
            queue = request.queues[0]
            tokens = request.new_tokens(request.limit)
            rows = self.all(
                "claim_many",
                {
                    "queue": queue,
                    "limit": request.limit,
                    "tokens": orjson.dumps(tokens).decode(),
                    "room": request.room_bytes,
                    "worker_id": request.worker_id,
                    "now_ms": request.now_ms,
                    "expires_ms": request.expires_ms,
                },
            )
            if rows:
                rank = {token: n for n, token in enumerate(tokens)}
                rows.sort(key=lambda row: rank[row["lease_token"]])
                return rows
            return None if self.one("queue_has_controls", {"queue": queue}) else []
        queues = orjson.dumps(list(request.queues)).decode()
        if self.one("queue_controls_for_claim", {"queues": queues}) is not None:
            return None
        return self.claim(request)

    def _claim_if_fits(self, params: dict[str, Any], room: int) -> dict[str, Any] | None:
        try:
            with self._driver.write(durable=False) as sp:  # nested: a savepoint of the claim
                row = sp.one("claim_by_id", params)
                if row is not None and _size(row) + REPLY_OVERHEAD_BYTES > room:
                    raise _Overflow
                return row
        except _Overflow:
            return None

    def sweep_lock(self) -> bool:
        """Always True: the write lock already admits one sweep at a time."""
        return True

    def sweep_plan(self, now_ms: int) -> tuple[bool, bool] | None:
        """Whether anything is due, in one statement (``sweep_probe``: two index seeks where
        the sweep itself runs two statements); None once this transaction has swept (the
        server's group commit sweeps before its claims, and each claim would sweep again). A
        savepoint rolled back forgets the sweep, so the next claim sweeps again. No lock:
        SQLite's write lock already admits one sweep at a time."""
        local = self._driver._local
        if local.swept:
            return None
        row = self.one("sweep_probe", {"now_ms": now_ms})
        assert row is not None  # a SELECT of two EXISTS always has its row
        local.swept = True
        return bool(row["expired"]), bool(row["due"])

    def made_ready(self, queue: str | None = None) -> None:
        """Nothing to do: other connections see the commit in ``PRAGMA data_version``."""


class SqliteChangeFeed:
    """Commits by other connections, from ``PRAGMA data_version`` on the calling thread's
    connection (it changes only when *another* connection commits, so this thread's own
    commits never count). It cannot push: ``queue_core.protocol.wakeups.FeedFollower`` polls it."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def token(self) -> int:
        """Return ``PRAGMA data_version`` on this thread's connection (on its sqlite3
        connection, inside Django's error translation: the server polls it once a loop pass).

        Raises:
            StorageLost: see ``ServedFile``.
        """
        conn = connections[self.alias]
        if conn.connection is None:
            conn.ensure_connection()
        with conn.wrap_database_errors:
            return int(conn.connection.execute("PRAGMA data_version").fetchone()[0])

    def subscribe(self, fn: Callable[[str | None], None]) -> bool:
        """SQLite cannot push: always False (poll ``wait`` instead)."""
        return False


class _ThreadState(threading.local):
    """A thread's write state in ``SqliteDriver`` (``_local``): its transaction's depth,
    connection, cursor, callbacks and levels. The class attributes are the defaults a thread
    starts from, so reading one needs no ``getattr(..., default)`` (the depth alone was
    read that way 11 times per lease+ack)."""

    depth = 0  # 0 outside a write transaction, 1 in it, more in savepoints
    raw: Any = None  # the transaction's sqlite3.Connection (set while depth > 0)
    aborted: RelayError | None = None  # the fault that rolled the transaction back
    cursor: tuple[sqlite3.Connection, Any] | None = None  # the kept cursor, per connection
    restore: tuple[sqlite3.Connection, int] | None = None  # a synchronous level to put back
    level: tuple[sqlite3.Connection, int] | None = None  # a connection's own level
    nowait: sqlite3.Connection | None = None  # the connection set to busy_timeout=0
    swept = False  # this transaction has swept (``SqliteTx.sweep_plan``)


class _FlatCall:
    """The context of a write nested directly in a flat group commit (``SqliteDriver.write``
    with ``savepoints=False`` outermost): no SAVEPOINT, the transaction's ``SqliteTx``. One per
    driver: it reads the calling thread's transaction state when entered."""

    __slots__ = ("_driver",)

    def __init__(self, driver: SqliteDriver) -> None:
        self._driver = driver

    def __enter__(self) -> SqliteTx:
        local = self._driver._local
        # If an earlier call's storage fault made SQLite roll the whole transaction back (and
        # that call caught it, as ack_batch does), nothing may run now: it would commit on
        # its own.
        if not local.raw.in_transaction:
            raise self._driver._rolled_back()
        local.depth = 2
        tx: SqliteTx = local.tx
        return tx

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._driver._local.depth = 1
        if exc is not None:
            mapped = self._driver._fault(exc)  # as a savepoint maps it
            if mapped is not None:
                raise mapped from exc


class _Transaction:
    """A thread's outermost write transaction (``SqliteDriver.write`` at depth 0, outside a
    caller's ``atomic()``): ``BEGIN IMMEDIATE``, the body, ``COMMIT`` (``ROLLBACK`` and the
    mapped error when either fails), at the ``synchronous`` level ``durable`` asks for. Once
    committed: the log synced if a durable write joined a relaxed transaction, a storage
    recovery noted, the after-commit callbacks run. A class, not a generator: it runs for
    every group commit, and ``contextlib`` alone took about 3% of a lease+ack's bytecodes
    when it was one (``relay_bench.bytecodes``).

    Args:
        driver: the driver (its thread-local state).
        cursor: the Django cursor the transaction's statements run on.
        conn: Django's connection (open).
        durable: see ``SqliteDriver.write``.
        wait: False: the write lock is not waited for (``WriteLocked``).
        flat: see ``SqliteDriver.write(savepoints=False)``.
    """

    __slots__ = (
        "_changes",
        "_conn",
        "_cursor",
        "_driver",
        "_durable",
        "_flat",
        "_level",
        "_raw",
        "_tx",
        "_wait",
    )

    def __init__(
        self, driver: SqliteDriver, cursor: Any, conn: Any, durable: bool, wait: bool, flat: bool
    ) -> None:
        self._driver = driver
        self._cursor = cursor
        self._conn = conn
        self._durable = durable
        self._wait = wait
        self._flat = flat

    def __enter__(self) -> SqliteTx:
        driver = self._driver
        local = driver._local
        local.after = []
        self._raw = raw = self._conn.connection
        self._level = level = driver._synchronous(raw, self._durable)
        local.durable = self._durable
        self._changes = raw.total_changes
        # One Tx for the transaction and its savepoints (building one costs ~1.5 us, and
        # the server's group commit opens two savepoints per request).
        self._tx = tx = SqliteTx(self._cursor, driver)
        try:
            driver._begin_immediate(tx.plain, raw, self._wait)
        except BaseException:
            if level is not None:
                driver._set_synchronous(raw, level)
            raise
        local.tx = tx
        local.raw = raw
        local.flat = self._flat
        local.depth = 1
        local.swept = False  # sweep_plan: this transaction has not swept yet
        local.aborted = None
        return tx

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        driver = self._driver
        local = driver._local
        raw = self._raw
        run = self._tx.plain
        try:
            if exc is not None:
                local.depth = 0
                local.after = []
                with contextlib.suppress(Exception):
                    run("ROLLBACK")
                mapped = driver._fault(exc)
                if mapped is not None:
                    raise mapped from exc
                return  # the body's own error goes on
            try:
                aborted = local.aborted
                if aborted is not None and not raw.in_transaction:
                    raise aborted  # SQLite rolled the whole transaction back (see _savepoint)
                driver._check_file(self._conn)
                run("COMMIT")
            except (DatabaseError, RelayError) as err:
                local.after = []
                with contextlib.suppress(Exception):
                    run("ROLLBACK")
                if isinstance(err, RelayError):
                    raise
                unknown = commit_fault(err)
                if unknown is not None:
                    driver._faults.fault(unknown, err)
                    raise unknown from err
                driver._raise_mapped(err, StoreBusy())
            finally:
                local.depth = 0
                local.tx = None
                local.aborted = None
        finally:
            if self._level is not None:
                driver._set_synchronous(raw, self._level)
        if self._level is not None and local.durable:
            try:
                driver._sync_log()  # a durable write joined a relaxed transaction
            except OutcomeUnknown:
                callbacks, local.after = local.after, []
                run_callbacks(callbacks, log)  # committed, if not synced: the others see it
                raise
        if driver._faults.failing and raw.total_changes != self._changes:
            # Only a commit that wrote rows says the storage writes again: one that changed
            # nothing (a reaper's idle sweep) appends nothing to the log, even on a full disk.
            driver._faults.ok()
        callbacks, local.after = local.after, []
        run_callbacks(callbacks, log)


class SqliteDriver:
    """SQLite access for the service layer (see ``queue_core.storage.base.Driver``).

    Args:
        alias: Django database alias (default ``"default"``).
    """

    capabilities = Capabilities(
        vendor="sqlite", single_writer=True, skip_locked=False, push_changes=False, kept_counts=True
    )

    def __init__(self, alias: str = "default") -> None:
        self.alias = alias
        self._local = _ThreadState()
        self._rng = random.Random()
        self.clock: Clock = SystemClock()  # paces fault logs and checkpoints
        self._faults = _FaultLog(self.clock)
        self._look_at = 0.0  # monotonic s: when maintain() next looks at the log's size
        self._checkpoint_at = 0.0  # monotonic s: when a checkpoint may next be tried
        self._checkpoint_backoff_s = 0.0
        # (path, (st_dev, st_ino)) of the file server_lock() holds: the one this process serves.
        self._served: tuple[str, tuple[int, int]] | None = None
        self._flat_call = _FlatCall(self)

    def _path(self) -> str:
        return str(connections[self.alias].settings_dict["NAME"])

    def _fault(self, exc: BaseException) -> RelayError | None:
        """Map a storage failure to Relay's error (logged, rate-limited); None otherwise."""
        mapped = storage_fault(exc, self._path())
        if mapped is not None:
            self._faults.fault(mapped, exc)
        return mapped

    def storage_error(self, exc: BaseException) -> RelayError | None:
        """Relay's error for a storage failure (``STORAGE_FULL``, ``STORAGE_IO``), or None for
        an error of another kind (see ``storage_fault``)."""
        return self._fault(exc)

    def _lost(self, why: str) -> StorageLost:
        lost = StorageLost(
            "the database file was removed or replaced while the server had it open; "
            "nothing was written: restart the server"
        )
        self._faults.fault(lost, FileNotFoundError(why))
        return lost

    def _check_file(self, conn: Any) -> None:
        """Refuse to commit into a file the path no longer names.

        A connection writes to the file it opened; if that file was removed or replaced since,
        its commits would be acknowledged and then lost (or, once another process opens the
        path, split between two files). The file expected is the one ``server_lock`` holds
        in a server, else the one the connection opened. One ``os.stat`` (~1-2 us) per write
        transaction.

        Raises:
            StorageLost: the path is gone or names another file, or the connection opened
                another file than the one this server holds.
        """
        own = getattr(conn, _IDENTITY_ATTR, None)
        if own is None:
            return
        path, identity = own
        served = self._served
        if served is not None and served[0] == path and served[1] != identity:
            raise self._lost(f"this connection opened another file than the {path} served")
        if _file_identity(path) != identity:
            raise self._lost(f"{path} is gone or is another file than the one opened")

    def _check_opened(self, conn: Any) -> None:
        """In a server, refuse to read through a connection opened on another file than the
        one it holds (one opened after the file was removed or replaced). No system call.

        Raises:
            StorageLost: it did.
        """
        own = getattr(conn, _IDENTITY_ATTR, None)
        served = self._served
        if served is not None and own is not None and own[0] == served[0] and own != served:
            raise self._lost(f"this connection opened another file than the {served[0]} served")

    def mark(self) -> int:
        """Return the position ``forgive`` compares with: the rows this thread's connection
        has changed so far (sqlite3's ``total_changes``: a failed statement adds none) and
        how many after-commit callbacks its transaction registered, as ``changes << 32 |
        callbacks``; 0 outside a transaction."""
        raw: sqlite3.Connection | None = self._local.raw
        if raw is None or not self._local.depth:
            return 0
        return raw.total_changes << 32 | len(self._local.after)

    def forgive(self, mark: int) -> bool:
        """See ``Driver.forgive``: True when the transaction is still open (SQLite rolls the
        whole transaction back on a full disk or an I/O error) and no row changed since
        ``mark``; the after-commit callbacks registered since are dropped."""
        raw: sqlite3.Connection | None = self._local.raw
        if raw is None or not self._local.depth or not raw.in_transaction:
            return False
        if self._local.aborted is not None or raw.total_changes != mark >> 32:
            return False
        del self._local.after[mark & 0xFFFFFFFF :]
        return True

    def write(
        self, *, savepoints: bool = True, durable: bool = True, wait: bool = True
    ) -> contextlib.AbstractContextManager[SqliteTx]:
        """Open a write transaction: ``BEGIN IMMEDIATE`` ... ``COMMIT`` (ROLLBACK on error).

        Nested calls on the same thread become ``SAVEPOINT``s. Inside a caller's
        ``transaction.atomic()`` it is a SAVEPOINT too, so the change commits or rolls back
        with the caller's transaction (transactional enqueue; the project sets
        ``transaction_mode: IMMEDIATE`` so that transaction holds the write lock from its
        start). "database is locked" at BEGIN is retried with jittered backoff for
        ``RELAY_BUSY_RETRY_BUDGET_MS``.

        Args:
            savepoints: False (outermost only; the server's group commit): the writes
                nested directly in this one take no SAVEPOINT (a call that fails is set
                apart with ``mark()`` and ``forgive(mark)``, or the whole transaction is
                rolled back); writes nested deeper still do, so code that catches a nested
                write's error keeps its rollback. Ignored inside a caller's ``atomic()``.
            durable: False (see ``Driver.write``): SQLite fixes a connection's
                ``synchronous`` level outside transactions only, so the outermost write
                decides: False runs the transaction at ``synchronous=NORMAL`` (when the
                connection is at FULL or EXTRA; restored after COMMIT), where the commit
                appends to the write-ahead log without an fsync. A nested durable write in
                such a transaction makes the driver ``fdatasync`` the log after COMMIT, as
                FULL would have (``_sync_log``).
        Raises:
            StoreBusy: the write lock could not be had within the retry budget.
            OutcomeUnknown: the log could not be synced after a relaxed transaction turned
                durable (committed, but not known to be on disk), or COMMIT failed an I/O
                operation (``commit_fault``).
        """
        local = self._local
        if local.depth == 1 and local.flat:
            # A call of a flat group commit: no savepoint (the caller sets a failure apart
            # with mark/forgive, or rolls everything back). A plain object, not a generator:
            # this runs for every call of every batch.
            if durable:
                local.durable = True
            return self._flat_call
        if not self._local.depth:
            conn = connections[self.alias]
            if not conn.in_atomic_block:
                kept = self._kept_cursor(conn)
                if kept is not None:
                    # The outermost transaction on a kept cursor (every group commit of the
                    # server): the transaction object itself, not a generator around it.
                    return _Transaction(self, kept, conn, durable, wait, flat=not savepoints)
        return self._write(savepoints=savepoints, durable=durable, wait=wait)

    @contextlib.contextmanager
    def _write(self, *, savepoints: bool, durable: bool, wait: bool) -> Iterator[SqliteTx]:
        """``write`` in every case but a call of a flat group commit (``_FlatCall``)."""
        depth = self._local.depth
        if depth:
            if durable:
                self._local.durable = True
            # Nested on this thread: a savepoint on the transaction's own cursor. A new Django
            # cursor per savepoint cost ~10 us, twice per request in the server's group commit
            # (docs/benchmarking.md).
            yield from self._savepoint(self._local.raw, self._local.tx, depth)
            return
        conn = connections[self.alias]
        kept = self._kept_cursor(conn)
        with conn.cursor() if kept is None else contextlib.nullcontext(kept) as cursor:
            if conn.in_atomic_block:
                self._local.after = []
                self._check_file(conn)
                self._local.raw = conn.connection
                self._local.flat = False
                yield from self._savepoint(conn.connection, SqliteTx(cursor, self), depth)
                # The caller's transaction decides: Django runs these after its COMMIT.
                for fn in self._local.after:
                    transaction.on_commit(fn, using=self.alias)
                self._local.after = []
                return
            with _Transaction(self, cursor, conn, durable, wait, flat=not savepoints) as tx:
                yield tx

    def _kept_cursor(self, conn: Any) -> Any:
        """The Django cursor this thread's transactions run on, kept open between them
        (Django makes a new one in ~10 Python calls); None when one must be made for this
        transaction alone: the connection is not open yet, or Django records its queries (a
        debug cursor, ``CaptureQueriesContext``). Kept per sqlite3 connection: one opened
        again (after ``heal`` closed it) gets a new cursor."""
        raw = conn.connection
        if raw is None or conn.queries_logged:
            return None
        kept: tuple[sqlite3.Connection, Any] | None = self._local.cursor
        if kept is not None and kept[0] is raw:
            return kept[1]
        cursor = conn.cursor()
        self._local.cursor = (raw, cursor)
        return cursor

    def _synchronous(self, raw: sqlite3.Connection, durable: bool) -> int | None:
        """Before BEGIN: put the connection at the level this transaction needs.

        A level a failed restore left behind (``_set_synchronous``) is put back first.
        Returns the level to restore after the transaction (the connection's own), or None
        when nothing changed: a durable transaction, or a connection at NORMAL or OFF
        already (``synchronous``: 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA)."""
        pending = self._local.restore
        if pending is not None:
            self._local.restore = None
            if pending[0] is raw:
                self._set_synchronous(raw, pending[1])
        if durable:
            return None
        known: tuple[sqlite3.Connection, int] | None = self._local.level
        if known is not None and known[0] is raw:  # the connection's own level, read once
            level = known[1]
        else:
            level = int(raw.execute("PRAGMA synchronous").fetchone()[0])
            self._local.level = (raw, level)
        if level <= SYNCHRONOUS_NORMAL:
            return None
        raw.execute(f"PRAGMA synchronous={SYNCHRONOUS_NORMAL}")
        return level

    def _set_synchronous(self, raw: sqlite3.Connection, level: int) -> None:
        """Set the connection's ``synchronous`` level outside a transaction; if that fails
        (a ROLLBACK that failed left one open), the next ``write`` tries again first."""
        try:
            raw.execute(f"PRAGMA synchronous={int(level)}")
        except sqlite3.Error:
            self._local.restore = (raw, level)

    def _sync_log(self) -> None:
        """``fdatasync`` the write-ahead log, as ``synchronous=FULL`` does at COMMIT: every
        frame appended so far, this transaction's included, is then on disk.

        Raises:
            OutcomeUnknown: the sync failed: the transaction is committed (and seen by
                others) but may not survive an OS crash or a power loss.
        """
        path = f"{self._path()}-wal"
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            err = OutcomeUnknown(
                f"the write-ahead log could not be synced after a commit ({exc.strerror}): "
                "the change was made, but may not survive an OS crash or a power loss"
            )
            self._faults.fault(err, exc)
            raise err from exc

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once this thread's write transaction has committed (see ``Driver``).

        Inside a caller's ``atomic()`` it becomes Django's ``transaction.on_commit``.
        """
        if not self.in_transaction():
            fn()
            return
        self._local.after.append(fn)

    def _rolled_back(self) -> RelayError:
        """The error for a write after SQLite rolled this thread's transaction back: the
        storage fault that did it (``_savepoint`` keeps it), else ``StorageIO``."""
        aborted: RelayError | None = self._local.aborted
        return aborted or StorageIO("the transaction was rolled back by SQLite")

    def _savepoint(self, raw: sqlite3.Connection, tx: SqliteTx, depth: int) -> Iterator[SqliteTx]:
        """Run the body in ``SAVEPOINT relay_sp{depth}`` on ``raw`` (the transaction's sqlite3
        connection): released on success, rolled back alone on error. The savepoint
        statements go straight to the sqlite3 connection (through Django's cursor wrapper a
        SAVEPOINT/RELEASE pair cost 9 us instead of 3 us)."""
        name = f"relay_sp{depth}"
        aborted = self._local.aborted
        if aborted is not None and not raw.in_transaction:
            # An earlier call's storage fault made SQLite roll the whole transaction back: a
            # SAVEPOINT now would open (and its RELEASE commit) a transaction of its own.
            raise aborted
        raw.execute(f"SAVEPOINT {name}")
        self._local.depth = depth + 1
        self._local.tx = tx
        mark = len(self._local.after)
        try:
            yield tx
        except BaseException as exc:
            del self._local.after[mark:]  # what this savepoint registered is undone with it
            self._local.swept = False  # a sweep in it may be undone too
            mapped = self._fault(exc)
            if raw.in_transaction:
                raw.execute(f"ROLLBACK TO {name}")
                raw.execute(f"RELEASE {name}")
            elif depth and self._local.aborted is None:
                # SQLite rolled the whole transaction back: it does on FULL and IOERR in a
                # statement that kept no statement journal (a one-row INSERT, say).
                self._local.aborted = mapped or (
                    exc
                    if isinstance(exc, StorageFull | StorageIO)
                    else StorageIO(f"the transaction was rolled back by SQLite after: {exc}")
                )
            if mapped is not None:
                raise mapped from exc
            raise
        else:
            raw.execute(f"RELEASE {name}")
        finally:
            self._local.depth = depth

    def _begin_immediate(
        self, run: Callable[[str], None], raw: sqlite3.Connection, wait: bool
    ) -> None:
        """``BEGIN IMMEDIATE``; "database is locked" is retried with jittered backoff for
        ``RELAY_BUSY_RETRY_BUDGET_MS``, or, with ``wait`` False, not at all: the connection
        then never waits for the lock (``busy_timeout=0``, set once per connection).

        Raises:
            StoreBusy: the lock stayed taken past the budget. WriteLocked: it was taken and
                ``wait`` is False.
        """
        budget_ms = relay_settings().busy_retry_budget_ms
        if not wait:
            budget_ms = 0
            if self._local.nowait is not raw:
                raw.execute("PRAGMA busy_timeout=0")
                self._local.nowait = raw
        deadline = time.monotonic() + budget_ms / 1000
        delay = 0.005
        while True:
            try:
                run("BEGIN IMMEDIATE")
                return
            except OperationalError as exc:
                if not _is_busy(exc) or time.monotonic() >= deadline:
                    self._raise_mapped(exc, StoreBusy() if wait else WriteLocked())
                log.debug("event=busy_retry delay_s=%.3f", delay)
                time.sleep(delay * self._rng.uniform(0.5, 1.0))
                delay = min(delay * 2, 0.2)

    def _raise_mapped(self, exc: BaseException, busy: Exception) -> NoReturn:
        """Raise ``busy`` for "database is locked", Relay's storage error for a storage
        fault (``_fault``), else ``exc`` itself."""
        if _is_busy(exc):
            raise busy from exc
        mapped = self._fault(exc)
        if mapped is not None:
            raise mapped from exc
        raise exc

    @contextlib.contextmanager
    def read(self) -> Iterator[SqliteTx]:
        """Run reads in autocommit (each statement sees the latest committed state).

        Inside ``write()`` on the same thread, reads join that transaction.
        """
        conn = connections[self.alias]
        try:
            with conn.cursor() as cursor:
                if self._served is not None and not self._local.depth:
                    self._check_opened(conn)
                yield SqliteTx(cursor, self)
        except DatabaseError as exc:
            mapped = self._fault(exc)
            if mapped is not None:
                raise mapped from exc
            raise

    def in_transaction(self) -> bool:
        """Return whether this thread is inside ``write()``."""
        return self._local.depth > 0

    def heal(self) -> None:
        """Outside a transaction, close this thread's connection if an error left it unusable."""
        conn = connections[self.alias]
        if not self._local.depth and not conn.in_atomic_block:
            conn.close_if_unusable_or_obsolete()

    def changes(self) -> SqliteChangeFeed:
        """A ``data_version`` feed on the calling thread's connection."""
        return SqliteChangeFeed(self.alias)

    def check(self, *, full: bool = True) -> list[str]:
        """Check the write-ahead log, then run ``PRAGMA integrity_check`` (``PRAGMA
        quick_check`` when not ``full``); return the problems found (``[]`` when healthy).

        The log is read before this process's first query, whose recovery would drop
        committed transactions after a damaged frame without an error (``wal.problems``).
        Such damage in a log last written before this machine booted is logged, not
        returned: an OS crash or power loss can tear frames that were never synced (leases
        commit without a sync, docs/design-decisions.md), and recovery dropping them is
        what it is for.

        ``integrity_check`` also compares every index entry with its row (O(N log N) instead
        of O(N); https://sqlite.org/pragma.html#pragma_integrity_check). A file that is not a
        database at all is reported as a problem, not raised; a file that cannot be read or
        opened for writing is not a problem of the file.

        Raises:
            StorageFull, StorageIO: the storage failed (full disk, I/O error, read-only
                file, folder or file system), whatever the file holds.
            StoreBusy: another process holds the database locked.
        """
        path = self._path()
        try:
            damage = wal.problems(path)
        except OSError as exc:
            raise os_fault(exc) from exc
        if damage and wal.written_since_boot(path) is False:
            log.warning(
                "event=wal_tail_dropped db=%s detail=%s",
                path,
                damage[0],
                extra={"event": "wal_tail_dropped", "db": path, "detail": damage[0]},
            )
        elif damage:
            return damage
        pragma = "integrity_check" if full else "quick_check"
        try:
            with connections[self.alias].cursor() as cursor:
                cursor.execute(f"PRAGMA {pragma}")
                rows = [str(r[0]) for r in cursor.fetchall()]
        except DatabaseError as exc:  # e.g. "file is not a database"
            mapped = storage_fault(exc, self._path())  # the caller reports it: no log line
            if mapped is not None:
                raise mapped from exc
            if _is_busy(exc):
                raise StoreBusy() from exc
            return [f"{type(exc).__name__}: {exc}"]
        return [] if rows == ["ok"] else rows

    def backup(self, path: str, *, overwrite: bool = False) -> dict[str, Any]:
        """Copy the database with SQLite's online backup API (see ``Driver.backup``).

        The copy is made in one backup step, which reads one snapshot of the database: in
        WAL mode a reader does not block the writer, so the server goes on committing while
        it runs (a copy made in several steps would start over whenever another connection
        wrote between two steps, so under a steady load it might never end). The
        write-ahead log may grow meanwhile: a checkpoint cannot pass the snapshot.
        """
        target = Path(path)
        source = Path(self._path())
        if not source.is_file():
            # sqlite3.connect would create it: a mistyped --db must not make an empty "backup".
            raise InvalidArgument(f"there is no database at {source}", field="db")
        try:  # a copy through another name than the server's lacks its log (a review: 162
            one_name(source.stat())  # of 300 acknowledged jobs, "integrity_check ok")
        except StorageIO as exc:
            raise StorageIO(f"database {source}: {exc.message}") from None
        live = {os.path.realpath(f"{source}{end}") for end in ("", "-wal", "-shm", "-journal")}
        if os.path.realpath(target) in live or (
            target.exists() and any(target.samefile(p) for p in live if os.path.exists(p))
        ):
            raise InvalidArgument(
                f"{path} is the live database or one of its files; back up to another path",
                field="path",
            )
        if target.exists() and not overwrite:
            raise FileExistsError(f"{path} exists (--force replaces it)")
        if not target.parent.is_dir():
            # Else sqlite3 says "unable to open database file", read as the database's fault.
            raise InvalidArgument(f"no folder {target.parent} to write {path} in", field="path")
        partial = target.with_name(f".{target.name}.partial")
        partial.unlink(missing_ok=True)
        timeout_s = relay_settings().busy_retry_budget_ms / 1000
        try:
            # Made empty first, its owner's alone: it holds every job and key as the database
            # does (a review: sqlite3 made it 0644); SQLite keeps an existing file's mode.
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as exc:
            raise os_fault(exc) from exc
        try:
            src = sqlite3.connect(self._path(), timeout=timeout_s)
            try:
                dst = sqlite3.connect(partial)
                try:
                    src.backup(dst)
                    pages = int(dst.execute("PRAGMA page_count").fetchone()[0])
                    problems = [str(r[0]) for r in dst.execute("PRAGMA integrity_check")]
                finally:
                    dst.close()
            finally:
                src.close()
        except sqlite3.Error as exc:
            partial.unlink(missing_ok=True)
            mapped = storage_fault(exc, str(partial))
            if mapped is not None:
                raise mapped from exc
            if isinstance(exc, sqlite3.DatabaseError) and "not a database" in str(exc):
                # The source is no SQLite file (a review: a traceback): relay backup's CORRUPT.
                raise ValueError(f"{source} is not a database: {exc}") from None
            raise
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        if problems != ["ok"]:
            partial.unlink(missing_ok=True)
            raise ValueError(f"the copy failed its integrity check: {'; '.join(problems[:5])}")
        os.replace(partial, target)
        # The copy's pages are synced by its own commit; the rename is a change of the folder,
        # which an OS crash could undo after "done" without this.
        fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return {"path": str(target), "bytes": target.stat().st_size, "pages": pages}

    @contextlib.contextmanager
    def bulk_turn(self) -> Iterator[None]:
        """Hold an exclusive ``flock`` on ``<database>-bulk.lock`` (beside the file the path
        resolves to, made on first use) while the context lasts (``Driver.bulk_turn``).

        Each process's bulk chunks already take turns and pause after each
        (``QueueService.bulk_chunk``), but SQLite's write lock is not fair: four HTTP workers
        running bulk replays at once filled each other's pauses and held a TCP sentinel up to
        391 ms (60 ms with one worker; a chaos review); with this turn, eight bulks of 1,000
        at once held it at most 21-44 ms a run where they had 82-287 ms (docs/failure-model.md,
        "A fourth attack"). A lock file, not the database file:
        the server holds that one's ``flock`` for its life (``server_lock``), and a POSIX lock
        on it would be dropped with SQLite's own at the first ``close`` of any descriptor of
        it. A holder that dies frees the turn with its descriptor; one that is stopped
        (SIGSTOP, a debugger) would hold it for as long, so a chunk that has waited
        ``BULK_TURN_WAIT_S`` goes ahead without it, as before there was one (the lock is tried
        1 ms, then up to 10 ms apart, on ``self.clock``). A database that is no file
        (``:memory:``), or a folder where the lock file cannot be made, leaves the turn to
        this process.
        """
        path = self._path()
        if _file_identity(path) is None:
            yield
            return
        try:
            fd = os.open(
                os.path.realpath(path) + "-bulk.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
        except OSError:
            yield
            return
        try:
            deadline = self.clock.monotonic() + BULK_TURN_WAIT_S
            pause = 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if self.clock.monotonic() >= deadline:
                        log.warning(
                            "event=bulk_turn_skipped waited_s=%s lock=%s-bulk.lock",
                            BULK_TURN_WAIT_S,
                            path,
                            extra={"event": "bulk_turn_skipped"},
                        )
                        break
                    self.clock.sleep(pause)
                    pause = min(pause * 2, 0.01)
            yield
        finally:
            os.close(fd)  # frees the lock, if it was taken

    def server_lock(self) -> IO[bytes]:
        """Hold an exclusive ``flock`` on the database file itself for the life of the process.

        ``flock`` locks the file (its inode), not a path: a second server reaching the same
        file through a symlink is refused too (a lock file beside the path was not: it
        re-leased live jobs); a file with hard links is refused once the lock is taken
        (``one_name``), so a second server through one is refused as ``AlreadyServed``.
        SQLite's own locks are POSIX ``fcntl`` locks, which ``flock`` does not touch on Linux.
        An absent file is created empty (SQLite takes an empty file as an empty database).
        From then on no connection of this process opens
        the path once it names another file (``ServedFile``, made the connections' factory).

        Raises:
            AlreadyServed: another process holds it.
            StorageFull, StorageIO: the file cannot be opened for writing (a read-only file,
                folder or file system; a full disk), or has more than one name (``one_name``).
        """
        path = self._path()
        try:  # a file made here is its owner's alone (schema._kept_fd says why)
            handle = os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
        except OSError as exc:
            raise os_fault(exc) from exc
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not _migrating(handle):
                handle.close()
                raise AlreadyServed(
                    f"another relay server is serving {path} ({_identity(path)}); stop it first"
                ) from None
            # `relay migrate` holds the file shared (``schema.migration_lock``): wait for it,
            # as the server did before migrations took the lock (a review: exit 4, for good).
            log.info(
                "event=waiting_for_migration db=%s", path, extra={"event": "waiting_for_migration"}
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        st = os.fstat(handle.fileno())
        try:  # after the lock: a second server through a hard link is ALREADY_SERVED (exit 4)
            one_name(st)
        except StorageIO:
            handle.close()
            raise
        self._served = (path, (st.st_dev, st.st_ino))
        _SERVED[path] = (self._served[1], handle, self._lost)
        options = connections.settings[self.alias].setdefault("OPTIONS", {})
        options["factory"] = _served_factory(options.get("factory", sqlite3.Connection))
        return handle

    def close(self) -> None:
        """Close this thread's connection (threads that used the driver call this on exit)."""
        connections[self.alias].close()

    def maintain(self, now_s: float) -> None:
        """Keep the write-ahead log under ``RELAY_SQLITE_WAL_LIMIT_BYTES`` (outside a write).

        SQLite's own checkpoint after each commit copies the log into the database but never
        waits for readers, so with reads always running it never gets to restart the log, and
        the ``-wal`` file grows for as long as they do. When the file has grown past the limit,
        this runs ``PRAGMA wal_checkpoint(RESTART)``: it takes the write lock, copies the log
        and waits up to ``RELAY_SQLITE_CHECKPOINT_WAIT_MS`` for readers of older snapshots; the
        next commit then writes from the start of the log and cuts the file back to the limit
        (``journal_size_limit``). A checkpoint a reader held up is tried again after 1 s, then
        after twice as long each time, up to ``MAX_CHECKPOINT_BACKOFF_S``. Looks at the file's
        size at most every ``MAINTAIN_EVERY_S``.

        Args:
            now_s: the caller's monotonic clock, in seconds.
        """
        if now_s < self._look_at or self._local.depth:
            return
        self._look_at = now_s + MAINTAIN_EVERY_S
        s = relay_settings()
        try:
            size = os.stat(f"{self._path()}-wal").st_size
        except OSError:
            return
        if size <= s.sqlite_wal_limit_bytes or now_s < self._checkpoint_at:
            return
        conn = connections[self.alias]
        if conn.in_atomic_block:
            return
        try:
            busy, frames, copied = self._checkpoint(conn, s.sqlite_checkpoint_wait_ms)
        except DatabaseError as exc:
            self._fault(exc)
            return
        if busy:
            self._checkpoint_backoff_s = min(
                max(1.0, 2 * self._checkpoint_backoff_s), MAX_CHECKPOINT_BACKOFF_S
            )
            self._checkpoint_at = now_s + self._checkpoint_backoff_s
            log.warning(
                "event=wal_checkpoint_blocked wal_bytes=%d frames=%d copied=%d retry_s=%.0f",
                size,
                frames,
                copied,
                self._checkpoint_backoff_s,
                extra={"event": "wal_checkpoint_blocked", "wal_bytes": size},
            )
            return
        self._checkpoint_backoff_s = 0.0
        log.debug("event=wal_checkpoint wal_bytes=%d frames=%d", size, frames)

    @staticmethod
    def _checkpoint(conn: Any, wait_ms: int) -> tuple[bool, int, int]:
        """``PRAGMA wal_checkpoint(RESTART)`` with the busy timeout set to ``wait_ms`` for it;
        return ``(busy, frames in the log, frames copied)``."""
        with conn.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout")
            before = int(cursor.fetchone()[0])
            cursor.execute(f"PRAGMA busy_timeout={int(wait_ms)}")
            try:
                cursor.execute("PRAGMA wal_checkpoint(RESTART)")
                busy, frames, copied = cursor.fetchone()
            finally:
                cursor.execute(f"PRAGMA busy_timeout={before}")
        return bool(busy), int(frames), int(copied)


def _identity(path: str) -> str:
    real = Path(path).resolve()
    with contextlib.suppress(OSError):
        st = os.stat(real)
        return f"{real}, inode {st.st_ino}"
    return str(real)
