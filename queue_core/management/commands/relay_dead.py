"""``relay dead list|retry|purge``: browse, replay and delete dead-lettered jobs (``retry``
and ``purge`` take cancelled jobs too)."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import CommandError, CommandParser
from rich.table import Table

from queue_core import errors
from queue_core.client import RelayClient
from queue_core.management.relay_command import (
    EXIT_ERROR,
    RelayClientCommand,
    add_connection_arguments,
    command_error,
    fmt_ms,
)


class Command(RelayClientCommand):
    """List dead jobs, replay them to ready, or purge them."""

    help = (
        "Dead letters. 'list' pages through dead jobs; 'retry JOB_ID...' replays them to ready "
        "(attempt history kept); 'purge JOB_ID...' deletes them for good."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Define the list, retry and purge subcommands, each with --address and --json."""
        actions = parser.add_subparsers(dest="action", required=True, metavar="{list,retry,purge}")
        listing = actions.add_parser("list", help="List dead jobs, oldest first.")
        listing.add_argument("--queue", metavar="QUEUE", help="Only this queue.")
        listing.add_argument(
            "--limit", type=int, default=100, metavar="N", help="Page size, 1..1000 (default 100)."
        )
        listing.add_argument(
            "--after", metavar="JOB_ID", help="Start after this job id (the printed cursor)."
        )
        add_connection_arguments(listing)
        retry = actions.add_parser("retry", help="Replay dead jobs to ready.")
        retry.add_argument("job_ids", nargs="+", metavar="JOB_ID")
        retry.add_argument(
            "--dry-run", action="store_true", help="Only check that each job is dead."
        )
        add_connection_arguments(retry)
        purge = actions.add_parser("purge", help="Delete dead jobs for good.")
        purge.add_argument("job_ids", nargs="+", metavar="JOB_ID")
        purge.add_argument(
            "--yes",
            action="store_true",
            help="Do not ask for confirmation (never asked when stdin is not a terminal).",
        )
        purge.add_argument(
            "--dry-run", action="store_true", help="Only check that each job is dead."
        )
        add_connection_arguments(purge)

    def run(self, client: RelayClient, **options: Any) -> None:
        """Dispatch to the chosen action."""
        if options["action"] == "list":
            self._list(client, options)
            return
        job_ids: list[str] = list(dict.fromkeys(options["job_ids"]))  # once each, in order
        if options["action"] == "purge" and not (options["yes"] or options["dry_run"]):
            self._confirm_purge(job_ids)
        self._each(
            client, options["action"], job_ids, json=options["json"], dry_run=options["dry_run"]
        )

    def _list(self, client: RelayClient, options: dict[str, Any]) -> None:
        result = client.dead_list(options["queue"], options["limit"], options["after"])
        if options["json"]:
            self.print_json(result)
            return
        jobs = result["jobs"]
        if not jobs:
            self.stdout.write("no dead jobs")
            return
        table = Table()
        table.add_column("job", no_wrap=True)
        for column in ("queue", "attempt", "failures", "died", "reason"):
            table.add_column(column, overflow="fold")
        for job in jobs:
            table.add_row(
                str(job.get("id")),
                str(job.get("queue")),
                str(job.get("attempt")),
                str(job.get("failures")),
                fmt_ms(job.get("finished_at_ms")),
                str(job.get("dead_reason") or job.get("last_error") or ""),
            )
        self.print_rich(table)
        if result.get("next_after"):
            self.stdout.write(f"more: relay dead list --after {result['next_after']}")

    def _confirm_purge(self, job_ids: list[str]) -> None:
        if not sys.stdin.isatty():
            return
        answer = input(f"Purge {len(job_ids)} dead job(s) for good? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            raise CommandError("aborted: nothing purged", returncode=EXIT_ERROR)

    def _each(
        self, client: RelayClient, action: str, job_ids: list[str], *, json: bool, dry_run: bool
    ) -> None:
        """Apply ``action`` to every id; report each failure and exit 1 if any failed."""
        results: list[dict[str, Any]] = []
        failures: list[errors.RelayError] = []
        for job_id in job_ids:
            try:
                if dry_run:
                    job = client.inspect(job_id)["job"]
                    if job.get("state") not in ("dead", "cancelled"):
                        raise errors.InvalidState(
                            f"cannot {action} {job_id}: it is {job.get('state')}, "
                            "not dead or cancelled",
                            job_id=job_id,
                            state=job.get("state"),
                        )
                    line = f"{job_id}: would {'replay' if action == 'retry' else 'purge'}"
                    result: dict[str, Any] = {"job_id": job_id, "dry_run": True, "ok": True}
                elif action == "retry":
                    job = client.dead_retry(job_id)["job"]
                    line = f"{job_id}: replayed, now {job.get('state')}"
                    result = {"job_id": job_id, "ok": True, "job": job}
                else:
                    client.dead_purge(job_id)
                    line = f"{job_id}: purged"
                    result = {"job_id": job_id, "ok": True, "purged": True}
            except errors.RelayError as exc:
                failures.append(exc)
                results.append({"job_id": job_id, "ok": False, "error": exc.to_dict()})
                if not json and len(job_ids) > 1:  # one id's error is the command's own
                    self.stderr.write(f"{job_id}: {exc.code}: {exc.message}")
                continue
            results.append(result)
            if not json:
                self.stdout.write(line)
        if json:
            self.print_json({"results": results})
        if len(failures) == 1 and len(job_ids) == 1:
            raise command_error(failures[0])
        if failures:
            codes = ", ".join(sorted({exc.code for exc in failures}))
            raise CommandError(
                f"{codes}: {len(failures)} of {len(job_ids)} jobs failed", returncode=EXIT_ERROR
            )
