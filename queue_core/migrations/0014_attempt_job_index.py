"""Drop ``relay_attempt_job_id_785bc873``, the index Django gave the attempt's foreign key.

The unique constraint ``relay_attempt_unique`` on ``(job_id, attempt)`` already serves every
read by job (``attempts_of``, ``end_attempt``, deleting a job's attempts, the foreign key's
checks) as its leading column, so the second index only cost a write per lease: 1–2% of the
instructions of a lease (docs/benchmarking.md, round 4's "measured and not built").

Plain ``DROP INDEX`` under ``SeparateDatabaseAndState``: Django's own ``AlterField`` to
``db_index=False`` would rebuild the whole attempt table on SQLite (a long write lock on a big
file) where dropping the index frees its pages and nothing else. The name is the same on
SQLite and PostgreSQL (Django derives it from the table and the column).
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("queue_core", "0013_task_results"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    sql="DROP INDEX IF EXISTS relay_attempt_job_id_785bc873",
                    reverse_sql=(
                        "CREATE INDEX IF NOT EXISTS relay_attempt_job_id_785bc873 "
                        "ON relay_attempt (job_id)"
                    ),
                ),
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="jobattempt",
                    name="job",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="attempts",
                        to="queue_core.job",
                    ),
                ),
            ],
        ),
    ]
