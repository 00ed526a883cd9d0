"""The TCP server's group commit on PostgreSQL runs a batch without a SAVEPOINT per call, and
still keeps every call apart: a call that fails cleanly is set aside, and one that fails after
writing (or on a statement the database refused) sends the batch round again with savepoints,
so nothing it wrote survives and the other calls still commit once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from queue_core import errors
from queue_core.models import Job
from queue_core.protocol import dispatch, limits
from queue_core.protocol.writer import Call, GroupCommit
from queue_core.service import QueueService
from queue_core.storage import driver_for
from tests.postgresql.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


@pytest.fixture
def service() -> QueueService:
    return QueueService(driver=driver_for("postgresql"))


def run_batch(service: QueueService, fns: list[Callable[[], Any]]) -> tuple[list[Any], list[str]]:
    """Run ``fns`` as one group commit of a PostgreSQL writer; return each call's result (or
    exception) and the statements sent."""
    loop = asyncio.new_event_loop()
    try:
        calls = [Call(fn, loop.create_future(), loop) for fn in fns]
        group = GroupCommit(
            service,
            sweep=lambda: set(service.sweep()),
            on_ready=lambda queues: None,
            failures=limits.Every(limits.FAILURE_LOG_EVERY_S),
        )
        assert group.flat
        with CaptureQueriesContext(connections["postgresql"]) as sent:
            outcomes = group.run(calls)
        assert group.commits == 1
        return [value for _ok, value in outcomes], [q["sql"] for q in sent.captured_queries]
    finally:
        loop.close()


def savepoints(sql: list[str]) -> int:
    return sum(1 for text in sql if text.startswith("SAVEPOINT"))


def test_a_clean_failure_is_set_apart_without_savepoints(service: QueueService) -> None:
    results, sql = run_batch(
        service,
        [
            lambda: service.submit("g", 1),
            lambda: service.ack("job_nope", worker_id="w", lease_token="t"),
            lambda: service.submit("g", 2),
        ],
    )
    assert isinstance(results[1], errors.JobNotFound)
    assert results[0]["job"]["state"] == results[2]["job"]["state"] == "ready"
    assert Job.objects.using("postgresql").filter(queue="g").count() == 2
    assert savepoints(sql) == 0


def test_a_call_that_fails_after_writing_leaves_nothing(service: QueueService) -> None:
    service.submit("g", {"v": 1}, idempotency_key="k")
    results, sql = run_batch(
        service,
        [
            lambda: service.submit("g", "before"),
            # The first job is inserted, then the key conflicts: the batch must not keep it.
            lambda: service.submit_batch(
                [
                    {"queue": "g", "payload": "half"},
                    {"queue": "g", "payload": {"v": 2}, "idempotency_key": "k"},
                ]
            ),
            lambda: service.submit("g", "after"),
        ],
    )
    assert isinstance(results[1], errors.IdempotencyConflict)
    payloads = sorted(
        Job.objects.using("postgresql").filter(queue="g").values_list("payload", flat=True)
    )
    assert payloads == ['"after"', '"before"', '{"v":1}']
    assert savepoints(sql) >= 3  # the batch went round again, a savepoint per call


def test_a_statement_the_database_refuses_fails_that_call_alone(service: QueueService) -> None:
    def refused() -> None:
        with connections["postgresql"].cursor() as cursor:
            cursor.execute("SELECT 1 / 0")

    results, _ = run_batch(
        service, [lambda: service.submit("g", 1), refused, lambda: service.submit("g", 2)]
    )
    assert "division by zero" in str(results[1])
    assert Job.objects.using("postgresql").filter(queue="g").count() == 2


def test_a_call_that_runs_twice_gets_the_same_answer(service: QueueService) -> None:
    # The protocol's submit handler, as the server calls it: the flat round fails on the
    # conflicting batch, the second round runs every call again from the same arguments.
    submit = dispatch.VERBS["submit"].handler
    ctx = dispatch.Context(peer="test")
    bad: dict[str, Any] = {"queue": "g", "payload": 1, "priority": 7}
    good: dict[str, Any] = {"queue": "g", "payload": 2, "idempotency_key": "k2"}
    service.submit("g", {"v": 1}, idempotency_key="k")
    results, _ = run_batch(
        service,
        [
            lambda: submit(service, bad, ctx),
            lambda: service.submit_batch(
                [
                    {"queue": "g", "payload": "half"},
                    {"queue": "g", "payload": 9, "idempotency_key": "k"},
                ]
            ),
            lambda: submit(service, good, ctx),
        ],
    )
    assert isinstance(results[0], errors.InvalidArgument)
    assert isinstance(results[1], errors.IdempotencyConflict)
    assert results[2].result["job"]["state"] == "ready"
    assert bad == {"queue": "g", "payload": 1, "priority": 7}  # untouched


def test_a_lone_invalid_call_is_answered_in_the_flat_round(service: QueueService) -> None:
    results, sql = run_batch(service, [lambda: service.submit("g", 1, priority=7)])
    assert isinstance(results[0], errors.InvalidArgument)
    assert savepoints(sql) == 0
