"""``relay inspect JOB_ID``: one job, its attempt history and its events."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.management.base import CommandParser
from rich.table import Table

from queue_core.client import RelayClient
from queue_core.management.relay_command import (
    RelayClientCommand,
    compact_json,
    fmt_duration,
    fmt_ms,
)


class Command(RelayClientCommand):
    """Print a job's fields and attempt history (or the raw job with --json)."""

    help = "Show a job: state, retry policy, payload, every attempt and every state change."

    def add_arguments(self, parser: CommandParser) -> None:
        """Define JOB_ID."""
        parser.add_argument("job_id", metavar="JOB_ID")
        super().add_arguments(parser)

    def run(self, client: RelayClient, **options: Any) -> None:
        """Fetch the job and print it."""
        job = client.inspect(options["job_id"])["job"]
        if options["json"]:
            self.print_json(job)
            return
        self.print_rich(*job_renderables(job))


def job_renderables(job: Mapping[str, Any]) -> list[Table]:
    """Return rich tables for a Job dict: its fields, its attempts and its events."""
    policy = job.get("retry_policy") or {}
    fields = Table.grid(padding=(0, 2))
    fields.add_column(style="bold")
    fields.add_column(overflow="fold")
    rows: list[tuple[str, str]] = [
        ("job", str(job.get("id"))),
        ("queue", str(job.get("queue"))),
        ("state", str(job.get("state"))),
        ("priority", str(job.get("priority"))),
        ("attempt", str(job.get("attempt"))),
        ("failures", f"{job.get('failures')} (max_retries {job.get('max_retries')})"),
        (
            "retry policy",
            f"{policy.get('backoff')} base={fmt_duration(policy.get('base_ms'))} "
            f"cap={fmt_duration(policy.get('cap_ms'))} jitter={policy.get('jitter')}",
        ),
        ("idempotency key", str(job.get("idempotency_key") or "-")),
        ("unique", str(job.get("unique") or "window")),
        ("meta", compact_json(job.get("meta") or {}, limit=2000)),
        ("created", fmt_ms(job.get("created_at_ms"))),
        ("available at", fmt_ms(job.get("available_at_ms"))),
        ("ready since", fmt_ms(job.get("ready_since_ms"))),
        ("leased by", str(job.get("leased_by") or "-")),
        ("lease expires", fmt_ms(job.get("lease_expires_at_ms"))),
        ("finished", fmt_ms(job.get("finished_at_ms"))),
        ("last error", str(job.get("last_error") or "-")),
        ("dead reason", str(job.get("dead_reason") or "-")),
        ("cancel requested", fmt_ms(job.get("cancel_requested_at_ms"))),
        ("time limit", fmt_duration(job.get("time_limit_ms"))),
        ("payload", compact_json(job.get("payload"), limit=2000)),
    ]
    for name, value in rows:
        fields.add_row(name, value)
    out = [fields]

    history = job.get("history") or []
    attempts = Table(title="attempts", title_justify="left")
    for column in ("#", "worker", "started", "duration", "outcome", "error"):
        attempts.add_column(column, overflow="fold")
    for entry in history:
        started, ended = entry.get("started_at_ms"), entry.get("ended_at_ms")
        attempts.add_row(
            str(entry.get("attempt")),
            str(entry.get("worker_id") or "-"),
            fmt_ms(started),
            fmt_duration(ended - started) if started is not None and ended is not None else "-",
            str(entry.get("outcome") or "running"),
            str(entry.get("error") or ""),
        )
    if history:
        out.append(attempts)

    events = job.get("events") or []
    event_table = Table(title="events", title_justify="left")
    for column in ("at", "event", "from", "to", "actor"):
        event_table.add_column(column)
    for event in events:
        event_table.add_row(
            fmt_ms(event.get("at_ms")),
            str(event.get("event")),
            str(event.get("from_state") or "-"),
            str(event.get("to_state") or "-"),
            str(event.get("actor") or "-"),
        )
    if events:
        out.append(event_table)
    return out
