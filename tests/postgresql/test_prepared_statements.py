"""On PostgreSQL Relay's statements run prepared although Django opens connections without
prepared statements; the application's queries on the same connection stay as Django left
them; the one-job claim is planned once per connection and its generic plan seeks the
indexes at any backlog; and a transaction costs no health-check round trip
(``queue_core.storage.postgresql.driver``)."""

from __future__ import annotations

import re
import time
from typing import Any
from unittest import mock

import orjson
import psycopg
import pytest
from django.db import connections
from django.test.utils import override_settings

from queue_core.errors import Unavailable
from queue_core.service import QueueService
from queue_core.storage import driver_for
from queue_core.storage.postgresql.driver import PREPARE_WHEN_ASKED, QUERIES
from tests.postgresql.conftest import DATABASES
from tests.postgresql.test_claim_plan import NOW_MS, buffers, fill, nodes

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

# claim_one's SET of the token (claim's reads an array: ``(...::text[])[...]``).
CLAIM_ONE = re.compile(r"lease_token = \$\d+::text,")


def prepared() -> list[dict[str, Any]]:
    """This connection's prepared statements (``pg_prepared_statements``)."""
    with connections["postgresql"].cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
        return [
            {"statement": s, "generic": int(g), "custom": int(c)} for s, g, c in cursor.fetchall()
        ]


def lease_and_ack(svc: QueueService, queue: str, n: int) -> None:
    svc.submit_batch([{"queue": queue, "payload": {"i": i}} for i in range(n)])
    for _ in range(n):
        (lease,) = svc.claim([queue], worker_id="w")
        svc.ack(lease["job_id"], worker_id="w", lease_token=lease["lease_token"])


def test_relay_statements_are_prepared_and_the_applications_are_not() -> None:
    conn = connections["postgresql"]
    conn.close()  # a connection as Django opens it: prepare_threshold None
    svc = QueueService(driver=driver_for("postgresql"))
    with conn.cursor() as cursor:  # the application's own query, on the same connection
        for _ in range(8):
            cursor.execute("SELECT %s::int + 1 AS app_query", [1])
    lease_and_ack(svc, "prep", 8)
    with conn.cursor() as cursor:
        for _ in range(8):
            cursor.execute("SELECT %s::int + 1 AS app_query", [1])
    assert conn.connection.prepare_threshold == PREPARE_WHEN_ASKED
    rows = prepared()
    texts = [r["statement"] for r in rows]
    assert not [t for t in texts if "app_query" in t], texts
    for fragment in ("INSERT INTO relay_attempt", "UPDATE relay_attempt", "pg_try_advisory"):
        assert [t for t in texts if fragment in t], (fragment, texts)
    (claim,) = [r for r in rows if CLAIM_ONE.search(r["statement"])]
    # Planned for each of its first five runs (PostgreSQL's rule), then by its generic plan.
    assert claim["custom"] == 5 and claim["generic"] == 3, claim


def test_without_prepared_statements_nothing_is_prepared() -> None:
    conn = connections["postgresql"]
    conn.close()
    with override_settings(RELAY_PG_PREPARED_STATEMENTS=False):
        lease_and_ack(QueueService(driver=driver_for("postgresql")), "unprep", 6)
        assert conn.connection.prepare_threshold is None
        assert prepared() == []


def explain_generic(queue: str) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) claim_one for ``queue`` by its generic plan (rolled back)."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    sql = re.sub(r"%\((\w+)\)s", number, QUERIES["claim_one"])
    values = {
        "guard": True,
        "queue": queue,
        "now_ms": NOW_MS,
        "expires_ms": NOW_MS + 30_000,
        "worker_id": "plan",
        "token": "t",
    }
    raw = connections["postgresql"].connection
    with psycopg.ClientCursor(raw) as cursor:
        cursor.execute("BEGIN")
        try:
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            cursor.execute(f"PREPARE generic_claim AS {sql}")
            args = ", ".join(["%s"] * len(names))
            cursor.execute(
                f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE generic_claim({args})",
                [values[n] for n in names],
            )
            row = cursor.fetchone()
            assert row is not None
            (plan,) = row
        finally:
            cursor.execute("ROLLBACK")
            cursor.execute("DEALLOCATE ALL")
    doc = plan if isinstance(plan, list) else orjson.loads(plan)
    return dict(doc[0])


def test_the_one_job_claims_generic_plan_seeks_the_indexes_and_stays_flat() -> None:
    connections["postgresql"].ensure_connection()
    fill(1_000, "small")
    fill(100_000, "large")
    explain_generic("small")  # warm the catalogue caches for both runs alike
    plans = {q: explain_generic(q) for q in ("small", "large")}
    for plan in plans.values():
        on_jobs = [n for n in nodes(plan["Plan"]) if n.get("Relation Name") == "relay_job"]
        scans = [n for n in on_jobs if "Scan" in n["Node Type"]]
        assert [n["Node Type"] for n in scans] == ["Index Scan"] * len(scans), scans
        assert {n.get("Index Name") for n in scans} == {"relay_job_ready", "relay_job_pkey"}
    small, large = buffers(plans["small"]), buffers(plans["large"])
    assert large <= 2 * small + 8, (small, large)


def test_a_transaction_runs_no_health_check_and_a_killed_connection_is_replaced() -> None:
    driver = driver_for("postgresql")
    svc = QueueService(driver=driver)
    conn = connections["postgresql"]
    svc.submit("heal", 1)  # connected
    with mock.patch.object(type(conn), "is_usable", autospec=True, return_value=True) as usable:
        lease_and_ack(svc, "heal", 3)
        assert usable.call_count == 0  # no SELECT 1 before each transaction
        # The backend is ended under the idle connection: the next call sees the socket
        # readable before it sends anything and runs on a new connection, with no error.
        pid = conn.connection.info.backend_pid
        with psycopg.connect(**driver.connect_kwargs(), autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", [pid])
            gone = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
            deadline = time.monotonic() + 10
            while other.execute(gone, [pid]).fetchone() != (0,):  # until it has exited
                assert time.monotonic() < deadline, "the backend did not exit"
        assert svc.submit("heal", 2)["job"]["state"] == "ready"
        assert conn.connection.info.backend_pid != pid
        assert usable.call_count == 0


def test_a_prepared_statement_a_schema_change_made_stale_costs_one_retryable_error() -> None:
    driver = driver_for("postgresql")
    svc = QueueService(driver=driver)
    conn = connections["postgresql"]
    conn.close()
    job = svc.submit("stale", 1)["job"]
    for _ in range(3):
        svc.get(job["id"])  # prepared on this connection
    pid = conn.connection.info.backend_pid
    with psycopg.connect(**driver.connect_kwargs(), autocommit=True) as other:  # a migration
        other.execute("ALTER TABLE relay_job ALTER COLUMN attempt TYPE bigint")
    try:
        with pytest.raises(Unavailable) as raised:  # retryable, never INTERNAL
            svc.get(job["id"])
        assert raised.value.retryable
        assert svc.get(job["id"])["id"] == job["id"]  # a new connection
        assert conn.connection.info.backend_pid != pid
    finally:
        conn.close()
        with psycopg.connect(**driver.connect_kwargs(), autocommit=True) as other:
            other.execute("ALTER TABLE relay_job ALTER COLUMN attempt TYPE integer")
