"""Stale-token mutations over TCP against a real ``relay_server`` process.

Worker A's lease runs out; the server's reaper takes the job back and worker B's long-poll gets it
(attempt 2): nothing sleeps, B's lease request is what waits. A's ack, fail, renew and release,
sent with its old token, are all refused with ``STALE_TOKEN`` on a connection that stays open,
and change nothing: the job row, its attempt history and its events are byte-for-byte the same.
Before anybody re-leases a job, the same calls get ``LEASE_EXPIRED`` instead, also changing
nothing. Each test runs on SQLite and on PostgreSQL (``relay_db``). (The service-level
versions are in tests/storage/test_service_contract.py.)
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from queue_core import errors
from queue_core.client import RelayClient
from tests.procs import Spawner
from tests.relay_db import DATABASES, RelayDb

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

SHORT_LEASES = {"RELAY_MIN_LEASE_MS": "100", "RELAY_REAPER_INTERVAL_MS": "50"}
VERBS = ("ack", "fail", "renew", "release")


@pytest.fixture
def server(spawn: Spawner, relay_db: RelayDb) -> str:
    _, port = spawn.server(**SHORT_LEASES)
    return f"127.0.0.1:{port}"


def snapshot(db: RelayDb, job_id: str) -> tuple[Any, ...]:
    """Every stored fact about the job: its row, its attempts, its events."""
    return (
        db.rows("SELECT * FROM relay_job WHERE id = %s", (job_id,)),
        db.rows("SELECT * FROM relay_attempt WHERE job_id = %s ORDER BY attempt", (job_id,)),
        db.rows("SELECT * FROM relay_event WHERE job_id = %s ORDER BY id", (job_id,)),
    )


def call(client: RelayClient, verb: str, lease: dict[str, Any], worker: str) -> Any:
    args = {"worker_id": worker, "lease_token": lease["lease_token"]}
    if verb == "fail":
        return client.fail(lease["job_id"], error="late", **args)
    if verb == "renew":
        return client.renew(lease["job_id"], lease_ms=5_000, **args)
    return getattr(client, verb)(lease["job_id"], **args)


def test_stale_worker_is_fenced_out_after_its_job_is_re_leased(
    server: str, relay_db: RelayDb
) -> None:
    db = relay_db
    with RelayClient(server) as a, RelayClient(server) as b:
        job = a.submit("fence", {"n": 1}, max_retries=5)["job"]
        old = a.lease(["fence"], worker_id="A", lease_ms=300)[0]
        assert old["attempt"] == 1
        # B waits on the server for the job; it comes back when A's lease runs out.
        new = b.lease(["fence"], worker_id="B", lease_ms=60_000, wait_ms=15_000)
        assert [(x["job_id"], x["attempt"]) for x in new] == [(job["id"], 2)]
        assert new[0]["lease_token"] != old["lease_token"]
        before = snapshot(db, job["id"])
        for verb in VERBS:
            with pytest.raises(errors.StaleToken):
                call(a, verb, old, "A")
            assert snapshot(db, job["id"]) == before, verb
        assert a.ping()["pong"] is True  # the refusals kept A's connection open
        seen = a.inspect(job["id"])["job"]
        assert (seen["state"], seen["attempt"], seen["failures"]) == ("leased", 2, 1)
        assert [h["outcome"] for h in seen["history"]] == ["lease_expired", None]

        assert (
            b.ack(job["id"], worker_id="B", lease_token=new[0]["lease_token"])["duplicate"] is False
        )
        after_ack = snapshot(db, job["id"])
        for verb in VERBS:
            # Still refused once B finished the job. Nobody holds it now, so the service
            # explains this one as LEASE_EXPIRED (its rule: expired, and not leased any more).
            with pytest.raises((errors.StaleToken, errors.LeaseExpired)):
                call(a, verb, old, "A")
        assert snapshot(db, job["id"]) == after_ack
    db.audit()


def test_expired_lease_nobody_holds_is_refused_as_expired(server: str, relay_db: RelayDb) -> None:
    db = relay_db
    with RelayClient(server) as a:
        job = a.submit("expire", {"n": 1}, max_retries=5)["job"]
        lease = a.lease(["expire"], worker_id="A", lease_ms=200)[0]
        deadline = time.monotonic() + 30
        while a.inspect(job["id"])["job"]["state"] != "ready":  # the reaper took it back
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.02)
        before = snapshot(db, job["id"])
        for verb in VERBS:
            with pytest.raises(errors.LeaseExpired):
                call(a, verb, lease, "A")
            assert snapshot(db, job["id"]) == before, verb
        seen = a.inspect(job["id"])["job"]
        assert (seen["state"], seen["attempt"], seen["failures"]) == ("ready", 1, 1)
    db.audit()
