"""The storage seam: the only module that runs raw SQL.

``Store.immediate()`` opens ``BEGIN IMMEDIATE`` (SQLite takes the write lock up front, so two
claimers can never both read a job as READY and both lease it), or a SAVEPOINT when already
inside one, which lets the server run many requests in one transaction (group commit) while
each request still rolls back alone. Statements are named blocks of ``sql/queries.sql``.

A PostgreSQL backend would implement the same small surface (``immediate``, ``reading``,
``Tx.one/all/run``, ``integrity_problems``) with ``BEGIN`` + ``FOR UPDATE SKIP LOCKED`` in its own
query file; callers would not change.

Django keeps SQLite in autocommit and issues ``BEGIN`` itself inside ``transaction.atomic()``,
so ``immediate()`` must not be called inside ``atomic()`` (tests use
``django_db(transaction=True)``).
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import resources
from typing import Any

from django.db import DatabaseError, OperationalError, connections, transaction
from django.db.backends.utils import CursorDebugWrapper

from queue_core.conf import relay_settings
from queue_core.errors import StoreBusy

log = logging.getLogger("relay.store")

_BLOCK_RE = re.compile(r"^-- name: (\w+)\n((?:--[^\n]*\n)*)(.*?)(?=^-- name: |\Z)", re.M | re.S)


def load_queries() -> dict[str, str]:
    """Parse ``sql/queries.sql`` into ``{name: statement}`` (comment lines dropped)."""
    text = resources.files("queue_core").joinpath("sql/queries.sql").read_text("utf-8")
    queries: dict[str, str] = {}
    for match in _BLOCK_RE.finditer(text):
        body = match.group(3).strip().rstrip(";").strip()
        queries[match.group(1)] = body
    return queries


QUERIES = load_queries()
_PARAM_RE = re.compile(r"%\((\w+)\)s")


def named_style(sql: str) -> str:
    """Spell Django's ``%(name)s`` placeholders as sqlite3's ``:name`` (and ``%%`` as ``%``)."""
    return _PARAM_RE.sub(r":\1", sql).replace("%%", "%")


# The same statements in sqlite3's own parameter style, for the raw cursor (see ``Tx``).
NAMED_QUERIES = {name: named_style(sql) for name, sql in QUERIES.items()}
_RAW_EXECUTE = sqlite3.Cursor.execute
_RAW_EXECUTEMANY = sqlite3.Cursor.executemany


def _is_busy(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


class Tx:
    """Statements inside one transaction (or savepoint), by query name.

    Statements go straight to the sqlite3 cursor under the Django cursor, with the query
    text already in sqlite3's ``:name`` style and Django's error translation around them
    (``OperationalError`` for "database is locked", ``IntegrityError``...). Django's cursor
    wrapper re-spelled every query on every call, which made a statement cost 10.7 us
    instead of 4.1 us (docs/benchmarking.md). Like Django's cursor, it refuses to run inside a
    caller's ``atomic()`` block that already failed (``TransactionManagementError``). When
    Django is recording queries (``DEBUG``, ``CaptureQueriesContext``) or a database
    instrumentation hook is installed (``connection.execute_wrapper``), statements go through
    Django's cursor instead, so they are counted and seen.

    Args:
        cursor: a Django cursor on the transaction's connection.
    """

    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor
        self._db = cursor.db
        self._django = isinstance(cursor, CursorDebugWrapper) or bool(self._db.execute_wrappers)
        self._raw = cursor.cursor  # Django's SQLiteCursorWrapper: a sqlite3.Cursor
        self._errors = self._db.wrap_database_errors

    def _execute(self, name: str, params: Mapping[str, Any]) -> Any:
        if self._django:
            self._cursor.execute(QUERIES[name], params)
            return self._cursor
        self._db.validate_no_broken_transaction()
        with self._errors:
            _RAW_EXECUTE(self._raw, NAMED_QUERIES[name], params)
        return self._raw

    def one(self, name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """Run query ``name``; return its first row as a dict, or None."""
        cur = self._execute(name, params or {})
        with self._errors:
            row = cur.fetchone()
            if row is None:
                return None
            cols = [d[0] for d in cur.description]
            # Drain the rest so RETURNING statements complete.
            cur.fetchall()
        return dict(zip(cols, row, strict=True))

    def all(self, name: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run query ``name``; return every row as a dict."""
        cur = self._execute(name, params or {})
        with self._errors:
            rows = cur.fetchall()
        if not rows:
            return []
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row, strict=True)) for row in rows]

    def many(self, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Run statement ``name`` once per mapping in ``rows`` (``executemany``)."""
        if self._django:
            self._cursor.executemany(QUERIES[name], rows)
            return
        self._db.validate_no_broken_transaction()
        with self._errors:
            _RAW_EXECUTEMANY(self._raw, NAMED_QUERIES[name], rows)

    def run(self, name: str, params: Mapping[str, Any] | None = None) -> int:
        """Run statement ``name``; return the number of rows it changed."""
        return int(self._execute(name, params or {}).rowcount)


class Store:
    """SQLite access for the service layer.

    Args:
        alias: Django database alias (default ``"default"``).
    """

    def __init__(self, alias: str = "default") -> None:
        self.alias = alias
        self._local = threading.local()
        self._rng = random.Random()

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @contextlib.contextmanager
    def immediate(self) -> Iterator[Tx]:
        """Open a write transaction: ``BEGIN IMMEDIATE`` ... ``COMMIT`` (ROLLBACK on error).

        Nested calls on the same thread become ``SAVEPOINT``s, released on success and rolled
        back alone on error. Inside a caller's ``transaction.atomic()`` it is a SAVEPOINT too,
        so the change commits or rolls back with the caller's transaction (transactional
        enqueue; the project sets ``transaction_mode: IMMEDIATE`` so that transaction holds
        the write lock from its start). "database is locked" at BEGIN is retried with jittered
        backoff for ``RELAY_BUSY_RETRY_BUDGET_MS``.

        Raises:
            StoreBusy: the write lock could not be had within the retry budget.
        """
        conn = connections[self.alias]
        depth = self._depth()
        if depth:
            # Nested on this thread: a savepoint on the transaction's own cursor. A new Django
            # cursor per savepoint cost ~10 us, twice per request in the server's group commit
            # (docs/benchmarking.md).
            yield from self._savepoint(conn, self._local.cursor, depth)
            return
        self._local.after = []
        with conn.cursor() as cursor:
            if conn.in_atomic_block:
                yield from self._savepoint(conn, cursor, depth)
                # The caller's transaction decides: Django runs these after its COMMIT.
                for fn in self._local.after:
                    transaction.on_commit(fn, using=self.alias)
                self._local.after = []
                return
            self._begin_immediate(cursor)
            self._local.depth = 1
            self._local.cursor = cursor
            try:
                yield Tx(cursor)
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
                self._local.cursor = None
        callbacks, self._local.after = self._local.after, []
        for fn in callbacks:
            try:
                fn()
            except Exception:
                log.exception("event=after_commit_failed")

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once this thread's write transaction has committed.

        Dropped if the transaction, or the savepoint it was registered in, rolls back; run at
        once outside a transaction. Inside a caller's ``atomic()`` it becomes Django's
        ``transaction.on_commit``. Errors ``fn`` raises are logged, never propagated.
        """
        if not self.in_transaction():
            fn()
            return
        self._local.after.append(fn)

    def _savepoint(self, conn: Any, cursor: Any, depth: int) -> Iterator[Tx]:
        """Run the body in ``SAVEPOINT relay_sp{depth}``: released on success, rolled back alone
        on error. The savepoint statements go straight to the sqlite3 connection (through
        Django's cursor wrapper a SAVEPOINT/RELEASE pair cost 9 us instead of 3 us)."""
        name = f"relay_sp{depth}"
        raw = conn.connection
        raw.execute(f"SAVEPOINT {name}")
        self._local.depth = depth + 1
        self._local.cursor = cursor
        mark = len(self._local.after)
        try:
            yield Tx(cursor)
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
    def reading(self) -> Iterator[Tx]:
        """Run reads in autocommit (each statement sees the latest committed state).

        Inside ``immediate()`` on the same thread, reads join that transaction.
        """
        with connections[self.alias].cursor() as cursor:
            yield Tx(cursor)

    def in_transaction(self) -> bool:
        """Return whether this thread is inside ``immediate()``."""
        return self._depth() > 0

    def integrity_problems(self, *, full: bool = True) -> list[str]:
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

    def data_version(self) -> int:
        """Return ``PRAGMA data_version``: it changes when another connection commits."""
        with connections[self.alias].cursor() as cursor:
            cursor.execute("PRAGMA data_version")
            return int(cursor.fetchone()[0])

    def close(self) -> None:
        """Close this thread's connection (threads that used the store call this on exit)."""
        connections[self.alias].close()
