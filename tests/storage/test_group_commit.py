"""The TCP server's group commit runs a batch without a SAVEPOINT per call, on both drivers,
and still keeps every call apart: a call that fails cleanly is set aside, and one that fails
after writing (or on a statement the database refused) sends the batch round again with
savepoints, so nothing it wrote survives and the other calls still commit once.

On PostgreSQL a SAVEPOINT costs round trips; on SQLite two statements and the Python around
them (about 8% of a lone call's instructions, docs/benchmarking.md). Writes nested deeper
than the call keep their savepoints on SQLite (``ack_batch`` relies on them).
"""

from __future__ import annotations

import contextlib
import gc
import sqlite3
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from queue_core import errors
from queue_core.models import Job
from queue_core.protocol import dispatch
from queue_core.service import QueueService
from tests.groupcommit import run_group
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


@contextlib.contextmanager
def statements(alias: str) -> Iterator[list[str]]:
    """Every statement sent on ``alias``'s connection meanwhile: Django's captured queries,
    and on SQLite sqlite3's trace (savepoints and BEGIN go straight to the sqlite3
    connection)."""
    conn = connections[alias]
    sent: list[str] = []
    if conn.vendor == "sqlite":
        conn.ensure_connection()
        raw: sqlite3.Connection = conn.connection
        raw.set_trace_callback(sent.append)
        try:
            yield sent
        finally:
            raw.set_trace_callback(None)
        return
    with CaptureQueriesContext(conn) as captured:
        yield sent
    sent.extend(q["sql"] for q in captured.captured_queries)


@pytest.fixture
def run_batch(
    service: QueueService, alias: str
) -> Callable[[list[Callable[[], Any]]], tuple[list[Any], list[str]]]:
    def run(fns: list[Callable[[], Any]]) -> tuple[list[Any], list[str]]:
        """Run ``fns`` as one group commit; return each call's result (or exception) and the
        statements sent."""
        with statements(alias) as sent:
            outcomes, group = run_group(service, fns)
        assert group.flat and group.commits == 1
        return [value for _ok, value in outcomes], sent

    return run


def savepoints(sql: list[str]) -> int:
    return sum(1 for text in sql if text.upper().startswith("SAVEPOINT"))


def test_a_clean_failure_is_set_apart_without_savepoints(
    service: QueueService, run_batch: Any
) -> None:
    results, sql = run_batch(
        [
            lambda: service.submit("g", 1),
            lambda: service.ack("job_nope", worker_id="w", lease_token="t"),
            lambda: service.submit("g", 2),
        ],
    )
    assert isinstance(results[1], errors.JobNotFound)
    assert results[0]["job"]["state"] == results[2]["job"]["state"] == "ready"
    assert Job.objects.filter(queue="g").count() == 2
    assert savepoints(sql) == 0


def test_a_call_that_fails_after_writing_leaves_nothing(
    service: QueueService, run_batch: Any
) -> None:
    service.submit("g", {"v": 1}, idempotency_key="k")
    results, sql = run_batch(
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
    payloads = sorted(Job.objects.filter(queue="g").values_list("payload", flat=True))
    assert payloads == ['"after"', '"before"', '{"v":1}']
    assert savepoints(sql) >= 3  # the batch went round again, a savepoint per call


def test_a_statement_the_database_refuses_fails_that_call_alone(
    service: QueueService, run_batch: Any, alias: str, backend: str
) -> None:
    # PostgreSQL aborts the transaction (the batch goes round again); SQLite refuses the
    # statement alone and keeps the transaction (the call is set apart).
    bad = "SELECT 1 / 0" if backend == "postgresql" else "SELECT * FROM relay_no_such_table"

    def refused() -> None:
        with connections[alias].cursor() as cursor:
            cursor.execute(bad)

    results, _ = run_batch(
        [lambda: service.submit("g", 1), refused, lambda: service.submit("g", 2)]
    )
    assert ("division by zero" if backend == "postgresql" else "no such table") in str(results[1])
    assert Job.objects.filter(queue="g").count() == 2


def test_a_call_that_runs_twice_gets_the_same_answer(service: QueueService, run_batch: Any) -> None:
    # The protocol's submit handler, as the server calls it: the flat round fails on the
    # conflicting batch, the second round runs every call again from the same arguments.
    submit = dispatch.VERBS["submit"].handler
    ctx = dispatch.Context(peer="test")
    bad: dict[str, Any] = {"queue": "g", "payload": 1, "priority": 7}
    good: dict[str, Any] = {"queue": "g", "payload": 2, "idempotency_key": "k2"}
    service.submit("g", {"v": 1}, idempotency_key="k")
    results, _ = run_batch(
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


def test_a_lone_invalid_call_is_answered_in_the_flat_round(
    service: QueueService, run_batch: Any
) -> None:
    results, sql = run_batch([lambda: service.submit("g", 1, priority=7)])
    assert isinstance(results[0], errors.InvalidArgument)
    assert savepoints(sql) == 0


def test_a_refused_ack_in_a_batch_of_acks_is_set_apart_in_the_flat_round(
    service: QueueService, run_batch: Any, backend: str
) -> None:
    # ack_batch catches each ack's refusal and goes on: its acks take no savepoint on either
    # driver; a refused one (it changed no row) is set apart with forgive.
    for n in range(3):
        service.submit("g", n)
    leases = service.claim(["g"], worker_id="w", max_jobs=3)
    acks = [
        {"job_id": job["job_id"], "worker_id": "w", "lease_token": job["lease_token"]}
        for job in leases
    ]
    acks[1]["lease_token"] = "stale"
    results, sql = run_batch(
        [lambda: service.ack_batch(acks), lambda: service.submit("g", "after")]
    )
    assert [r["ok"] for r in results[0]["results"]] == [True, False, True]
    assert results[0]["results"][1]["error"]["code"] == "STALE_TOKEN"
    assert results[1]["job"]["state"] == "ready"
    states = sorted(Job.objects.filter(queue="g").values_list("state", flat=True))
    assert states == ["leased", "ready", "succeeded", "succeeded"]
    assert savepoints(sql) == 0  # no savepoint per ack, one round
    # The acks' guarded UPDATE is one statement for the three (ack_many); the refused one is
    # then tried alone, as a single ack, to say why. (Distinct texts: SQLite's trace repeats a
    # statement for each trigger it fires.)
    job_updates = {t for t in sql if t.lstrip().upper().startswith("UPDATE RELAY_JOB")}
    assert len(job_updates) == 2, job_updates


def test_a_refused_call_leaves_no_reference_cycle_holding_its_arguments(
    service: QueueService,
) -> None:
    """A refusal's traceback held the frames it passed, and through ``f_back`` the batch's
    own frame, whose outcomes held the refusal: a cycle that kept each refused request's
    arguments until the cyclic collector ran (30 clients sending 1 MB payloads over the
    limit held 458 MiB). A ``RelayError`` comes back without its traceback; the call's
    locals then go with the outcome."""

    class Big:
        pass

    held: list[weakref.ref[Big]] = []

    def refused() -> None:
        big = Big()  # what a request's arguments are to a real refusal
        held.append(weakref.ref(big))
        raise errors.FrameTooLarge("payload is over the limit", field="payload", limit=1)

    gc.disable()  # nothing but reference counts frees it
    try:
        outcomes, group = run_group(service, [refused, lambda: service.submit("q", 1)])
        assert group.commits == 1 and outcomes[1][0] is True
        ok, exc = outcomes[0]
        assert not ok and isinstance(exc, errors.FrameTooLarge)
        assert exc.__traceback__ is None
        del outcomes, exc, group
        assert held[0]() is None, "a refusal's arguments outlived it"
    finally:
        gc.enable()


def test_a_call_marked_alone_commits_in_a_transaction_of_its_own(service: QueueService) -> None:
    """A submit that may start a queue takes the queue cap's lock on PostgreSQL; taken among
    other calls' row locks it made deadlocks (a review), so the server marks it ``alone``:
    the others commit together and it commits by itself, and each is answered in order."""
    fns = [
        lambda: service.submit("held", 1),
        lambda: service.submit("new", 1),
        lambda: service.submit("held", 2),
    ]
    outcomes, group = run_group(service, fns, alone=[False, True, False])
    assert [ok for ok, _ in outcomes] == [True, True, True]
    assert [value["job"]["queue"] for _, value in outcomes] == ["held", "new", "held"]
    assert group.commits == 2
    outcomes, group = run_group(service, fns)
    assert group.commits == 1 and all(ok for ok, _ in outcomes)
