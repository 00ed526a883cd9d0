"""Indexes for the operator console (queue_admin).

- relay_attempt_failed: the overview's "recent failures" reads the newest failed attempts;
  without it that is a scan and sort of every attempt. Partial, so acks and successful
  attempts never touch it.
- relay_job_queue_id: the job list filtered by queue alone, newest first, is a seek instead
  of sorting the whole queue. queue and id never change after insert, so transitions do not
  maintain it; only submit and purge do.

Plain SQL with no model state: models.py is left as it is (the lead may move these into
Meta.indexes with SeparateDatabaseAndState).
"""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("queue_core", "0002_api_key"),
    ]

    operations = [
        migrations.RunSQL(
            sql=(
                "CREATE INDEX IF NOT EXISTS relay_attempt_failed "
                "ON relay_attempt (ended_at_ms) WHERE outcome = 'failed'"
            ),
            reverse_sql="DROP INDEX IF EXISTS relay_attempt_failed",
        ),
        migrations.RunSQL(
            sql="CREATE INDEX IF NOT EXISTS relay_job_queue_id ON relay_job (queue, id)",
            reverse_sql="DROP INDEX IF EXISTS relay_job_queue_id",
        ),
    ]
