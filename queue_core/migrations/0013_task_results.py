"""Results stored by the service: ``relay_result``, one row per job that a worker sent a
result (with its ack) or structured errors (with its fails) for.

No vendor-specific SQL: a plain table keyed by the job id (a deferred foreign key, as
``relay_attempt``'s), written and deleted through the drivers' named statements
(``store_result``, ``store_errors``, ``delete_result``). No SQLite trigger is needed:
``relay_job_count`` counts jobs, not results.
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("queue_core", "0012_job_meta_unique"),
    ]

    operations = [
        migrations.CreateModel(
            name="JobResult",
            fields=[
                (
                    "job",
                    models.OneToOneField(
                        db_column="job_id",
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="result",
                        serialize=False,
                        to="queue_core.job",
                    ),
                ),
                (
                    "return_value",
                    models.TextField(
                        blank=True,
                        help_text=(
                            "The result sent with the ack, as canonical JSON text; NULL when "
                            "none was."
                        ),
                        null=True,
                    ),
                ),
                (
                    "errors",
                    models.TextField(
                        help_text=(
                            'JSON list of {"attempt", "exception_class", "traceback"}, oldest '
                            "first: the newest that fit RELAY_MAX_RESULT_BYTES."
                        )
                    ),
                ),
                (
                    "updated_at_ms",
                    models.BigIntegerField(help_text="When the row was last written, epoch ms."),
                ),
            ],
            options={
                "db_table": "relay_result",
            },
        ),
    ]
