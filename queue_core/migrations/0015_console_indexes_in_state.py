"""Give the console's two indexes of migration 0003 model state, and bring back the one SQLite lost.

Migration 0003 created ``relay_job_queue_id`` (``queue, id``) and ``relay_attempt_failed``
with plain SQL and no model state. On SQLite, migration 0011 rebuilds ``relay_job`` (Django
copies the table to change a CHECK constraint) and the copy keeps only the indexes the model
declares, so every SQLite database migrated past 0011 lost ``relay_job_queue_id``: the
console's job list of one queue, newest first, sorted the whole queue (1.2 s a page at
1,000,000 jobs; 0.3 ms with the index). PostgreSQL kept it.

Both indexes are now declared in ``Meta.indexes``, so a later rebuild keeps them, and
``CREATE INDEX IF NOT EXISTS`` makes the missing one again (once, over the rows there: about
2 s a million jobs on the benchmark machine) and leaves the others as they are. Going back
leaves them: migration 0003's own reverse drops them.
"""

from django.db import migrations, models
from django.db.models import Q


class Migration(migrations.Migration):
    dependencies = [
        ("queue_core", "0014_attempt_job_index"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    sql="CREATE INDEX IF NOT EXISTS relay_job_queue_id ON relay_job (queue, id)",
                    reverse_sql=migrations.RunSQL.noop,
                ),
                migrations.RunSQL(
                    sql=(
                        "CREATE INDEX IF NOT EXISTS relay_attempt_failed "
                        "ON relay_attempt (ended_at_ms) WHERE outcome = 'failed'"
                    ),
                    reverse_sql=migrations.RunSQL.noop,
                ),
            ],
            state_operations=[
                migrations.AddIndex(
                    model_name="job",
                    index=models.Index(fields=["queue", "id"], name="relay_job_queue_id"),
                ),
                migrations.AddIndex(
                    model_name="jobattempt",
                    index=models.Index(
                        condition=Q(outcome="failed"),
                        fields=["ended_at_ms"],
                        name="relay_attempt_failed",
                    ),
                ),
            ],
        ),
    ]
