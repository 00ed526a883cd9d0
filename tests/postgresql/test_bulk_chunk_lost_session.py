"""A bulk chunk (``queue_api.calls.run_each``, ``queue_admin.operations.BulkRunner``) whose
session PostgreSQL ended between two of its calls kept nothing: its jobs must all get
``UNAVAILABLE``, as ``PostgresDriver.write`` promises for "a savepoint that could not roll back".

Found by a chaos run (pg_terminate_backend / SIGSTOP of the gunicorn worker during
``POST /api/v1/dead/replay``): the calls before the loss came back ``OUTCOME_UNKNOWN`` and
the ones after it ``UNAVAILABLE``, in one chunk whose jobs were all still DEAD. The next
call's ``SAVEPOINT`` fails inside Django's ``Atomic.__enter__``, which never marks the
connection ``needs_rollback``, so the driver's guard does not fire and the COMMIT is tried
on the dead session (``OutcomeUnknown``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connections
from django.test import RequestFactory

from queue_api import calls
from queue_core import errors
from queue_core.models import Job
from queue_core.service import QueueService
from queue_core.storage import driver_for
from tests.postgresql.conftest import DATABASES, count_sessions
from tests.storage.conftest import database_url
from tests.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

ALIAS = "postgresql"


@pytest.fixture
def service(pg_service: QueueService) -> QueueService:
    """The root ``dead_job`` fixture's service: here, on the PostgreSQL test database."""
    return pg_service


@pytest.fixture
def dead_jobs(dead_job: Callable[..., dict[str, Any]]) -> Callable[[str, int], list[str]]:
    """``dead_jobs(queue, n) -> [job ids]``, each failed non-retryably."""
    return lambda queue, n: [dead_job(queue=queue)["id"] for _ in range(n)]


@pytest.mark.parametrize("how", ["idle_timeout", "terminated"])
def test_a_chunk_whose_session_ended_between_calls_is_unavailable_for_every_job(
    how: str,
    service: QueueService,
    dead_jobs: Callable[[str, int], list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    ids = dead_jobs(f"lost-{how}", 3)
    with connections[ALIAS].cursor() as cursor:
        idle = "SET idle_in_transaction_session_timeout = '50ms'"
        cursor.execute(idle if how == "idle_timeout" else "SELECT 1")
    pid = connections[ALIAS].connection.info.backend_pid
    replay, replays = service.replay, []

    def replay_losing_the_session_after_the_first(job_id: str, **kwargs: Any) -> Any:
        if replays:  # the session ends between the chunk's first call and its second
            if how == "terminated":
                with psycopg.connect(url, autocommit=True) as killer:
                    killer.execute("SELECT pg_terminate_backend(%s)", [pid])
            wait_until(
                lambda: count_sessions(url, "a.pid = %s", [pid]) == 0,
                what="PostgreSQL to end the session",
            )
        replays.append(job_id)
        return replay(job_id, **kwargs)

    monkeypatch.setattr(service, "replay", replay_losing_the_session_after_the_first)
    monkeypatch.setattr(calls, "service", lambda: service)
    done = calls.run_each(RequestFactory().post("/"), "dead_retry", [{"job_id": i} for i in ids])
    assert {service.get(i)["state"] for i in ids} == {"dead"}  # nothing was kept
    codes = [o.code if isinstance(o, errors.RelayError) else "ok" for o in done]
    # Before the fix: ['OUTCOME_UNKNOWN', 'UNAVAILABLE', 'UNAVAILABLE'].
    assert codes == ["UNAVAILABLE"] * 3


def test_one_locked_row_does_not_undo_or_stop_the_consoles_bulk_purge(
    service: QueueService, dead_jobs: Callable[[str, int], list[str]]
) -> None:
    """The console's ``BulkRunner`` says each call "rolls back alone when the service refuses
    it"; the HTTP API's ``run_each`` answers BUSY for a job whose row stays locked past
    ``RELAY_LOCK_TIMEOUT_MS`` and goes on. The console let that one job's ``StoreBusy``
    roll its whole chunk back and stop the run ("The database stayed busy ... 200 left"),
    purging none of the 199 free jobs (a chaos run: 2 of 2; also after a deadlock between
    the console and an HTTP bulk replay, 2 of 2 three-way races)."""
    from queue_admin.operations import BulkRunner, Op, chunked

    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    ids = dead_jobs("locked-row", 60)
    with psycopg.connect(url) as holder:
        holder.execute("SELECT 1 FROM relay_job WHERE id = %s FOR UPDATE", [ids[3]])
        outcome = BulkRunner(service, actor="alice").run(
            Op.PURGE, chunked(ids), dead_only=True, total=len(ids)
        )
        holder.rollback()
    left = [i for i in ids if Job.objects.using(ALIAS).filter(id=i).exists()]
    # Before: done 0, busy True, remaining 60, all 60 jobs left.
    assert left == [ids[3]]
    assert len(outcome.done) == len(ids) - 1


def test_the_consoles_bulk_replay_reports_a_lost_session_instead_of_raising(
    dead_jobs: Callable[[str, int], list[str]],
) -> None:
    """``BulkRunner.run`` catches only ``StoreBusy`` from a chunk; ``queue_admin.admin._run``
    catches nothing around it. A PostgreSQL session lost mid-run (a restart, a
    ``pg_terminate_backend``, the idle-in-transaction timeout) raised ``Unavailable`` out of
    ``run``: the console's action answered a 500, and the operator was not told that the
    earlier chunks had been replayed (a chaos run: 1,450 and 1,200 of 4,000 replayed, 2 of 2)."""
    from queue_admin.operations import BulkRunner, Op, chunked

    url = database_url("postgresql")["RELAY_DATABASE_URL"]

    class Dropping(QueueService):
        calls = 0

        def replay(self, job_id: str, *, actor: str | None = None) -> dict[str, object]:
            Dropping.calls += 1
            if Dropping.calls == 60:  # inside the second chunk
                pid = connections[ALIAS].connection.info.backend_pid
                with psycopg.connect(url, autocommit=True) as killer:
                    killer.execute("SELECT pg_terminate_backend(%s)", [pid])
            return super().replay(job_id, actor=actor)

    ids = dead_jobs("dropped-session", 150)
    outcome = BulkRunner(Dropping(driver=driver_for(ALIAS)), actor="alice").run(
        Op.REPLAY, chunked(ids), total=len(ids)
    )
    assert len(outcome.done) >= 50  # the first chunk committed, and is reported
    assert outcome.remaining > 0 or len(outcome.done) == len(ids)
