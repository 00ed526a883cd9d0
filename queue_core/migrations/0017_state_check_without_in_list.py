"""SQLite: ``relay_job_state_known`` checks one equality per state, ORed, not ``state IN (...)``.

SQLite checks a constant ``IN`` list of more than two values by building a temporary index of
the list (``OpenEphemeral``) each time it checks the constraint: on every INSERT and UPDATE of a
``relay_job`` row. Under callgrind that cost about 35,000 machine instructions a row, 16% of a
claim's statement and 22% of an ack's; seven equalities cost a few hundred. The check admits
the same states. On SQLite a constraint lives in ``CREATE TABLE``, so Django rebuilds
``relay_job`` (a copy of the table, twice: remove, then add), which drops its triggers: the
``relay_job_count`` triggers are made again afterwards and the counts rebuilt, as in 0011.

On PostgreSQL, which checks an ``IN`` list without such a cost, the database keeps its
constraint: rebuilding it would scan the table under an exclusive lock for nothing. Only the
migration state changes there.
"""

import importlib
from typing import Any

from django.db import migrations, models

# Migration 0011's triggers and count rebuild (unchanged since).
_0011 = importlib.import_module("queue_core.migrations.0011_cancel_time_limit")

STATES = ["pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled"]

NEW = models.CheckConstraint(
    condition=models.Q(*(("state", state) for state in STATES), _connector="OR"),
    name="relay_job_state_known",
)


class _OnSqlite:
    """Run the operation's database half on SQLite only (its state half everywhere)."""

    def database_forwards(self, app_label: str, schema_editor: Any, *args: Any) -> None:
        if schema_editor.connection.vendor == "sqlite":
            super().database_forwards(app_label, schema_editor, *args)  # type: ignore[misc]

    def database_backwards(self, app_label: str, schema_editor: Any, *args: Any) -> None:
        if schema_editor.connection.vendor == "sqlite":
            super().database_backwards(app_label, schema_editor, *args)  # type: ignore[misc]


class RemoveConstraintOnSqlite(_OnSqlite, migrations.RemoveConstraint):
    pass


class AddConstraintOnSqlite(_OnSqlite, migrations.AddConstraint):
    pass


class Migration(migrations.Migration):
    dependencies = [
        ("queue_core", "0016_postgresql_like_indexes"),
    ]

    operations = [
        # Unapplying rebuilds the table too: the triggers are made again last (this runs last).
        migrations.RunPython(migrations.RunPython.noop, _0011.restore_triggers),
        RemoveConstraintOnSqlite(model_name="job", name="relay_job_state_known"),
        AddConstraintOnSqlite(model_name="job", constraint=NEW),
        migrations.RunPython(_0011.restore_triggers, migrations.RunPython.noop),
    ]
