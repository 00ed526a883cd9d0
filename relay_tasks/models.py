"""The legacy result row of one Django task run on Relay (read only now)."""

from __future__ import annotations

from django.db import models


class TaskResultRecord(models.Model):
    """Return value and errors of the Django task that Relay job ``job_id`` runs.

    Written by the ``relay_worker --tasks`` executor of releases before migration 0013; results
    now go to ``queue_core``'s ``relay_result`` with the ack or fail, and this table is only
    read (``RelayBackend`` on the shared database, for jobs that finished before the upgrade)
    and deleted from with its jobs. No foreign key to ``relay_job``: ``QueueService.purge``
    deletes the job and this row in one transaction with raw SQL (``delete_task_result``); a
    row left without its job reads as "no such result".
    """

    job_id = models.CharField(primary_key=True, max_length=40)
    return_value = models.TextField(
        null=True,
        blank=True,
        help_text="JSON return value of the attempt that succeeded; NULL before.",
    )
    errors = models.TextField(
        default="[]",
        help_text='JSON list of {"attempt", "exception_class_path", "traceback"}.',
    )
    updated_at_ms = models.BigIntegerField(help_text="When the row was last written, epoch ms.")

    class Meta:
        db_table = "relay_task_result"

    def __str__(self) -> str:
        return f"result of {self.job_id}"
