"""A real server whose wall clock is stepped an hour forward keeps its healthy leases (item 13).

On PostgreSQL a server keeps the database's time, not its machine's (``AnchoredClock``): the
step only shows as ``event=host_clock_off``; two servers: tests/postgresql/test_server_clocks.py.

The report: a 1 h forward step of the server's clock expired five healthy, renewing leases and
dead-lettered their jobs. Here a ``relay_server`` process runs on ``tests.stepclock``'s clock
(``RELAY_CLOCK``), five jobs without retry budget are held by a real worker (threads, TCP) that
renews every half second, and the test steps the server's clock by an hour while they run:
the server must log the step once, the renewals must go on being accepted, and every job must
succeed on its first delivery. Once per storage driver.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from queue_core.client import RelayClient
from queue_core.worker import Worker
from queue_core.worker.handlers import JobContext
from tests.procs import Spawner
from tests.relay_db import DATABASES, RelayDb
from tests.stepclock import STEP_FILE_ENV, step_to

pytestmark = [
    pytest.mark.slow,
    pytest.mark.crash,
    pytest.mark.django_db(transaction=True, databases=DATABASES),
]

HOUR_MS = 3_600_000
JOBS = 5
LEASE_MS = 1_500  # renewed every 500 ms


class _WorkerEvents(logging.Handler):
    """Counts the worker's log events (``renewed``, ``lease_lost``, ``acked``...) and wakes
    whoever waits on them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.cond = threading.Condition()
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        with self.cond:
            self.counts[str(getattr(record, "event", ""))] += 1
            self.cond.notify_all()

    def wait(self, predicate: Callable[[collections.Counter[str]], bool], what: str) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.counts), 60), (what, self.counts)


@pytest.fixture
def events() -> Iterator[_WorkerEvents]:
    logger = logging.getLogger("relay.worker")
    handler, level = _WorkerEvents(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # "renewed" is a debug record
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class Renewer:
    """A real worker (threads, TCP) holding ``JOBS`` jobs of ``queue`` through ``address``
    and renewing their ``LEASE_MS`` leases every half second until ``finish``."""

    def __init__(self, address: str, queue: str, events: _WorkerEvents) -> None:
        self.events = events
        self._running: set[str] = set()
        self._cond = threading.Condition()
        self._finish = threading.Event()
        self.worker = Worker(
            lambda: RelayClient(address),
            [queue],
            concurrency=JOBS,
            handler=self._hold,
            lease_ms=LEASE_MS,
            wait_ms=500,
            worker_id="renewer",
        )
        self._thread = threading.Thread(target=self.worker.run, name="renewer", daemon=True)

    def _hold(self, payload: Any, ctx: JobContext) -> None:
        with self._cond:
            self._running.add(ctx.job_id)
            self._cond.notify_all()
        assert self._finish.wait(120), "the test never let the job finish"

    def renewed_again(self, what: str) -> None:
        """Wait until every lease renewed at least four more times (two lease lengths) while
        the reapers swept, or a renewal was rejected: the lease was lost."""
        with self.events.cond:
            base = self.events.counts["renewed"]
        self.events.wait(
            lambda c: c["renewed"] >= base + 4 * JOBS or c["lease_lost"] > 0,
            f"renewals after {what}",
        )

    def finish(self) -> None:
        """Let the jobs finish, and wait for their acks (or lost leases)."""
        self._finish.set()
        self.events.wait(lambda c: c["acked"] + c["lease_lost"] >= JOBS, "the acks")


@contextlib.contextmanager
def renewer(address: str, queue: str, events: _WorkerEvents) -> Iterator[Renewer]:
    """Start a ``Renewer``, yield it once it holds every job, and stop it on the way out."""
    held = Renewer(address, queue, events)
    held._thread.start()
    try:
        with held._cond:
            assert held._cond.wait_for(lambda: len(held._running) == JOBS, 60), held._running
        yield held
    finally:
        held._finish.set()
        held.worker.stop()
        held._thread.join(30)


def test_forward_hour_step_of_a_server_keeps_renewing_leases(
    relay_db: RelayDb, spawn: Spawner, tmp_path: Path, events: _WorkerEvents
) -> None:
    step_file = tmp_path / "clock-step"
    server, port = spawn.server(
        RELAY_REAPER_INTERVAL_MS="100",
        RELAY_SERVER_HEARTBEAT_MS="200",
        RELAY_CLOCK="tests.stepclock.FileStepClock",
        **{STEP_FILE_ENV: str(step_file)},
    )
    address = f"127.0.0.1:{port}"
    with RelayClient(address) as client:
        ids = [client.submit("steps", {"i": i}, max_retries=0)["job"]["id"] for i in range(JOBS)]

    with renewer(address, "steps", events) as held:
        step_to(step_file, HOUR_MS)
        if relay_db.backend == "sqlite":
            record = server.wait_event("clock_step", timeout=30)
            assert abs(record["step_ms"] - HOUR_MS) < 50  # measured against the monotonic clock
        else:  # the server keeps the database's time (AnchoredClock): the step is only reported
            record = server.wait_event("host_clock_off", timeout=30)
            assert abs(record["offset_ms"] - HOUR_MS) < 1_000
        held.renewed_again("the step")
        held.finish()
    stats = held.worker.counters()
    assert (stats["lost"], stats["acked"]) == (0, JOBS), stats
    marks = ", ".join(["%s"] * JOBS)
    rows = relay_db.rows(f"SELECT state, attempt FROM relay_job WHERE id IN ({marks})", ids)
    assert sorted(rows) == [("succeeded", 1)] * JOBS
    expired = relay_db.rows("SELECT COUNT(*) FROM relay_attempt WHERE outcome = 'lease_expired'")
    assert expired == [(0,)]
    steps = [r for r in server.records if r.get("event") == "clock_step"]
    if relay_db.backend == "sqlite":
        assert len(steps) == 1 and steps[0]["level"] == "WARNING", steps
    else:
        assert steps == []
    relay_db.audit()
