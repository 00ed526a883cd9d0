"""Connections under Django's own settings: every test runs once per driver."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connections

from queue_core.models import Job
from queue_core.service import QueueService
from queue_core.storage import Driver
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


@pytest.fixture
def conn_max_age_0(alias: str) -> Iterator[None]:
    """Django's default ``CONN_MAX_AGE`` (0: a connection is obsolete once opened)."""
    conn = connections[alias]
    kept = conn.settings_dict["CONN_MAX_AGE"]
    conn.close()
    conn.settings_dict["CONN_MAX_AGE"] = 0
    try:
        yield
    finally:
        conn.close()
        conn.settings_dict["CONN_MAX_AGE"] = kept


@pytest.mark.usefixtures("conn_max_age_0")
def test_a_read_inside_a_read_keeps_the_outer_reads_connection(driver: Driver) -> None:
    # The inner read healed the connection as if no read held it: with CONN_MAX_AGE 0 it
    # closed the outer read's, whose next statement failed "the connection is closed" (a
    # review: relay_worker could not start in a Django project on PostgreSQL).
    with driver.read() as outer:
        assert outer.all("queue_controls_all") == []
        with driver.read() as inner:
            assert inner.all("queue_controls_all") == []
        assert outer.all("queue_controls_all") == []


@pytest.mark.usefixtures("conn_max_age_0")
def test_the_reads_that_read_the_clock_inside_work_at_conn_max_age_0(driver: Driver) -> None:
    service = QueueService(driver=driver)  # the default clock: the database's on PostgreSQL
    for _ in range(3):
        assert service.servers() == []
        assert service.health()["server_time_ms"] > 0
        assert service.count_prunable({"succeeded": 1000})["succeeded"] == 0


@pytest.mark.usefixtures("conn_max_age_0")
def test_calls_outside_a_transaction_keep_the_projects_connection(
    alias: str, service: QueueService
) -> None:
    # At CONN_MAX_AGE 0 each call outside atomic() closed the project's own connection on
    # PostgreSQL, as if a request had ended (a Django review): a server-side cursor open across
    # an enqueue failed "the connection is closed", and the session's state was lost.
    submitted = sorted(service.submit("q", {"n": n})["job"]["id"] for n in range(5))
    conn = connections[alias]
    with conn.cursor() as cursor:
        cursor.execute("CREATE TEMPORARY TABLE project_scratch (x integer)")
    raw = conn.connection
    ids = Job.objects.using(alias).filter(id__in=submitted).order_by("id")
    rows = ids.values_list("id", flat=True).iterator(chunk_size=2)
    seen = [next(rows)]
    service.submit("q", {"n": 5})
    service.stats()
    seen += list(rows)
    assert seen == submitted
    assert conn.connection is raw
    with conn.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM project_scratch")  # the session's own table
        assert cursor.fetchone() == (0,)
