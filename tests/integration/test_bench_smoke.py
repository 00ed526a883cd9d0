"""Smoke tests of ``relay_bench``: its own code paths at tiny sizes, never its timings.

Speed is what the benchmark measures (docs/benchmarking.md); these tests only prove the tool
runs end to end (a real ``relay_server``, load children, the floor, the worker process) and
that its JSON has the keys the docs and the plot read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest
from django.core.management import call_command

from relay_bench import floor, procs, report, stats
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
    "other_synchronous",
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
        "--runs",
        "2",
        "--synchronous",
        "full,normal",
        "--producers",
        "1,2",
        "--workers",
        "1,2",
        "--no-backlog",
        "--no-http",
        "--no-progress",
        "--json-out",
        str(tmp_path / "bench.json"),
        "--markdown-out",
        str(tmp_path / "bench.md"),
        "--plot",
        str(plot),
        stdout=out,
        stderr=io.StringIO(),
    )
    doc = orjson.loads(out.getvalue())
    assert set(doc) >= TOP_KEYS
    assert doc == orjson.loads((tmp_path / "bench.json").read_bytes())
    meta = doc["meta"]
    assert meta["machine"]["cores"] >= 1
    assert meta["machine"]["python_build"].endswith("libpython")
    assert report.failed_requests(doc) == []  # every measured request was answered
    assert (meta["synchronous"], meta["synchronous_levels"], meta["runs"]) == (
        "FULL",
        ["FULL", "NORMAL"],
        2,
    )
    assert [r["run"] for r in meta["loadavg_runs"]] == [1, 2]
    normal = doc["other_synchronous"]["NORMAL"]
    for part in (doc, normal):
        for kind in ("lean", "schema"):
            assert {"insert_one", "insert_batch100", "claim_ack"} <= set(part["floor"][kind])
            assert len(part["floor"][kind]["claim_ack"]["spread"]["per_s"]["runs"]) == 2
        assert {(r["mode"], r["concurrency"]) for r in part["submit"]} == {
            ("single", 1),
            ("single", 2),
            ("batch100", 1),
            ("batch100", 2),
        }
        for row in part["submit"] + part["lease_ack"]:
            assert row["errors"] == 0, row["error_sample"]
            assert row["ops"] > 0 and row["runs"] == 2
            assert row["ratio_to_floor"] is not None
            assert row["ratio_to_schema_floor"] is not None
            assert len(row["spread"]["per_s"]["runs"]) == 2
            assert {"p50", "p95", "p99", "max"} <= set(next(iter(row["latency_ms"].values())))
        # 1 worker again with each ack leasing the next job (runs.LEASE_NEXT_WORKERS).
        assert [(r["concurrency"], r.get("mode")) for r in part["lease_ack"]] == [
            (1, None),
            (2, None),
            (1, "lease_next"),
        ]
        # One request per job: a lease for the first job and one that finds the queue empty.
        one_request = part["lease_ack"][2]["latency_ms"]
        assert one_request["lease"]["n"] <= 2 < one_request["ack"]["n"]
        assert part["submit_to_start"]["samples"] > 0
        assert part["worker"]["jobs"] > 0 and part["worker"]["ratio_to_floor"] is not None
        assert part["server"]["peak_rss_mb"] > 0
    assert doc["backlog"]["status"].startswith("skipped")
    assert doc["http"]["status"].startswith("skipped")
    assert [t["name"] for t in doc["targets"]] == [t["name"] for t in targets(doc)]
    judged = {t["name"]: t for t in doc["targets"]}
    assert judged["NORMAL: lease+ack, 16 workers, vs lean NORMAL claim+ack floor"]["met"] is None
    assert judged["lease+ack, 1 worker, vs lean claim+ack floor"]["runs"] == 2
    name = "lease+ack, 1 worker, each ack leasing the next job (1 request/job)"
    assert judged[name]["runs"] == 2
    table = (tmp_path / "bench.md").read_text()
    assert "NORMAL jobs/s" in table and "lean floor: insert, 100 per txn" in table
    assert "ack with lease_next, 1 request/job" in table
    # The plot is drawn when matplotlib is installed (the dev lock pins it).
    assert plot.exists() or "matplotlib" in doc["meta"]["plot"]


@pytest.mark.slow
def test_bench_quick_defaults_to_one_run_at_the_configured_level(tmp_path: Path) -> None:
    out = io.StringIO()
    call_command(
        "relay_bench",
        "--quick",
        "--json",
        "--scale",
        "0.005",
        "--producers",
        "1",
        "--workers",
        "1",
        "--no-backlog",
        "--no-http",
        "--no-progress",
        stdout=out,
        stderr=io.StringIO(),
    )
    doc = orjson.loads(out.getvalue())
    assert (doc["meta"]["runs"], doc["meta"]["synchronous_levels"]) == (1, ["FULL"])
    # The floors run at NORMAL all the same; the Relay scenarios do not.
    assert set(doc["other_synchronous"]) == {"NORMAL"}
    assert set(doc["other_synchronous"]["NORMAL"]) == {"floor"}


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
    assert procs.count_state(Path(path), "ready") == 205
    assert procs.count_state(tmp_path / "claim.db", "succeeded") == 5


@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])
def test_lean_floor_inserts_claims_and_acks_every_job_at_a_tiny_scale(
    tmp_path: Path, synchronous: str
) -> None:
    one = floor.insert_one(
        floor.create_lean(str(tmp_path / "one.db")), 7, '{"n":1}', synchronous, kind="lean"
    )
    path = floor.create_lean(str(tmp_path / "batch.db"))
    ticks: list[int] = []
    batch = floor.insert_batches(path, 3, 100, '{"n":1}', synchronous, ticks.append, kind="lean")
    claim_path = floor.create_lean(str(tmp_path / "claim.db"))
    claim = floor.claim_ack(claim_path, 9, "{}", synchronous, kind="lean")
    assert (one["jobs"], batch["jobs"], claim["jobs"]) == (7, 300, 9)
    assert ticks == [100, 100, 100]
    assert batch["latency_ms"]["n"] == 3 and claim["ack_latency_ms"]["n"] == 9
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT COUNT(DISTINCT id), MIN(state), MAX(state) FROM job")
        assert rows.fetchone() == (300, "ready", "ready")
        indexes = {r[1] for r in conn.execute("PRAGMA index_list(job)")}
    assert indexes == {"job_ready", "sqlite_autoindex_job_1"}  # one ready index + the key
    with contextlib.closing(sqlite3.connect(claim_path)) as conn:
        states = dict(conn.execute("SELECT state, COUNT(*) FROM job GROUP BY state"))
        tokens = conn.execute("SELECT COUNT(*) FROM job WHERE lease_token IS NOT NULL")
        assert tokens.fetchone() == (0,)
    assert states == {"succeeded": 9}


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


def check_backlog_only(doc: dict[str, Any], sizes: list[int]) -> None:
    """What a ``relay bench --backlog-only`` document must hold, on either database: both
    variants at every size, every claim served, the controls the server says were in force,
    nothing leased from the paused queue, the two flat-claim targets judged."""
    assert [r["ready_jobs"] for r in doc["backlog"]["sizes"]] == sizes
    rows = doc["backlog_controls"]["sizes"]
    assert [r["ready_jobs"] for r in rows] == sizes
    for row in doc["backlog"]["sizes"] + rows:
        assert row["claims"] == row["lease_latency_ms"]["n"] > 0
    for row in rows:
        assert row["leased_from_paused"] == 0
        paused, limited = row["controls"]["paused"], row["controls"]["limited"]
        assert paused["paused"] is True and limited["paused"] is False
        assert (limited["max_leased"], limited["rate_per_s"], limited["burst"]) == (
            1000,
            1_000_000.0,
            1000,
        )
    names = [t["name"] for t in doc["targets"]]
    assert names == [
        f"claim p50, {sizes[-1]:,} vs {sizes[0]:,} ready",
        f"claim p50 with a paused queue and a capped, rated queue, {sizes[-1]:,} vs "
        f"{sizes[0]:,} ready",
    ]
    assert all(t["value"] is not None for t in doc["targets"])


@pytest.mark.slow
def test_backlog_only_measures_the_claim_plain_and_with_queue_controls(tmp_path: Path) -> None:
    out = io.StringIO()
    call_command(
        "relay_bench",
        "--backlog-only",
        "--quick",
        "--scale",
        "0.005",
        "--runs",
        "2",
        "--no-progress",
        "--json-out",
        str(tmp_path / "backlog.json"),
        stdout=out,
        stderr=io.StringIO(),
    )
    doc = orjson.loads((tmp_path / "backlog.json").read_bytes())
    assert doc["meta"]["database"] == "sqlite"
    check_backlog_only(doc, [100, 500])
    assert {r["claims"] for r in doc["backlog"]["sizes"]} == {10}
    # Two runs: each run's own ratios, and the targets judged on their median and spread.
    assert [r["run"] for r in doc["backlog_runs"]] == [1, 2]
    assert all(r["controls"]["p50_ratio"] is not None for r in doc["backlog_runs"])
    assert [t["runs"] for t in doc["targets"]] == [2, 2]
    p99 = doc["backlog_controls"]["sizes"][0]["lease_latency_ms"]["spread"]["p99"]
    assert len(p99["runs"]) == 2 and None not in p99["runs"]
    # stdout is the Markdown: the plain and controls columns side by side, then the targets.
    table = out.getvalue()
    assert "| ready jobs | plain claim p50 ms |" in table
    assert "| ratio 500 / 100, median of each run's |" in table
    assert "claim p50 with a paused queue and a capped, rated queue, 500 vs 100 ready" in table


def test_the_full_run_measures_the_controls_variant_at_each_backlog_size(tmp_path: Path) -> None:
    from relay_bench import runner, scenarios

    steps = runner.Steps()
    steps.progress, steps.step_seconds = runner.Progress(), {}
    env = scenarios.Env(tmp_path, procs.template_db(tmp_path), "FULL", "t", 30.0)
    sizes = dataclasses.replace(FULL.scaled(0.0001), backlog_sizes=(100, 300), backlog_claims=5)
    out = runner.backlog_controls(steps, env, sizes)
    assert out["controls"] == scenarios.CONTROLS
    rows = out["sizes"]
    assert [(r["ready_jobs"], r["claims"], r["leased_from_paused"]) for r in rows] == [
        (100, 5, 0),
        (300, 5, 0),
    ]
    assert all(r["controls"]["paused"]["paused"] for r in rows)
    assert not list(tmp_path.glob("backlog-*"))  # each size's file is deleted when done


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
