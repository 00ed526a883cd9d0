"""Database invariants of a Relay database, checked from the outside (plain ``sqlite3``, or any
DB-API connection: the checks are portable SQL, so a PostgreSQL database is audited too).

``audit(db)`` reads one consistent snapshot (a read transaction: under WAL it sees exactly the
commits made before it began, even while a server keeps writing) and raises ``AuditFailure``
listing every violated invariant. It needs no Django (``counts(db)`` gives jobs by state), so
the chaos script and the crash tests call it between a SIGKILL and the restart, after each
restart, and at the end.

The invariants (each a query that returns the offending rows):

* lease fields (token, holder, expiry) are set iff the job is LEASED; a due time iff PENDING or
  RETRYING; READY jobs have a ``ready_since_ms``; terminal jobs, and only they, have
  ``finished_at_ms``; DEAD jobs, and only they, have a ``dead_reason``;
* ``0 <= failures <= max_retries + 1`` and ``failures <= attempt``; RETRYING implies a failure;
* attempts of a job are numbered 1..``attempt`` with no gap; at most one attempt per job is
  open, and a job has one exactly when it is LEASED, matching the job's attempt, token, holder
  and lease start;
* an attempt is closed with a known outcome, never before it started, and the next attempt of
  the job never starts before the previous one ended (leases never overlap in time);
* lease tokens are never reused; a SUCCEEDED job has exactly one succeeded attempt, its last;
  no other job has any; a DEAD job's last attempt failed or expired;
* without a replay in its events, a job's ``failures`` equals its failed and expired attempts;
* idempotency key and its expiry are set together; ``PRAGMA quick_check`` is ``ok``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

TERMINAL = ("succeeded", "dead", "cancelled")
OUTCOMES = (
    "succeeded",
    "failed",
    "lease_expired",
    "released",
    "recovered",
    "cancelled",
    "timeout",
)

# name -> query returning one row per violation (first column: the job id or a description).
CHECKS: dict[str, str] = {
    "lease fields set iff leased": """
        SELECT id, state, lease_token IS NOT NULL, leased_by, lease_expires_at_ms
          FROM relay_job
         WHERE (state = 'leased' AND (lease_token IS NULL OR leased_by IS NULL
                                      OR lease_expires_at_ms IS NULL OR leased_at_ms IS NULL))
            OR (state != 'leased' AND (lease_token IS NOT NULL OR leased_by IS NOT NULL
                                       OR lease_expires_at_ms IS NOT NULL))""",
    "due time set iff pending or retrying": """
        SELECT id, state, available_at_ms FROM relay_job
         WHERE (state IN ('pending', 'retrying')) != (available_at_ms IS NOT NULL)""",
    "ready job has ready_since_ms": """
        SELECT id FROM relay_job WHERE state = 'ready' AND ready_since_ms IS NULL""",
    "finished_at_ms set iff terminal": """
        SELECT id, state, finished_at_ms FROM relay_job
         WHERE (state IN ('succeeded', 'dead', 'cancelled')) != (finished_at_ms IS NOT NULL)""",
    "dead_reason set iff dead": """
        SELECT id, state, dead_reason FROM relay_job
         WHERE (state = 'dead') != (dead_reason IS NOT NULL)""",
    "failures within 0..max_retries+1 and <= attempt": """
        SELECT id, failures, max_retries, attempt FROM relay_job
         WHERE failures < 0 OR failures > max_retries + 1 OR failures > attempt
            OR attempt < 0""",
    "retrying job has a failure": """
        SELECT id, failures FROM relay_job WHERE state = 'retrying' AND failures < 1""",
    "attempts numbered 1..attempt without gaps": """
        SELECT j.id, j.attempt, COUNT(a.id), MIN(a.attempt), MAX(a.attempt)
          FROM relay_job j LEFT JOIN relay_attempt a ON a.job_id = j.id
         GROUP BY j.id
        HAVING COUNT(a.id) != j.attempt
            OR (j.attempt > 0 AND (MIN(a.attempt) != 1 OR MAX(a.attempt) != j.attempt))""",
    "attempt rows belong to a job": """
        SELECT a.job_id, a.attempt FROM relay_attempt a
         WHERE NOT EXISTS (SELECT 1 FROM relay_job j WHERE j.id = a.job_id)""",
    "at most one open attempt per job": """
        SELECT job_id, COUNT(*) FROM relay_attempt WHERE ended_at_ms IS NULL
         GROUP BY job_id HAVING COUNT(*) > 1""",
    "leased job has one open attempt matching its lease": """
        SELECT j.id, j.attempt, a.attempt, a.worker_id, j.leased_by
          FROM relay_job j
          LEFT JOIN relay_attempt a ON a.job_id = j.id AND a.ended_at_ms IS NULL
         WHERE j.state = 'leased'
           AND (a.id IS NULL OR a.attempt != j.attempt OR a.lease_token != j.lease_token
                OR a.worker_id != j.leased_by OR a.started_at_ms != j.leased_at_ms)""",
    "job that is not leased has no open attempt": """
        SELECT j.id, j.state, a.attempt FROM relay_job j
          JOIN relay_attempt a ON a.job_id = j.id AND a.ended_at_ms IS NULL
         WHERE j.state != 'leased'""",
    "attempt closed consistently with a known outcome": f"""
        SELECT job_id, attempt, outcome, started_at_ms, ended_at_ms FROM relay_attempt
         WHERE (ended_at_ms IS NULL) != (outcome IS NULL)
            OR (outcome IS NOT NULL AND outcome NOT IN {OUTCOMES!r})
            OR ended_at_ms < started_at_ms""",
    "consecutive attempts do not overlap": """
        SELECT a.job_id, a.attempt, a.ended_at_ms, b.started_at_ms
          FROM relay_attempt a
          JOIN relay_attempt b ON b.job_id = a.job_id AND b.attempt = a.attempt + 1
         WHERE a.ended_at_ms IS NULL OR b.started_at_ms < a.ended_at_ms""",
    "lease tokens are never reused": """
        SELECT lease_token, COUNT(*) FROM relay_attempt
         GROUP BY lease_token HAVING COUNT(*) > 1""",
    "succeeded job has exactly one succeeded attempt, its last": """
        SELECT id, state, attempt, n, last FROM (
            SELECT j.id, j.state, j.attempt,
                   (SELECT COUNT(*) FROM relay_attempt a
                     WHERE a.job_id = j.id AND a.outcome = 'succeeded') AS n,
                   (SELECT a.outcome FROM relay_attempt a
                     WHERE a.job_id = j.id AND a.attempt = j.attempt) AS last
              FROM relay_job j) AS s
         WHERE (state = 'succeeded' AND (n != 1 OR last IS DISTINCT FROM 'succeeded'))
            OR (state != 'succeeded' AND n != 0)""",
    "dead job's last attempt failed or expired": """
        SELECT j.id, a.outcome FROM relay_job j
          LEFT JOIN relay_attempt a ON a.job_id = j.id AND a.attempt = j.attempt
         WHERE j.state = 'dead' AND (a.outcome IS NULL
                                     OR a.outcome NOT IN ('failed', 'lease_expired', 'timeout'))""",
    "failures match failed and expired attempts (jobs never replayed)": """
        SELECT id, failures, counted FROM (
            SELECT j.id, j.failures,
                   (SELECT COUNT(*) FROM relay_attempt a WHERE a.job_id = j.id
                       AND a.outcome IN ('failed', 'lease_expired', 'timeout')) AS counted
              FROM relay_job j
             WHERE NOT EXISTS (SELECT 1 FROM relay_event e
                                WHERE e.job_id = j.id AND e.event = 'replayed')) AS s
         WHERE failures != counted""",
    "idempotency key and its expiry set together": """
        SELECT id FROM relay_job
         WHERE (idempotency_key IS NULL) != (idempotency_expires_at_ms IS NULL)""",
}


class AuditFailure(AssertionError):
    """The database breaks at least one invariant; the message lists each with examples."""

    def __init__(self, db: str, violations: dict[str, list[tuple[object, ...]]]) -> None:
        self.violations = violations
        lines = [f"{db}: {len(violations)} invariant(s) violated"]
        for name, rows in violations.items():
            lines.append(f"- {name}: {len(rows)} row(s), e.g. {rows[:3]}")
        super().__init__("\n".join(lines))


@contextlib.contextmanager
def _snapshot(db: str | os.PathLike[str]) -> Iterator[sqlite3.Connection]:
    path = os.fspath(db)
    if not os.path.exists(path):
        raise FileNotFoundError(path)  # sqlite3.connect would create an empty database
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("BEGIN")  # one read snapshot for every check
        yield conn
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("COMMIT")
        conn.close()


Db = str | os.PathLike[str] | Any
"""A database file path, or an open DB-API connection (``django.db.connection`` works)."""


def _violations(
    rows: Callable[[str], list[tuple[object, ...]]], quick_check: bool
) -> dict[str, list[tuple[object, ...]]]:
    found: dict[str, list[tuple[object, ...]]] = {}
    if quick_check:
        try:
            check = [str(r[0]) for r in rows("PRAGMA quick_check")]
        except Exception as exc:  # "database disk image is malformed" and the like
            check = [f"{type(exc).__name__}: {exc}"]
        if check != ["ok"]:
            found["PRAGMA quick_check is ok"] = [tuple(check[:10])]
    for name, sql in CHECKS.items():
        try:
            bad = rows(sql)
        except Exception as exc:  # a damaged file can fail the query itself
            bad = [("query failed", f"{type(exc).__name__}: {exc}")]
        if bad:
            found[name] = [tuple(r) for r in bad]
    return found


def find_violations(db: Db, *, quick_check: bool = True) -> dict[str, list[tuple[object, ...]]]:
    """Return ``{invariant: offending rows}`` for every invariant ``db`` breaks (``{}``: none).

    Args:
        db: a file path (read in one snapshot on a connection of its own), or an open DB-API
            connection (read on it as it stands, for a caller that is the only writer).
        quick_check: also run ``PRAGMA quick_check``.
    """
    if isinstance(db, str | os.PathLike):
        with _snapshot(db) as conn:
            return _violations(lambda sql: conn.execute(sql).fetchall(), quick_check)

    def rows(sql: str) -> list[tuple[object, ...]]:
        with db.cursor() as cursor:
            cursor.execute(sql)
            return list(cursor.fetchall())

    return _violations(rows, quick_check)


def counts(db: str | os.PathLike[str]) -> dict[str, int]:
    """Return the number of jobs in each state (every state present, 0 when none)."""
    states = ("pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled")
    with _snapshot(db) as conn:
        rows = dict(conn.execute("SELECT state, COUNT(*) FROM relay_job GROUP BY state"))
    return {state: int(rows.get(state, 0)) for state in states}


def audit(db: Db, *, quick_check: bool = True) -> None:
    """Check every invariant of ``db`` (in one snapshot when given a path).

    Args:
        db: path of a Relay SQLite database (a server may be running on it), or an open DB-API
            connection such as ``django.db.connection``.
        quick_check: also run ``PRAGMA quick_check``.
    Raises:
        AuditFailure: an invariant is broken (the message names each with example rows).
        FileNotFoundError: the path does not exist.
    """
    violations = find_violations(db, quick_check=quick_check)
    if violations:
        name = os.fspath(db) if isinstance(db, str | os.PathLike) else repr(db)
        raise AuditFailure(name, violations)
