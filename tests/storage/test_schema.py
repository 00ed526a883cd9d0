"""The migrated schema, once per storage driver: every index the models declare is there.

On SQLite Django rebuilds a table to change a constraint, and the copy keeps only what the
model state declares: migration 0011's rebuild dropped ``relay_job_queue_id``, which 0003
had made with plain SQL, from every SQLite database (the console's job list of one queue
then sorted the whole queue). These tests read the test databases, migrated from 0001 as an
operator's are, and compare them with the models.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.apps import apps
from django.db import connections
from django.db.models import Index, UniqueConstraint

from tests.procs import FUTURE_MIGRATION, Spawner
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


def declared() -> dict[str, set[str]]:
    """Each queue_core table's declared index names (``Meta.indexes`` and unique constraints)."""
    tables: dict[str, set[str]] = {}
    for model in apps.get_app_config("queue_core").get_models():
        if model._meta.proxy:
            continue  # the console's views of relay_job declare nothing of their own
        names = {index.name for index in model._meta.indexes if isinstance(index, Index)}
        names |= {
            c.name for c in model._meta.constraints if isinstance(c, UniqueConstraint) and c.name
        }
        tables[model._meta.db_table] = names
    return tables


def test_every_declared_index_exists(alias: str) -> None:
    connection = connections[alias]
    missing = {}
    with connection.cursor() as cursor:
        for table, names in declared().items():
            present = set(connection.introspection.get_constraints(cursor, table))
            if names - present:
                missing[table] = sorted(names - present)
    assert not missing, missing
    # The console's two indexes of migration 0003 are declared since 0015.
    assert {"relay_job_queue_id"} <= declared()["relay_job"]
    assert {"relay_attempt_failed"} <= declared()["relay_attempt"]


def test_the_console_job_list_of_one_queue_is_a_seek(alias: str) -> None:
    # The console's page of one queue's jobs, newest first: an index walk that stops after a
    # page, not a sort of every job of the queue.
    query = "SELECT id FROM relay_job WHERE queue = 'q' ORDER BY id DESC LIMIT 100"
    with connections[alias].cursor() as cursor:
        if alias == "postgresql":
            cursor.execute("SET enable_seqscan = off")  # an empty table: plan as a large one
            cursor.execute("EXPLAIN " + query)
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + query)
        plan = " | ".join(str(row[-1]) for row in cursor.fetchall())
    assert "relay_job_queue_id" in plan, plan
    assert "TEMP B-TREE" not in plan and "Sort" not in plan, plan


def test_the_migrations_applied_are_this_codes(alias: str) -> None:
    from queue_core import schema

    assert schema.problem(alias) is None


@contextlib.contextmanager
def recorded(alias: str, name: str, *, applied: bool) -> Iterator[None]:
    """``queue_core.<name>`` recorded as applied (or not) in ``django_migrations`` for the
    block, as it was after it."""
    insert = (
        "INSERT INTO django_migrations (app, name, applied) "
        "VALUES ('queue_core', %s, CURRENT_TIMESTAMP)"
    )
    delete = "DELETE FROM django_migrations WHERE app = 'queue_core' AND name = %s"
    with connections[alias].cursor() as cursor:
        cursor.execute(insert if applied else delete, [name])
    try:
        yield
    finally:
        with connections[alias].cursor() as cursor:
            cursor.execute(delete if applied else insert, [name])


def test_a_database_a_newer_relay_migrated_is_named_so(alias: str) -> None:
    # An older server on a database a newer one had migrated answered stats with INTERNAL
    # once a job was CANCELLED, and ignored pauses (an upgrade review): it must refuse.
    from queue_core import schema

    with recorded(alias, FUTURE_MIGRATION, applied=True):
        found = schema.problem(alias)
    assert found is not None and found.newer
    assert f"queue_core.{FUTURE_MIGRATION}" in found.message


def test_a_database_behind_the_code_is_named_so(alias: str) -> None:
    from django.db.migrations.loader import MigrationLoader

    from queue_core import schema

    graph = MigrationLoader(None, ignore_no_migrations=True).graph
    (last,) = [name for app, name in graph.leaf_nodes() if app == "queue_core"]
    with recorded(alias, last, applied=False):
        found = schema.problem(alias)
    assert found is not None and not found.newer
    assert f"1 unapplied migration(s) (queue_core.{last})" in found.message


def _ephemeral_opens(sql: str) -> int:
    """How many temporary b-trees (``OpenEphemeral``) SQLite's program for ``sql`` opens."""
    params = dict.fromkeys(re.findall(r":(\w+)", sql))
    with connections["default"].cursor() as cursor:
        program = cursor.connection.execute("EXPLAIN " + sql, params).fetchall()
    return sum(1 for row in program if row[1] == "OpenEphemeral")


@pytest.mark.parametrize("backend", ["sqlite"])
def test_writing_a_job_row_on_sqlite_builds_no_temporary_index() -> None:
    # SQLite checked relay_job_state_known (``state IN`` seven constants) by building a
    # temporary index of the list on every INSERT and UPDATE of a row: about 35,000
    # instructions a row, a sixth of a claim's statement (migration 0017).
    from queue_core.storage.sqlite.driver import NAMED_QUERIES

    insert = NAMED_QUERIES["insert_job"]
    assert _ephemeral_opens(insert) == 0
    update = "UPDATE relay_job SET state = :state WHERE id = :id"
    assert _ephemeral_opens(update) == 0
    # The statement the check was measured on: only its RETURNING clause's table is left.
    assert _ephemeral_opens(NAMED_QUERIES["ack"]) == 1


JOB_COLUMNS = (
    "id, queue, state, priority, payload, attempt, failures, max_retries, backoff, "
    "backoff_base_ms, backoff_cap_ms, jitter, created_at_ms, available_at_ms, ready_since_ms, "
    "lease_token, leased_by, lease_expires_at_ms, updated_at_ms"
)


def _job(n: int, state: str) -> tuple[object, ...]:
    """A ``relay_job`` row in ``state`` that every CHECK of the table admits."""
    due = 5_000 if state in ("pending", "retrying") else None
    lease = ("t", "w", 9_000) if state == "leased" else (None, None, None)
    ready = 1_000 if state == "ready" else None
    head = (f"j{n:03d}", f"q{n % 3}", state, 1, "{}", 0, 0, 3, "exponential", 1000, 60000, 1)
    return (*head, 1_000, due, ready, *lease, 1_000)


def _by_key(counts: list[tuple[object, ...]]) -> dict[tuple[object, object], object]:
    """relay_job_count's rows as ``{(queue, state): n}``."""
    return {(queue, state): n for queue, state, n in counts}


def _schema_and_counts(path: str) -> tuple[list[tuple[str, str]], list[tuple[object, ...]]]:
    """The file's indexes and triggers on relay_job (name, SQL without quotes: Django quotes
    the names of an index it makes again, 0015's plain SQL did not), and relay_job_count."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        schema = db.execute(
            "SELECT name, replace(sql, '\"', '') FROM sqlite_master "
            "WHERE tbl_name = 'relay_job' AND type IN ('index', 'trigger') ORDER BY name"
        ).fetchall()
        counts = db.execute("SELECT queue, state, n FROM relay_job_count ORDER BY 1, 2").fetchall()
    return schema, counts


@pytest.mark.parametrize("backend", ["sqlite"])
def test_migration_0017_on_sqlite_keeps_indexes_triggers_and_counts(
    spawn: Spawner, tmp_path: Path
) -> None:
    # The rebuild of relay_job that a constraint change takes on SQLite drops the table's
    # triggers (as 0011's did): they are made again and the counts rebuilt, both ways.
    path = str(tmp_path / "upgrade.db")
    spawn.migrate("queue_core", "0016_postgresql_like_indexes", RELAY_DB=path)
    states = ["pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled"]
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        marks = ", ".join("?" * len(JOB_COLUMNS.split(",")))
        db.executemany(
            f"INSERT INTO relay_job ({JOB_COLUMNS}) VALUES ({marks})",
            [_job(n, states[n % len(states)]) for n in range(60)],
        )
        db.execute(
            "INSERT INTO relay_job_count (queue, state, n) "
            "SELECT queue, state, COUNT(*) FROM relay_job GROUP BY queue, state"
        )
    before = _schema_and_counts(path)
    # The primary key's index, the 10 declared, 2 triggers; 7 states in 3 queues.
    assert len(before[0]) == 13 and len(before[1]) == 21
    spawn.migrate("queue_core", "0017_state_check_without_in_list", RELAY_DB=path)
    assert _schema_and_counts(path) == before
    with contextlib.closing(sqlite3.connect(path)) as db:
        table = db.execute("SELECT sql FROM sqlite_master WHERE name = 'relay_job'").fetchone()[0]
        assert "\"state\" = 'cancelled'" in table and "'ready', 'leased'" not in table
        with pytest.raises(sqlite3.IntegrityError, match="relay_job_state_known"):
            db.execute("UPDATE relay_job SET state = 'lost' WHERE id = 'j001'")
        with db:  # the count trigger follows a transition
            db.execute(
                "UPDATE relay_job SET state = 'ready', ready_since_ms = 1, "
                "available_at_ms = NULL WHERE id = 'j000'"
            )
        moved = _by_key(_schema_and_counts(path)[1])
    assert moved[("q0", "pending")] == _by_key(before[1])[("q0", "pending")] - 1
    assert moved[("q0", "ready")] == _by_key(before[1])[("q0", "ready")] + 1
    spawn.migrate("queue_core", "0016_postgresql_like_indexes", RELAY_DB=path)
    schema, counts = _schema_and_counts(path)
    assert schema == before[0]
    assert _by_key(counts) == {key: n for key, n in moved.items() if n}  # rebuilt
