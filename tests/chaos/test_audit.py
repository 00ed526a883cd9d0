"""``tests.audit.audit`` passes on every state the service can reach and catches each broken
invariant: one impossible row at a time is written behind the service's back (with the schema's
CHECK constraints switched off for that connection) and the audit must name it."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
from django.db import connection

from queue_core.clock import FakeClock
from queue_core.service import QueueService
from tests.audit import CHECKS, AuditFailure, audit, counts, find_violations

pytestmark = pytest.mark.django_db(transaction=True)


def lease(service: QueueService, worker: str = "w", lease_ms: int = 10_000) -> dict[str, str]:
    (got,) = service.claim(["q"], worker_id=worker, lease_ms=lease_ms)
    return {"job_id": got["job_id"], "worker_id": worker, "lease_token": got["lease_token"]}


@pytest.fixture
def db(service: QueueService, clock: FakeClock) -> Path:
    """A database holding a job in every state the service can reach, and every history."""
    submit = service.submit
    submit("q", {"n": "succeeded"}, idempotency_key="k1")
    service.ack(**lease(service))
    submit("q", {"n": "retrying"}, max_retries=3, backoff="fixed", backoff_base_ms=60_000)
    service.fail(**lease(service), error="boom")
    submit("q", {"n": "dead"})
    service.fail(**lease(service), error="bad", retryable=False)
    submit("q", {"n": "expired, leased again"}, max_retries=3)
    lease(service, "w1", lease_ms=1_000)
    clock.advance(ms=1_000)
    lease(service, "w2")
    submit("q", {"n": "replayed"}, max_retries=0)
    service.fail(**lease(service), error="once")
    dead = service.dead_list("q")["jobs"][-1]["id"]
    service.replay(dead, actor="ops")
    submit("q", {"n": "recovered"})
    lease(service, "w3")
    submit("q", {"n": "purged"})
    purged = lease(service)
    service.ack(**purged)
    service.purge(purged["job_id"])
    submit("q", {"n": "released"})
    service.release(**lease(service))
    submit("q", {"n": "pending"}, delay_ms=3_600_000)
    submit("q", {"n": "ready"})
    return Path(connection.settings_dict["NAME"])


def test_every_reachable_state_passes(db: Path, service: QueueService) -> None:
    audit(db)
    audit(connection)  # the same checks through an open connection
    service.recover()
    audit(db)
    states = counts(db)
    assert all(states[s] for s in ("pending", "ready", "retrying", "succeeded", "dead")), states


BREAKS = {
    "lease fields set iff leased": (
        "UPDATE relay_job SET lease_expires_at_ms = NULL WHERE state = 'leased'"
    ),
    "due time set iff pending or retrying": (
        "UPDATE relay_job SET available_at_ms = NULL WHERE state = 'pending'"
    ),
    "ready job has ready_since_ms": (
        "UPDATE relay_job SET ready_since_ms = NULL WHERE state = 'ready'"
    ),
    "finished_at_ms set iff terminal": (
        "UPDATE relay_job SET finished_at_ms = NULL WHERE state = 'succeeded'"
    ),
    "dead_reason set iff dead": "UPDATE relay_job SET dead_reason = NULL WHERE state = 'dead'",
    "failures within 0..max_retries+1 and <= attempt": (
        "UPDATE relay_job SET failures = max_retries + 2, attempt = max_retries + 2"
        " WHERE state = 'dead'"
    ),
    "retrying job has a failure": "UPDATE relay_job SET failures = 0 WHERE state = 'retrying'",
    "attempts numbered 1..attempt without gaps": (
        "UPDATE relay_job SET attempt = attempt + 1 WHERE state = 'succeeded'"
    ),
    "attempt rows belong to a job": (
        "INSERT INTO relay_attempt (job_id, attempt, worker_id, lease_token, started_at_ms)"
        " VALUES ('job_gone', 1, 'w', 'orphan-token', 0)"
    ),
    "at most one open attempt per job": (
        "UPDATE relay_attempt SET ended_at_ms = NULL, outcome = NULL"
        " WHERE attempt = 1 AND job_id IN (SELECT id FROM relay_job"
        "  WHERE state = 'leased' AND attempt = 2)"
    ),
    "leased job has one open attempt matching its lease": (
        "UPDATE relay_attempt SET lease_token = 'not-the-lease' WHERE ended_at_ms IS NULL"
    ),
    "job that is not leased has no open attempt": (
        "UPDATE relay_attempt SET ended_at_ms = NULL, outcome = NULL"
        " WHERE job_id IN (SELECT id FROM relay_job WHERE state = 'dead')"
    ),
    "attempt closed consistently with a known outcome": (
        "UPDATE relay_attempt SET outcome = 'vanished' WHERE outcome = 'released'"
    ),
    "consecutive attempts do not overlap": (
        "UPDATE relay_attempt SET started_at_ms = started_at_ms - 500 WHERE attempt = 2"
    ),
    "lease tokens are never reused": (
        "UPDATE relay_attempt SET lease_token = (SELECT lease_token FROM relay_attempt"
        " WHERE attempt = 1 ORDER BY id LIMIT 1) WHERE outcome = 'released'"
    ),
    "succeeded job has exactly one succeeded attempt, its last": (
        "UPDATE relay_attempt SET outcome = 'succeeded' WHERE outcome = 'released'"
    ),
    "dead job's last attempt failed or expired": (
        "UPDATE relay_attempt SET outcome = 'released'"
        " WHERE job_id IN (SELECT id FROM relay_job WHERE state = 'dead')"
    ),
    "failures match failed and expired attempts (jobs never replayed)": (
        "UPDATE relay_job SET failures = 2 WHERE state = 'retrying'"
    ),
    "idempotency key and its expiry set together": (
        "UPDATE relay_job SET idempotency_expires_at_ms = NULL WHERE idempotency_key IS NOT NULL"
    ),
}


def test_every_check_has_a_breaking_case() -> None:
    assert set(BREAKS) == set(CHECKS)


@pytest.mark.parametrize(("invariant", "sql"), list(BREAKS.items()), ids=list(BREAKS))
def test_audit_names_each_broken_invariant(db: Path, invariant: str, sql: str) -> None:
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("PRAGMA ignore_check_constraints = ON")
        conn.execute("PRAGMA foreign_keys = OFF")
        assert conn.execute(sql).rowcount >= 1, "the break changed nothing"
    with pytest.raises(AuditFailure) as failure:
        audit(db)
    assert invariant in failure.value.violations
    assert invariant in str(failure.value)


def test_quick_check_findings_are_violations(db: Path, tmp_path: Path) -> None:
    copy = tmp_path / "damaged.db"
    with (
        contextlib.closing(sqlite3.connect(db)) as src,
        contextlib.closing(sqlite3.connect(copy)) as dst,
    ):
        src.backup(dst)
        (page,) = dst.execute(
            "SELECT pageno FROM dbstat WHERE name = 'relay_job_queue_state' LIMIT 1"
        ).fetchone()
    with copy.open("r+b") as f:  # garbage over an index page
        f.seek((page - 1) * 4096)
        f.write(b"\xa5" * 4096)
    assert "PRAGMA quick_check is ok" in find_violations(copy)
