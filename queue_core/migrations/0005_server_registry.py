"""The server registry (several servers on one PostgreSQL database) and the live-jobs index.

- relay_server: one row per running ``relay server``, renewed by its heartbeat.
- relay_job_live: jobs by queue and state, without SUCCEEDED ones, so the metrics gauges and
  ``stats`` count what is live and never every finished job (bloat stays out of a scrape).
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("queue_core", "0004_attempt_retry_at"),
    ]

    operations = [
        migrations.CreateModel(
            name="RelayServer",
            fields=[
                ("id", models.CharField(max_length=40, primary_key=True, serialize=False)),
                ("address", models.CharField(max_length=300)),
                ("host", models.CharField(max_length=255)),
                ("pid", models.IntegerField()),
                ("started_at_ms", models.BigIntegerField()),
                ("seen_at_ms", models.BigIntegerField()),
                (
                    "clock_skew_ms",
                    models.BigIntegerField(
                        default=0, help_text="This server's clock minus the database's, in ms."
                    ),
                ),
            ],
            options={"db_table": "relay_server", "ordering": ["started_at_ms"]},
        ),
        migrations.RunSQL(
            sql=(
                "CREATE INDEX IF NOT EXISTS relay_job_live "
                "ON relay_job (queue, state) WHERE state <> 'succeeded'"
            ),
            reverse_sql="DROP INDEX IF EXISTS relay_job_live",
        ),
    ]
