"""PostgreSQL only: vacuum relay_job and relay_attempt sooner, and drop the LIKE indexes.

Every transition updates a job row, so a busy queue leaves dead tuples fast; PostgreSQL's
default (vacuum once 20% of the table is dead) lets a table of finished jobs bloat before it
runs. Per-table storage parameters (PostgreSQL's CREATE TABLE ... WITH, "Storage
Parameters") make these two tables vacuum after about 1% of their rows died, with a cost limit
high enough to keep up.

Django gives every text primary key and foreign key on PostgreSQL a second index with
``varchar_pattern_ops`` (``..._like``) for ``LIKE 'x%'`` lookups. Relay never runs those on
its job tables, and each is one more index every submit writes, so they are dropped (the
reverse migration does not recreate them). Nothing happens on other databases.
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
    if schema_editor.connection.vendor != "postgresql":
        return
    for table in TABLES:
        schema_editor.execute(f"ALTER TABLE {table} SET ({SETTINGS})")
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() "
            "AND tablename = ANY(%s) AND indexname LIKE '%%\\_like'",
            [list(TABLES)],
        )
        likes = [row[0] for row in cursor.fetchall()]
    for name in likes:
        schema_editor.execute(f'DROP INDEX IF EXISTS "{name}"')


def untune(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for table in TABLES:
            schema_editor.execute(f"ALTER TABLE {table} RESET ({RESET})")


class Migration(migrations.Migration):

    dependencies = [
        ("queue_core", "0005_server_registry"),
    ]

    operations = [migrations.RunPython(tune, untune)]
