"""``relay stats [--queue Q]``: job counts by state per queue, the oldest ready job's age, and
the live servers."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from django.core.management.base import CommandParser
from rich.table import Table

from queue_core.client import RelayClient
from queue_core.management.relay_command import RelayClientCommand, fmt_duration, fmt_ms

STATES = ("pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled")
# Rows a table shows unless --limit says otherwise: rich lays out about 2,000 rows a second here
# (30,000 queues took 25 s); the totals always count every queue.
DEFAULT_LIMIT = 100


class Command(RelayClientCommand):
    """Print per-queue counts by state as a table (or the raw result with --json)."""

    help = "Show job counts by state for each queue and how long the oldest ready job has waited."

    def add_arguments(self, parser: CommandParser) -> None:
        """Define --queue."""
        parser.add_argument("--queue", metavar="QUEUE", help="Only this queue.")
        parser.add_argument(
            "--limit",
            type=_limit,
            default=DEFAULT_LIMIT,
            metavar="N",
            help=f"Show at most N queues a table, by name (default {DEFAULT_LIMIT}; 0: all). "
            "The totals and --json always hold every queue.",
        )
        super().add_arguments(parser)

    def run(self, client: RelayClient, **options: Any) -> None:
        """Fetch stats and print them."""
        result = client.stats(options["queue"])
        while result.get("next_after"):  # thousands of queues come a page at a time
            page = client.stats(options["queue"], after=result["next_after"])
            result["queues"].update(page["queues"])
            result.setdefault("controls", {}).update(page.get("controls") or {})
            result["next_after"] = page["next_after"]
        if options["json"]:
            self.print_json(result)
            return
        limit: int = options["limit"]
        self._queues(result, options["queue"], limit)
        if result.get("controls"):
            self._controls(result["controls"], limit)
        if result.get("servers"):
            self._servers(result["servers"])

    def _queues(self, result: Mapping[str, Any], only: str | None, limit: int) -> None:
        """Print the counts by queue and state."""
        queues: dict[str, dict[str, Any]] = result.get("queues") or {}
        if not queues:
            self.stdout.write("no jobs" + (f" in queue {only}" if only else ""))
            return
        table = Table(
            title=f"Relay queues at {fmt_ms(result.get('server_time_ms'))}",
            title_justify="left",
        )
        table.add_column("queue")
        for state in STATES:
            table.add_column(state, justify="right")
        table.add_column("oldest ready", justify="right")
        for name in _shown(queues, limit):
            counts = queues[name]
            table.add_row(
                name,
                *(str(counts.get(state, 0)) for state in STATES),
                fmt_duration(counts.get("oldest_ready_age_ms")),
            )
        totals = result.get("totals")
        if len(queues) > 1 and isinstance(totals, dict):
            ages = [
                c["oldest_ready_age_ms"] for c in queues.values() if c.get("oldest_ready_age_ms")
            ]
            oldest = totals.get("oldest_ready_age_ms", max(ages, default=None))
            table.add_section()
            table.add_row(
                "total",
                *(str(totals.get(state, 0)) for state in STATES),
                fmt_duration(oldest),
                style="bold",
            )
        self.print_rich(table)
        self._more(len(queues), limit, "queues")

    def _controls(self, controls: Mapping[str, Mapping[str, Any]], limit: int) -> None:
        """Print the paused, capped and rate-limited queues."""
        table = Table(title="Queue controls", title_justify="left")
        for column in ("queue", "state", "max leased", "rate/s", "burst", "set"):
            table.add_column(column, justify="left" if column in ("queue", "state") else "right")
        for name in _shown(controls, limit):
            c = controls[name]
            table.add_row(
                name,
                "paused" if c.get("paused") else "running",
                str(c.get("max_leased") or "-"),
                f"{c['rate_per_s']:g}" if c.get("rate_per_s") else "-",
                str(c.get("burst")) if c.get("rate_per_s") else "-",
                fmt_ms(c.get("updated_at_ms")),
            )
        self.print_rich(table)
        self._more(len(controls), limit, "controlled queues")

    def _more(self, count: int, limit: int, what: str) -> None:
        """Say how many rows a table left out past ``limit``, and how to see them."""
        if limit and count > limit:
            self.stdout.write(
                f"{count - limit:,} of {count:,} {what} not shown "
                "(--limit 0 shows every one, --json the raw result)"
            )

    def _servers(self, servers: Sequence[Mapping[str, Any]]) -> None:
        """Print the live servers (several share a PostgreSQL database)."""
        table = Table(title=f"Live servers: {len(servers)}", title_justify="left")
        for column in ("address", "host", "pid", "up since", "last seen", "clock skew"):
            table.add_column(column, justify="left" if column in ("address", "host") else "right")
        for server in servers:
            table.add_row(
                str(server.get("address")),
                str(server.get("host")),
                str(server.get("pid")),
                fmt_ms(server.get("started_at_ms")),
                fmt_ms(server.get("seen_at_ms")),
                f"{server.get('clock_skew_ms', 0)} ms",
            )
        self.print_rich(table)


def _limit(text: str) -> int:
    """Parse --limit: a whole number of rows, 0 or more (0: no limit)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number, 0 or more: {text!r}")
    return value


def _shown(rows: Mapping[str, Any], limit: int) -> list[str]:
    """The names of ``rows`` a table shows: the first ``limit`` by name (all when 0)."""
    names = sorted(rows)
    return names[:limit] if limit else names
