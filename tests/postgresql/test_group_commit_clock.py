"""On PostgreSQL several writers run at once (writer threads, servers), and a group commit's
calls may wait for row locks another writer holds. Each call therefore reads the clock when it
runs, not when its batch began: a reading taken before a wait would judge the call by a time
before it ran. Round 11 (docs/benchmarking.md) tried one reading per group commit; a review
found both faults below with it, and these tests fail with it:

* a capped claim that waited for the queue's controls row must start its lease after the wait
  (the ack it waited for ended the other lease then): else the attempt history shows more jobs
  leased at once than the cap;
* a renew in a batch that began before the lease expired, behind a claim that locked a queue's
  controls row, must see the lease expired rather than wait for the expired job's row, which
  another writer's sweep holds while it waits for that controls row: else the two writers
  deadlock (PostgreSQL breaks the cycle after ``deadlock_timeout``, stalling both batches).

Every wait here is for a condition PostgreSQL reports (a backend waiting for a lock) or a thread
event, bounded in time; the clock is a ``FakeClock`` moved by the test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connections

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.service import QueueService
from queue_core.storage import driver_for
from tests.groupcommit import run_group
from tests.postgresql.conftest import DATABASES, count_sessions, deadlocks
from tests.storage.conftest import database_url
from tests.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

ALIAS = "postgresql"
WAIT_S = 10.0  # the most any step here waits for a condition


def _admin_url() -> str:
    """A libpq URL of the test database (the one Django's ``postgresql`` alias uses)."""
    return database_url("postgresql")["RELAY_DATABASE_URL"]


def _lock_waiters(url: str) -> int:
    """Backends of the test database waiting for a lock now."""
    return count_sessions(url, "a.wait_event_type = 'Lock'")


def _group_commit(
    service: QueueService, fns: list[Callable[[], Any]], *, claims: bool
) -> list[tuple[bool, Any]]:
    """Run ``fns`` as one group commit of the TCP server (this thread's own connection)."""
    try:
        return run_group(service, fns, claims=claims)[0]
    finally:
        connections.close_all()


class _Thread(threading.Thread):
    """A thread that keeps its target's result or exception."""

    def __init__(self, target: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._fn = target
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:
            self.error = exc

    def outcome(self) -> Any:
        self.join(WAIT_S * 3)
        assert not self.is_alive(), "the thread did not end"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def service(clock: FakeClock) -> Iterator[QueueService]:
    yield QueueService(driver=driver_for(ALIAS), clock=clock)
    connections.close_all()


@pytest.fixture
def url(service: QueueService) -> str:
    """A libpq URL of the test database, for PostgreSQL's own views."""
    return _admin_url()


def test_a_capped_claim_that_waited_for_the_controls_lock_leases_from_after_the_wait(
    service: QueueService, clock: FakeClock, url: str
) -> None:
    service.set_queue_limits("capped", max_leased=1)
    service.submit("capped", {"n": 1})
    service.submit("capped", {"n": 2})
    (first,) = service.claim(["capped"], worker_id="w1", max_jobs=1)

    locked, go = threading.Event(), threading.Event()

    def holder() -> None:
        """Another writer: a capped claim (it locks the controls row), then w1's ack."""
        try:
            with service.transaction():
                assert service.claim(["capped"], worker_id="wb", max_jobs=1) == []
                locked.set()
                assert go.wait(WAIT_S)
                service.ack(first["job_id"], worker_id="w1", lease_token=first["lease_token"])
        finally:
            connections.close_all()

    other = _Thread(holder)
    other.start()
    assert locked.wait(WAIT_S)
    claim = _Thread(
        lambda: _group_commit(
            service, [lambda: service.claim(["capped"], worker_id="w2", max_jobs=1)], claims=True
        )
    )
    claim.start()
    wait_until(
        lambda: _lock_waiters(url) >= 1,
        what="the group commit's claim waits for the controls row",
        timeout_s=WAIT_S,
    )
    clock.advance(ms=5_000)  # 5 s pass while it waits; then the ack frees the cap's slot
    go.set()
    other.outcome()
    ((ok, leased),) = claim.outcome()
    assert ok, leased
    (second,) = leased
    ended = service.get(first["job_id"])["finished_at_ms"]
    history = service.get(second["job_id"])["history"]
    assert history[-1]["started_at_ms"] == ended  # not before: never two leased under cap 1
    assert second["lease_expires_at_ms"] == ended + service.settings.visibility_timeout_ms


def test_a_renew_behind_a_controls_lock_does_not_wait_for_a_row_swept_meanwhile(
    service: QueueService, clock: FakeClock, url: str
) -> None:
    service.set_queue_limits("capped", max_leased=10)
    for queue, n in (("held", 1), ("other", 1), ("capped", 2)):
        for i in range(n):
            service.submit(queue, {"i": i})
    (lease,) = service.claim(["held"], worker_id="w1", max_jobs=1, lease_ms=1_000)
    clock.advance(ms=500)  # the lease has 500 ms left
    before = deadlocks(url)

    y_began, y_go, x_swept, x_go = (threading.Event() for _ in range(4))

    def y_pause() -> None:
        y_began.set()
        assert y_go.wait(WAIT_S)

    def x_pause() -> None:
        x_swept.set()
        assert x_go.wait(WAIT_S)

    # Y: a batch that begins before the lease expires; its claim locks the capped queue's
    # controls row, then it renews the lease.
    y = _Thread(
        lambda: _group_commit(
            service,
            [
                lambda: service.submit("other", {"y": 1}),
                y_pause,
                lambda: service.claim(["capped"], worker_id="wy", max_jobs=1),
                lambda: service.renew(
                    lease["job_id"], worker_id="w1", lease_token=lease["lease_token"]
                ),
            ],
            claims=False,
        )
    )
    y.start()
    assert y_began.wait(WAIT_S)
    clock.advance(ms=1_000)  # the lease has expired
    # X: a batch whose sweep expires the lease (it holds that job's row until it commits),
    # then a claim on the capped queue, which waits for Y's controls row.
    x = _Thread(
        lambda: _group_commit(
            service,
            [
                lambda: service.claim(["other"], worker_id="wx", max_jobs=1),
                x_pause,
                lambda: service.claim(["capped"], worker_id="wx", max_jobs=1),
            ],
            claims=True,
        )
    )
    x.start()
    assert x_swept.wait(WAIT_S)
    y_go.set()
    # Y either ends (its renew finds the lease expired) or waits for the swept row.
    wait_until(
        lambda: not y.is_alive() or _lock_waiters(url) >= 1,
        what="Y ends or waits for a lock",
        timeout_s=WAIT_S,
    )
    x_go.set()
    y_outcomes, x_outcomes = y.outcome(), x.outcome()
    assert deadlocks(url) == before
    assert [ok for ok, _ in y_outcomes] == [True, True, True, False]
    assert isinstance(y_outcomes[3][1], errors.LeaseExpired), y_outcomes[3][1]
    assert all(ok for ok, _ in x_outcomes), x_outcomes
    assert len(x_outcomes[2][1]) == 1  # its capped claim leased, after Y's commit
