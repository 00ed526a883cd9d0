"""Smoke test of ``relay bench --database-url``: its code paths at tiny sizes on the real
PostgreSQL server, never its timings (docs/benchmarking.md has those)."""

from __future__ import annotations

import io

import orjson
import psycopg
import pytest
from django.core.management import call_command

from tests.integration.test_bench_smoke import check_backlog_only
from tests.postgresql.conftest import DATABASES
from tests.storage.conftest import database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]


def test_bench_on_postgresql_runs_end_to_end_and_drops_its_database() -> None:
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    out = io.StringIO()
    call_command(
        "relay_bench",
        "--database-url",
        url,
        "--quick",
        "--json",
        "--scale",
        "0.02",
        "--producers",
        "1,2",
        "--workers",
        "1,2",
        "--no-progress",
        stdout=out,
        stderr=io.StringIO(),
    )
    doc = orjson.loads(out.getvalue())
    assert doc["meta"]["database"] == "postgresql"
    assert set(doc) >= {"floor", "submit", "lease_ack", "two_servers", "backlog", "targets"}
    assert doc["floor"]["claim_ack"]["jobs"] > 0 and doc["two_servers"]["jobs"] > 0
    assert [row["concurrency"] for row in doc["lease_ack"]] == [1, 2]
    assert len(doc["backlog"]["sizes"]) == 2 and doc["submit_to_start_across"]["samples"] > 0
    assert {t["name"] for t in doc["targets"]} >= {
        "lease+ack, 16 workers vs PostgreSQL claim+ack floor",
        "submit-to-start p99 across servers, idle (ms)",
    }
    with psycopg.connect(url) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname LIKE 'relay\\_bench\\_%%'"
        ).fetchone()
    assert left == (0,)


def test_backlog_only_on_postgresql_measures_both_variants_and_drops_its_database() -> None:
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    out = io.StringIO()
    call_command(
        "relay_bench",
        "--database-url",
        url,
        "--backlog-only",
        "--quick",
        "--json",
        "--scale",
        "0.005",
        "--no-progress",
        stdout=out,
        stderr=io.StringIO(),
    )
    doc = orjson.loads(out.getvalue())
    assert doc["meta"]["database"] == "postgresql"
    assert "submit" not in doc and "lease_ack" not in doc  # only the backlog ran
    check_backlog_only(doc, [100, 500])
    with psycopg.connect(url) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname LIKE 'relay\\_bench\\_%%'"
        ).fetchone()
    assert left == (0,)
