"""The PostgreSQL driver: several relay servers on one database (psycopg 3, Django's backend).

Transactions are Django's ``atomic()`` on the alias (BEGIN, SAVEPOINTs when nested, COMMIT),
so a caller's own ``atomic()`` block takes Relay's writes into its transaction exactly as
with SQLite. Statements are the named blocks of ``queries.sql`` beside this file, run on a
psycopg cursor with server-side binding under Django's connection, as prepared statements
prepared on their first run on each connection (``RELAY_PG_PREPARED_STATEMENTS``). Django
turns psycopg's prepared statements off (``prepare_threshold`` None, for connection
poolers), and PostgreSQL then parses and plans every statement: on the benchmark machine
that was about half of its CPU per lease+ack (docs/benchmarking.md, "PostgreSQL").

Several servers write at once, so the guarantees SQLite's single writer gave for free are
made explicit: the claim locks what it takes and skips what others hold (``FOR UPDATE SKIP
LOCKED``), idempotency keys are bound with ``INSERT ... ON CONFLICT``, sweeps take an advisory
lock (one server sweeps at a time) and every sweep update keeps its state guard. Lock waits
a retry cures (deadlock, serialization failure, lock timeout) raise ``StoreBusy`` (``BUSY``,
retryable); a lost connection raises ``Unavailable``.

Wake-ups cross servers through LISTEN/NOTIFY: a transaction that makes jobs READY sends one
``NOTIFY relay_ready`` (delivered at COMMIT), and each process's change feed listens on its
own connection. The leases themselves never depend on a notification: a lost one delays a
long-poll until its deadline, the reaper's next pass, or the feed's reconnect (which wakes
every waiter, as notifications may have been missed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import psycopg
from django.db import DatabaseError, connections, transaction
from django.db.backends.signals import connection_created
from psycopg import pq
from psycopg.pq import TransactionStatus

from queue_core.conf import relay_settings
from queue_core.errors import (
    InvalidArgument,
    OutcomeUnknown,
    RelayError,
    StorageFull,
    StorageIO,
    StoreBusy,
    Unavailable,
)
from queue_core.storage.base import (
    Capabilities,
    ClaimRequest,
    SqlTx,
    load_queries,
    run_callbacks,
)

log = logging.getLogger("relay.store")

QUERIES = load_queries("queue_core.storage.postgresql")
# The statements that can change rows (``Driver.mark``): all but the plain SELECTs.
WRITES = frozenset(
    name for name, sql in QUERIES.items() if not sql.lstrip().upper().startswith("SELECT")
)
CHANNEL = "relay_ready"
# SQLSTATEs a retry cures: serialization_failure, deadlock_detected, lock_not_available.
_BUSY_STATES = frozenset({"40001", "40P01", "55P03"})
RECONNECT_MAX_S = 2.0  # the change feed's longest pause between reconnect attempts
NOTIFY_POLL_S = 1.0  # how long the listener blocks before it looks at its stop flag
_FEEDS: weakref.WeakSet[PostgresChangeFeed] = weakref.WeakSet()
# Statements that must read their partial indexes however the planner costs them. Every job
# passes through READY, so relay_job_ready keeps the pages of the largest backlog it held, and
# the planner, costing an index scan by its pages, can prefer to scan every finished job of
# the table (tests/postgresql/test_claim_plan.py shows it doing so).
INDEXED_ONLY = frozenset({"counts_live"})
# psycopg's prepare_threshold for a connection Django opened with None (no prepared
# statements): a count no query reaches, so only what asks (Relay's statements, and
# executemany, which always asks) is prepared; the application's own queries stay as they were.
PREPARE_WHEN_ASKED = 1 << 62


def _execute_prepared(cursor: psycopg.Cursor[Any], query: str, params: Any) -> Any:
    """``cursor.execute`` as a prepared statement (prepared on its first run here)."""
    return cursor.execute(query, params, prepare=True)


# This thread's connection holds a prepared statement whose result types a schema change
# altered ("cached plan must not change result type", which psycopg does not recover from):
# ``heal`` replaces the connection.
_STALE = threading.local()
# When this thread's last statement ran out of lock_timeout (``at``, monotonic s): for one
# lock_timeout after it, its transactions wait SHORT_LOCK_WAIT for a lock, not the whole
# timeout again (``PostgresDriver.write``): a batch whose calls meet rows another session
# holds answers them BUSY one after another at once, instead of a lock_timeout each.
_LOCK_WAITS = threading.local()
SHORT_LOCK_WAIT = "10ms"


def _translate(exc: DatabaseError) -> Exception | None:
    """Map a database error to Relay's: BUSY for waits a retry cures, UNAVAILABLE for a lost
    connection or a stale prepared statement, STORAGE_IO for a database that takes no
    writes, STORAGE_FULL for its full disk; None to re-raise it as it is (``INTERNAL``)."""
    cause = exc.__cause__
    state = getattr(cause, "sqlstate", None)
    text = str(cause).strip()[:200]
    if state == "0A000" and "cached plan must not change result type" in str(cause):
        # A migration changed a column's type under a prepared statement: the connection
        # cannot run it again, so the next heal() opens a new one; the call may be retried.
        _STALE.reset = True
        return Unavailable("a schema change made a prepared statement stale; try again")
    if state in _BUSY_STATES:
        if state == "55P03":  # lock_not_available: it waited the whole lock_timeout
            _LOCK_WAITS.at = time.monotonic()
        return StoreBusy(f"the database cannot serve this now ({state}: a lock); try again")
    if state == "57014":
        # query_canceled: a statement_timeout (a role's or database's setting) or an
        # operator's pg_cancel_backend; nothing of the transaction was kept.
        return StoreBusy(f"the database cancelled a statement ({state}: {text}); try again")
    if state == "25006":
        # read_only_sql_transaction: a standby (a connection left on a demoted primary), or
        # default_transaction_read_only. A new session sees the setting as it is then (the
        # old one kept the setting it started with: INTERNAL for 34 s after it was lifted).
        _STALE.reset = True
        return StorageIO(f"the database takes no writes ({state}: {text}); nothing was written")
    if state == "53100":  # disk_full
        return StorageFull(f"the database's disk is full ({state}: {text}); nothing was written")
    # No SQLSTATE (the socket is gone), class 08 (connection exception), 57P (the server shut
    # the session down: pg_terminate_backend, a restart) or 25P03 (it ended the session for
    # idle_in_transaction_session_timeout, an InternalError): the connection is lost.
    if state == "25P03" or (
        isinstance(cause, psycopg.OperationalError)
        and (state is None or state.startswith(("08", "57P")))
    ):
        return Unavailable(f"the database is unreachable: {text}")
    if isinstance(cause, psycopg.DataError) and (state == "22021" or "NUL" in str(cause)):
        # A character the database cannot store in text (NUL): the caller's input.
        return InvalidArgument(f"text the database cannot store: {str(cause).strip()[:200]}")
    return None


def _ended_idle(exc: BaseException) -> bool:
    """Whether ``exc`` comes from PostgreSQL ending the session for idling in its transaction
    (25P03): it ends a session only while waiting for its next command, so a COMMIT it
    answers that way never ran (not ``OUTCOME_UNKNOWN``: a chaos review)."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "sqlstate", None) == "25P03":
            return True
        seen = seen.__cause__
    return False


@contextlib.contextmanager
def _relay_errors() -> Iterator[None]:
    try:
        yield
    except DatabaseError as exc:
        mapped = _translate(exc)
        if mapped is None:
            raise
        raise mapped from exc


def _lost(raw: psycopg.Connection[Any] | None) -> bool:
    """Whether this connection can no longer carry a statement: closed, or broken by an
    error that ended its session (psycopg's ``broken``). No round trip."""
    return raw is None or raw.closed or raw.broken


# Connections whose notices are watched for a FATAL one (``_watch``), and those that had one.
_WATCHED: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
_ENDED: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()


def _watch(raw: psycopg.Connection[Any]) -> None:
    """Mark ``raw`` ended (``_ENDED``) when the server sends it a FATAL error while idle
    (libpq hands such an error to the notice handlers)."""
    if raw in _WATCHED:
        return
    ref = weakref.ref(raw)

    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        conn = ref()
        if conn is not None and diag.severity_nonlocalized in ("FATAL", "PANIC"):
            _ENDED.add(conn)

    raw.add_notice_handler(on_notice)
    _WATCHED.add(raw)


def _hung_up(raw: psycopg.Connection[Any]) -> bool:
    """Whether the server ended the session of an idle connection (a FATAL error and EOF:
    ``pg_terminate_backend``, a restart). One ``poll`` of the socket, no round trip; when it
    is readable, libpq reads and parses what came: a FATAL error, or the end of the stream.

    Anything else that came (a notification for a channel the project's own connection
    listens to, in the shared-database mode; a notice) is left to psycopg: taken for a
    hang-up, it closed the project's session with its locks, temporary tables and ``LISTEN``
    (a review)."""
    if _lost(raw):
        return True
    if raw.info.transaction_status != TransactionStatus.IDLE:
        return False
    try:
        poller = select.poll()
        poller.register(raw.fileno(), select.POLLIN)
        if not poller.poll(0):
            return False
        _watch(raw)
        raw.pgconn.consume_input()
        raw.pgconn.is_busy()  # parses what came: notices to their handlers, notifications kept
    except (OSError, ValueError, psycopg.Error):  # "server closed the connection"
        return True
    return raw in _ENDED or raw.pgconn.status != pq.ConnStatus.OK


class PostgresTx(SqlTx):
    """``Tx`` on PostgreSQL (see ``queue_core.storage.base.Tx``)."""

    def __init__(self, cursor: Any, driver: PostgresDriver) -> None:
        conn = cursor.db.connection
        raw = psycopg.Cursor(conn)  # server-side binding
        execute = _execute_prepared if driver.prepares(conn) else psycopg.Cursor.execute
        super().__init__(cursor, raw, QUERIES, QUERIES, execute, psycopg.Cursor.executemany)
        self._driver = driver

    def _execute(self, name: str, params: Any) -> Any:
        with _relay_errors():
            cursor = super()._execute(name, params)
        if name in WRITES and cursor.rowcount:
            self._driver._local.changed = getattr(self._driver._local, "changed", 0) + 1
        return cursor

    def all(self, name: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run query ``name``; return every row as a dict (``INDEXED_ONLY`` statements with
        sequential scans off for their duration)."""
        if name not in INDEXED_ONLY:
            return super().all(name, params)
        with _relay_errors():
            self._raw.execute("SET enable_seqscan = off")
        try:
            return super().all(name, params)
        finally:
            # In a transaction the statement's error aborted, the SET is undone with it and
            # this RESET fails: the statement's own error is the one to raise.
            with contextlib.suppress(psycopg.Error):
                self._raw.execute("RESET enable_seqscan")

    def many(self, name: str, rows: Any) -> None:
        """Run statement ``name`` once per mapping in ``rows`` (``executemany``)."""
        with _relay_errors():
            super().many(name, rows)
        if name in WRITES and rows:
            self._driver._local.changed = getattr(self._driver._local, "changed", 0) + 1

    def claim(self, request: ClaimRequest) -> list[dict[str, Any]]:
        """Lease the best READY jobs in one statement (``claim`` in queries.sql)."""
        return self._claim(request, guard=False)

    def claim_unless_controlled(self, request: ClaimRequest) -> list[dict[str, Any]] | None:
        """The claim statement, guarded so that it leases nothing when a queue it names has
        controls: no round trip beyond the claim itself while no queue is controlled. Only
        an empty answer asks whether controls were the reason (``queue_controlled``)."""
        rows = self._claim(request, guard=True)
        if rows:
            return rows
        row = self.one("queue_controlled", {"queues": list(request.queues)})
        return None if row and row["controlled"] else []

    def _claim(self, request: ClaimRequest, *, guard: bool) -> list[dict[str, Any]]:
        if request.limit == 1 and len(request.queues) == 1:
            # One job from one queue: the statement whose generic plan is planned once.
            return self.all(
                "claim_one",
                {
                    "guard": guard,
                    "queue": request.queues[0],
                    "now_ms": request.now_ms,
                    "expires_ms": request.expires_ms,
                    "worker_id": request.worker_id,
                    "token": request.new_token(),
                },
            )
        rows = self.all(
            "claim",
            {
                "guard": guard,
                "queues": list(request.queues),
                "limits": list(request.queue_limits or [request.limit] * len(request.queues)),
                "limit": request.limit,
                "now_ms": request.now_ms,
                "expires_ms": request.expires_ms,
                "worker_id": request.worker_id,
                # One statement: the tokens go in before it knows how many jobs it takes.
                "tokens": request.new_tokens(request.limit),
                "room": request.room_bytes,
            },
        )
        rows.sort(key=lambda r: r["n"])
        for row in rows:
            del row["n"]
        return rows

    def sweep_lock(self) -> bool:
        """Try the advisory sweep lock, held until this transaction ends.

        False too when this transaction has swept already (the TCP server sweeps before a
        group of claims, then each claim would again): one sweep per transaction, three
        round trips saved per claim.
        """
        local = self._driver._local
        if getattr(local, "swept", False):
            return False
        row = self.one("sweep_lock")
        locked = bool(row and row["locked"])
        local.swept = locked
        return locked

    def sweep_plan(self, now_ms: int) -> tuple[bool, bool] | None:
        """The sweep lock and whether anything is due, in one round trip (``sweep_probe``);
        None when another server holds the lock or this transaction swept already."""
        local = self._driver._local
        if getattr(local, "swept", False):
            return None
        row = self.one("sweep_probe", {"now_ms": now_ms})
        if not (row and row["locked"]):
            return None
        local.swept = True
        return bool(row["expired"]), bool(row["due"])

    def made_ready(self, queue: str | None = None) -> None:
        """Send ``NOTIFY relay_ready`` once per queue per transaction (delivered at COMMIT),
        so other servers wake only that queue's long-polls."""
        self._driver.notify(self, queue)


class PostgresChangeFeed:
    """Commits by other servers and processes, from ``LISTEN relay_ready`` on a connection
    of its own (one per driver, in a daemon thread started on first use).

    A notification this driver sent is ignored (its own waiters are woken directly). After
    the connection is (re)established the feed moves on once, since notifications sent while
    it was away are lost: waiters look again rather than wait for a wake-up that will not come.
    """

    def __init__(self, driver: PostgresDriver) -> None:
        self._driver = driver
        self._lock = threading.Lock()
        self._position = 0
        self._subscribers: list[Callable[[str | None], None]] = []
        self._stopped = False
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="relay-pg-listen", daemon=True)
        self._thread.start()
        _FEEDS.add(self)

    def token(self) -> int:
        """Return the count of foreign commits seen so far."""
        with self._lock:
            return self._position

    def subscribe(self, fn: Callable[[str | None], None]) -> bool:
        """Call ``fn(queue)`` from the listener thread on each foreign commit (``queue`` None:
        any queue); True (it pushes)."""
        with self._lock:
            self._subscribers.append(fn)
        return True

    def stop(self, timeout_s: float = 2 * NOTIFY_POLL_S) -> None:
        """Stop listening and wait up to ``timeout_s`` for the thread to close its connection."""
        self._stopped = True
        self._thread.join(timeout_s)

    def _moved(self, queue: str | None = None) -> None:
        with self._lock:
            self._position += 1
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(queue)
            except Exception:
                log.exception("event=change_subscriber_failed")

    def _listen(self) -> None:
        pause = 0.05
        while not self._stopped:
            try:
                with psycopg.connect(**self._driver.connect_kwargs(), autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.connected.set()
                    self._moved()  # anything sent while we were away is lost: look again
                    pause = 0.05
                    while not self._stopped:
                        for note in conn.notifies(timeout=NOTIFY_POLL_S):
                            origin, _, queue = note.payload.partition(" ")
                            if origin != self._driver.origin:
                                self._moved(queue or None)
            except Exception as exc:  # noqa: BLE001 - logged; the loop reconnects
                self.connected.clear()
                log.warning("event=listen_failed error=%r retry_in_s=%.2f", exc, pause)
                time.sleep(pause)
                pause = min(pause * 2, RECONNECT_MAX_S)


def stop_feeds() -> None:
    """Stop every change feed of this process (before its database is dropped, in tests)."""
    for feed in list(_FEEDS):
        feed.stop()


class PostgresDriver:
    """PostgreSQL access for the service layer (see ``queue_core.storage.base.Driver``).

    Args:
        alias: Django database alias whose ENGINE is ``django.db.backends.postgresql``.
    """

    capabilities = Capabilities(
        vendor="postgresql", single_writer=False, skip_locked=True, push_changes=True
    )

    def __init__(self, alias: str = "default") -> None:
        self.alias = alias
        self.origin = uuid.uuid4().hex  # this driver's NOTIFY payload
        self._local = threading.local()
        self._feed: PostgresChangeFeed | None = None
        self._feed_lock = threading.Lock()
        # This process's sessions' application_name once it serves (``server_lock``).
        self._name: str | None = None
        self._stuck_check_at = 0.0  # monotonic s: when ``maintain`` looks next

    @contextlib.contextmanager
    def write(
        self, *, savepoints: bool = True, durable: bool = True, wait: bool = True
    ) -> Iterator[PostgresTx]:
        """Open a write transaction (Django's ``atomic()``: BEGIN, or a SAVEPOINT when nested
        or inside the caller's ``atomic()``); see ``Driver.write`` (``wait`` is ignored:
        PostgreSQL's writers do not exclude each other).

        Args:
            savepoints: False at the outermost level: no nested write takes a SAVEPOINT (the
                TCP server's group commit; ``mark``/``forgive`` set a failed call apart).
            durable: False (see ``Driver.write``): when no write of the transaction was
                durable, ``SET LOCAL synchronous_commit = off`` runs just before its COMMIT
                (one round trip; at the outermost level, outside any SAVEPOINT, so no
                rollback undoes it): the COMMIT returns without waiting for the WAL flush,
                which the WAL writer does within ``3 * wal_writer_delay`` (PostgreSQL's
                asynchronous commit). The setting ends with the transaction.
        Raises:
            StoreBusy: deadlock, serialization failure or lock timeout, at a statement or at
                COMMIT. Unavailable: the connection is lost before COMMIT (nothing was kept).
            OutcomeUnknown: the connection is lost at COMMIT (it may have been kept).
        """
        conn = connections[self.alias]
        outermost = not conn.in_atomic_block
        if outermost:
            self.heal()  # a broken connection from an earlier error: open a new one
            self._local.short_locks = False
            self._local.notified = None
            self._local.swept = False
            self._local.changed = 0
            self._local.flat = not savepoints
            self._local.depth = 0
            self._local.durable = durable
        elif durable:
            self._local.durable = True
        self._local.depth = depth = getattr(self._local, "depth", 0) + 1
        # A SAVEPOINT costs two round trips. The first nesting level gets one (a call of the
        # TCP server's group commit, an item of an admin bulk action: each rolls back
        # alone); deeper levels (the service's own transaction inside such a call) roll back
        # with it, so they need none.
        savepoint = depth <= 2 and not getattr(self._local, "flat", False)
        committing = False
        waited = getattr(_LOCK_WAITS, "at", None)
        shorten = (
            waited is not None
            and depth <= 2
            and not getattr(self._local, "short_locks", False)
            and time.monotonic() - waited < relay_settings().lock_timeout_ms / 1000
        )
        try:
            if shorten and not outermost:  # at the outer level, before this call's savepoint
                self._shorten_lock_waits(conn)
            with (
                _relay_errors(),
                transaction.atomic(using=self.alias, savepoint=savepoint),
                conn.cursor() as cursor,
            ):
                if shorten and outermost:
                    self._shorten_lock_waits(conn)
                tx = PostgresTx(cursor, self)
                yield tx
                if outermost and (conn.needs_rollback or _lost(conn.connection)):
                    # A savepoint that could not roll back (the connection was lost in a
                    # call the caller set apart) dooms the transaction: Django's atomic
                    # would roll it back without a word, and the calls before it would
                    # pass for committed. A savepoint that could not even begin (the
                    # session ended between two calls) marks nothing in Django, but leaves
                    # the connection broken: a COMMIT sent on it would be answered
                    # OUTCOME_UNKNOWN, though nothing went out (a chaos run: the earlier
                    # calls of a bulk chunk got it, their jobs all unchanged).
                    raise Unavailable(
                        "the transaction was lost before it could commit (the database "
                        "connection failed): nothing of it was kept"
                    )
                if outermost and not self._local.durable:
                    self._relax_commit(conn, tx)
                committing = outermost
        except Unavailable as exc:
            self._local.notified = None
            if committing and not _ended_idle(exc):
                # The COMMIT went out and no answer came back: it may have been applied.
                raise OutcomeUnknown(
                    "the database connection was lost while it committed: the change may or "
                    "may not have been made"
                ) from exc
            raise
        except BaseException:
            # A savepoint that rolled back took its NOTIFY with it: send again if needed.
            self._local.notified = None
            raise
        finally:
            self._local.depth -= 1

    def _shorten_lock_waits(self, conn: Any) -> None:
        """``SET LOCAL lock_timeout`` to ``SHORT_LOCK_WAIT`` for the rest of this transaction
        (one round trip, only after a lock wait ran out on this thread: ``_LOCK_WAITS``)."""
        with _relay_errors(), conn.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = '{SHORT_LOCK_WAIT}'")
        self._local.short_locks = True

    @staticmethod
    def _relax_commit(conn: Any, tx: PostgresTx) -> None:
        """``SET LOCAL synchronous_commit = off`` in this transaction, unless it is to roll
        back (Django's rollback mark) or ran no statement (psycopg sent no BEGIN: its COMMIT
        writes nothing)."""
        raw = conn.connection
        if conn.needs_rollback or raw is None:
            return
        if raw.info.transaction_status != TransactionStatus.INTRANS:
            return
        tx.run("relax_commit")

    def mark(self) -> int:
        """Return how many statements changed rows in this thread's transaction so far."""
        return int(getattr(self._local, "changed", 0))

    def forgive(self, mark: int) -> bool:
        """See ``Driver.forgive``: the transaction must not be in the aborted state (a
        statement failed) and no statement may have changed rows since ``mark``. Then
        Django's rollback mark, set when the exception left an ``atomic(savepoint=False)``,
        is cleared: the database transaction is intact."""
        conn = connections[self.alias]
        raw = conn.connection
        # IDLE: no statement ran yet in this transaction (psycopg sends BEGIN with the first).
        intact = (TransactionStatus.INTRANS, TransactionStatus.IDLE)
        if raw is None or raw.info.transaction_status not in intact:
            return False
        if self.mark() != mark:
            return False
        transaction.set_rollback(False, using=self.alias)
        return True

    def notify(self, tx: PostgresTx, queue: str | None = None) -> None:
        """Send this transaction's ``NOTIFY relay_ready`` for ``queue`` unless sent already
        (payload ``"<origin> <queue>"``, or ``"<origin>"`` for any queue; queue names hold no
        spaces; see ``PostgresTx.made_ready``)."""
        sent: set[str | None] | None = getattr(self._local, "notified", None)
        if sent is None:
            sent = self._local.notified = set()
        if queue in sent or None in sent:
            return
        payload = self.origin if queue is None else f"{self.origin} {queue}"
        tx.one("notify_ready", {"origin": payload})
        sent.add(queue)

    @contextlib.contextmanager
    def read(self) -> Iterator[PostgresTx]:
        """Run reads in autocommit, or inside this thread's transaction when there is one."""
        self.heal()
        local = self._local
        depth = getattr(local, "reads", 0)
        local.reads = depth + 1  # heal() leaves the connection of a read in progress alone
        try:
            with _relay_errors(), connections[self.alias].cursor() as cursor:
                yield PostgresTx(cursor, self)
        finally:
            local.reads = depth

    def heal(self) -> None:
        """Outside a transaction or a read, close this thread's connection if it cannot serve:
        the server ended its session, a prepared statement went stale, or an error left it
        unusable. The next statement opens a new one.

        A working connection is never closed for its age here. ``CONN_MAX_AGE`` is Django's
        to apply between requests (``close_old_connections``, as the HTTP pool's threads and
        the tasks worker call it): called before every transaction, with the default of 0 it
        closed the project's own connection at each ``enqueue`` outside ``atomic()`` (an open
        server-side cursor failed "the connection is closed", temporary tables, session
        locks and ``SET``s were lost) and had a ``relay_server`` reconnect per transaction
        (with the worker's own, 1,005 sessions for 300 tasks: a Django review). So the
        server's threads keep a connection until it fails.

        Django's ``close_if_unusable_or_obsolete`` also re-arms ``CONN_HEALTH_CHECKS``: called
        before every transaction, it cost a ``SELECT 1`` round trip per transaction. Instead,
        a connection whose socket is readable while idle (the server ended the session:
        ``pg_terminate_backend``, a restart) is replaced without a round trip (``_hung_up``),
        and so is one holding a prepared statement a schema change made stale; after an error
        Django's ``is_usable`` decides (one ``SELECT 1``).
        """
        conn = connections[self.alias]
        if conn.in_atomic_block or conn.connection is None or getattr(self._local, "reads", 0) > 0:
            # In a transaction or a read: closing would pull the connection from under it
            # (with CONN_MAX_AGE 0 a read inside a read closed the outer one's: a review).
            return
        raw = conn.connection
        if getattr(_STALE, "reset", False) or _hung_up(raw):
            _STALE.reset = False
            conn.close()
            return
        # Autocommit off is the project's own transaction (Django's manual transactions, in
        # the shared-database mode): the call joins it. Closed as Django closes it between
        # requests, it lost the project's uncommitted rows without an error (a review).
        if conn.errors_occurred:
            if conn.is_usable():
                conn.errors_occurred = False
            else:
                conn.close()

    @staticmethod
    def prepares(conn: psycopg.Connection[Any]) -> bool:
        """Whether Relay's statements run prepared on ``conn`` (``RELAY_PG_PREPARED_STATEMENTS``);
        when Django opened it without prepared statements, they are let in for the statements
        that ask (``PREPARE_WHEN_ASKED``)."""
        if not relay_settings().pg_prepared_statements:
            return False
        if conn.prepare_threshold is None:
            conn.prepare_threshold = PREPARE_WHEN_ASKED
        return True

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` after COMMIT (Django's ``on_commit``, robust: errors are logged)."""
        if not self.in_transaction():
            run_callbacks([fn], log)
            return
        transaction.on_commit(lambda: run_callbacks([fn], log), using=self.alias)

    def in_transaction(self) -> bool:
        """Return whether this thread is inside ``write()``."""
        return getattr(self._local, "depth", 0) > 0

    def changes(self) -> PostgresChangeFeed:
        """The process's LISTEN feed for this driver (started on first use)."""
        with self._feed_lock:
            if self._feed is None:
                self._feed = PostgresChangeFeed(self)
            return self._feed

    def connect_kwargs(self) -> dict[str, Any]:
        """psycopg connection arguments for this alias (the feed's own connection)."""
        params = connections[self.alias].get_connection_params()
        return {k: v for k, v in params.items() if k not in ("cursor_factory", "context")}

    def backup(self, path: str, *, overwrite: bool = False) -> dict[str, Any]:
        """Not here: a PostgreSQL database is copied with its own tools (``pg_dump``)."""
        raise NotImplementedError(
            "relay backup copies SQLite databases; back up PostgreSQL with pg_dump"
        )

    def check(self, *, full: bool = True) -> list[str]:
        """Connect and read Relay's table; return the problems found (``[]`` when healthy).

        ``full`` changes nothing here: PostgreSQL checks its own pages (and checksums, when
        the cluster has them) as it reads them.
        """
        try:
            with self.read() as tx:
                tx.one("check")
        except (DatabaseError, Unavailable) as exc:
            return [f"{type(exc).__name__}: {str(exc).strip()}"]
        return []

    def bulk_turn(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to hold (``Driver.bulk_turn``): writers lock rows, not the database."""
        return contextlib.nullcontext()

    def server_lock(self) -> None:
        """Return None (any number of servers may serve one PostgreSQL database), and give
        every connection this process opens to the database from now on the server's limits:
        ``lock_timeout`` (``RELAY_LOCK_TIMEOUT_MS``) and ``idle_in_transaction_session_timeout``
        (``RELAY_PG_IDLE_IN_TRANSACTION_TIMEOUT_MS``), set for the session as it opens, with
        ``application_name`` ``relay server <pid> <8 hex digits>`` (which ``pg_stat_activity``
        shows, and by which ``maintain`` tells other servers' sessions).

        Set here, not in the project's database settings, because the alias may be a Django
        project's own, whose web processes may sit in a transaction as long as they like:
        only the server's sessions get them. The idle limit is what frees the batch's row
        locks and the sweep's advisory lock (``sweep_lock``) of a server frozen mid-batch.
        """
        alias = self.alias
        self._name = name = f"relay server {os.getpid()} {self.origin[:8]}"

        def limit(sender: Any, connection: Any, **kwargs: Any) -> None:
            if connection.alias != alias:
                return
            s = relay_settings()
            values = [str(s.lock_timeout_ms), str(s.pg_idle_in_transaction_timeout_ms), name]
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT set_config('lock_timeout', %s, false), "
                    "set_config('idle_in_transaction_session_timeout', %s, false), "
                    "set_config('application_name', %s, false)",
                    values,
                )

        uid = f"relay.server_limits.{alias}"
        connection_created.disconnect(dispatch_uid=uid)  # a driver's earlier name, if any
        connection_created.connect(limit, weak=False, dispatch_uid=uid)
        return None

    def close(self) -> None:
        """Close this thread's connection (threads that used the driver call this on exit)."""
        connections[self.alias].close()

    def maintain(self, now_s: float) -> None:
        """In a server, every third of ``RELAY_PG_STUCK_TRANSACTION_MS``: end the sessions of
        other relay servers that have waited that long for their server in the middle of a
        transaction (``end_stuck_sessions``; a server frozen mid-command holds its locks, and
        the sweep's, until then). Nothing else: autovacuum keeps PostgreSQL's tables
        (migration 0006 tunes it).

        Args:
            now_s: a monotonic reading, in s.
        """
        stuck_ms = relay_settings().pg_stuck_transaction_ms
        if self._name is None or stuck_ms <= 0 or now_s < self._stuck_check_at:
            return
        self._stuck_check_at = now_s + stuck_ms / 3000
        try:
            with connections[self.alias].cursor() as cursor:
                cursor.execute(
                    QUERIES["end_stuck_sessions"], {"me": self._name, "stuck_ms": stuck_ms}
                )
                row = cursor.fetchone()
        except DatabaseError as exc:  # e.g. not allowed to end another role's session
            log.warning("event=stuck_sessions_check_failed error=%r", exc)
            return
        if row and row[0]:
            log.warning(
                "event=stuck_sessions_ended sessions=%d stuck_ms=%d",
                row[0],
                stuck_ms,
                extra={"event": "stuck_sessions_ended", "sessions": row[0], "stuck_ms": stuck_ms},
            )

    def storage_error(self, exc: BaseException) -> RelayError | None:
        """Relay's error for a database error (``BUSY``, ``UNAVAILABLE``...), or None."""
        if isinstance(exc, DatabaseError):
            mapped = _translate(exc)
            return mapped if isinstance(mapped, RelayError) else None
        return None
