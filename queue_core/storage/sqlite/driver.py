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
import fcntl
import logging
import os
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from django.db import DatabaseError, OperationalError, connections, transaction

from queue_core.conf import relay_settings
from queue_core.errors import StoreBusy
from queue_core.states import effective_priority
from queue_core.storage.base import (
    REPLY_OVERHEAD_BYTES,
    AlreadyServed,
    Capabilities,
    ClaimRequest,
    SqlTx,
    load_queries,
    run_callbacks,
)

log = logging.getLogger("relay.store")

QUERIES = load_queries("queue_core.storage.sqlite")
_PARAM_RE = re.compile(r"%\((\w+)\)s")


def named_style(sql: str) -> str:
    """Spell Django's ``%(name)s`` placeholders as sqlite3's ``:name`` (and ``%%`` as ``%``)."""
    return _PARAM_RE.sub(r":\1", sql).replace("%%", "%")


# The same statements in sqlite3's own parameter style, for the raw cursor.
NAMED_QUERIES = {name: named_style(sql) for name, sql in QUERIES.items()}
WATCH_INTERVAL_S = 0.05  # how often a waiting feed reads PRAGMA data_version


def _is_busy(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


class _Overflow(Exception):
    """Rolls back the savepoint of a claim whose payload would overflow the lease reply."""


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

    def claim(self, request: ClaimRequest) -> list[dict[str, Any]]:
        """Lease the best READY jobs: the heads of each base class of each queue (one index
        seek each on ``relay_job_ready``), ranked by aged class, then FIFO, then leased by id.

        Once the next job could overflow the reply, it is claimed inside a savepoint and the
        claim undone if it does.
        """
        limit = request.limit
        now = request.now_ms
        heads: list[tuple[int, int, str]] = []
        for name in request.queues:
            for r in self.all("ready_heads", {"queue": name, "limit": limit}):
                eff = effective_priority(r["priority"], r["ready_since_ms"], now)
                heads.append((-eff, r["ready_since_ms"], r["id"]))
        heads.sort()
        rows: list[dict[str, Any]] = []
        used = 0
        for _, _, job_id in heads[:limit]:
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
            used += len(row["payload"].encode()) + REPLY_OVERHEAD_BYTES
            row["lease_token"] = token
            rows.append(row)
        return rows

    def _claim_if_fits(self, params: dict[str, Any], room: int) -> dict[str, Any] | None:
        try:
            with self._driver.write() as sp:  # nested: a savepoint
                row = sp.one("claim_by_id", params)
                if row is not None and len(row["payload"].encode()) + REPLY_OVERHEAD_BYTES > room:
                    raise _Overflow
                return row
        except _Overflow:
            return None

    def sweep_lock(self) -> bool:
        """Always True: the write lock already admits one sweep at a time."""
        return True

    def sweep_plan(self, now_ms: int) -> tuple[bool, bool] | None:
        """``(True, True)``: the sweep's own statements are index seeks in this process, as
        cheap as asking first."""
        return (True, True)

    def made_ready(self, queue: str | None = None) -> None:
        """Nothing to do: other connections see the commit in ``PRAGMA data_version``."""


class SqliteChangeFeed:
    """Commits by other connections, from ``PRAGMA data_version`` on the calling thread's
    connection (it changes only when *another* connection commits, so this thread's own
    commits never count). Polled every ``WATCH_INTERVAL_S``; it cannot push."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def token(self) -> int:
        """Return ``PRAGMA data_version`` on this thread's connection."""
        with connections[self.alias].cursor() as cursor:
            cursor.execute("PRAGMA data_version")
            return int(cursor.fetchone()[0])

    def wait(self, token: int, timeout_s: float) -> int | None:
        """Poll ``data_version`` until it differs from ``token`` or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = self.token()
            if now != token:
                return now
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(WATCH_INTERVAL_S, left))

    def subscribe(self, fn: Callable[[str | None], None]) -> bool:
        """SQLite cannot push: always False (poll ``wait`` instead)."""
        return False


class SqliteDriver:
    """SQLite access for the service layer (see ``queue_core.storage.base.Driver``).

    Args:
        alias: Django database alias (default ``"default"``).
    """

    capabilities = Capabilities(
        vendor="sqlite", single_writer=True, skip_locked=False, push_changes=False
    )

    def __init__(self, alias: str = "default") -> None:
        self.alias = alias
        self._local = threading.local()
        self._rng = random.Random()

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def mark(self) -> int:
        """Return 0: SQLite transactions always take savepoints (see ``forgive``)."""
        return 0

    def forgive(self, mark: int) -> bool:
        """False: a SAVEPOINT costs ~3 us here, so ``write(savepoints=False)`` keeps them and
        a caller that wants a failed call set apart should rely on them."""
        return False

    @contextlib.contextmanager
    def write(self, *, savepoints: bool = True) -> Iterator[SqliteTx]:
        """Open a write transaction: ``BEGIN IMMEDIATE`` ... ``COMMIT`` (ROLLBACK on error).

        Nested calls on the same thread become ``SAVEPOINT``s. Inside a caller's
        ``transaction.atomic()`` it is a SAVEPOINT too, so the change commits or rolls back
        with the caller's transaction (transactional enqueue; the project sets
        ``transaction_mode: IMMEDIATE`` so that transaction holds the write lock from its
        start). "database is locked" at BEGIN is retried with jittered backoff for
        ``RELAY_BUSY_RETRY_BUDGET_MS``.

        Args:
            savepoints: ignored: nested writes always take a SAVEPOINT on SQLite.
        Raises:
            StoreBusy: the write lock could not be had within the retry budget.
        """
        conn = connections[self.alias]
        depth = self._depth()
        if depth:
            # Nested on this thread: a savepoint on the transaction's own cursor. A new Django
            # cursor per savepoint cost ~10 us, twice per request in the server's group commit
            # (docs/benchmarking.md).
            yield from self._savepoint(conn, self._local.tx, depth)
            return
        self._local.after = []
        with conn.cursor() as cursor:
            if conn.in_atomic_block:
                yield from self._savepoint(conn, SqliteTx(cursor, self), depth)
                # The caller's transaction decides: Django runs these after its COMMIT.
                for fn in self._local.after:
                    transaction.on_commit(fn, using=self.alias)
                self._local.after = []
                return
            self._begin_immediate(cursor)
            self._local.depth = 1
            # One Tx for the transaction and its savepoints (building one costs ~1.5 us, and
            # the server's group commit opens two savepoints per request).
            tx = self._local.tx = SqliteTx(cursor, self)
            try:
                yield tx
            except BaseException:
                self._local.depth = 0
                self._local.after = []
                with contextlib.suppress(Exception):
                    cursor.execute("ROLLBACK")
                raise
            try:
                cursor.execute("COMMIT")
            except OperationalError as exc:
                self._local.after = []
                with contextlib.suppress(Exception):
                    cursor.execute("ROLLBACK")
                if _is_busy(exc):
                    raise StoreBusy() from exc
                raise
            finally:
                self._local.depth = 0
                self._local.tx = None
        callbacks, self._local.after = self._local.after, []
        run_callbacks(callbacks, log)

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once this thread's write transaction has committed (see ``Driver``).

        Inside a caller's ``atomic()`` it becomes Django's ``transaction.on_commit``.
        """
        if not self.in_transaction():
            fn()
            return
        self._local.after.append(fn)

    def _savepoint(self, conn: Any, tx: SqliteTx, depth: int) -> Iterator[SqliteTx]:
        """Run the body in ``SAVEPOINT relay_sp{depth}``: released on success, rolled back alone
        on error. The savepoint statements go straight to the sqlite3 connection (through
        Django's cursor wrapper a SAVEPOINT/RELEASE pair cost 9 us instead of 3 us)."""
        name = f"relay_sp{depth}"
        raw = conn.connection
        raw.execute(f"SAVEPOINT {name}")
        self._local.depth = depth + 1
        self._local.tx = tx
        mark = len(self._local.after)
        try:
            yield tx
        except BaseException:
            del self._local.after[mark:]  # what this savepoint registered is undone with it
            raw.execute(f"ROLLBACK TO {name}")
            raw.execute(f"RELEASE {name}")
            raise
        else:
            raw.execute(f"RELEASE {name}")
        finally:
            self._local.depth = depth

    def _begin_immediate(self, cursor: Any) -> None:
        budget_s = relay_settings().busy_retry_budget_ms / 1000
        deadline = time.monotonic() + budget_s
        delay = 0.005
        while True:
            try:
                cursor.execute("BEGIN IMMEDIATE")
                return
            except OperationalError as exc:
                if not _is_busy(exc) or time.monotonic() >= deadline:
                    if _is_busy(exc):
                        raise StoreBusy() from exc
                    raise
                log.debug("event=busy_retry delay_s=%.3f", delay)
                time.sleep(delay * self._rng.uniform(0.5, 1.0))
                delay = min(delay * 2, 0.2)

    @contextlib.contextmanager
    def read(self) -> Iterator[SqliteTx]:
        """Run reads in autocommit (each statement sees the latest committed state).

        Inside ``write()`` on the same thread, reads join that transaction.
        """
        with connections[self.alias].cursor() as cursor:
            yield SqliteTx(cursor, self)

    def in_transaction(self) -> bool:
        """Return whether this thread is inside ``write()``."""
        return self._depth() > 0

    def heal(self) -> None:
        """Outside a transaction, close this thread's connection if an error left it unusable."""
        conn = connections[self.alias]
        if not self._depth() and not conn.in_atomic_block:
            conn.close_if_unusable_or_obsolete()

    def changes(self) -> SqliteChangeFeed:
        """A ``data_version`` feed on the calling thread's connection."""
        return SqliteChangeFeed(self.alias)

    def check(self, *, full: bool = True) -> list[str]:
        """Run ``PRAGMA integrity_check`` (``PRAGMA quick_check`` when not ``full``); return
        the problems found (``[]`` when healthy).

        ``integrity_check`` also compares every index entry with its row (O(N log N) instead
        of O(N); https://sqlite.org/pragma.html#pragma_integrity_check). A file that is not a
        database at all is reported as a problem, not raised.
        """
        pragma = "integrity_check" if full else "quick_check"
        try:
            with connections[self.alias].cursor() as cursor:
                cursor.execute(f"PRAGMA {pragma}")
                rows = [str(r[0]) for r in cursor.fetchall()]
        except DatabaseError as exc:  # e.g. "file is not a database"
            return [f"{type(exc).__name__}: {exc}"]
        return [] if rows == ["ok"] else rows

    def server_lock(self) -> IO[bytes]:
        """Hold an exclusive ``flock`` on the database file itself for the life of the process.

        ``flock`` locks the file (its inode), not a path: a second server reaching the same
        file through a symlink or a hard link is refused too (a lock file beside the path was
        not: it re-leased live jobs). SQLite's own locks are POSIX ``fcntl`` locks, which
        ``flock`` does not touch on Linux. An absent file is created empty (SQLite takes an
        empty file as an empty database).

        Raises:
            AlreadyServed: another process holds it.
        """
        path = str(connections[self.alias].settings_dict["NAME"])
        handle = open(path, "ab")  # noqa: SIM115 - held until exit
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise AlreadyServed(
                f"another relay server is serving {path} ({_identity(path)}); stop it first"
            ) from None
        return handle

    def close(self) -> None:
        """Close this thread's connection (threads that used the driver call this on exit)."""
        connections[self.alias].close()


def _identity(path: str) -> str:
    real = Path(path).resolve()
    with contextlib.suppress(OSError):
        st = os.stat(real)
        return f"{real}, inode {st.st_ino}"
    return str(real)
