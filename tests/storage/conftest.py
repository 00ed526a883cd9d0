"""The storage contract suite's fixtures: every test here runs once per driver.

After River's ``riverdrivertest`` (one suite run over every driver) and Huey's
``StorageTests``: ``backend`` is ``"sqlite"`` or ``"postgresql"``, and ``service`` is a
``QueueService`` on that driver's test database with the fake clock. Modules mark themselves
``pytest.mark.django_db(transaction=True, databases=DATABASES)`` so both test databases are
there and flushed between tests. The PostgreSQL database comes from tests/settings.py; when
PostgreSQL is not running these tests fail at set-up, they do not skip.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connections
from django.test.utils import override_settings

from queue_core.clock import FakeClock
from queue_core.service import QueueService
from queue_core.storage import Driver, driver_for

BACKENDS = ["sqlite", "postgresql"]
ALIASES = {"sqlite": "default", "postgresql": "postgresql"}
DATABASES = ["default", "postgresql"]


@pytest.fixture(scope="session", autouse=True)
def _postgresql_connections_closed(
    django_db_setup: None, django_db_blocker: object
) -> Iterator[None]:
    """Before pytest-django drops the PostgreSQL test database, end what still holds it: the
    change feeds' listener connections, and any other session on it."""
    yield
    from queue_core.storage.postgresql.driver import stop_feeds

    stop_feeds()
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        with connections["postgresql"].cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        connections.close_all()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The driver under test: ``"sqlite"`` or ``"postgresql"``."""
    return str(request.param)


@pytest.fixture
def alias(backend: str) -> str:
    """The Django database alias of ``backend``'s test database."""
    return ALIASES[backend]


class OneDatabase:
    """A database router sending every ORM read and write to one alias."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_read(self, model: object, **hints: object) -> str:
        return self.alias

    def db_for_write(self, model: object, **hints: object) -> str:
        return self.alias


@pytest.fixture(autouse=True)
def _orm_on_backend(alias: str) -> Iterator[None]:
    """The ORM reads tests make (``Job.objects...``) go to the driver's database."""
    with override_settings(DATABASE_ROUTERS=[OneDatabase(alias)]):
        yield


@pytest.fixture
def assert_queries(backend: str, alias: str, django_assert_num_queries: Any) -> Callable[..., Any]:
    """``with assert_queries(sqlite=N, postgresql=M):`` pins the statements one call runs."""

    def check(**counts: int) -> Any:
        return django_assert_num_queries(counts[backend], connection=connections[alias])

    return check


@pytest.fixture
def driver(backend: str, transactional_db: None) -> Driver:
    """The process's driver for ``backend``'s test database."""
    return driver_for(ALIASES[backend])


@pytest.fixture
def service(driver: Driver, clock: FakeClock, rng: random.Random) -> QueueService:
    """A QueueService on ``backend``'s test database with the fake clock."""
    return QueueService(driver=driver, clock=clock, rng=rng)


def database_url(backend: str) -> dict[str, str]:
    """The environment a spawned relay process needs to use ``backend``'s test database."""
    if backend == "sqlite":
        return {}
    conf = connections["postgresql"].settings_dict
    user = conf.get("USER") or "postgres"
    host = conf.get("HOST") or "127.0.0.1"
    port = conf.get("PORT") or "5432"
    return {"RELAY_DATABASE_URL": f"postgresql://{user}@{host}:{port}/{conf['NAME']}"}
