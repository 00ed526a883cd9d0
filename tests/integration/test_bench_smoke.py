"""Smoke tests of ``relay_bench``: its own code paths at tiny sizes, never its timings.

Speed is what the benchmark measures (docs/benchmarking.md); these tests only prove the tool
runs end to end (a real ``relay_server``, load children, the floor, the worker process) and
that its JSON has the keys the docs and the plot read.
"""

from __future__ import annotations

import contextlib
import io
import sqlite3
from pathlib import Path

import orjson
import pytest
from django.core.management import call_command

from relay_bench import floor, procs, stats
from relay_bench.runner import FULL, targets

TOP_KEYS = {
    "meta",
    "floor",
    "submit",
    "lease_ack",
    "submit_to_start",
    "worker",
    "server",
    "http",
    "backlog",
    "targets",
}


@pytest.mark.slow
def test_bench_command_runs_end_to_end_and_reports_json(tmp_path: Path) -> None:
    out = io.StringIO()
    plot = tmp_path / "bench.png"
    call_command(
        "relay_bench",
        "--quick",
        "--json",
        "--scale",
        "0.01",
        "--producers",
        "1,2",
        "--workers",
        "1,2",
        "--no-backlog",
        "--no-http",
        "--no-progress",
        "--json-out",
        str(tmp_path / "bench.json"),
        "--plot",
        str(plot),
        stdout=out,
        stderr=io.StringIO(),
    )
    doc = orjson.loads(out.getvalue())
    assert set(doc) >= TOP_KEYS
    assert doc == orjson.loads((tmp_path / "bench.json").read_bytes())
    assert {"insert_one", "insert_batch100", "claim_ack"} <= set(doc["floor"])
    assert doc["meta"]["machine"]["cores"] >= 1
    assert doc["meta"]["synchronous"] == "FULL"
    assert {(r["mode"], r["concurrency"]) for r in doc["submit"]} == {
        ("single", 1),
        ("single", 2),
        ("batch100", 1),
        ("batch100", 2),
    }
    for row in doc["submit"] + doc["lease_ack"]:
        assert row["errors"] == 0, row["error_sample"]
        assert row["ops"] > 0
        assert row["ratio_to_floor"] is not None
        assert {"p50", "p95", "p99", "max"} <= set(next(iter(row["latency_ms"].values())))
    assert [r["concurrency"] for r in doc["lease_ack"]] == [1, 2]
    assert doc["submit_to_start"]["samples"] > 0
    assert doc["worker"]["jobs"] > 0
    assert doc["server"]["peak_rss_mb"] > 0
    assert doc["backlog"]["status"].startswith("skipped")
    assert doc["http"]["status"].startswith("skipped")
    assert [t["name"] for t in doc["targets"]] == [t["name"] for t in targets(doc)]
    # The plot is drawn when matplotlib is installed (the dev lock pins it).
    assert plot.exists() or "matplotlib" in doc["meta"]["plot"]


def test_backlog_fill_writes_ready_jobs_over_classes(tmp_path: Path) -> None:
    template = procs.template_db(tmp_path)
    db = procs.fresh_db(template, tmp_path, "backlog")
    procs.fill_backlog(db, 250)
    assert procs.count_state(db, "ready") == 250
    with contextlib.closing(sqlite3.connect(db)) as conn:
        classes = dict(conn.execute("SELECT priority, COUNT(*) FROM relay_job GROUP BY priority"))
        ages = conn.execute("SELECT COUNT(DISTINCT ready_since_ms) FROM relay_job").fetchone()[0]
    assert classes == {0: 63, 1: 63, 2: 62, 3: 62}
    assert ages > 200
    # The floor's statements run on the same schema.
    path = str(procs.fresh_db(template, tmp_path, "floor"))
    one = floor.insert_one(path, 5, '{"n":1}', "FULL")
    batch = floor.insert_batches(path, 2, 100, '{"n":1}', "FULL")
    claim = floor.claim_ack(str(procs.fresh_db(template, tmp_path, "claim")), 5, "{}", "FULL")
    assert (one["jobs"], batch["jobs"], claim["jobs"]) == (5, 200, 5)


@pytest.mark.slow
def test_prune_scenario_runs_end_to_end(tmp_path: Path) -> None:
    out = io.StringIO()
    call_command(
        "relay_bench", "--prune-jobs", "1200", "--no-progress", stdout=out, stderr=io.StringIO()
    )
    prune = orjson.loads(out.getvalue())["prune"]
    assert prune["finished_jobs"] == prune["pruned"] == 1200
    assert prune["lease_latency_ms_after"]["n"] == 2000
    assert {"prune_s", "pruned_per_s", "lease_latency_ms_while_pruning"} <= set(prune)


def test_finished_fill_writes_succeeded_jobs_with_attempts(tmp_path: Path) -> None:
    db = procs.fresh_db(procs.template_db(tmp_path), tmp_path, "finished")
    procs.fill_finished(db, 250, finished_at_ms=1_000_000_000)
    assert procs.count_state(db, "succeeded", queue="bench-done") == 250
    with contextlib.closing(sqlite3.connect(db)) as conn:
        attempts = conn.execute("SELECT COUNT(DISTINCT job_id) FROM relay_attempt").fetchone()[0]
        span = conn.execute("SELECT MIN(finished_at_ms), MAX(finished_at_ms) FROM relay_job")
        low, high = span.fetchone()
        counted = conn.execute("SELECT n FROM relay_job_count WHERE state = 'succeeded'")
        assert counted.fetchone()[0] == 250
    assert attempts == 250
    assert 1_000_000_000 - 3_600_000 < low < high <= 1_000_000_000


def test_percentiles_use_nearest_rank() -> None:
    values = [float(n) for n in range(1, 201)]
    summary = stats.summarize(values)
    assert (summary["p50"], summary["p95"], summary["p99"], summary["max"]) == (100, 190, 198, 200)
    assert stats.summarize([])["p99"] is None
    assert stats.ratio(50, 100) == 0.5
    assert stats.ratio(1, None) is None


def test_scaled_sizes_keep_every_level_runnable() -> None:
    tiny = FULL.scaled(0.0001)
    assert tiny.backlog_sizes == (100,)
    assert all(n >= 2 * c for c, n in tiny.lease_jobs.items())
    assert tiny.submit_total >= 16
