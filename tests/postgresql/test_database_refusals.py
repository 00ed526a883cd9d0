"""What a call gets when PostgreSQL refuses a statement for a reason of its own: a stable code
a client can act on, never ``INTERNAL`` with a traceback in the server's log.

A chaos review on a private PostgreSQL found three SQLSTATEs answered ``INTERNAL``: a session
ended for ``idle_in_transaction_session_timeout`` (25P03, which docs/failure-model.md said
fails ``UNAVAILABLE``), a read-only database (25006: a standby, or
``default_transaction_read_only``; the connection kept the setting it started with, so writes
failed for 34 s after it was lifted) and a statement cancelled by ``statement_timeout``
(57014).
"""

from __future__ import annotations

import psycopg
import psycopg.errors
import pytest
from django.db import DatabaseError, connections

from queue_core import errors
from queue_core.models import Job
from queue_core.service import QueueService
from queue_core.storage import driver_for
from queue_core.storage.postgresql.driver import _translate
from tests.postgresql.conftest import DATABASES, count_sessions
from tests.storage.conftest import database_url
from tests.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

ALIAS = "postgresql"


def session(sql: str) -> None:
    """Run ``sql`` on this thread's connection of the driver (a session setting)."""
    with connections[ALIAS].cursor() as cursor:
        cursor.execute(sql)


def test_a_statement_cancelled_by_statement_timeout_is_busy() -> None:
    service = QueueService(driver=driver_for(ALIAS))
    job = service.submit("locked", 1)["job"]
    (lease,) = service.claim(["locked"], worker_id="w")
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    with psycopg.connect(url) as holder:
        holder.execute("SELECT 1 FROM relay_job WHERE id = %s FOR UPDATE", [job["id"]])
        session("SET statement_timeout = '100ms'")  # shorter than lock_timeout (2 s)
        try:
            with pytest.raises(errors.StoreBusy, match="57014"):
                service.ack(job["id"], worker_id="w", lease_token=lease["lease_token"])
        finally:
            session("RESET statement_timeout")
        holder.rollback()
    assert service.ack(job["id"], worker_id="w", lease_token=lease["lease_token"])
    assert service.get(job["id"])["state"] == "succeeded"


def test_a_read_only_database_is_storage_io_and_a_new_session_writes_once_it_is_lifted() -> None:
    service = QueueService(driver=driver_for(ALIAS))
    session("SET default_transaction_read_only = on")  # as a standby's sessions are
    with pytest.raises(errors.StorageIO, match="25006"):
        service.submit("ro", 1)
    assert not Job.objects.using(ALIAS).filter(queue="ro").exists()
    # That session would refuse every write until it ended; the driver replaced it.
    assert service.submit("ro", 2)["job"]["state"] == "ready"


def test_a_session_ended_for_idling_in_its_transaction_is_unavailable_and_replaced() -> None:
    service = QueueService(driver=driver_for(ALIAS))
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    service.submit("idle", 0)
    session("SET idle_in_transaction_session_timeout = '50ms'")
    pid = connections[ALIAS].connection.info.backend_pid

    def idle_then_submit() -> None:
        with service.transaction():
            service.submit("idle", 1)
            wait_until(
                lambda: count_sessions(url, "a.pid = %s", [pid]) == 0,
                what="PostgreSQL to end the idle session",
            )
            service.submit("idle", 2)

    with pytest.raises(errors.Unavailable):
        idle_then_submit()
    assert service.submit("idle", 3)["job"]["state"] == "ready"  # on a new session
    assert sorted(
        Job.objects.using(ALIAS).filter(queue="idle").values_list("payload", flat=True)
    ) == ["0", "3"]


def test_a_commit_answered_with_the_idle_session_timeout_never_ran_so_it_is_unavailable() -> None:
    # PostgreSQL ends a session for idle_in_transaction_session_timeout only while it waits for
    # the next command: the COMMIT never ran. It was answered OUTCOME_UNKNOWN (a chaos review).
    service = QueueService(driver=driver_for(ALIAS))
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    session("SET idle_in_transaction_session_timeout = '50ms'")
    pid = connections[ALIAS].connection.info.backend_pid

    def submit_then_idle() -> None:
        with service.transaction():
            service.submit("idle-commit", 1)
            wait_until(
                lambda: count_sessions(url, "a.pid = %s", [pid]) == 0,
                what="PostgreSQL to end the idle session",
            )

    with pytest.raises(errors.Unavailable) as raised:
        submit_then_idle()
    assert not isinstance(raised.value, errors.OutcomeUnknown)
    assert not Job.objects.using(ALIAS).filter(queue="idle-commit").exists()


@pytest.mark.parametrize(
    ("error", "mapped"),
    [
        (psycopg.errors.DiskFull("could not extend file: No space left on device"), "STORAGE_FULL"),
        (psycopg.errors.ReadOnlySqlTransaction("read-only transaction"), "STORAGE_IO"),
        (psycopg.errors.QueryCanceled("canceling statement due to user request"), "BUSY"),
        (psycopg.errors.IdleInTransactionSessionTimeout("terminating connection"), "UNAVAILABLE"),
        (psycopg.errors.AdminShutdown("terminating connection"), "UNAVAILABLE"),
        (psycopg.errors.UndefinedTable('relation "relay_job" does not exist'), None),
    ],
)
def test_sqlstates_map_to_relay_codes(error: psycopg.Error, mapped: str | None) -> None:
    # A disk filling up cannot be staged on the shared test server: the mapping itself.
    wrapped = DatabaseError(str(error))
    wrapped.__cause__ = error
    got = _translate(wrapped)
    assert (got.code if isinstance(got, errors.RelayError) else got) == mapped
