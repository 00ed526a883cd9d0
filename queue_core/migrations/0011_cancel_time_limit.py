"""Cancel and time limits (issue 16, items 3 and 4): the CANCELLED state, two columns and an index.

* ``cancel_requested_at_ms``: when a cancel was asked for (a LEASED job's worker is told to stop
  at its next renew; a CANCELLED job keeps when it was cancelled).
* ``time_limit_ms``: the most one attempt may run, in ms from its lease (NULL: no limit).
* ``relay_job_state_known`` admits ``cancelled``; ``relay_job_cancelled_done`` lets retention
  seek to the oldest cancelled jobs, as ``relay_job_dead_done`` does for dead ones.
* The ``queue_core.cancel_job`` permission (the admin's cancel action).

Both columns are nullable without a default, so they are added in place (``ALTER TABLE ...
ADD COLUMN``) on both databases. The CHECK constraint is rebuilt: cheap DDL on PostgreSQL, but
on SQLite, where a constraint lives in ``CREATE TABLE``, Django rebuilds ``relay_job`` (a copy
of the table, twice: remove, then add). That copy drops the table's triggers, so the
``relay_job_count`` triggers of migration 0007 (update and delete; 0008 moved the insert count
into the driver) are created again afterwards and the counts rebuilt.
"""

from typing import Any

from django.db import migrations, models

# Migration 0007's update and delete triggers, as they stand after 0008.
TRIGGERS = (
    "DROP TRIGGER IF EXISTS relay_job_count_update",
    "DROP TRIGGER IF EXISTS relay_job_count_delete",
    """CREATE TRIGGER relay_job_count_update AFTER UPDATE OF queue, state ON relay_job
       WHEN old.state IS NOT new.state OR old.queue IS NOT new.queue
       BEGIN
           UPDATE relay_job_count SET n = n - 1 WHERE queue = old.queue AND state = old.state;
           INSERT INTO relay_job_count (queue, state, n) VALUES (new.queue, new.state, 1)
           ON CONFLICT (queue, state) DO UPDATE SET n = n + 1;
       END""",
    """CREATE TRIGGER relay_job_count_delete AFTER DELETE ON relay_job
       BEGIN
           UPDATE relay_job_count SET n = n - 1 WHERE queue = old.queue AND state = old.state;
       END""",
    "DELETE FROM relay_job_count",
    """INSERT INTO relay_job_count (queue, state, n)
       SELECT queue, state, COUNT(*) FROM relay_job GROUP BY queue, state""",
)


def restore_triggers(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "sqlite":
        for sql in TRIGGERS:
            schema_editor.execute(sql)


STATES_BEFORE = ["pending", "ready", "leased", "retrying", "succeeded", "dead"]
STATES_AFTER = [*STATES_BEFORE, "cancelled"]


class Migration(migrations.Migration):
    dependencies = [
        ("queue_core", "0010_queue_controls"),
    ]

    operations = [
        # Unapplying rebuilds the table too: the triggers are made again last (this runs last).
        migrations.RunPython(migrations.RunPython.noop, restore_triggers),
        migrations.AddField(
            model_name="job",
            name="cancel_requested_at_ms",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="time_limit_ms",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="job",
            name="state",
            field=models.CharField(
                choices=[(s, s.upper()) for s in STATES_AFTER],
                max_length=16,
            ),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=models.Q(("state", "cancelled")),
                fields=["finished_at_ms"],
                name="relay_job_cancelled_done",
            ),
        ),
        migrations.RemoveConstraint(model_name="job", name="relay_job_state_known"),
        migrations.AddConstraint(
            model_name="job",
            constraint=models.CheckConstraint(
                condition=models.Q(("state__in", STATES_AFTER)), name="relay_job_state_known"
            ),
        ),
        migrations.RunPython(restore_triggers, migrations.RunPython.noop),
        # The admin's cancel action needs its own permission.
        migrations.AlterModelOptions(
            name="deadletter",
            options={
                "permissions": [
                    ("replay_job", "Can replay dead-lettered jobs"),
                    ("purge_job", "Can purge terminal jobs"),
                    ("cancel_job", "Can cancel jobs"),
                ],
                "verbose_name": "dead letter",
            },
        ),
    ]
