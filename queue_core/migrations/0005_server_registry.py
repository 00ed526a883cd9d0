"""The server registry: one row per running ``relay server`` (several may serve one PostgreSQL
database), renewed by its heartbeat."""

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
    ]
