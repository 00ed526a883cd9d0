"""Shared-database mode: Relay's calls in the project's process run on the project's own
PostgreSQL connection, and must leave it as the project has it (a review of the mode on
PostgreSQL): a transaction the project manages by hand, and the channels it listens to.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from django.db import connections, transaction

from queue_core.models import Job
from queue_core.service import QueueService
from tests.postgresql.conftest import DATABASES
from tests.storage.conftest import database_url

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

ALIAS = "postgresql"


@pytest.fixture
def scratch() -> Iterator[None]:
    """A table of the project's own, ``project_rows``."""
    with connections[ALIAS].cursor() as cursor:
        cursor.execute("CREATE TABLE project_rows (n integer)")
    yield
    transaction.set_autocommit(True, using=ALIAS)
    with connections[ALIAS].cursor() as cursor:
        cursor.execute("DROP TABLE project_rows")


@pytest.mark.usefixtures("scratch")
@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_a_submit_in_a_transaction_managed_by_hand_joins_it(
    pg_service: QueueService, end: str
) -> None:
    # Autocommit off (Django's manual transactions): the submit closed the connection, so the
    # project's uncommitted row was lost without an error while the job was committed.
    transaction.set_autocommit(False, using=ALIAS)
    with connections[ALIAS].cursor() as cursor:
        cursor.execute("INSERT INTO project_rows VALUES (1)")
    job = pg_service.submit("manual", {"n": 1})["job"]
    getattr(transaction, end)(using=ALIAS)
    transaction.set_autocommit(True, using=ALIAS)
    with connections[ALIAS].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM project_rows")
        rows = cursor.fetchone()[0]
    jobs = Job.objects.using(ALIAS).filter(id=job["id"]).count()
    assert (rows, jobs) == ((1, 1) if end == "commit" else (0, 0))


def test_a_notification_waiting_on_the_projects_connection_keeps_it(
    pg_service: QueueService,
) -> None:
    # A LISTENing connection with a notification waiting was taken for one the server had
    # ended, and closed: its session lock, temporary tables and LISTEN went with it.
    conn = connections[ALIAS]
    with conn.cursor() as cursor:
        cursor.execute("LISTEN project_channel")
        cursor.execute("SELECT pg_advisory_lock(4242)")
    raw = conn.connection
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    with psycopg.connect(url, autocommit=True) as other:
        other.execute("NOTIFY project_channel, 'hello'")
        pg_service.submit("listening", {"n": 1})
        assert conn.connection is raw
        held = other.execute("SELECT pg_try_advisory_lock(4242)").fetchone()
    assert held == (False,)  # still the project's
    got = [n.payload for n in raw.notifies(timeout=5, stop_after=1)]
    assert got == ["hello"]  # and the notification still reaches it
    with conn.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_unlock(4242)")
