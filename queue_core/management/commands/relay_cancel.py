"""``relay cancel JOB_ID...``: cancel jobs through the server (the ``cancel`` op).

A ready, pending or retrying job is cancelled at once; a leased one is marked, and its worker
stops it at its next renew (the line says ``cancel requested``). A finished job is refused
with ``JOB_FINISHED``. Like ``relay dead retry``: one line per job, exit 1 when any failed.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from queue_core import errors
from queue_core.client import RelayClient
from queue_core.management.relay_command import EXIT_ERROR, RelayClientCommand, command_error


class Command(RelayClientCommand):
    """Cancel each job given; print what happened to each."""

    help = (
        "Cancel jobs: ready, pending and retrying ones at once; a running one is told to stop "
        "at its worker's next renew. A finished job is refused (JOB_FINISHED)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Define JOB_ID..."""
        parser.add_argument("job_ids", nargs="+", metavar="JOB_ID")
        super().add_arguments(parser)

    def run(self, client: RelayClient, **options: Any) -> None:
        """Cancel every id in order; report each failure and exit 1 if any failed.

        Raises:
            CommandError: ``CODE: message`` (exit 1) for one job that failed, or a summary of
                the codes when several were given.
        """
        job_ids: list[str] = list(dict.fromkeys(options["job_ids"]))  # once each, in order
        results: list[dict[str, Any]] = []
        failures: list[errors.RelayError] = []
        for job_id in job_ids:
            try:
                out = client.cancel(job_id)
            except errors.RelayError as exc:
                failures.append(exc)
                results.append({"job_id": job_id, "ok": False, "error": exc.to_dict()})
                if not options["json"] and len(job_ids) > 1:  # one job: the error says it
                    self.stderr.write(f"{job_id}: {exc.code}: {exc.message}")
                continue
            results.append({"job_id": job_id, "ok": True, **out})
            if not options["json"]:
                job = out["job"]
                if out["cancelled"]:
                    self.stdout.write(f"{job_id}: cancelled")
                else:
                    holder = job.get("leased_by") or "its worker"
                    self.stdout.write(
                        f"{job_id}: cancel requested; {holder} stops it at its next renew"
                    )
        if options["json"]:
            self.print_json({"results": results})
        if len(failures) == 1 and len(job_ids) == 1:
            raise command_error(failures[0])
        if failures:
            codes = ", ".join(sorted({exc.code for exc in failures}))
            raise CommandError(
                f"{codes}: {len(failures)} of {len(job_ids)} jobs failed", returncode=EXIT_ERROR
            )
