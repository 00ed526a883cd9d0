"""PostgreSQL only: drop the ``_like`` indexes of Relay's other tables, as 0006 did for two.

Migration 0006 dropped Django's ``varchar_pattern_ops`` indexes (``..._like``, for ``LIKE
'x%'``, which Relay never runs) on ``relay_job`` and ``relay_attempt``; the tables made since
kept theirs (an upgrade review): ``relay_result``'s costs one more index write on every ack
with a result and every fail with errors. ``relay_queue``, ``relay_server`` and
``relay_api_key`` are looked up by equality only. Nothing happens on other databases; the
reverse does not recreate them.
"""

from typing import Any

from django.db import migrations

TABLES = ("relay_result", "relay_queue", "relay_server", "relay_api_key")


def drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() "
            "AND tablename = ANY(%s) AND indexname LIKE '%%\\_like'",
            [list(TABLES)],
        )
        likes = [row[0] for row in cursor.fetchall()]
    for name in likes:
        schema_editor.execute(f'DROP INDEX IF EXISTS "{name}"')


class Migration(migrations.Migration):
    dependencies = [
        ("queue_core", "0015_console_indexes_in_state"),
    ]

    operations = [migrations.RunPython(drop, migrations.RunPython.noop)]
