"""Unique while active under races (issue 16, item 6): two ``relay server`` processes and
direct ``QueueService`` threads (each its own connection) on one PostgreSQL database submit one
idempotency key with ``unique: "active"`` at once.

* Racing submits make exactly one job; once it succeeded, the same race makes exactly one new
  job (three rounds).
* Submits racing workers that lease and ack the jobs through both servers: no two jobs with the
  key are ever active together. The unique index on ``(queue, idempotency_key)`` admits one
  row with the key, and a job keeps its key until the transaction that makes it terminal, so
  "every unfinished job holds the key, every finished one has freed it" at the end, with one
  creating answer per job, shows it for every instant in between.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections

from queue_core.client import RelayClient
from queue_core.models import Job
from queue_core.service import QueueService
from queue_core.storage import driver_for
from tests.audit import audit
from tests.postgresql.conftest import DATABASES, Server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

Start = Callable[..., list[Server]]
Answer = tuple[str, str, bool]  # (source, job id, deduplicated)

QUEUE = "signup"
KEY = "signup-42"
PAYLOAD = {"user_id": 42}
ACTIVE = {"idempotency_key": KEY, "unique": "active"}


def direct_submits(n: int, alias: str) -> list[Answer]:
    service = QueueService(driver=driver_for(alias))
    try:
        return [
            ("direct", r["job"]["id"], r["deduplicated"])
            for r in (service.submit(QUEUE, PAYLOAD, **ACTIVE) for _ in range(n))
        ]
    finally:
        connections.close_all()


def client_submits(address: str, n: int) -> list[Answer]:
    with RelayClient(address) as client:
        return [
            (address, r["job"]["id"], r["deduplicated"])
            for r in (client.submit(QUEUE, PAYLOAD, **ACTIVE) for _ in range(n))
        ]


def race(addresses: list[str], per_source: int = 3, alias: str = "postgresql") -> list[Answer]:
    """Every source submits the key ``per_source`` times, all starting at one barrier: six
    threads calling the service on database ``alias`` and four clients per server."""
    sources: list[Callable[[], list[Answer]]] = [lambda: direct_submits(per_source, alias)] * 6
    for address in addresses:
        sources += [lambda a=address: client_submits(a, per_source)] * 4
    barrier = threading.Barrier(len(sources))

    def at_barrier(fn: Callable[[], list[Answer]]) -> list[Answer]:
        barrier.wait(timeout=60)
        return fn()

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(sources)) as pool:
        futures = [pool.submit(at_barrier, fn) for fn in sources]
        return [a for f in futures for a in f.result(timeout=120)]


def lease_and_ack(address: str, job_id: str) -> None:
    with RelayClient(address) as client:
        (lease,) = client.lease([QUEUE], worker_id="w", wait_ms=5_000)
        assert lease["job_id"] == job_id
        client.ack(job_id, worker_id="w", lease_token=lease["lease_token"])


def test_racing_submits_through_two_servers_make_one_active_job(servers: Start) -> None:
    a, b = servers(2)
    rounds_make_one_active_job([a.address, b.address], "postgresql")
    audit(connections["postgresql"], quick_check=False)


def rounds_make_one_active_job(addresses: list[str], alias: str) -> None:
    """Three rounds: racing submits make one job, which is then leased and acked."""
    made: list[str] = []
    for round_ in range(3):
        answers = race(addresses, alias=alias)
        assert len(answers) == (6 + 4 * len(addresses)) * 3
        ids = {job_id for _, job_id, _ in answers}
        assert len(ids) == 1, (round_, sorted(ids))
        assert [dedup for _, _, dedup in answers].count(False) == 1
        (job_id,) = ids
        assert job_id not in made
        made.append(job_id)
        assert Job.objects.filter(queue=QUEUE).exclude(state="succeeded").count() == 1
        lease_and_ack(addresses[round_ % len(addresses)], job_id)
    rows = {j.id: (j.state, j.idempotency_key) for j in Job.objects.filter(queue=QUEUE)}
    assert rows == {job_id: ("succeeded", None) for job_id in made}


def test_submits_racing_acks_never_make_two_active_jobs(servers: Start) -> None:
    a, b = servers(2)
    addresses = [a.address, b.address]
    stop = threading.Event()
    acked: list[str] = []

    def work(address: str) -> None:
        with RelayClient(address) as client:
            for _ in range(100_000):  # bounded; stopped long before
                if stop.is_set():
                    return
                for lease in client.lease([QUEUE], worker_id=f"w-{address}", wait_ms=200):
                    client.ack(lease["job_id"], worker_id=f"w-{address}", **_token(lease))
                    acked.append(lease["job_id"])

    workers = [threading.Thread(target=work, args=(address,)) for address in addresses * 2]
    for worker in workers:
        worker.start()
    try:
        answers = race(addresses, per_source=25)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    assert not any(worker.is_alive() for worker in workers)

    created = [job_id for _, job_id, dedup in answers if not dedup]
    jobs = {j.id: j for j in Job.objects.filter(queue=QUEUE)}
    # Each job was created by exactly one submit, and every answer names one of them.
    assert len(created) == len(set(created)) == len(jobs)
    assert {job_id for _, job_id, _ in answers} == set(jobs)
    # Every unfinished job holds the key (so there is at most one: the unique index), and
    # every finished one has freed it.
    unfinished = [j for j in jobs.values() if j.state != "succeeded"]
    assert len(unfinished) <= 1
    assert all(j.idempotency_key == KEY for j in unfinished)
    assert all(j.idempotency_key is None for j in jobs.values() if j.state == "succeeded")
    assert len(set(acked)) == len(acked) == len(jobs) - len(unfinished)
    # The race did interleave: acks freed the key while submits went on.
    assert len(jobs) > 1, len(jobs)
    audit(connections["postgresql"], quick_check=False)


def _token(lease: dict[str, Any]) -> dict[str, str]:
    return {"lease_token": lease["lease_token"]}
