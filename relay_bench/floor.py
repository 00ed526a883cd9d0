"""The raw SQLite floors: what a plain ``sqlite3`` loop achieves for the same work.

Two floors, each measured at the ``synchronous`` level it is compared with (``FULL`` and
``NORMAL``), one process, one connection, WAL, ``busy_timeout``, no network, no Python
per-request work beyond the loop:

* **the lean floor** (``kind="lean"``, issue 15): a minimal jobs table (``LEAN_SCHEMA``: id,
  queue, state, priority, payload, timestamps, the lease's token and expiry) with one partial
  ready index and nothing else. What a job queue on SQLite could reach with no attempt
  history, no idempotency, no counters, no CHECK constraints; the targets are judged
  against it.
* **the schema floor** (``kind="schema"``): Relay's own table (a copy of a freshly migrated
  database: its 25 columns, indexes, triggers and CHECK constraints, foreign keys on) and the
  statements of ``queue_core/storage/sqlite/queries.sql`` (``insert_job``, ``claim_by_id``,
  ``ack``). What Relay's schema alone costs, beside the lean floor.

Each does the same three loops:

* insert one job per transaction: ``BEGIN IMMEDIATE; INSERT; COMMIT``;
* insert in batches of 100: ``BEGIN IMMEDIATE; executemany(INSERT, 100 rows); COMMIT`` (one
  ``executemany``, as the server's batch submit does);
* claim + ack: ``BEGIN IMMEDIATE;`` one seek on the ready index and the claim ``UPDATE;
  COMMIT``, then ``BEGIN IMMEDIATE; UPDATE (ack); COMMIT``. One transaction each, so two
  commits per job, as in Relay.

Relay does more per job than this (the attempt history row, the four class heads and aging,
idempotency, validation, the reply), so a ratio below 1 is expected for one client; group
commit is what lets many concurrent clients beat one commit per request.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from relay_bench.stats import rate, summarize

Tick = Callable[[int], None]
Kind = Literal["lean", "schema"]
KINDS: tuple[Kind, ...] = ("lean", "schema")

# The lean floor's whole schema: the columns a queue cannot do without, one partial index for
# the claim's seek (the same shape as relay_job_ready), the primary key's own index.
LEAN_SCHEMA = """
CREATE TABLE job (
    id TEXT PRIMARY KEY,
    queue TEXT NOT NULL,
    state TEXT NOT NULL,
    priority INTEGER NOT NULL,
    payload TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL,
    ready_since_ms INTEGER,
    lease_token TEXT,
    lease_expires_at_ms INTEGER
);
CREATE INDEX job_ready ON job (queue, priority, ready_since_ms, id) WHERE state = 'ready';
"""

LEAN_INSERT = (
    "INSERT INTO job (id, queue, state, priority, payload, created_at_ms, updated_at_ms, "
    "ready_since_ms) VALUES (:id, :queue, :state, :priority, :payload, :now_ms, :now_ms, "
    ":ready_since_ms)"
)
LEAN_CLAIM = (
    "UPDATE job SET state = 'leased', lease_token = :token, lease_expires_at_ms = :expires_ms, "
    "updated_at_ms = :now_ms WHERE id = (SELECT id FROM job WHERE state = 'ready' "
    "AND queue = :queue AND priority = 1 ORDER BY ready_since_ms, id LIMIT 1) "
    "RETURNING id, payload"
)
LEAN_ACK = (
    "UPDATE job SET state = 'succeeded', lease_token = NULL, lease_expires_at_ms = NULL, "
    "updated_at_ms = :now_ms WHERE id = :job_id AND state = 'leased' AND lease_token = :token "
    "AND lease_expires_at_ms > :now_ms"
)


def _queries() -> dict[str, str]:
    from queue_core.storage.sqlite.driver import NAMED_QUERIES  # Django is set up here

    return {name: NAMED_QUERIES[name] for name in ("insert_job", "claim_by_id", "ack")}


def connect(path: str, synchronous: str, busy_timeout_ms: int = 5000) -> sqlite3.Connection:
    """Open ``path`` in autocommit with the server's pragmas (WAL, ``synchronous``, ``busy_timeout``
    in ms, foreign keys on)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def create_lean(path: str) -> str:
    """Create the lean floor's database at ``path`` (a new file: ``LEAN_SCHEMA`` in WAL mode)
    and return ``path``.

    Raises:
        sqlite3.OperationalError: ``path`` already holds a ``job`` table.
    """
    conn = connect(path, "OFF")
    try:
        conn.executescript(LEAN_SCHEMA)
    finally:
        conn.close()
    return path


# insert_job's parameters that a plain submit binds to NULL (its later, optional columns).
_UNSET: dict[str, Any] = {"unique_scope": None, "meta": None, "time_limit_ms": None}


def job_row(n: int, now_ms: int, payload: str, queue: str = "bench") -> dict[str, Any]:
    """The ``insert_job`` parameters of a READY job like the ones the server creates (the
    options a plain submit leaves unset, such as ``meta``, as NULL: ``_UNSET``)."""
    return _UNSET | {
        "id": f"job_{now_ms:013d}{n:013d}",
        "queue": queue,
        "state": "ready",
        "priority": 1,
        "payload": payload,
        "idempotency_key": None,
        "idempotency_expires_at_ms": None,
        "max_retries": 3,
        "backoff": "exponential",
        "backoff_base_ms": 1000,
        "backoff_cap_ms": 300_000,
        "jitter": True,
        "now_ms": now_ms,
        "available_at_ms": None,
        "ready_since_ms": now_ms,
    }


def lean_row(n: int, now_ms: int, payload: str, queue: str = "bench") -> dict[str, Any]:
    """The lean floor's insert parameters of a READY job (same id shape as ``job_row``)."""
    return {
        "id": f"job_{now_ms:013d}{n:013d}",
        "queue": queue,
        "state": "ready",
        "priority": 1,
        "payload": payload,
        "now_ms": now_ms,
        "ready_since_ms": now_ms,
    }


def ack_params(job_id: str, token: str) -> dict[str, Any]:
    """The named ``ack`` statement's parameters for a lease the floor took just now (no
    clock step outstanding: ``judge_ms`` is now, ``mark_ms`` -1; ``queue_core.clock.Reading``)."""
    now = _now_ms()
    return {
        "job_id": job_id,
        "lease_token": token,
        "worker_id": "floor",
        "now_ms": now,
        "judge_ms": now,
        "mark_ms": -1,
    }


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _insert(kind: Kind) -> tuple[str, Callable[..., dict[str, Any]]]:
    """The insert statement and row builder of a floor."""
    if kind == "lean":
        return LEAN_INSERT, lean_row
    return _queries()["insert_job"], job_row


def insert_one(
    path: str,
    count: int,
    payload: str,
    synchronous: str,
    tick: Tick | None = None,
    *,
    kind: Kind = "schema",
) -> dict[str, Any]:
    """Insert ``count`` jobs, one transaction each; return the rate and per-txn latency (ms).

    ``path`` is a copy of the migrated template (``kind="schema"``) or a ``create_lean`` file.
    """
    sql, row = _insert(kind)
    conn = connect(path, synchronous)
    lat: list[float] = []
    try:
        start = time.perf_counter()
        for n in range(count):
            t0 = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(sql, row(n, _now_ms(), payload))
            conn.execute("COMMIT")
            lat.append((time.perf_counter() - t0) * 1000)
            if tick is not None:
                tick(1)
        elapsed = time.perf_counter() - start
    finally:
        conn.close()
    return {
        "jobs": count,
        "seconds": round(elapsed, 3),
        "per_s": rate(count, elapsed),
        "latency_ms": summarize(lat),
    }


def insert_batches(
    path: str,
    batches: int,
    batch: int,
    payload: str,
    synchronous: str,
    tick: Tick | None = None,
    *,
    kind: Kind = "schema",
) -> dict[str, Any]:
    """Insert ``batches`` x ``batch`` jobs, one transaction and one ``executemany`` per batch;
    return jobs/s and the per-transaction latency (ms)."""
    sql, row = _insert(kind)
    conn = connect(path, synchronous)
    lat: list[float] = []
    n = 0

    def rows(now: int) -> Iterator[dict[str, Any]]:
        nonlocal n
        for _ in range(batch):
            yield row(n, now, payload)
            n += 1

    try:
        start = time.perf_counter()
        for _ in range(batches):
            t0 = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(sql, rows(_now_ms()))
            conn.execute("COMMIT")
            lat.append((time.perf_counter() - t0) * 1000)
            if tick is not None:
                tick(batch)
        elapsed = time.perf_counter() - start
    finally:
        conn.close()
    return {
        "jobs": n,
        "batch": batch,
        "seconds": round(elapsed, 3),
        "per_s": rate(n, elapsed),
        "latency_ms": summarize(lat),
    }


def prefill(
    path: str, count: int, payload: str, queue: str = "bench", *, kind: Kind = "schema"
) -> None:
    """Insert ``count`` READY jobs in one unsynchronised transaction (set-up, not measured)."""
    sql, row = _insert(kind)
    conn = connect(path, "OFF")
    try:
        now = _now_ms()
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(sql, (row(n, now, payload, queue) for n in range(count)))
        conn.execute("COMMIT")
    finally:
        conn.close()


_PICK = (
    "SELECT id FROM relay_job WHERE state = 'ready' AND queue = :queue AND priority = 1 "
    "ORDER BY ready_since_ms, id LIMIT 1"
)


def _claim_schema(conn: sqlite3.Connection, q: dict[str, str]) -> tuple[str, str] | None:
    """One claim transaction on Relay's table: the ready seek, then ``claim_by_id``."""
    now = _now_ms()
    token = secrets.token_urlsafe(24)
    conn.execute("BEGIN IMMEDIATE")
    row = conn.execute(_PICK, {"queue": "bench"}).fetchone()
    if row is None:
        conn.execute("COMMIT")
        return None
    params = {
        "job_id": row[0],
        "token": token,
        "worker_id": "floor",
        "now_ms": now,
        "expires_ms": now + 30_000,
    }
    conn.execute(q["claim_by_id"], params).fetchall()
    conn.execute("COMMIT")
    return row[0], token


def _ack_schema(conn: sqlite3.Connection, q: dict[str, str], job_id: str, token: str) -> None:
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(q["ack"], ack_params(job_id, token)).fetchall()
    conn.execute("COMMIT")


def _claim_lean(conn: sqlite3.Connection) -> tuple[str, str] | None:
    """One claim transaction on the lean table: one ``UPDATE`` whose subquery seeks the index."""
    now = _now_ms()
    token = secrets.token_urlsafe(24)
    conn.execute("BEGIN IMMEDIATE")
    params = {"token": token, "expires_ms": now + 30_000, "now_ms": now, "queue": "bench"}
    row = conn.execute(LEAN_CLAIM, params).fetchone()
    conn.execute("COMMIT")
    return None if row is None else (row[0], token)


def _ack_lean(conn: sqlite3.Connection, job_id: str, token: str) -> None:
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(LEAN_ACK, {"job_id": job_id, "token": token, "now_ms": _now_ms()})
    conn.execute("COMMIT")


def claim_ack(
    path: str,
    count: int,
    payload: str,
    synchronous: str,
    tick: Tick | None = None,
    *,
    kind: Kind = "schema",
) -> dict[str, Any]:
    """Prefill ``count`` jobs, then claim (one txn) and ack (one txn) each; return jobs/s and
    the claim and ack latencies (ms)."""
    prefill(path, count, payload, kind=kind)
    q = _queries() if kind == "schema" else {}
    conn = connect(path, synchronous)
    claim_lat: list[float] = []
    ack_lat: list[float] = []
    done = 0
    try:
        start = time.perf_counter()
        for _ in range(count):
            t0 = time.perf_counter()
            got = _claim_lean(conn) if kind == "lean" else _claim_schema(conn, q)
            if got is None:
                break
            t1 = time.perf_counter()
            if kind == "lean":
                _ack_lean(conn, *got)
            else:
                _ack_schema(conn, q, *got)
            t2 = time.perf_counter()
            claim_lat.append((t1 - t0) * 1000)
            ack_lat.append((t2 - t1) * 1000)
            done += 1
            if tick is not None:
                tick(1)
        elapsed = time.perf_counter() - start
    finally:
        conn.close()
    return {
        "jobs": done,
        "seconds": round(elapsed, 3),
        "per_s": rate(done, elapsed),
        "claim_latency_ms": summarize(claim_lat),
        "ack_latency_ms": summarize(ack_lat),
    }
