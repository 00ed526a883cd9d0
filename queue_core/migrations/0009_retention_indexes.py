"""Retention: partial indexes on finished_at_ms for SUCCEEDED and for DEAD jobs.

``QueueService.prune`` deletes the oldest finished jobs of one state in small batches; with
these it seeks to them instead of scanning every job of the state. Each costs one index
entry per job that reaches its state (an ack writes one more entry).
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("queue_core", "0008_sqlite_count_inserts_in_driver"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=models.Q(("state", "succeeded")),
                fields=["finished_at_ms"],
                name="relay_job_succeeded_done",
            ),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=models.Q(("state", "dead")),
                fields=["finished_at_ms"],
                name="relay_job_dead_done",
            ),
        ),
    ]
