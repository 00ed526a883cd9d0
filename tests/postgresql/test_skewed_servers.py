"""Two services on one PostgreSQL database whose clocks differ (two servers' readings of the
database's clock agree only to within their round trips): a job's instants never go back.

A hostile run of ``test_several_servers`` failed the audit once servers kept the database's
time (``AnchoredClock``): a job leased through one server and acked through the other 10 ms
behind it had its attempt end before it started. Every change now stamps ``GREATEST(now,
the row's last change)``, and an attempt ends no earlier than it started.
"""

from __future__ import annotations

import pytest
from django.db import connections

from queue_core.clock import FakeClock
from queue_core.service import QueueService
from queue_core.storage import driver_for
from tests.audit import audit
from tests.postgresql.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


def test_a_job_leased_through_one_server_and_finished_through_one_behind_keeps_its_order() -> None:
    driver = driver_for("postgresql")
    ahead_clock = FakeClock()
    behind_clock = FakeClock(start_ms=ahead_clock.now_ms() - 50)
    ahead = QueueService(driver=driver, clock=ahead_clock)
    behind = QueueService(driver=driver, clock=behind_clock)
    ids = [ahead.submit("skew", {"i": i}, max_retries=1)["job"]["id"] for i in range(4)]
    leases = ahead.claim(["skew"], worker_id="w", max_jobs=4)
    by_id = {lease["job_id"]: lease for lease in leases}

    def ids_of(lease: dict[str, str]) -> dict[str, str]:
        return {"worker_id": "w", "lease_token": lease["lease_token"]}

    behind.ack(ids[0], **ids_of(by_id[ids[0]]))
    behind.fail(ids[1], **ids_of(by_id[ids[1]]), error="x", retryable=True)  # to RETRYING
    behind.release(ids[2], **ids_of(by_id[ids[2]]))
    behind.renew(ids[3], **ids_of(by_id[ids[3]]))
    behind.fail(ids[3], **ids_of(by_id[ids[3]]), error="x", retryable=False)  # to DEAD
    for clock in (ahead_clock, behind_clock):
        clock.advance(seconds=3600)  # every retry is due
    again = behind.claim(["skew"], worker_id="w", max_jobs=4)
    assert {lease["job_id"] for lease in again} == {ids[1], ids[2]}
    for lease in again:
        ahead.ack(lease["job_id"], **ids_of(lease))
    with connections["postgresql"].cursor() as cursor:
        cursor.execute(
            "SELECT job_id, attempt, started_at_ms, ended_at_ms FROM relay_attempt "
            "WHERE ended_at_ms < started_at_ms"
        )
        assert cursor.fetchall() == []
        cursor.execute(
            "SELECT id FROM relay_job WHERE finished_at_ms < leased_at_ms "
            "OR updated_at_ms < created_at_ms"
        )
        assert cursor.fetchall() == []
    audit(connections["postgresql"], quick_check=False)
