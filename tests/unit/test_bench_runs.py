"""The benchmark's arithmetic over repeated runs (``relay_bench.stats``, ``relay_bench.runs``):
medians and their spread, ratios to the floors of the same run, and the targets' judging.
Pure functions on hand-made documents: nothing is timed."""

from __future__ import annotations

import argparse
import io
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from queue_core.management.commands.relay_bench import _synchronous
from relay_bench import report, runs
from relay_bench.stats import judge, median, spread


def test_median_of_odd_and_even_counts_ignores_missing_values() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([5.0, None, 1.0]) == 3.0
    assert median([7]) == 7.0
    assert median([]) is None
    assert median([None, None]) is None


def test_spread_keeps_every_run_in_order_and_its_extremes() -> None:
    assert spread([120.0, 80.0, 100.0]) == {
        "median": 100.0,
        "min": 80.0,
        "max": 120.0,
        "runs": [120.0, 80.0, 100.0],
    }
    assert spread([1 / 3, 2 / 3], digits=2) == {
        "median": 0.5,
        "min": 0.33,
        "max": 0.67,
        "runs": [1 / 3, 2 / 3],
    }
    assert spread([None, 4.0]) == {"median": 4.0, "min": 4.0, "max": 4.0, "runs": [None, 4.0]}
    assert spread([None]) == {"median": None, "min": None, "max": None, "runs": [None]}


@pytest.mark.parametrize(
    ("value", "op", "goal", "met"),
    [
        (0.5, ">=", 0.5, True),  # the boundary meets a ">=" goal
        (0.499, ">=", 0.5, False),
        (100.0, "<=", 100.0, True),
        (100.1, "<=", 100.0, False),
        (50.0, "<", 50.0, False),  # and misses a strict one
        (49.9, "<", 50.0, True),
        (2.0, ">", 2.0, False),
        (None, ">=", 0.5, None),  # not measured
    ],
)
def test_judge_compares_the_boundary_exactly(
    value: float | None, op: str, goal: float, met: bool | None
) -> None:
    assert judge(value, op, goal) is met


def test_judge_rejects_an_unknown_comparison() -> None:
    with pytest.raises(ValueError, match="unknown comparison"):
        judge(1.0, "==", 1.0)


def test_merge_takes_medians_sums_errors_and_keeps_spread() -> None:
    rows = [
        {"per_s": 100.0, "errors": 0, "error_sample": None, "concurrency": 16, "mode": "single"},
        {"per_s": 300.0, "errors": 2, "error_sample": "boom", "concurrency": 16, "mode": "single"},
        {"per_s": 200.0, "errors": 1, "error_sample": "bang", "concurrency": 16, "mode": "single"},
    ]
    merged = runs.merge(rows)
    assert merged["per_s"] == 200.0
    assert (merged["errors"], merged["error_sample"]) == (3, "boom")
    assert merged["concurrency"] == 16 and isinstance(merged["concurrency"], int)
    assert merged["mode"] == "single"
    assert merged["runs"] == 3
    assert merged["spread"]["per_s"] == {
        "median": 200.0,
        "min": 100.0,
        "max": 300.0,
        "runs": [100.0, 300.0, 200.0],
    }


def _part(
    lean: float, schema: float, submit: float, lease16: float, cpu: float, worker: float
) -> dict[str, Any]:
    """One run's part at one level with round figures."""

    def fl(per_s: float) -> dict[str, Any]:
        return {key: {"per_s": per_s} for key in runs.FLOOR_KEYS}

    return {
        "floor": {"lean": fl(lean), "schema": fl(schema)},
        "submit": [
            {
                "transport": "tcp",
                "mode": "single",
                "concurrency": 1,
                "per_s": submit,
                "server_cpu_us_per_job": None,
            },
            {
                "transport": "tcp",
                "mode": "single",
                "concurrency": 16,
                "per_s": submit * 4,
                "server_cpu_us_per_job": cpu,
            },
        ],
        "lease_ack": [
            {
                "concurrency": 16,
                "per_s": lease16,
                "least_served_share": 0.9,
                "server_cpu_us_per_job": cpu * 2,
            }
        ],
        "worker": {"concurrency": 16, "per_s": worker},
        "server": {"peak_rss_mb": 70.0 + lean / 1000},
    }


def test_ratios_are_to_the_floors_of_the_same_run() -> None:
    part = _part(lean=1000, schema=500, submit=600, lease16=2500, cpu=90, worker=1600)
    runs.ratios(part)
    one = part["submit"][0]
    assert (one["floor"], one["ratio_to_floor"], one["ratio_to_schema_floor"]) == (
        "insert_one",
        0.6,
        1.2,
    )
    assert part["lease_ack"][0]["ratio_to_floor"] == 2.5
    assert part["worker"]["ratio_to_floor"] == 1.6


def test_the_median_ratio_is_the_median_of_each_runs_ratio() -> None:
    # Run 2's machine was slow for Relay and floor alike: its ratio is the same as run 1's,
    # while a ratio of medians (1400 / 1000) would have read 1.4.
    parts = [
        _part(lean=1000, schema=500, submit=600, lease16=2000, cpu=80, worker=1600),
        _part(lean=400, schema=200, submit=240, lease16=800, cpu=120, worker=600),
        _part(lean=1200, schema=600, submit=720, lease16=3000, cpu=100, worker=1200),
    ]
    for part in parts:
        runs.ratios(part)
    merged = runs.merge_parts(parts)
    assert merged["floor"]["lean"]["claim_ack"]["per_s"] == 1000
    assert merged["floor"]["lean"]["claim_ack"]["spread"]["per_s"]["min"] == 400
    lease = merged["lease_ack"][0]
    assert lease["per_s"] == 2000
    assert lease["ratio_to_floor"] == 2.0
    assert lease["spread"]["ratio_to_floor"]["runs"] == [2.0, 2.0, 2.5]
    assert merged["server"]["peak_rss_mb"] == 71.2  # the highest run, not a median
    assert [r["concurrency"] for r in merged["submit"]] == [1, 16]


def _doc(parts_full: list[dict[str, Any]], parts_normal: list[dict[str, Any]]) -> dict[str, Any]:
    for part in parts_full + parts_normal:
        runs.ratios(part)
    doc: dict[str, Any] = {"meta": {"synchronous": "FULL"}}
    doc.update(runs.merge_parts(parts_full))
    doc["other_synchronous"] = {"NORMAL": runs.merge_parts(parts_normal)}
    return doc


def test_targets_judge_the_medians_against_the_lean_floor() -> None:
    full = [
        _part(lean=1000, schema=500, submit=600, lease16=2500, cpu=90, worker=1600),
        _part(lean=1000, schema=500, submit=400, lease16=1900, cpu=110, worker=1400),
        _part(lean=1000, schema=500, submit=500, lease16=2100, cpu=100, worker=1500),
    ]
    normal = [
        _part(lean=10000, schema=5000, submit=3000, lease16=4000, cpu=90, worker=3000),
        _part(lean=10000, schema=5000, submit=3000, lease16=6000, cpu=90, worker=3000),
        _part(lean=10000, schema=5000, submit=3000, lease16=5000, cpu=90, worker=3000),
    ]
    judged = {t["name"]: t for t in runs.targets(_doc(full, normal))}
    one = judged["single-job submit, 1 producer, vs lean insert floor"]
    assert (one["value"], one["min"], one["max"], one["runs"], one["met"]) == (
        0.5,
        0.4,
        0.6,
        3,
        True,
    )
    assert judged["single-job submit, 16 producers, vs lean insert floor"]["value"] == 2.0
    lease = judged["lease+ack, 16 workers in 4 processes, vs lean claim+ack floor"]
    assert (lease["value"], lease["met"]) == (2.1, True)
    share = judged["lease+ack, 16 workers: least-served worker's share"]
    assert (share["value"], share["met"]) == (0.9, True)
    worker = judged["relay_worker --concurrency 16 draining, vs lean claim+ack floor"]
    assert (worker["value"], worker["met"]) == (1.5, True)  # the boundary meets ">= 1.5"
    at_normal = judged["NORMAL: lease+ack, 16 workers, vs lean NORMAL claim+ack floor"]
    assert (at_normal["value"], at_normal["met"]) == (0.5, True)
    cpu = judged["server CPU per single-job submit, 16 producers (µs)"]
    assert (cpu["value"], cpu["target"], cpu["met"]) == (100, "<= 100", True)
    cpu_lease = judged["server CPU per lease+ack, 16 workers (µs)"]
    assert (cpu_lease["value"], cpu_lease["met"]) == (200, True)
    # Not measured in these documents: judged None, not failed.
    assert judged["batches of 100, 1 producer, vs lean batch floor"]["met"] is None
    assert judged["lease+ack, 1 worker, vs lean claim+ack floor"]["met"] is None
    assert judged["server peak RSS with 1,000,000 jobs waiting (MiB)"]["met"] is None


def test_a_target_below_its_goal_fails_and_without_normal_is_not_measured() -> None:
    full = [_part(lean=1000, schema=500, submit=490, lease16=1990, cpu=101, worker=1490)]
    for part in full:
        runs.ratios(part)
    doc: dict[str, Any] = {"meta": {"synchronous": "FULL"}, **runs.merge_parts(full)}
    doc["other_synchronous"] = {"NORMAL": {"floor": full[0]["floor"]}}  # floors only
    judged = {t["name"]: t for t in runs.targets(doc)}
    assert judged["single-job submit, 1 producer, vs lean insert floor"]["met"] is False
    assert judged["lease+ack, 16 workers in 4 processes, vs lean claim+ack floor"]["met"] is False
    assert judged["server CPU per single-job submit, 16 producers (µs)"]["met"] is False
    assert judged["relay_worker --concurrency 16 draining, vs lean claim+ack floor"]["met"] is False
    at_normal = judged["NORMAL: lease+ack, 16 workers, vs lean NORMAL claim+ack floor"]
    assert (at_normal["value"], at_normal["met"], at_normal["runs"]) == (None, None, 0)


def test_level_finds_the_top_level_or_another() -> None:
    doc: dict[str, Any] = {"meta": {"synchronous": "NORMAL"}, "other_synchronous": {"FULL": {}}}
    assert runs.level(doc, "NORMAL") is doc
    assert runs.level(doc, "FULL") == {}
    assert runs.level(doc, "EXTRA") is None


def test_synchronous_option_parses_levels() -> None:
    assert _synchronous("full,normal") == ("FULL", "NORMAL")
    assert _synchronous(" Normal , normal ") == ("NORMAL",)
    with pytest.raises(argparse.ArgumentTypeError):
        _synchronous("fast")
    with pytest.raises(argparse.ArgumentTypeError):
        _synchronous(",")


def test_the_schema_floor_gets_its_ratio_to_the_lean_floor_of_its_run() -> None:
    part = _part(lean=1000, schema=400, submit=600, lease16=2500, cpu=90, worker=1600)
    runs.ratios(part)
    assert {k: part["floor"]["schema"][k]["ratio_to_floor"] for k in runs.FLOOR_KEYS} == {
        "insert_one": 0.4,
        "insert_batch100": 0.4,
        "claim_ack": 0.4,
    }
    assert "ratio_to_floor" not in part["floor"]["lean"]["insert_one"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--runs", "0"], "--runs must be 1..20"),
        (["--runs", "21"], "--runs must be 1..20"),
        (["--database-url", "postgresql://x@127.0.0.1/y", "--runs", "3"], "apply to SQLite"),
        (["--database-url", "postgresql://x@127.0.0.1/y", "--synchronous", "normal"], "SQLite"),
        (["--address", "127.0.0.1:1", "--synchronous", "full,normal"], "one --synchronous"),
        (["--backlog-only", "--no-backlog"], "exclude each other"),
        (["--backlog-only", "--address", "127.0.0.1:1"], "starts its own servers"),
        (["--backlog-only", "--runs", "0"], "--runs must be 1..20"),
        (["--backlog-only", "--synchronous", "normal"], "configured level"),
        (["--with-ceiling", "--backlog-only"], "main run on SQLite"),
        (["--with-ceiling", "--prune-jobs", "10"], "main run on SQLite"),
        (["--with-ceiling", "--database-url", "postgresql://x@127.0.0.1/y"], "main run"),
        (["--with-ceiling", "--address", "127.0.0.1:1"], "a server the run starts"),
        (["--ceiling-schema", "relay"], "goes with --with-ceiling"),
    ],
)
def test_bench_refuses_runs_and_levels_it_cannot_honour(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("relay_bench", *args, "--no-progress", stdout=io.StringIO())


def _backlog_row(size: int, p50: float | None, p99: float | None = None) -> dict[str, Any]:
    return {"ready_jobs": size, "lease_latency_ms": {"n": 10, "p50": p50, "p99": p99}}


def test_scaling_compares_the_largest_backlog_with_the_smallest_in_any_order() -> None:
    rows = [_backlog_row(100_000, 1.2, 4.0), _backlog_row(1_000_000, 1.5, 9.0)]
    rows.append(_backlog_row(1_000, 1.0, 3.0))
    assert runs.scaling(rows) == {
        "small": 1_000,
        "big": 1_000_000,
        "p50_ratio": 1.5,
        "p99_ratio": 3.0,
        "flat": True,  # the boundary is flat: "<= 1.5", as the plain backlog's target
    }
    over = runs.scaling([_backlog_row(1_000, 1.0), _backlog_row(1_000_000, 1.501)])
    assert over is not None and (over["p50_ratio"], over["p99_ratio"], over["flat"]) == (
        1.501,
        None,
        False,
    )
    assert runs.scaling([_backlog_row(1_000, 1.0)]) is None
    assert runs.scaling([_backlog_row(1_000, 1.0), _backlog_row(1_000, 2.0)]) is None
    assert runs.scaling([]) is None
    missing = runs.scaling([_backlog_row(1_000, None), _backlog_row(10_000, 1.0)])
    assert missing is not None and (missing["p50_ratio"], missing["flat"]) == (None, None)


def test_the_controls_variant_is_judged_as_the_plain_backlog_and_named_for_its_sizes() -> None:
    doc: dict[str, Any] = {
        "meta": {"synchronous": "FULL"},
        "backlog": {"sizes": [_backlog_row(1_000, 1.0), _backlog_row(1_000_000, 1.4)]},
        "backlog_controls": {"sizes": [_backlog_row(1_000, 1.0), _backlog_row(1_000_000, 1.6)]},
    }
    for row in doc["backlog"]["sizes"]:
        row["server_peak_rss_mb"] = 75.0
    plain, controls = runs.backlog_targets(doc)
    assert (plain["name"], plain["target"], plain["value"], plain["met"]) == (
        "claim p50, 1,000,000 vs 1,000 ready",
        "<= 1.5",
        1.4,
        True,
    )
    assert (controls["name"], controls["value"], controls["met"]) == (
        "claim p50 with a paused queue and a capped, rated queue, 1,000,000 vs 1,000 ready",
        1.6,
        False,
    )
    # The whole run's targets carry both, the plain one under the name it always had.
    judged = {t["name"]: t for t in runs.targets(doc)}
    assert judged[plain["name"]]["value"] == 1.4
    assert judged[controls["name"]]["met"] is False
    # Without the variant (--no-backlog, --address): not measured, not failed.
    (unmeasured,) = [t for t in runs.targets({"meta": {}}) if "paused queue" in t["name"]]
    assert (unmeasured["name"], unmeasured["met"], unmeasured["runs"]) == (
        "claim p50 with a paused queue and a capped, rated queue, largest vs smallest backlog",
        None,
        0,
    )


def test_the_backlog_table_puts_the_controls_beside_the_plain_claim() -> None:
    from relay_bench.report import backlog_controls_section

    ctl = [_backlog_row(1_000, 1.0, 2.0), _backlog_row(1_000_000, 1.25, 5.0)]
    for row in ctl:
        row["leased_from_paused"] = 0
    doc: dict[str, Any] = {
        "backlog": {"sizes": [_backlog_row(1_000, 0.5, 1.0), _backlog_row(1_000_000, 0.6, 2.0)]},
        "backlog_controls": {"status": "ran once", "controls": {"max_leased": 1000}, "sizes": ctl},
    }
    title, head, rows = backlog_controls_section(doc)
    assert "max_leased 1000" in title and len(head) == 6
    assert rows == [
        ["1,000", "0.50", "1.00", "1.00", "2.00", "0"],
        ["1,000,000", "0.60", "2.00", "1.25", "5.00", "0"],
        ["ratio 1,000,000 / 1,000", "1.20x", "2.00x", "1.25x", "2.50x", "-"],
    ]

    # Several runs: the ratio row is the median of each run's own ratio, with its min-max.
    doc["backlog_runs"] = [
        {"plain": {"p50_ratio": r, "p99_ratio": 2.0}, "controls": {"p50_ratio": r, "p99_ratio": 3}}
        for r in (1.1, 0.9, 1.4)
    ]
    assert backlog_controls_section(doc)[2][-1] == [
        "ratio 1,000,000 / 1,000, median of each run's",
        "1.10x (0.90-1.40)",
        "2.00x (2.00-2.00)",
        "1.10x (0.90-1.40)",
        "3.00x (3.00-3.00)",
        "-",
    ]


def test_repeated_backlog_runs_are_judged_on_the_median_of_each_runs_ratio() -> None:
    doc: dict[str, Any] = {
        "backlog": {"sizes": [_backlog_row(1_000, 1.0), _backlog_row(1_000_000, 1.1)]},
        "backlog_controls": {"sizes": [_backlog_row(1_000, 1.0), _backlog_row(1_000_000, 1.0)]},
        "backlog_runs": [
            {"plain": {"p50_ratio": 1.2}, "controls": {"p50_ratio": 1.6}},
            {"plain": {"p50_ratio": 0.9}, "controls": {"p50_ratio": 1.4}},
            {"plain": {"p50_ratio": 1.0}, "controls": None},  # a run that measured one size
        ],
    }
    plain, controls = runs.backlog_targets(doc)
    assert (plain["value"], plain["min"], plain["max"], plain["runs"], plain["met"]) == (
        1.0,
        0.9,
        1.2,
        3,
        True,
    )
    assert (controls["value"], controls["min"], controls["max"], controls["runs"]) == (
        1.5,
        1.4,
        1.6,
        2,
    )
    assert controls["met"] is True  # 1.5 is the boundary: "<= 1.5"


def test_rows_that_lease_with_the_ack_are_kept_and_judged_apart() -> None:
    # Two runs, each with 16 workers leasing and acking in two requests and in one: the rows
    # merge by mode, each gets its ratio, and each target reads its own row.
    parts = []
    for lease16, following in ((1000, 1500), (1200, 1700)):
        part = _part(lean=1000, schema=500, submit=600, lease16=lease16, cpu=90, worker=1600)
        part["lease_ack"].append(
            {
                "concurrency": 16,
                "mode": "lease_next",
                "per_s": following,
                "least_served_share": 0.8,
                "server_cpu_us_per_job": 150,
            }
        )
        parts.append(part)
    doc = _doc(parts, [])
    assert [(r["concurrency"], r.get("mode")) for r in doc["lease_ack"]] == [
        (16, None),
        (16, "lease_next"),
    ]
    judged = {t["name"]: t for t in runs.targets(doc)}
    two = judged["lease+ack, 16 workers in 4 processes, vs lean claim+ack floor"]
    one = judged[
        "lease+ack, 16 workers in 4 processes, each ack leasing the next job (1 request/job)"
    ]
    assert (two["value"], two["met"]) == (1.1, False)
    assert (one["value"], one["min"], one["max"], one["met"]) == (1.6, 1.5, 1.7, False)
    cpu = judged["server CPU per lease+ack, 16 workers, each ack leasing the next job (µs)"]
    assert (cpu["value"], cpu["met"]) == (150, True)
    assert (
        judged["lease+ack, 1 worker, each ack leasing the next job (1 request/job)"]["met"] is None
    )


def test_each_target_gets_what_the_ceiling_server_reached_in_the_same_runs() -> None:
    """``--with-ceiling``: each run's part holds the ceiling's rows beside Relay's, ratioed to
    the same floors; every target it measured shows its median, spread and verdict."""
    full, normal = [], []
    for submit, ceiling_submit in ((300, 400), (250, 450), (280, 500)):
        part = _part(lean=1000, schema=500, submit=submit, lease16=900, cpu=300, worker=800)
        theirs = _part(lean=1000, schema=500, submit=ceiling_submit, lease16=2100, cpu=90, worker=0)
        theirs["floor"] = part["floor"]
        runs.ratios(theirs)
        part["ceiling"] = {k: v for k, v in theirs.items() if k in ("submit", "lease_ack")}
        full.append(part)
        normal.append(_part(lean=10000, schema=5000, submit=3000, lease16=4000, cpu=90, worker=1))
    doc = _doc(full, normal)
    doc["meta"]["with_ceiling"] = True
    judged = {t["name"]: t for t in runs.targets(doc)}
    one = judged["single-job submit, 1 producer, vs lean insert floor"]
    assert (one["value"], one["met"]) == (0.28, False)
    assert one["ceiling"] == {"value": 0.45, "min": 0.4, "max": 0.5, "met": False}
    lease = judged["lease+ack, 16 workers in 4 processes, vs lean claim+ack floor"]
    assert (lease["met"], lease["ceiling"]["value"], lease["ceiling"]["met"]) == (False, 2.1, True)
    cpu = judged["server CPU per single-job submit, 16 producers (µs)"]
    assert cpu["ceiling"] == {"value": 90, "min": 90, "max": 90, "met": True}
    # What the ceiling did not run has no entry: the worker process, NORMAL here, backlogs.
    assert (
        "ceiling" not in judged["relay_worker --concurrency 16 draining, vs lean claim+ack floor"]
    )
    assert "ceiling" not in judged["NORMAL: lease+ack, 16 workers, vs lean NORMAL claim+ack floor"]
    assert report._ceiling_cell(one["ceiling"]) == "0.45 (0.40-0.50) no"
    assert report._ceiling_cell(cpu["ceiling"]) == "90.00 yes"
    assert report._ceiling_cell(None) == "-"
    doc["targets"] = runs.targets(doc)
    for schema, header in (
        ("lean", "ceiling server: median (min-max), met"),
        ("relay", "ceiling server on Relay's schema: median (min-max), met"),
    ):
        doc["meta"]["ceiling_schema"] = schema
        assert report.targets_section(doc)[1][-1] == header


@pytest.mark.parametrize(("p99", "met"), [(4.99, True), (5.0, False), (6.8, False)])
def test_submit_to_start_is_judged_by_issue_15s_five_milliseconds(p99: float, met: bool) -> None:
    """Issue 15: "submit-to-start p99 < 5 ms idle" (an earlier issue's 50 ms is looser)."""
    doc = _doc([_part(lean=1000, schema=500, submit=500, lease16=2000, cpu=100, worker=1500)], [])
    doc["submit_to_start"] = {"latency_ms": {"p99": p99}}
    (judged,) = [t for t in runs.targets(doc) if t["name"].startswith("submit-to-start p99")]
    assert (judged["target"], judged["value"], judged["met"]) == ("< 5", p99, met)


def test_the_interpreter_build_is_named_from_its_configure_arguments() -> None:
    from relay_bench.runner import interpreter_build

    pyenv = "'--prefix=/root/.pyenv/versions/3.13.0' '--enable-shared' '--libdir=/x'"
    assert interpreter_build(pyenv, 1) == "no PGO, no LTO, shared libpython"
    assert interpreter_build("'--enable-optimizations' '--with-lto'", 0) == (
        "PGO+LTO, static libpython"
    )
    assert interpreter_build("'--enable-optimizations'", 1) == "PGO, no LTO, shared libpython"
    assert interpreter_build("--with-lto=full", 0) == "LTO, no PGO, static libpython"
    doc: dict[str, Any] = {"meta": {"machine": {"python_build": "PGO+LTO, static libpython"}}}
    assert report._build(doc["meta"]["machine"]) == " (PGO+LTO, static libpython)"
    assert report._build({}) == ""


def test_rows_whose_requests_failed_are_named_next_to_the_tables() -> None:
    """Walkthrough: an installed Relay's HTTP rows read 0 jobs/s (every request a 500), and
    nothing said so."""
    ok = {"transport": "tcp", "mode": "single", "concurrency": 1, "errors": 0, "requests": 9}
    bad = {
        "transport": "http",
        "mode": "single",
        "concurrency": 16,
        "errors": 640,
        "requests": 640,
        "error_sample": "RuntimeError: HTTP 500",
    }
    doc = {"submit": [ok, bad], "normal": {"lease_ack": [{**ok, "errors": 2, "requests": 5}]}}
    assert report.failed_requests(doc) == [
        "submit[http, single, 16]: 640 of 640 requests failed (RuntimeError: HTTP 500)",
        "normal.lease_ack[tcp, single, 1]: 2 of 5 requests failed (no sample)",
    ]
    assert report.failed_requests({"submit": [ok]}) == []
