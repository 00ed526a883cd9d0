"""``relay bench``: a real Relay server measured against the raw SQLite floors (lean and
schema, ``relay_bench.floor``), medians of ``--runs`` runs, or with
``--database-url`` on PostgreSQL against a raw psycopg floor.

The benchmark itself is the ``relay_bench`` package, which needs the ``bench`` extra (psutil):
this command parses the options, imports it when it runs, and without the extra exits 1 with
one line saying how to install it. See docs/benchmarking.md for what it measures.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from django.core.management.base import CommandError, CommandParser
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from queue_core.management.relay_command import EXIT_ERROR, RelayBaseCommand, resolve_address

if TYPE_CHECKING:
    from relay_bench.runner import Sizes

NEEDS_EXTRA = "relay bench needs the bench extra: pip install 'relay-queue[bench]'"
# What the bench extra adds (pyproject.toml, [project.optional-dependencies] bench).
EXTRA_MODULES = frozenset({"psutil"})


@contextlib.contextmanager
def _bench_extra() -> Iterator[None]:
    """Turn the import of a missing bench-extra module inside the block into ``NEEDS_EXTRA``.

    Raises:
        CommandError: a module of the bench extra is not installed (exit 1, ``NEEDS_EXTRA``).
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name not in EXTRA_MODULES:
            raise
        raise CommandError(NEEDS_EXTRA, returncode=EXIT_ERROR) from None


SYNCHRONOUS_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")


def _synchronous(text: str) -> tuple[str, ...]:
    """Parse ``"full,normal"`` into ``("FULL", "NORMAL")`` (each a ``RELAY_SQLITE_SYNCHRONOUS``
    value: OFF, NORMAL, FULL or EXTRA, any case; duplicates dropped)."""
    levels = tuple(dict.fromkeys(part.strip().upper() for part in text.split(",") if part.strip()))
    if not levels or not all(level in SYNCHRONOUS_LEVELS for level in levels):
        raise argparse.ArgumentTypeError(
            f"expected levels from {','.join(SYNCHRONOUS_LEVELS).lower()}, got {text!r}"
        )
    return levels


def _levels(text: str) -> tuple[int, ...]:
    """Parse ``"1,4,16"`` into ``(1, 4, 16)`` (each 1..256)."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,4,16, got {text!r}") from exc
    if not levels or not all(1 <= n <= 256 for n in levels):
        raise argparse.ArgumentTypeError("each level must be 1..256")
    return levels


class Command(RelayBaseCommand):
    """Run the benchmark, print a table (or JSON), optionally write JSON and a PNG plot.

    Exit codes: 0 when the run finished (whether or not the targets were met), 1 when a
    scenario could not run (the server would not start, a client failed), an argument is
    invalid, or the bench extra is not installed.
    """

    help = (
        "Measure submit and lease+ack throughput, latency percentiles, backlog scaling and "
        "peak RSS of a real relay_server, each as a ratio to a lean SQLite floor and to the "
        "schema floor measured in the same run, at FULL and NORMAL; medians of --runs runs."
    )
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        """Declare the options."""
        parser.add_argument(
            "--address",
            default=None,
            metavar="HOST:PORT",
            help="Measure this already running server instead of spawning one (RSS and "
            "backlog scaling are then skipped).",
        )
        parser.add_argument(
            "--database-url",
            default=None,
            metavar="URL",
            help="Measure Relay on PostgreSQL (postgresql://user@host:port/dbname) against a "
            "raw psycopg floor, with two servers against one; the run creates and drops a "
            "database of its own there (docs/benchmarking.md).",
        )
        parser.add_argument(
            "--runs",
            type=int,
            default=None,
            metavar="N",
            help="Run every floor and Relay scenario N times (1..20) and report medians with "
            "their min-max (default 3; 1 with --quick). SQLite only.",
        )
        parser.add_argument(
            "--synchronous",
            type=_synchronous,
            default=None,
            metavar="LEVEL,...",
            help="Run the Relay scenarios at these RELAY_SQLITE_SYNCHRONOUS levels, e.g. "
            "full,normal (default: the configured one). The floors always run at FULL and "
            "NORMAL. SQLite only.",
        )
        parser.add_argument(
            "--with-ceiling",
            action="store_true",
            help="Also run the TCP scenarios against relay_bench.ceiling, a minimal asyncio + "
            "sqlite3 server of the same ops and replies on the lean table, in every run, and "
            "show what it reaches beside each target: a target it misses is out of reach for "
            "a server of this kind (one CPython process, asyncio, sqlite3) on this machine "
            "(docs/benchmarking.md). SQLite only.",
        )
        # Imported here: the product's modules import nothing of relay_bench at import
        # (tests/integration/test_bench_extra.py); this one needs only stdlib and orjson.
        from relay_bench.ceiling import SCHEMAS

        parser.add_argument(
            "--ceiling-schema",
            choices=SCHEMAS,
            default="lean",
            help="With --with-ceiling: the ceiling's table and statements. lean (default): "
            "the lean floor's; relay: Relay's own table, indexes and triggers and the "
            "statements its transitions run there (job row, count, attempt history): what a "
            "server of this kind can reach on Relay's schema.",
        )
        parser.add_argument("--json", action="store_true", help="Print JSON instead of tables.")
        parser.add_argument(
            "--quick",
            action="store_true",
            help="Smaller counts, no 1M backlog, one run: under a minute.",
        )
        parser.add_argument(
            "--scale",
            type=float,
            default=1.0,
            help="Multiply every count (and backlog size) by this factor (default 1).",
        )
        parser.add_argument("--json-out", metavar="PATH", help="Also write the JSON here.")
        parser.add_argument(
            "--markdown-out", metavar="PATH", help="Also write the tables as Markdown here."
        )
        parser.add_argument(
            "--plot", metavar="PATH", help="Draw the scaling curves to this PNG (matplotlib)."
        )
        parser.add_argument(
            "--prune-jobs",
            type=int,
            default=0,
            metavar="N",
            help="Run only the retention scenario: N old finished jobs pruned by the server "
            "while one worker does lease+ack (claim p99 during and after; JSON output; "
            "1..5000000; e.g. 1000000).",
        )
        parser.add_argument(
            "--backlog-only",
            action="store_true",
            help="Run only the backlog scaling scenario, plain and with queue controls in force "
            "(a paused queue holding as many ready jobs, a cap and a rate on the claimed queue), "
            "and judge the flat claim of each; on SQLite, or on PostgreSQL with --database-url.",
        )
        parser.add_argument("--no-http", action="store_true", help="Skip the HTTP scenario.")
        parser.add_argument(
            "--no-backlog", action="store_true", help="Skip the backlog scaling scenario."
        )
        parser.add_argument("--no-progress", action="store_true", help="No progress bar on stderr.")
        parser.add_argument(
            "--producers",
            type=_levels,
            default=None,
            metavar="N,N,...",
            help="Concurrent producers of the submission scenarios (default 1,4,16; 1,16 with "
            "--database-url).",
        )
        parser.add_argument(
            "--workers",
            type=_levels,
            default=None,
            metavar="N,N,...",
            help="Concurrent workers of the lease+ack scenario (default 1,4,16,64; 1,4,16 "
            "with --database-url, where levels over 16 are dropped).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the benchmark and report."""
        with _bench_extra():
            from relay_bench import report, runner
        if options["scale"] <= 0:
            raise CommandError("INVALID_ARGUMENT: --scale must be > 0")
        if options["with_ceiling"] and (
            options["database_url"]
            or options["backlog_only"]
            or options["prune_jobs"]
            or options["address"]
        ):
            raise CommandError(
                "INVALID_ARGUMENT: --with-ceiling goes with the main run on SQLite, on a server "
                "the run starts (not with --address, --database-url, --backlog-only or "
                "--prune-jobs)"
            )
        if options["ceiling_schema"] != "lean" and not options["with_ceiling"]:
            raise CommandError("INVALID_ARGUMENT: --ceiling-schema goes with --with-ceiling")
        address = resolve_address(options["address"]) if options["address"] else None
        sizes = runner.QUICK if options["quick"] else runner.FULL
        if options["scale"] != 1.0:
            sizes = sizes.scaled(options["scale"])
        err = getattr(self.stderr, "_out", sys.stderr)
        console = Console(file=err, stderr=err is sys.stderr)
        bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=options["no_progress"],
            transient=False,
        )
        if options["prune_jobs"]:
            if not 1 <= options["prune_jobs"] <= 5_000_000:
                raise CommandError("INVALID_ARGUMENT: --prune-jobs must be 1..5000000")
            with bar:
                doc = runner.prune_run(
                    options["prune_jobs"],
                    deadline_s=max(sizes.deadline_s, 900.0),
                    progress=runner.RichBar(bar),
                )
            text = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
            if options["json_out"]:
                Path(options["json_out"]).write_text(text + "\n", encoding="utf-8")
            self.stdout.write(text)
            return
        if options["backlog_only"] and options["no_backlog"]:
            raise CommandError(
                "INVALID_ARGUMENT: --backlog-only and --no-backlog exclude each other"
            )
        if options["backlog_only"] and not options["database_url"]:
            if address is not None:
                raise CommandError("INVALID_ARGUMENT: --backlog-only starts its own servers")
            if options["synchronous"] is not None:
                raise CommandError(
                    "INVALID_ARGUMENT: --backlog-only runs at the configured level "
                    "(RELAY_SQLITE_SYNCHRONOUS), not at --synchronous"
                )
            runs_n = (
                options["runs"] if options["runs"] is not None else (1 if options["quick"] else 3)
            )
            if not 1 <= runs_n <= runner.MAX_RUNS:
                raise CommandError(f"INVALID_ARGUMENT: --runs must be 1..{runner.MAX_RUNS}")
            with bar:
                doc = runner.backlog_run(sizes, runs_n=runs_n, progress=runner.RichBar(bar))
            self._backlog_report(doc, options)
            return
        if options["database_url"]:
            if options["runs"] is not None or options["synchronous"] is not None:
                raise CommandError(
                    "INVALID_ARGUMENT: --runs and --synchronous apply to SQLite, "
                    "not to --database-url"
                )
            self._postgresql(options, sizes, bar)
            return
        runs = options["runs"] if options["runs"] is not None else (1 if options["quick"] else 3)
        if not 1 <= runs <= runner.MAX_RUNS:
            raise CommandError(f"INVALID_ARGUMENT: --runs must be 1..{runner.MAX_RUNS}")
        if address is not None and len(options["synchronous"] or ()) > 1:
            raise CommandError(
                "INVALID_ARGUMENT: --address measures one server: one --synchronous level"
            )
        bench = runner.Bench(
            sizes,
            address=address,
            progress=runner.RichBar(bar),
            http_enabled=not options["no_http"],
            backlog_enabled=not options["no_backlog"],
            producers=options["producers"] or runner.SUBMIT_CONCURRENCY,
            workers=options["workers"] or runner.LEASE_CONCURRENCY,
            runs=runs,
            synchronous=options["synchronous"] or (),
            with_ceiling=options["with_ceiling"],
            ceiling_schema=options["ceiling_schema"],
        )
        try:
            with bar:
                doc = bench.run()
        except RuntimeError as exc:
            raise CommandError(f"benchmark failed: {exc}") from exc
        if options["plot"]:
            missing = report.plot(doc, Path(options["plot"]))
            doc["meta"]["plot"] = missing or options["plot"]
            if missing:
                console.print(f"[yellow]{missing}[/yellow]")
        text = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
        if options["json_out"]:
            Path(options["json_out"]).write_text(text + "\n", encoding="utf-8")
        if options["markdown_out"]:
            Path(options["markdown_out"]).write_text(report.markdown(doc), encoding="utf-8")
        if options["json"]:
            self.stdout.write(text)
            return
        out = getattr(self.stdout, "_out", sys.stdout)
        tty = bool(getattr(out, "isatty", lambda: False)())
        Console(file=out, force_terminal=tty, width=140 if not tty else None).print(
            report.render(doc)
        )

    def _postgresql(self, options: dict[str, Any], sizes: Sizes, bar: RichProgress) -> None:
        """Run the PostgreSQL benchmark (``relay_bench.postgresql``) and report it."""
        import psycopg

        from relay_bench import postgresql, runner

        if not options["database_url"].startswith(("postgresql://", "postgres://")):
            raise CommandError("INVALID_ARGUMENT: --database-url must be postgresql://...")
        workers = tuple(n for n in options["workers"] or () if n <= 16) or postgresql.WORKERS
        producers = options["producers"] or postgresql.PRODUCERS
        bench = postgresql.PgBench(
            options["database_url"],
            sizes,
            progress=runner.RichBar(bar),
            producers=producers,
            workers=workers,
            backlog_enabled=not options["no_backlog"],
            backlog_only=options["backlog_only"],
        )
        try:
            with bar:
                doc = bench.run()
        except (RuntimeError, psycopg.Error) as exc:
            raise CommandError(f"benchmark failed: {exc}") from exc
        if options["backlog_only"]:
            self._backlog_report(doc, options)
            return
        text = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
        if options["json_out"]:
            Path(options["json_out"]).write_text(text + "\n", encoding="utf-8")
        table = postgresql.markdown(doc)
        if options["markdown_out"]:
            Path(options["markdown_out"]).write_text(table, encoding="utf-8")
        self.stdout.write(text if options["json"] else table)

    def _backlog_report(self, doc: dict[str, Any], options: dict[str, Any]) -> None:
        """Write a ``--backlog-only`` document: JSON (``--json``, ``--json-out``) or its
        Markdown tables (``report.backlog_markdown``; also to ``--markdown-out``)."""
        from relay_bench import report

        text = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
        table = report.backlog_markdown(doc)
        if options["json_out"]:
            Path(options["json_out"]).write_text(text + "\n", encoding="utf-8")
        if options["markdown_out"]:
            Path(options["markdown_out"]).write_text(table, encoding="utf-8")
        self.stdout.write(text if options["json"] else table)
