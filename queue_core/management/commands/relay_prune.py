"""``relay prune --older-than 7d [--state succeeded|dead|cancelled|all] [--dry-run]``: delete
finished jobs by age now, as the server's retention does (docs/failure-model.md, "Retention").

A local command: it opens the database itself (``RELAY_DB`` / ``RELAY_DATABASE_URL``, or the
global ``--db`` / ``--database-url``) through ``QueueService.prune``, in the same bounded
batches, so it may run beside a live server. Exit codes: 0 done, 1 a bad argument (a SQLite
file that is not there), a database not migrated, or a Relay error (``CODE: message`` on
stderr), 9 a database a newer Relay migrated.
"""

from __future__ import annotations

from typing import Any

import orjson
from django.core.management.base import CommandParser

from queue_core import errors
from queue_core.conf import parse_duration_ms
from queue_core.management.relay_command import (
    RelayBaseCommand,
    command_error,
    invalid_argument,
    local_service,
)
from queue_core.service import PRUNABLE_STATES, PRUNE_BATCH


class Command(RelayBaseCommand):
    """Delete SUCCEEDED, DEAD and CANCELLED jobs (or those of one ``--state``) that finished
    more than ``--older-than`` ago."""

    help = (
        "Delete finished jobs (with their attempts, events and task results) that finished "
        "more than --older-than ago, in batches; the server does this by itself with "
        "RELAY_RETENTION_SUCCEEDED / RELAY_RETENTION_DEAD."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Define --older-than, --state, --batch, --yield, --dry-run and --json."""
        parser.add_argument(
            "--older-than",
            required=True,
            metavar="DURATION",
            help="age past which finished jobs go: 7d, 12h, 30m, 45s, 500ms (must be > 0).",
        )
        parser.add_argument(
            "--state",
            choices=[*PRUNABLE_STATES, "all"],
            default="all",
            help="which finished jobs (default: all: succeeded, dead and cancelled).",
        )
        parser.add_argument(
            "--batch",
            type=int,
            default=PRUNE_BATCH,
            metavar="N",
            help=f"jobs per transaction, 1..10000 (default {PRUNE_BATCH}).",
        )
        parser.add_argument(
            "--yield",
            dest="yield_factor",
            type=float,
            default=2.0,
            metavar="FACTOR",
            help="after each batch, wait FACTOR times as long as it took, leaving the write "
            "lock to the server (default 2: pruning takes a third of the time; 0: no wait).",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="only count the jobs that would go."
        )
        parser.add_argument("--json", action="store_true", help="print the counts as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Prune (or count) and print how many jobs went (or would go).

        Raises:
            CommandError: ``INVALID_ARGUMENT`` (exit 1) for a bad duration or batch; any
                other ``RelayError`` as ``CODE: message`` (exit 1).
        """
        try:
            age_ms = parse_duration_ms(options["older_than"])
        except ValueError as exc:
            raise invalid_argument(f"--older-than: {exc}") from None
        if age_ms <= 0:
            raise invalid_argument("--older-than must be more than 0")
        if not 0 <= options["yield_factor"] <= 100:
            raise invalid_argument("--yield must be 0..100")
        states = PRUNABLE_STATES if options["state"] == "all" else (options["state"],)
        older_than = dict.fromkeys(states, age_ms)
        service = local_service()
        try:
            if options["dry_run"]:
                counts = service.count_prunable(older_than)
            else:
                counts = service.prune(
                    older_than, batch=options["batch"], yield_factor=options["yield_factor"]
                )
        except errors.RelayError as exc:
            raise command_error(exc) from None
        finally:
            service.close()
        if options["json"]:
            self.stdout.write(orjson.dumps({**counts, "dry_run": options["dry_run"]}).decode())
            return
        verb = "would prune" if options["dry_run"] else "pruned"
        total = sum(counts.values())
        self.stdout.write(
            f"{verb} {total} jobs ({counts['succeeded']} succeeded, {counts['dead']} dead, "
            f"{counts['cancelled']} cancelled) finished more than {options['older_than']} ago"
        )
