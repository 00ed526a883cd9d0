"""SQLite only: keep the number of jobs per (queue, state) in ``relay_job_count``.

``stats`` counted jobs with ``GROUP BY queue, state`` over an index of every job: a read as
long as the table, and readers that long, back to back, never let the write-ahead log restart
(a 385 MiB ``-wal`` beside a 111 MiB database in 40 s with four clients looping ``stats``;
docs/failure-model.md, item 6). Triggers on ``relay_job`` keep the counts in the same
transaction as each insert, state change and delete, whoever writes (the server, the HTTP API,
a migration), so ``stats`` reads one row per queue and state. Nothing happens on PostgreSQL.
"""

from typing import Any

from django.db import migrations

CREATE = (
    """CREATE TABLE relay_job_count (
        queue varchar(128) NOT NULL,
        state varchar(16) NOT NULL,
        n integer NOT NULL,
        PRIMARY KEY (queue, state)
    ) WITHOUT ROWID""",
    """INSERT INTO relay_job_count (queue, state, n)
       SELECT queue, state, COUNT(*) FROM relay_job GROUP BY queue, state""",
    """CREATE TRIGGER relay_job_count_insert AFTER INSERT ON relay_job
       BEGIN
           INSERT INTO relay_job_count (queue, state, n) VALUES (new.queue, new.state, 1)
           ON CONFLICT (queue, state) DO UPDATE SET n = n + 1;
       END""",
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
)
DROP = (
    "DROP TRIGGER IF EXISTS relay_job_count_insert",
    "DROP TRIGGER IF EXISTS relay_job_count_update",
    "DROP TRIGGER IF EXISTS relay_job_count_delete",
    "DROP TABLE IF EXISTS relay_job_count",
)


def create(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "sqlite":
        for sql in CREATE:
            schema_editor.execute(sql)


def drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "sqlite":
        for sql in DROP:
            schema_editor.execute(sql)


class Migration(migrations.Migration):

    dependencies = [
        ("queue_core", "0006_postgresql_tuning"),
    ]

    operations = [migrations.RunPython(create, drop)]
