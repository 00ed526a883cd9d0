"""PostgreSQL plans stay indexed: the claim seeks ``relay_job_ready`` once per (queue, class)
and never scans the table, and the pages it touches do not grow from 1,000 to 100,000 ready
jobs (flat cost; ``relay bench --database-url`` measures 1,000,000); the metrics gauges' counts
read the live states' partial indexes, never the finished jobs."""

from __future__ import annotations

from typing import Any
from unittest import mock

import orjson
import psycopg
import pytest
from django.db import connections

from queue_core.service import QueueService
from queue_core.storage import driver_for
from queue_core.storage.postgresql.driver import QUERIES
from tests.postgresql.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

NOW_MS = 1_767_225_600_000


def fill(n: int, queue: str) -> None:
    """Insert ``n`` READY jobs of ``queue`` spread over the four classes, then ANALYZE."""
    with connections["postgresql"].cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO relay_job (id, queue, state, priority, payload, attempt, failures,
                                   max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter,
                                   created_at_ms, ready_since_ms, updated_at_ms)
            SELECT 'job_' || %(queue)s || lpad(g::text, 10, '0'), %(queue)s, 'ready', g %% 4,
                   '{}', 0, 0, 3, 'exponential', 1000, 300000, true,
                   %(now)s - g, %(now)s - g, %(now)s - g
              FROM generate_series(1, %(n)s) AS g
            """,
            {"queue": queue, "n": n, "now": NOW_MS},
        )
        cursor.execute("ANALYZE relay_job")


def explain(queue: str, *, analyze: bool, limit: int = 1, cap: int | None = None) -> dict[str, Any]:
    """EXPLAIN the real claim statement for ``limit`` jobs of ``queue`` (rolled back), that
    queue giving at most ``cap`` (its room under a cap or its tokens; default ``limit``)."""
    params = {
        "guard": cap is None,
        "queues": [queue],
        "limits": [cap or limit],
        "limit": limit,
        "now_ms": NOW_MS,
        "expires_ms": NOW_MS + 30_000,
        "worker_id": "plan",
        "tokens": [f"t{i}" for i in range(limit)],
        "room": 1 << 20,
    }
    options = "ANALYZE, BUFFERS, FORMAT JSON" if analyze else "FORMAT JSON"
    conn = connections["postgresql"]
    with conn.cursor() as cursor:
        cursor.execute("BEGIN")
        try:
            cursor.execute(f"EXPLAIN ({options}) {QUERIES['claim']}", params)
            (plan,) = cursor.fetchone()
        finally:
            cursor.execute("ROLLBACK")
    doc = plan if isinstance(plan, list) else orjson.loads(plan)
    return dict(doc[0])


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = [plan]
    for child in plan.get("Plans", []):
        out.extend(nodes(child))
    return out


def buffers(plan: dict[str, Any]) -> int:
    top = plan["Plan"]
    return int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))


def test_the_claim_seeks_the_ready_index_and_never_scans_the_table() -> None:
    fill(20_000, "plan")
    scans = [n for n in nodes(explain("plan", analyze=False)["Plan"]) if "Relation Name" in n]
    on_jobs = [n for n in scans if n["Relation Name"] == "relay_job"]
    assert on_jobs, scans
    assert not [n for n in on_jobs if n["Node Type"] == "Seq Scan"], on_jobs
    # The heads come from the partial READY index; the UPDATE finds each row by primary key.
    heads = [n for n in on_jobs if n["Node Type"] in ("Index Scan", "Index Only Scan")]
    assert {n["Index Name"] for n in heads} <= {"relay_job_ready", "relay_job_pkey"}
    assert "relay_job_ready" in {n["Index Name"] for n in heads}


def test_the_claim_touches_as_many_pages_at_100k_ready_as_at_1k() -> None:
    fill(1_000, "small")
    fill(100_000, "large")
    explain("small", analyze=True)  # warm the catalogue caches for both runs alike
    small = buffers(explain("small", analyze=True))
    large = buffers(explain("large", analyze=True))
    assert large <= 2 * small + 8, (small, large)


def explain_named(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) one named statement in a transaction rolled back."""
    conn = connections["postgresql"]
    with conn.cursor() as cursor:
        cursor.execute("BEGIN")
        try:
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {QUERIES[name]}", params)
            (plan,) = cursor.fetchone()
        finally:
            cursor.execute("ROLLBACK")
    doc = plan if isinstance(plan, list) else orjson.loads(plan)
    return dict(doc[0])


def lease_some(queue: str, n: int) -> None:
    """Lease ``n`` of ``queue``'s jobs by hand (what a cap counts), then ANALYZE."""
    with connections["postgresql"].cursor() as cursor:
        cursor.execute(
            """
            UPDATE relay_job SET state = 'leased', attempt = 1, lease_token = id,
                   leased_by = 'w', leased_at_ms = %(now)s, lease_expires_at_ms = %(exp)s
             WHERE id IN (SELECT id FROM relay_job WHERE queue = %(queue)s AND state = 'ready'
                          ORDER BY id LIMIT %(n)s)
            """,
            {"queue": queue, "n": n, "now": NOW_MS, "exp": NOW_MS + 60_000},
        )
        cursor.execute("ANALYZE relay_job")


def test_with_a_cap_and_a_pause_in_force_the_claim_stays_indexed_and_flat() -> None:
    # Two capped queues with 3 jobs leased each, one with 1,000 ready jobs and one with
    # 100,000, and a paused queue: the service reads the controls (relay_queue), counts each
    # capped queue's leases, then claims with that queue's room as its limit.
    fill(1_000, "small")
    fill(100_000, "large")
    lease_some("small", 3)
    lease_some("large", 3)
    svc = QueueService(driver=driver_for("postgresql"))
    svc.set_queue_limits("small", max_leased=5, rate_per_s=100, burst=10)
    svc.set_queue_limits("large", max_leased=5, rate_per_s=100, burst=10)
    svc.pause("paused")
    pages = {}
    for queue in ("small", "large"):
        controls = explain_named(
            "queue_controls_for_claim", {"queues": orjson.dumps([queue, "paused"]).decode()}
        )
        leased = explain_named("queue_leased", {"queue": queue})
        claim = explain(queue, analyze=True, limit=10, cap=2)
        for plan in (controls, leased, claim):
            scans = [n for n in nodes(plan["Plan"]) if n.get("Relation Name") == "relay_job"]
            assert not [n for n in scans if n["Node Type"] == "Seq Scan"], scans
        # The lease count reads leased jobs only: those of the queue on relay_job_queue_state,
        # or every leased job on the partial relay_job_leased (the planner picks either).
        names = {n.get("Index Name") for n in nodes(leased["Plan"])}
        assert names & {"relay_job_queue_state", "relay_job_leased"}, names
        pages[queue] = buffers(controls) + buffers(leased) + buffers(claim)
    explain("small", analyze=True, limit=10, cap=2)  # warm caches alike
    assert pages["large"] <= 2 * pages["small"] + 8, pages


def counts_plan(*, seqscan: bool) -> dict[str, Any]:
    """EXPLAIN ``counts_live`` as the planner sees it, with sequential scans allowed or not."""
    with connections["postgresql"].cursor() as cursor:
        if not seqscan:
            cursor.execute("SET enable_seqscan = off")
        try:
            cursor.execute(f"EXPLAIN (FORMAT JSON) {QUERIES['counts_live']}")
            (plan,) = cursor.fetchone()
        finally:
            cursor.execute("RESET enable_seqscan")
    doc = plan if isinstance(plan, list) else orjson.loads(plan)
    return dict(doc[0])


def test_the_gauges_count_live_jobs_without_reading_finished_ones() -> None:
    # 200,000 jobs that went through READY and finished, beside 50 live ones, vacuumed as
    # autovacuum would: relay_job_ready keeps the pages of its largest backlog.
    fill(200_000, "done")
    with connections["postgresql"].cursor() as cursor:
        cursor.execute(
            "UPDATE relay_job SET state = 'succeeded', finished_at_ms = ready_since_ms, "
            "ready_since_ms = NULL WHERE queue = 'done'"
        )
    fill(50, "live")
    with connections["postgresql"].cursor() as cursor:
        cursor.execute("VACUUM ANALYZE relay_job")
    # Left to itself the planner scans the whole table for the READY count ...
    alone = [n for n in nodes(counts_plan(seqscan=True)["Plan"]) if n.get("Relation Name")]
    assert "Seq Scan" in {n["Node Type"] for n in alone}
    # ... so the driver runs this statement with sequential scans off: four partial indexes.
    scans = [n for n in nodes(counts_plan(seqscan=False)["Plan"]) if n.get("Relation Name")]
    assert {(n["Node Type"], n.get("Index Name")) for n in scans} <= {
        ("Index Scan", "relay_job_ready"),
        ("Index Scan", "relay_job_scheduled"),
        ("Index Scan", "relay_job_leased"),
        ("Index Scan", "relay_job_dead"),
        # Retention's index of DEAD jobs (migration 0009): partial on state = 'dead' too.
        ("Index Scan", "relay_job_dead_done"),
        # CANCELLED jobs: retention's index of them (migration 0011), partial on their state.
        ("Index Scan", "relay_job_cancelled_done"),
        ("Bitmap Index Scan", "relay_job_cancelled_done"),
        ("Index Only Scan", "relay_job_ready"),
        ("Bitmap Index Scan", "relay_job_ready"),
    }, scans
    sent: list[str] = []
    real = psycopg.Cursor.execute

    def spy(cursor: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(str(query).strip().splitlines()[0])
        return real(cursor, query, *args, **kwargs)

    with mock.patch.object(psycopg.Cursor, "execute", spy):
        rows = QueueService(driver=driver_for("postgresql")).stats(finished=False)
    assert rows["totals"]["ready"] == 50 and "succeeded" not in rows["totals"]
    at = sent.index("SET enable_seqscan = off")
    assert sent[at + 1] == QUERIES["counts_live"].strip().splitlines()[0]
    assert sent[at + 2] == "RESET enable_seqscan"


def test_ack_many_looks_each_entry_up_by_primary_key_whatever_the_statistics() -> None:
    # Statistics taken while every lease's expiry lay in the past (short leases make that the
    # normal state), then 20,000 live leases: the batch's acks must not hash every live lease
    # through relay_job_leased (27-47 ms a batch, found in review), but seek each entry.
    with connections["postgresql"].cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO relay_job (id, queue, state, priority, payload, attempt, failures,
                                   max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter,
                                   created_at_ms, updated_at_ms, leased_at_ms, lease_token,
                                   leased_by, lease_expires_at_ms)
            SELECT 'job_l' || lpad(g::text, 10, '0'), 'l', 'leased', 1, '{}', 1, 0, 3,
                   'exponential', 1000, 300000, true, %(now)s - 60000, %(now)s - 60000,
                   %(now)s - 60000, 't' || g, 'w', %(now)s - 30000
              FROM generate_series(1, 20000) AS g
            """,
            {"now": NOW_MS},
        )
        cursor.execute("ANALYZE relay_job")
        cursor.execute("UPDATE relay_job SET lease_expires_at_ms = %s", [NOW_MS + 30_000])
    acks = [{"job_id": f"job_l{n:010d}", "lease_token": f"t{n}", "worker_id": "w"} for n in (5, 9)]
    params = {"acks": orjson.dumps(acks).decode(), "now_ms": NOW_MS, "judge_ms": NOW_MS}
    conn = connections["postgresql"]
    with conn.cursor() as cursor:
        cursor.execute("BEGIN")
        try:
            cursor.execute(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {QUERIES['ack_many']}", {**params, "mark_ms": 0}
            )
            (plan,) = cursor.fetchone()
        finally:
            cursor.execute("ROLLBACK")
    doc = plan if isinstance(plan, list) else orjson.loads(plan)
    scans = [n for n in nodes(doc[0]["Plan"]) if n["Node Type"].endswith("Scan")]
    assert {n.get("Index Name") for n in scans if "Index Name" in n} == {"relay_job_pkey"}, scans
    assert all(n["Actual Rows"] <= len(acks) for n in scans)  # no node read the live leases
