"""Shared fixtures: an injected clock and rng, the service, and job factories.

Factories go through the service (submit, then claim, then fail), never INSERT, so a fixture
can't build a state the service could not reach (procrastinate's deferred-job factory).
Tests that touch the database use ``django_db(transaction=True)``: the store issues raw
``BEGIN IMMEDIATE``, which cannot run inside the test-case transaction.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest

from queue_core import auth
from queue_core.clock import FakeClock
from queue_core.service import QueueService
from tests.procs import Spawner, spawner

# The ``relay_db`` fixture: crash tests that run on both drivers.
pytest_plugins = ["tests.relay_db"]

# The CLI's tables size to the terminal (``relay_command.console_width``: COLUMNS, else the
# terminal, else 120). Tests read them at the width they get off a terminal, whatever the
# terminal pytest runs in; pytest-xdist's workers would otherwise get COLUMNS=80. Children
# inherit it.
os.environ["COLUMNS"] = "120"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Make a report's captured output UTF-8-safe (``\\udcff`` for a lone surrogate): tests of
    such error texts log them, and pytest-xdist cannot send a report that holds one."""
    report = yield
    report.sections = [
        (title, text.encode("utf-8", "backslashreplace").decode("utf-8"))
        for title, text in report.sections
    ]
    return report


@pytest.fixture(autouse=True)
def _forget_the_key_ring() -> Iterator[None]:
    """Drop this process's API-key snapshot after each test: a key one test made must not
    make the next test's requests need one (the snapshot lives ``RING_TTL_S``)."""
    yield
    auth.invalidate()


@pytest.fixture(autouse=True)
def _forget_kept_gauges() -> Iterator[None]:
    """Drop the gauges a slow scrape left kept (``metrics.SharedRead``) after each test: the
    next test's database is another."""
    yield
    from queue_core import metrics

    metrics.forget_gauges()


@pytest.fixture(scope="session")
def django_db_modify_db_settings() -> None:
    """Give each pytest process its own file-backed test DB (children processes share it),
    and its own PostgreSQL test database."""
    from django.conf import settings

    name = os.path.join(tempfile.gettempdir(), f"relay-test-{os.getpid()}.db")
    settings.DATABASES["default"]["TEST"]["NAME"] = name
    # The storage contract suite's PostgreSQL database: one per run, so runs never collide.
    settings.DATABASES["postgresql"].setdefault("TEST", {})["NAME"] = f"relay_test_{os.getpid()}"


@pytest.fixture(autouse=True)
def _stop_http_wakeups() -> Iterator[None]:
    """After each test, stop the HTTP API's change-feed polling thread if a test started it
    (it polls the test database, which closes to other threads between tests)."""
    yield
    from queue_api import calls

    calls.wakeups().stop()


@pytest.fixture(autouse=True)
def _stop_http_pool() -> Iterator[None]:
    """After each test, close the HTTP side's database threads' connections and stop them if
    a test used them (queue_api.pool: lease claims, in-process ASGI requests)."""
    yield
    from queue_api import pool

    pool.shutdown()


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock at 2026-01-01T00:00:00Z."""
    return FakeClock()


@pytest.fixture
def rng() -> random.Random:
    """A seeded random source for jitter."""
    return random.Random(1234)


@pytest.fixture
def service(transactional_db: None, clock: FakeClock, rng: random.Random) -> QueueService:
    """A QueueService on the test database with the fake clock."""
    return QueueService(clock=clock, rng=rng)


@pytest.fixture
def job_factory(service: QueueService) -> Callable[..., dict[str, Any]]:
    """Submit a job: ``job_factory(queue="default", payload={...}, **options) -> Job``."""

    def make(queue: str = "default", payload: Any = None, **options: Any) -> dict[str, Any]:
        body = {"n": 1} if payload is None else payload
        return service.submit(queue, body, **options)["job"]

    return make


@pytest.fixture
def leased_job(
    service: QueueService, job_factory: Callable[..., dict[str, Any]]
) -> Callable[..., dict[str, Any]]:
    """Submit and lease a job: ``leased_job(worker_id="w1", lease_ms=30000, **submit_options)``."""

    def make(worker_id: str = "w1", lease_ms: int = 30_000, **options: Any) -> dict[str, Any]:
        queue = options.pop("queue", "default")
        job = job_factory(queue=queue, **options)
        leases = service.claim([queue], worker_id=worker_id, lease_ms=lease_ms)
        assert [lease["job_id"] for lease in leases] == [job["id"]]
        return leases[0]

    return make


@pytest.fixture
def dead_job(
    service: QueueService, leased_job: Callable[..., dict[str, Any]]
) -> Callable[..., dict[str, Any]]:
    """A job failed non-retryably: ``dead_job(error="boom", **submit_options) -> Job``."""

    def make(error: str = "boom", **options: Any) -> dict[str, Any]:
        lease = leased_job(**options)
        service.fail(
            lease["job_id"],
            worker_id="w1",
            lease_token=lease["lease_token"],
            error=error,
            retryable=False,
        )
        return service.get(lease["job_id"])

    return make


@pytest.fixture
def spawn(transactional_db: None) -> Iterator[Spawner]:
    """Start real ``manage.py`` processes on the test database; all are killed at teardown."""
    from django.db import connection

    with spawner(str(connection.settings_dict["NAME"])) as s:
        yield s
