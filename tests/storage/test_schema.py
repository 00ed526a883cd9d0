"""The migrated schema, once per storage driver: every index the models declare is there.

On SQLite Django rebuilds a table to change a constraint, and the copy keeps only what the
model state declares: migration 0011's rebuild dropped ``relay_job_queue_id``, which 0003
had made with plain SQL, from every SQLite database (the console's job list of one queue
then sorted the whole queue). These tests read the test databases, migrated from 0001 as an
operator's are, and compare them with the models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from django.apps import apps
from django.db import connections
from django.db.models import Index, UniqueConstraint

from tests.procs import FUTURE_MIGRATION
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
