"""``relay bench``: a real Relay server measured against the raw SQLite floor, or with
``--database-url`` on PostgreSQL against a raw psycopg floor.

See docs/benchmarking.md for what it measures and how to read it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson
from django.core.management.base import BaseCommand, CommandError, CommandParser
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from queue_core.bench import report
from queue_core.bench.runner import (
    FULL,
    LEASE_CONCURRENCY,
    QUICK,
    SUBMIT_CONCURRENCY,
    Bench,
    Progress,
    Sizes,
)
from queue_core.management.relay_command import resolve_address


def _levels(text: str) -> tuple[int, ...]:
    """Parse ``"1,4,16"`` into ``(1, 4, 16)`` (each 1..256)."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,4,16, got {text!r}") from exc
    if not levels or not all(1 <= n <= 256 for n in levels):
        raise argparse.ArgumentTypeError("each level must be 1..256")
    return levels


class _Bar(Progress):
    """The runner's progress hook on a rich progress bar (one bar per step)."""

    def __init__(self, progress: RichProgress) -> None:
        self.progress = progress
        self.task: Any = None

    def step(self, name: str, total: int) -> None:
        self.task = self.progress.add_task(name, total=max(1, total))

    def tick(self, n: int = 1) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)

    def done(self) -> None:
        if self.task is not None:
            task = self.progress.tasks[self.task]
            self.progress.update(self.task, completed=task.total)
            self.task = None


class Command(BaseCommand):
    """Run the benchmark, print a table (or JSON), optionally write JSON and a PNG plot.

    Exit codes: 0 when the run finished (whether or not the targets were met), 1 when a
    scenario could not run (the server would not start, a client failed).
    """

    help = (
        "Measure submit and lease+ack throughput, latency percentiles, backlog scaling and "
        "peak RSS of a real relay_server, each as a ratio to a raw SQLite loop measured in "
        "the same run."
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
        parser.add_argument("--json", action="store_true", help="Print JSON instead of tables.")
        parser.add_argument(
            "--quick", action="store_true", help="Smaller counts, no 1M backlog: under a minute."
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
        parser.add_argument("--no-http", action="store_true", help="Skip the HTTP scenario.")
        parser.add_argument(
            "--no-backlog", action="store_true", help="Skip the backlog scaling scenario."
        )
        parser.add_argument("--no-progress", action="store_true", help="No progress bar on stderr.")
        parser.add_argument(
            "--producers",
            type=_levels,
            default=SUBMIT_CONCURRENCY,
            metavar="N,N,...",
            help="Concurrent producers of the submission scenarios (default 1,4,16).",
        )
        parser.add_argument(
            "--workers",
            type=_levels,
            default=LEASE_CONCURRENCY,
            metavar="N,N,...",
            help="Concurrent workers of the lease+ack scenario (default 1,4,16,64).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the benchmark and report."""
        if options["scale"] <= 0:
            raise CommandError("INVALID_ARGUMENT: --scale must be > 0")
        address = resolve_address(options["address"]) if options["address"] else None
        sizes = QUICK if options["quick"] else FULL
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
        if options["database_url"]:
            self._postgresql(options, sizes, bar)
            return
        bench = Bench(
            sizes,
            address=address,
            progress=_Bar(bar),
            http_enabled=not options["no_http"],
            backlog_enabled=not options["no_backlog"],
            producers=options["producers"],
            workers=options["workers"],
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
        """Run the PostgreSQL benchmark (``queue_core.bench.postgresql``) and report it."""
        import psycopg

        from queue_core.bench import postgresql

        if not options["database_url"].startswith(("postgresql://", "postgres://")):
            raise CommandError("INVALID_ARGUMENT: --database-url must be postgresql://...")
        workers = tuple(n for n in options["workers"] if n <= 16) or postgresql.WORKERS
        if options["workers"] == LEASE_CONCURRENCY:
            workers = postgresql.WORKERS
        producers = options["producers"]
        if producers == SUBMIT_CONCURRENCY:
            producers = postgresql.PRODUCERS
        bench = postgresql.PgBench(
            options["database_url"],
            sizes,
            progress=_Bar(bar),
            producers=producers,
            workers=workers,
            backlog_enabled=not options["no_backlog"],
        )
        try:
            with bar:
                doc = bench.run()
        except (RuntimeError, psycopg.Error) as exc:
            raise CommandError(f"benchmark failed: {exc}") from exc
        text = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
        if options["json_out"]:
            Path(options["json_out"]).write_text(text + "\n", encoding="utf-8")
        table = postgresql.markdown(doc)
        if options["markdown_out"]:
            Path(options["markdown_out"]).write_text(table, encoding="utf-8")
        self.stdout.write(text if options["json"] else table)
