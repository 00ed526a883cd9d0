"""The raw SQLite floor: what a plain ``sqlite3`` loop achieves for the same work.

Same file layout (a copy of a freshly migrated database, so the same table, indexes and CHECK
constraints), same pragmas as the server (WAL, ``synchronous`` from
``RELAY_SQLITE_SYNCHRONOUS``, ``busy_timeout``, foreign keys), and the same statements as
``queue_core/storage/sqlite/queries.sql`` (``insert_job``, ``claim_by_id``, ``ack``), one
process, one connection, no network, no Python per-request work beyond the loop:

* insert one job per transaction: ``BEGIN IMMEDIATE; INSERT; COMMIT``;
* insert in batches of 100: ``BEGIN IMMEDIATE; 100 x INSERT; COMMIT``;
* claim + ack: ``BEGIN IMMEDIATE; SELECT id ... ORDER BY ready_since_ms, id LIMIT 1`` (one
  seek on the ``relay_job_ready`` index) ``; UPDATE (claim_by_id); COMMIT``, then
  ``BEGIN IMMEDIATE; UPDATE (ack); COMMIT``. Two fsyncs per job, as in Relay.

Relay does more per job than this (the attempt history row, the four class heads and aging,
idempotency, validation, the reply), so a ratio below 1 is expected for one client; group
commit is what lets many concurrent clients beat one fsync per request.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from relay_bench.stats import rate, summarize

Tick = Callable[[int], None]


def _queries() -> dict[str, str]:
    from queue_core.storage.sqlite.driver import NAMED_QUERIES  # Django is set up here

    return {name: NAMED_QUERIES[name] for name in ("insert_job", "claim_by_id", "ack")}


def connect(path: str, synchronous: str, busy_timeout_ms: int = 5000) -> sqlite3.Connection:
    """Open ``path`` in autocommit with the server's pragmas."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def job_row(n: int, now_ms: int, payload: str, queue: str = "bench") -> dict[str, Any]:
    """The ``insert_job`` parameters of a READY job like the ones the server creates."""
    return {
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
        "time_limit_ms": None,
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


def insert_one(
    path: str, count: int, payload: str, synchronous: str, tick: Tick | None = None
) -> dict[str, Any]:
    """Insert ``count`` jobs, one transaction each; return the rate and per-txn latency."""
    sql = _queries()["insert_job"]
    conn = connect(path, synchronous)
    lat: list[float] = []
    try:
        start = time.perf_counter()
        for n in range(count):
            t0 = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(sql, job_row(n, _now_ms(), payload))
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
    path: str, batches: int, batch: int, payload: str, synchronous: str, tick: Tick | None = None
) -> dict[str, Any]:
    """Insert ``batches`` x ``batch`` jobs, one transaction per batch; return jobs/s."""
    sql = _queries()["insert_job"]
    conn = connect(path, synchronous)
    lat: list[float] = []
    try:
        start = time.perf_counter()
        n = 0
        for _ in range(batches):
            t0 = time.perf_counter()
            now = _now_ms()
            conn.execute("BEGIN IMMEDIATE")
            for _ in range(batch):
                conn.execute(sql, job_row(n, now, payload))
                n += 1
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


def prefill(path: str, count: int, payload: str, queue: str = "bench") -> None:
    """Insert ``count`` READY jobs in one unsynchronised transaction (set-up, not measured)."""
    sql = _queries()["insert_job"]
    conn = connect(path, "OFF")
    try:
        now = _now_ms()
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(sql, (job_row(n, now, payload, queue) for n in range(count)))
        conn.execute("COMMIT")
    finally:
        conn.close()


_PICK = (
    "SELECT id FROM relay_job WHERE state = 'ready' AND queue = :queue AND priority = 1 "
    "ORDER BY ready_since_ms, id LIMIT 1"
)


def claim_ack(
    path: str, count: int, payload: str, synchronous: str, tick: Tick | None = None
) -> dict[str, Any]:
    """Prefill ``count`` jobs, then claim (one txn) and ack (one txn) each; return jobs/s."""
    prefill(path, count, payload)
    q = _queries()
    conn = connect(path, synchronous)
    claim_lat: list[float] = []
    ack_lat: list[float] = []
    done = 0
    try:
        start = time.perf_counter()
        for _ in range(count):
            t0 = time.perf_counter()
            now = _now_ms()
            token = secrets.token_urlsafe(24)
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute(_PICK, {"queue": "bench"}).fetchone()
            if row is None:
                conn.execute("COMMIT")
                break
            params = {
                "job_id": row[0],
                "token": token,
                "worker_id": "floor",
                "now_ms": now,
                "expires_ms": now + 30_000,
            }
            conn.execute(q["claim_by_id"], params).fetchall()
            conn.execute("COMMIT")
            t1 = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                q["ack"],
                ack_params(row[0], token),
            ).fetchall()
            conn.execute("COMMIT")
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
