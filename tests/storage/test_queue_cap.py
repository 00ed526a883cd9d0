"""The queue cap, ``RELAY_MAX_QUEUES``, once per storage driver (fake clock).

A hostile review made 200,000 queue names with one producer key in 5.5 s; after it each
``stats`` took 1.5-1.7 s and the first ``/metrics`` scrape 2.1-2.4 s, since both read every
queue's counts. A submit that would make more than ``RELAY_MAX_QUEUES`` queues hold jobs is
now refused ``TOO_MANY_QUEUES`` (``QueueService._new_queues``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext, override_settings

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job
from queue_core.service import QUEUE_CAP_RECHECK_MS, QueueService
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


def counted(ran: CaptureQueriesContext) -> bool:
    """Whether ``queue_count`` ran: the words only it has, in either driver."""
    marks = ("SELECT DISTINCT queue FROM relay_job_count", "WITH RECURSIVE q(queue)")
    return any(mark in q["sql"] for q in ran.captured_queries for mark in marks)


def empty(service: QueueService, queue: str) -> None:
    """Cancel and purge every job of ``queue``, so it holds none."""
    for job in Job.objects.filter(queue=queue):
        if job.state != "cancelled":
            service.cancel(job.id)
        service.purge(job.id)
    assert not Job.objects.filter(queue=queue).exists()


def refused(call: Callable[[], object]) -> errors.TooManyQueues:
    with pytest.raises(errors.TooManyQueues) as caught:
        call()
    return caught.value


@override_settings(RELAY_MAX_QUEUES=3)
def test_a_job_for_a_queue_past_the_cap_is_refused_and_the_held_queues_still_take_jobs(
    service: QueueService,
) -> None:
    for name in ("a", "b", "c"):
        service.submit(name, 1)
    exc = refused(lambda: service.submit("d", 1))
    assert exc.code == "TOO_MANY_QUEUES" and exc.details == {"limit": 3, "queue": "d"}
    assert exc.retryable is False and exc.http_status == 409
    assert "RELAY_MAX_QUEUES (3)" in exc.message
    assert service.submit("a", 2)["job"]["queue"] == "a"
    # A batch is all or nothing: its job for a held queue is not made either.
    exc = refused(
        lambda: service.submit_batch([{"queue": "b", "payload": 1}, {"queue": "e", "payload": 1}])
    )
    assert exc.details["queue"] == "e"
    assert Job.objects.filter(queue="b").count() == 1
    assert not Job.objects.filter(queue__in=["d", "e"]).exists()
    # A service that has seen none of the names (another server, a restart) counts them.
    other = QueueService(driver=service.driver, clock=service.clock)
    refused(lambda: other.submit("d", 1))
    assert other.submit("c", 2)["job"]["queue"] == "c"
    assert service.stats()["totals"]["ready"] == 5


@override_settings(RELAY_MAX_QUEUES=3)
def test_delayed_dead_and_finished_jobs_hold_their_queue(
    service: QueueService, clock: FakeClock
) -> None:
    service.submit("later", 1, delay_ms=60_000)
    job = service.submit("gone", 1)["job"]
    service.cancel(job["id"])
    service.submit("c", 1)
    other = QueueService(driver=service.driver, clock=clock)
    refused(lambda: other.submit("d", 1))


@override_settings(RELAY_MAX_QUEUES=3)
def test_once_full_new_names_wait_out_the_recheck_exactly(
    service: QueueService, clock: FakeClock
) -> None:
    """After a count finds the cap reached, a new name is refused without counting for
    ``QUEUE_CAP_RECHECK_MS``: a queue emptied meanwhile is room from that instant on."""
    for name in ("a", "b", "c"):
        service.submit(name, 1)
    refused(lambda: service.submit("d", 1))
    empty(service, "a")
    clock.advance(ms=QUEUE_CAP_RECHECK_MS - 1)
    refused(lambda: service.submit("d", 1))
    clock.advance(ms=1)
    assert service.submit("d", 1)["job"]["queue"] == "d"
    refused(lambda: service.submit("e", 1))


@override_settings(RELAY_MAX_QUEUES=3)
def test_a_wall_clock_stepped_back_does_not_stretch_the_recheck(
    service: QueueService, clock: FakeClock
) -> None:
    """Stepped back an hour after a full count, the service counts again at once, rather than
    refusing new names uncounted for the hour and a second."""
    for name in ("a", "b", "c"):
        service.submit(name, 1)
    refused(lambda: service.submit("d", 1))
    empty(service, "a")
    clock.step(-3_600_000)
    assert service.submit("d", 1)["job"]["queue"] == "d"


@override_settings(RELAY_MAX_QUEUES=3)
def test_a_batch_counts_its_new_queues_together(service: QueueService) -> None:
    """Two new names with room for one: the batch is refused, and since the queues held are
    under the cap, a single new name right after is taken (no recheck wait)."""
    service.submit_batch([{"queue": "a", "payload": 1}, {"queue": "b", "payload": 1}])
    exc = refused(
        lambda: service.submit_batch([{"queue": "y", "payload": 1}, {"queue": "x", "payload": 1}])
    )
    assert exc.details == {"limit": 3, "queue": "x"}
    assert service.submit("x", 1)["job"]["queue"] == "x"
    results = service.submit_batch([{"queue": q, "payload": 2} for q in ("a", "b", "x", "a")])
    assert [r["queue"] for r in results] == ["a", "b", "x", "a"]


@override_settings(RELAY_MAX_QUEUES=3)
def test_names_remembered_are_bounded_by_the_cap(service: QueueService) -> None:
    """The names a service remembers as holding jobs never outnumber the cap: it forgets
    them all before it would."""
    for round_ in range(4):
        for name in ("a", "b", "c"):
            service.submit(f"{name}{round_}", 1)
            assert len(service._queues_seen) <= 3
        for name in ("a", "b", "c"):
            empty(service, f"{name}{round_}")


@override_settings(RELAY_MAX_QUEUES=2)
def test_a_batch_rolled_back_leaves_its_names_unremembered(service: QueueService) -> None:
    """Names are remembered once the submit that made them commits: a batch undone by an
    idempotency conflict does not leave ``b`` to be admitted later without a count."""
    service.submit("a", 1, idempotency_key="k")
    with pytest.raises(errors.IdempotencyConflict):
        service.submit_batch(
            [{"queue": "b", "payload": 1}, {"queue": "a", "payload": 2, "idempotency_key": "k"}]
        )
    assert not Job.objects.filter(queue="b").exists()
    assert service._queues_seen == {"a"}
    service.submit("b", 1)
    assert service._queues_seen == {"a", "b"}


def test_count_queues_counts_queues_holding_jobs_in_any_state(service: QueueService) -> None:
    assert service.count_queues() == 0
    service.submit("a", 1)
    service.submit("a", 2)
    service.submit("b", 1, delay_ms=60_000)
    done = service.submit("c", 1)["job"]["id"]
    service.cancel(done)
    assert service.count_queues() == 3
    empty(service, "c")
    assert service.count_queues() == 2


@override_settings(RELAY_MAX_QUEUES=50)
def test_concurrent_batches_of_new_queues_stop_at_the_cap(
    service: QueueService, clock: FakeClock
) -> None:
    """A review: on PostgreSQL, eight batches of 1,000 new names sent at once through two
    servers all counted the same room (9,000 queues against a cap of 2,000). Four threads,
    each its own service (a server of its own), send 20 new names at once into 30 held
    queues: one batch fits, the others are refused, and 50 queues hold jobs."""
    service.submit_batch([{"queue": f"held{i:02d}", "payload": i} for i in range(30)])
    start = threading.Barrier(4)
    outcomes: list[str] = []

    def send(tag: str) -> None:
        mine = QueueService(driver=service.driver, clock=clock)
        start.wait(10)
        try:
            mine.submit_batch([{"queue": f"{tag}{i:02d}", "payload": i} for i in range(20)])
            outcomes.append("ok")
        except errors.TooManyQueues:
            outcomes.append("refused")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=send, args=(tag,)) for tag in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["ok", "refused", "refused", "refused"]
    assert service.count_queues() == 50


@override_settings(RELAY_MAX_QUEUES=3)
def test_after_a_refusing_count_what_would_not_fit_is_refused_uncounted(
    service: QueueService, clock: FakeClock
) -> None:
    """A review: below the cap no refusal was remembered, so a producer sending batches of
    two new names into the last free queue made the server count every queue each time.
    For a second after a count refuses, a submit that would not have fitted it is refused
    without counting again; one that might fit is counted."""
    service.submit_batch([{"queue": "a", "payload": 1}, {"queue": "b", "payload": 1}])

    def two_new() -> None:
        service.submit_batch([{"queue": "x", "payload": 1}, {"queue": "y", "payload": 1}])

    refused(two_new)
    with CaptureQueriesContext(connections[service.driver.alias]) as ran:
        refused(two_new)
    assert not counted(ran), ran.captured_queries
    clock.advance(ms=QUEUE_CAP_RECHECK_MS)
    with CaptureQueriesContext(connections[service.driver.alias]) as ran:
        refused(two_new)
    assert counted(ran), ran.captured_queries
    assert service.submit("x", 1)["job"]["queue"] == "x"  # one new name fits: counted


@override_settings(RELAY_MAX_QUEUES=5)
def test_a_submit_that_fails_on_its_own_costs_no_count(service: QueueService) -> None:
    """A review: a batch naming a new queue and binding one idempotency key to two payloads
    was counted, then rolled back by its conflict, remembered nowhere, and sent again: a
    count a request (on PostgreSQL under the cap's lock, 4 clients held a sentinel 1.5 s).
    The queues are counted once the jobs are in, so the conflict comes first."""
    service.submit("held", 1)
    for i in range(3):
        jobs = [
            {"queue": f"new{i}", "payload": 1, "idempotency_key": "k"},
            {"queue": f"new{i}", "payload": 2, "idempotency_key": "k"},
        ]
        with (
            CaptureQueriesContext(connections[service.driver.alias]) as ran,
            pytest.raises(errors.IdempotencyConflict),
        ):
            service.submit_batch(jobs)
        assert not counted(ran), ran.captured_queries
    with CaptureQueriesContext(connections[service.driver.alias]) as ran:
        service.submit("new0", 1)
    assert counted(ran)
    assert service.count_queues() == 2


def test_may_start_queues_says_whether_a_name_is_unseen(service: QueueService) -> None:
    assert service.may_start_queues(["a"]) and service.may_start_queues([None, "a"])
    assert not service.may_start_queues([None, 5, {"x": 1}])
    service.submit("a", 1)
    assert not service.may_start_queues(["a", "a"])
    assert service.may_start_queues(["a", "b"])
