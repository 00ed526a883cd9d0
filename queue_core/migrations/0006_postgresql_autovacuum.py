"""PostgreSQL only: vacuum and analyse relay_job and relay_attempt sooner than the defaults.

Every transition updates a job row, so a busy queue leaves dead tuples fast; PostgreSQL's
default (vacuum once 20% of the table is dead) lets a table of finished jobs bloat before it
runs. Per-table storage parameters (PostgreSQL's CREATE TABLE ... WITH, "Storage
Parameters") make these two tables vacuum after about 1% of their rows died, with a cost limit
high enough to keep up. Nothing happens on other databases.
"""

from typing import Any

from django.db import migrations

TABLES = ("relay_job", "relay_attempt")
SETTINGS = (
    "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000, "
    "autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_limit = 2000"
)
RESET = (
    "autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, "
    "autovacuum_analyze_scale_factor, autovacuum_vacuum_cost_limit"
)


def tune(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for table in TABLES:
            schema_editor.execute(f"ALTER TABLE {table} SET ({SETTINGS})")


def untune(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for table in TABLES:
            schema_editor.execute(f"ALTER TABLE {table} RESET ({RESET})")


class Migration(migrations.Migration):

    dependencies = [
        ("queue_core", "0005_server_registry"),
    ]

    operations = [migrations.RunPython(tune, untune)]
