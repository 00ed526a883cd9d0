"""The storage driver interface: the one door to a database, used only by ``QueueService``.

A driver owns transactions, named statements, the claim, a change feed for wake-ups,
after-commit hooks and the start-up health check of one database engine (after River's
``riverdriver`` interface, run by one contract suite over every driver, and procrastinate's
connectors). ``queue_core.storage.sqlite`` and ``queue_core.storage.postgresql`` implement it;
``driver_for(alias)`` picks one by the Django database's vendor. Statements are named blocks
of the driver's own ``queries.sql``: the same names where the same work is done, so the
service never sees SQL, and a block only one database needs says why.

Both drivers reach the database through Django's connection for that alias (its settings,
its error translation, its ``atomic()`` for callers that enqueue inside their own
transaction), but run their statements on the raw DB-API cursor under it: Django's cursor
wrapper re-spells a query on every call (docs/benchmarking.md). When Django records queries
(``DEBUG``, ``CaptureQueriesContext``) or an ``execute_wrapper`` is installed, statements go
through Django's cursor, so they are counted and seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from typing import Any, NamedTuple, Protocol

from django.db.backends.utils import CursorDebugWrapper

from queue_core.errors import RelayError
from queue_core.jobs import JOB_COLUMNS

# Bytes a lease reply spends per job beyond its payload (ids, token, times), generously rounded.
REPLY_OVERHEAD_BYTES = 1024

_BLOCK_RE = re.compile(r"^-- name: (\w+)\n((?:--[^\n]*\n)*)(.*?)(?=^-- name: |\Z)", re.M | re.S)


def load_queries(package: str) -> dict[str, str]:
    """Parse ``<package>/queries.sql`` into ``{name: statement}`` (comment lines dropped).

    ``{job_columns}`` in a statement becomes ``jobs.JOB_COLUMNS``, comma-separated: the
    columns of a job view, listed once for every statement that reads one.

    Args:
        package: a dotted package name, e.g. ``"queue_core.storage.sqlite"``.
    """
    text = resources.files(package).joinpath("queries.sql").read_text("utf-8")
    text = text.replace("{job_columns}", ", ".join(JOB_COLUMNS))
    queries: dict[str, str] = {}
    for match in _BLOCK_RE.finditer(text):
        queries[match.group(1)] = match.group(3).strip().rstrip(";").strip()
    return queries


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What a driver's database can do, for the few places where that changes behaviour.

    Attributes:
        vendor: ``"sqlite"`` or ``"postgresql"`` (Django's ``connection.vendor``).
        single_writer: one ``relay server`` per database: it takes a lock by file identity,
            and releases every lease at start (nobody else can hold one). False where several
            servers share the database: leases belong to workers and come back by expiry.
        skip_locked: the claim skips rows other transactions hold (``FOR UPDATE SKIP
            LOCKED``); SQLite needs none, its write lock admits one writer at a time.
        push_changes: the change feed pushes wake-ups (``ChangeFeed.subscribe``); otherwise
            it is polled.
        kept_counts: the jobs per queue and state are kept in a table beside the jobs
            (SQLite's ``relay_job_count``: triggers and the driver's inserts), so a writer that
            does not keep them (a Relay older than migration 0008) can leave them wrong:
            ``QueueService.repair_counts`` checks them at server start. PostgreSQL counts
            from the jobs' indexes at each read.
    """

    vendor: str
    single_writer: bool
    skip_locked: bool
    push_changes: bool
    kept_counts: bool = False


class ClaimRequest(NamedTuple):
    """What one claim asks for (``Tx.claim``).

    Attributes:
        queues: 1..16 queue names, already validated.
        worker_id: who leases.
        now_ms: the instant of the claim, epoch ms (aging counts to it).
        expires_ms: the lease expiry to set, epoch ms.
        limit: the most jobs to lease (1..``RELAY_MAX_JOBS_PER_LEASE``).
        new_token: returns a fresh fencing token (``secrets``); called once per job leased.
        new_tokens: returns ``n`` fresh fencing tokens at once (one ``os.urandom`` call), where
            the claim is one statement and draws ``limit`` tokens before it.
        room_bytes: the reply's budget: jobs are leased while their payloads and metas plus
            ``REPLY_OVERHEAD_BYTES`` each fit in it (the first job always is).
        payload_cap_bytes: the most a job's payload and meta can take together
            (``RELAY_MAX_PAYLOAD_BYTES + RELAY_MAX_META_BYTES``).
        queue_limits: the most jobs to lease from each queue (1..``limit``), one per name of
            ``queues``: the room under a queue's cap and its rate's tokens
            (``QueueService.claim``); None: ``limit`` for every queue.
    """

    queues: Sequence[str]
    worker_id: str
    now_ms: int
    expires_ms: int
    limit: int
    new_token: Callable[[], str]
    new_tokens: Callable[[int], list[str]]
    room_bytes: int
    payload_cap_bytes: int
    queue_limits: Sequence[int] | None = None


class Tx(Protocol):
    """Statements inside one write transaction (or savepoint), or a read, by query name.

    Rows are dicts keyed by column name. Errors are Django's (``IntegrityError``...), except
    lock waits a retry can cure, which raise ``StoreBusy`` (``BUSY``).
    """

    def one(self, name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """Run query ``name``; return its first row, or None."""
        ...

    def all(self, name: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run query ``name``; return every row."""
        ...

    def many(self, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Run statement ``name`` once per mapping in ``rows`` (``executemany``)."""
        ...

    def run(self, name: str, params: Mapping[str, Any] | None = None) -> int:
        """Run statement ``name``; return the number of rows it changed."""
        ...

    def claim(self, request: ClaimRequest) -> list[dict[str, Any]]:
        """Lease the best READY jobs of ``request.queues`` (READY -> LEASED, attempt + 1).

        Best means: highest aged class (base class + one per whole minute since
        ``ready_since_ms``, capped at CRITICAL), then oldest ``ready_since_ms``, then id. The
        claim stays indexed: its cost does not grow with the backlog.

        Returns:
            The leased rows in that order: ``id, queue, payload, attempt, priority,
            failures, max_retries, created_at_ms, meta, lease_token``.
        """
        ...

    def claim_unless_controlled(self, request: ClaimRequest) -> list[dict[str, Any]] | None:
        """``claim`` (``request.queue_limits`` is None), unless a queue of ``request.queues``
        has controls (a ``relay_queue`` row: paused, capped or rate-limited): then lease
        nothing and return None, and the caller reads the controls and claims with limits.

        The claim path of queues nobody controls: it costs no more than ``claim``
        (PostgreSQL: the same statement with the check inside; SQLite: one seek per queue).
        """
        ...

    def sweep_lock(self) -> bool:
        """Take the sweep lock for the rest of the transaction; False when another server's
        sweep holds it, or when this transaction swept already (skip this sweep: that one
        does the work)."""
        ...

    def sweep_plan(self, now_ms: int) -> tuple[bool, bool] | None:
        """Take the sweep lock as ``sweep_lock`` does; None when not had, else ``(expire,
        promote)``: whether leases may have expired and jobs may be due at ``now_ms`` (both
        True where asking costs more than sweeping)."""
        ...

    def made_ready(self, queue: str | None = None) -> None:
        """Note that this transaction makes jobs READY in ``queue`` (None: in queues not
        named), so waiters elsewhere are woken once it commits: those of that queue, or
        every waiter for None (a no-op where the change feed sees every commit by itself)."""
        ...


class ChangeFeed(Protocol):
    """Commits made elsewhere (another process, another server), for long-poll wake-ups.

    Followed by ``queue_core.protocol.wakeups.FeedFollower``, the one long-poll design of
    the TCP server and the HTTP API: ``subscribe`` where the feed pushes, else ``token()``
    polled from one thread, each change a commit elsewhere. Commits made by this process
    never count: its own waiters are woken directly.
    """

    def token(self) -> int:
        """Return the feed's current position (on SQLite, the calling thread's connection's)."""
        ...

    def subscribe(self, fn: Callable[[str | None], None]) -> bool:
        """Call ``fn(queue)`` (from a driver thread, so it must be thread-safe and quick) on
        each commit elsewhere that made jobs READY in ``queue`` (None: any queue may have
        changed); return False when this feed cannot push and must be polled."""
        ...


class Driver(Protocol):
    """One database engine behind ``QueueService``; documented once, here."""

    alias: str
    capabilities: Capabilities

    def write(
        self, *, savepoints: bool = True, durable: bool = True, wait: bool = True
    ) -> contextlib.AbstractContextManager[Tx]:
        """Open a write transaction; COMMIT on success, ROLLBACK on error.

        Nested on the same thread it is a SAVEPOINT, released on success and rolled back
        alone on error (how the server runs many requests in one commit). Inside a caller's
        ``transaction.atomic()`` it is a SAVEPOINT too, committed with the caller's work.

        Args:
            savepoints: False (outermost only; honoured where a SAVEPOINT costs round trips,
                PostgreSQL): nested writes take none, and a nested call that fails is set
                apart with ``mark()`` and ``forgive(mark)``, or the whole transaction is
                rolled back.
            durable: False: what this write changes is lease bookkeeping (a claim, a sweep)
                that an OS crash or power loss may take back, so its COMMIT need not wait
                for the disk (a crash of the process alone loses nothing: the operating
                system still holds the write). The transaction commits without waiting only
                when every write opened in it, outermost and nested, said False: one
                durable write anywhere makes the whole transaction durable. Each later
                durable commit makes the earlier ones durable too (the log is sequential),
                so only the tail after the last durable commit can be lost
                (docs/design-decisions.md, "Leases without their own fsync"). SQLite:
                ``synchronous=NORMAL`` for the transaction (set before BEGIN, by the
                outermost write; a nested durable write then syncs the log after COMMIT);
                PostgreSQL: ``SET LOCAL synchronous_commit = off`` before COMMIT. Ignored
                inside a caller's ``atomic()``: its transaction commits as configured.
        Raises:
            StoreBusy: the write could not start (or commit) within the retry budget.
        """
        ...

    def mark(self) -> int:
        """Return this thread's count of statements that changed rows in its transaction
        (the position ``forgive`` compares with)."""
        ...

    def forgive(self, mark: int) -> bool:
        """After a call failed inside ``write(savepoints=False)``: True when the transaction
        is intact and nothing changed since ``mark`` (it goes on as if the call never ran);
        False when it must be rolled back (the call changed rows, or the database aborted
        the transaction)."""
        ...

    def read(self) -> contextlib.AbstractContextManager[Tx]:
        """Run reads: each statement sees the latest committed state (inside ``write()`` on
        the same thread, reads join that transaction)."""
        ...

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once this thread's write transaction commits; dropped if it (or the
        savepoint ``fn`` was registered in) rolls back; at once outside a transaction.
        Errors ``fn`` raises are logged, never propagated."""
        ...

    def in_transaction(self) -> bool:
        """Return whether this thread is inside ``write()``."""
        ...

    def heal(self) -> None:
        """Outside a transaction, close this thread's connection if an error left it
        unusable (a terminated backend, a restarted database); the next statement reconnects.
        Cheap unless an error occurred."""
        ...

    def changes(self) -> ChangeFeed:
        """The change feed for the calling thread (see ``ChangeFeed``)."""
        ...

    def check(self, *, full: bool = True) -> list[str]:
        """The start-up health check; return the problems found (``[]`` when healthy).

        SQLite: ``PRAGMA integrity_check`` (``quick_check`` when not ``full``). PostgreSQL:
        connectivity; the server checks unapplied migrations beside it.
        """
        ...

    def server_lock(self) -> Any:
        """Claim the database for this server: where only one may serve it (SQLite), a lock;
        where several may (PostgreSQL), the server's session limits on the connections it
        opens from now on. Return a handle to keep for the life of the process (None where
        none is needed).

        Raises:
            AlreadyServed: another server holds it.
        """
        ...

    def bulk_turn(self) -> contextlib.AbstractContextManager[None]:
        """Hold, across processes, the turn of one chunk of an operator's bulk action
        (``QueueService.bulk_chunk``, which also holds its process's turn) for as long as the
        context lasts: where writers take turns at one lock (SQLite), so that bulk actions in
        several processes (HTTP workers, the console) do not fill each other's pauses. Where
        writers lock rows (PostgreSQL), nothing. Never raises for want of a lock: a turn
        that cannot be taken across processes is this process's alone.
        """
        ...

    def close(self) -> None:
        """Close this thread's connection (threads that used the driver call this on exit)."""
        ...

    def maintain(self, now_s: float) -> None:
        """Storage upkeep, run outside a transaction after the server's sweeps commit (SQLite:
        keep the write-ahead log bounded; PostgreSQL: nothing, autovacuum does its own). Cheap
        when there is nothing to do; never raises.

        Args:
            now_s: the caller's monotonic clock, in seconds (paces the work).
        """
        ...

    def backup(self, path: str, *, overwrite: bool = False) -> dict[str, Any]:
        """Copy the database to the file ``path`` while it is in use, consistent as of one
        instant, and check the copy (SQLite: the online backup API, then ``PRAGMA
        integrity_check`` on the copy; the copy is written beside ``path`` and renamed into
        place only once it passed, so ``path`` never holds half a copy).

        Args:
            path: the file to write; its folder must exist.
            overwrite: replace an existing file at ``path`` (otherwise refused).
        Returns:
            ``{"path": str, "bytes": int, "pages": int}`` of the copy.
        Raises:
            FileExistsError: ``path`` exists and ``overwrite`` is False.
            InvalidArgument: there is no database to copy (a mistyped path), or ``path`` is
                the live database or one of its ``-wal``/``-shm``/``-journal`` files.
            ValueError: the copy failed its integrity check (it is deleted; the message
                names the problems).
            NotImplementedError: the database has no such backup (PostgreSQL: use
                ``pg_dump``).
            StorageFull, StorageIO: writing the copy failed.
        """
        ...

    def storage_error(self, exc: BaseException) -> RelayError | None:
        """Relay's error for ``exc`` when the storage itself failed (``STORAGE_FULL``,
        ``STORAGE_IO``...), None otherwise; for errors raised outside the driver (``migrate``)."""
        ...


class AlreadyServed(Exception):
    """Another ``relay server`` holds this database (single-writer drivers only)."""


RawExecute = Callable[[Any, str, Mapping[str, Any]], Any]
RawExecuteMany = Callable[[Any, str, Sequence[Mapping[str, Any]]], Any]


class WriteLocked(Exception):
    """``write(wait=False)`` found the write lock taken by another connection: nothing ran.

    Never reaches a client: the server's event loop, which must not wait for a lock, hands
    the calls to its writer thread instead (``queue_core.protocol.writer.Database``)."""


class SqlTx:
    """The statement half of ``Tx``, shared by the drivers.

    Statements run on the DB-API cursor ``raw`` under the Django cursor, spelled for that
    driver (``raw_queries``), inside Django's error translation; when Django is recording
    queries or an ``execute_wrapper`` is installed, through the Django cursor instead
    (``queries``, Django's ``%(name)s`` style). Like Django's cursor, it refuses to run inside
    a caller's ``atomic()`` block that already failed (``TransactionManagementError``).

    Args:
        cursor: a Django cursor on the transaction's connection.
        raw: the DB-API cursor to run statements on.
        queries / raw_queries: the driver's statements, by name, in both spellings.
    """

    def __init__(
        self,
        cursor: Any,
        raw: Any,
        queries: Mapping[str, str],
        raw_queries: Mapping[str, str],
        execute: RawExecute,
        executemany: RawExecuteMany,
    ) -> None:
        self._cursor = cursor
        self._db = cursor.db
        self._django = isinstance(cursor, CursorDebugWrapper) or bool(self._db.execute_wrappers)
        self._raw = raw
        self._errors = self._db.wrap_database_errors
        self._queries = queries
        self._raw_queries = raw_queries
        self._execute_raw = execute
        self._executemany_raw = executemany

    def _execute(self, name: str, params: Mapping[str, Any]) -> Any:
        if self._django:
            self._cursor.execute(self._queries[name], params)
            return self._cursor
        if self._db.needs_rollback:  # what validate_no_broken_transaction() checks, inline
            self._db.validate_no_broken_transaction()
        try:
            self._execute_raw(self._raw, self._raw_queries[name], params)
        except Exception:
            with self._errors:  # Django's error translation, entered for an error only
                raise
        return self._raw

    def one(self, name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """Run query ``name``; return its first row as a dict, or None."""
        cur = self._execute(name, params or {})
        with self._errors:
            row = cur.fetchone()
            if row is None:
                return None
            cols = column_names(cur.description)
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
        cols = column_names(cur.description)
        return [dict(zip(cols, row, strict=True)) for row in rows]

    def many(self, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Run statement ``name`` once per mapping in ``rows`` (``executemany``)."""
        if self._django:
            self._cursor.executemany(self._queries[name], rows)
            return
        if self._db.needs_rollback:
            self._db.validate_no_broken_transaction()
        try:
            self._executemany_raw(self._raw, self._raw_queries[name], rows)
        except Exception:
            with self._errors:
                raise

    def run(self, name: str, params: Mapping[str, Any] | None = None) -> int:
        """Run statement ``name``; return the number of rows it changed."""
        return int(self._execute(name, params or {}).rowcount)


_NAME = operator.itemgetter(0)


def column_names(description: Sequence[Sequence[Any]]) -> list[str]:
    """The column names of a DB-API ``cursor.description`` (each entry's first item), taken
    in C: a claim's row has 26 columns, and a Python loop over them ran for every row."""
    return list(map(_NAME, description))


def run_callbacks(callbacks: list[Callable[[], None]], log: Any) -> None:
    """Run after-commit callbacks in order; log (never raise) what they raise."""
    for fn in callbacks:
        try:
            fn()
        except Exception:
            log.exception("event=after_commit_failed")
