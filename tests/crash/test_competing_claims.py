"""Competing claims: threads, processes and TCP clients claim from one queue at once.

Eight threads of this process call ``QueueService.claim`` directly, three child processes do the
same on the same database, and four threads claim over TCP through a real ``relay_server``
process: on SQLite, and on PostgreSQL (``relay_db``). Leases are short (200 ms) and a third of
the deliveries are abandoned, so leases expire and jobs are handed out again while the race goes
on. A sampler audits the database snapshots while it runs. Afterwards, from every delivery each
racer saw and the attempt history:

* no delivery (job, attempt) was handed to two claimers, and no token was issued twice;
* every delivery the history records reached exactly one claimer (none lost in between);
* per job, each delivery began only after the previous one had ended: acked, or its lease
  expired; so a job never had two valid leases at one instant;
* each job was acked exactly once, by its last delivery, before that lease expired.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections
from django.test import override_settings

from queue_core import errors
from queue_core.client import RelayClient
from tests.crash.racer import Racer, not_busy
from tests.procs import Spawner
from tests.relay_db import DATABASES, RelayDb

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

QUEUE = "race"
JOBS = 240
LEASE_MS = 200
ABANDON = 0.3
SHORT_LEASES = {"RELAY_MIN_LEASE_MS": "100", "RELAY_REAPER_INTERVAL_MS": "50"}

Record = dict[str, Any]


def claim_until_done(
    name: str,
    claim: Callable[[int], list[dict[str, Any]]],
    ack: Callable[[dict[str, Any]], None],
    done: threading.Event,
    seed: int,
) -> list[Record]:
    """Claim, ack or abandon, until ``done``; return what this claimer saw. A call refused
    ``BUSY`` (nothing changed) is made again, as a client would (``racer.not_busy``)."""
    rng = random.Random(seed)
    seen: list[Record] = []
    while not done.is_set():
        seen.append({"kind": "claim", "worker": name})
        max_jobs = rng.randint(1, 3)
        for lease in not_busy(functools.partial(claim, max_jobs)):
            seen.append({"kind": "lease", "worker": name, **lease})
            if rng.random() < ABANDON:
                continue
            try:
                not_busy(functools.partial(ack, lease))
                seen.append({"kind": "ack", "job_id": lease["job_id"], "attempt": lease["attempt"]})
            except (errors.LeaseExpired, errors.StaleToken) as exc:
                seen.append({"kind": "ack_rejected", "job_id": lease["job_id"], "code": exc.code})
    return seen


@pytest.fixture
def tcp_server(spawn: Spawner, relay_db: RelayDb) -> str:
    _, port = spawn.server(**SHORT_LEASES)
    return f"127.0.0.1:{port}"


@override_settings(RELAY_MIN_LEASE_MS=100)
def test_competing_claims_never_hand_out_a_valid_lease_twice(
    tcp_server: str, relay_db: RelayDb
) -> None:
    db = relay_db
    # A lost lease counts as a failure: a budget no run of abandoned leases can spend.
    db.service().submit_batch(
        [{"queue": QUEUE, "payload": {"i": i}, "max_retries": 100} for i in range(JOBS)]
    )
    done = threading.Event()
    start = threading.Barrier(8 + 4 + 1)
    violations: list[str] = []

    def direct(n: int) -> list[Record]:
        service = db.service()
        name = f"thread-{n}"
        start.wait(timeout=60)
        try:
            return claim_until_done(
                name,
                lambda k: service.claim([QUEUE], worker_id=name, max_jobs=k, lease_ms=LEASE_MS),
                lambda lease: service.ack(
                    lease["job_id"], worker_id=name, lease_token=lease["lease_token"]
                ),
                done,
                seed=n,
            )
        finally:
            connections.close_all()

    def over_tcp(n: int) -> list[Record]:
        name = f"tcp-{n}"
        with RelayClient(tcp_server) as client:
            client.ping()  # connected before the start
            start.wait(timeout=60)
            return claim_until_done(
                name,
                lambda k: client.lease([QUEUE], worker_id=name, max_jobs=k, lease_ms=LEASE_MS),
                lambda lease: client.ack(
                    lease["job_id"], worker_id=name, lease_token=lease["lease_token"]
                ),
                done,
                seed=100 + n,
            )

    def sampler() -> int:
        """Audit snapshots of the database while the race runs."""
        runs = 0
        try:
            while not done.is_set():
                try:
                    db.audit(quick_check=False)
                except AssertionError as exc:
                    violations.append(str(exc))
                    return runs
                runs += 1
            return runs
        finally:
            connections.close_all()

    racers = [
        Racer(
            db.path,
            *("claim", "--queue", QUEUE, "--worker-id", f"proc-{n}", "--jobs", str(JOBS)),
            *("--lease-ms", str(LEASE_MS), "--abandon", str(ABANDON), "--seed", str(200 + n)),
            "--hold-after-first",
            **SHORT_LEASES,
            **db.env,
        )
        for n in range(3)
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
            threads = [pool.submit(direct, n) for n in range(8)]
            threads += [pool.submit(over_tcp, n) for n in range(4)]
            # The processes take their first leases, each then waiting (--hold-after-first),
            # and only then does the race start: on a loaded machine eight threads in a tight
            # loop could drain the queue before a child won SQLite's lock once (CI, three test
            # workers on two cores), and so could two children (once in 14 runs, December 7).
            for racer in racers:
                racer.go()
            for racer in racers:
                assert racer.first()["kind"] == "lease"
            for racer in racers:
                racer.go()
            start.wait(timeout=60)
            audits = pool.submit(sampler)
            children = [pool.submit(racer.results) for racer in racers]
            try:
                # The children stop once every job is done; then the threads stop too.
                records = [r for child in children for r in child.result(timeout=180)]
            finally:
                done.set()
            for future in threads:
                records += future.result(timeout=60)
            assert audits.result(timeout=60) > 0
    finally:
        for racer in racers:
            racer.kill()

    assert not violations, violations[0]
    db.audit()
    check_deliveries(db, records)


def check_deliveries(db: RelayDb, records: list[Record]) -> None:
    """The properties in the module docstring, from what the claimers saw and the history."""
    leases = [r for r in records if r["kind"] == "lease"]
    # Threads and child processes both won some of the race; the TCP clients (the slowest
    # path, through the server process) took part in it.
    assert {"thread", "proc"} <= {r["worker"].split("-")[0] for r in leases}
    claims = collections.Counter(r["worker"] for r in records if r["kind"] == "claim")
    assert all(claims[f"tcp-{n}"] > 0 for n in range(4))
    by_delivery = collections.Counter((r["job_id"], r["attempt"]) for r in leases)
    assert max(by_delivery.values()) == 1, [k for k, n in by_delivery.items() if n > 1][:5]
    assert len({r["lease_token"] for r in leases}) == len(leases)
    history = {
        (job_id, attempt): (started, ended, outcome)
        for job_id, attempt, started, ended, outcome in db.rows(
            "SELECT job_id, attempt, started_at_ms, ended_at_ms, outcome FROM relay_attempt"
        )
    }
    states = collections.Counter(s for (s,) in db.rows("SELECT state FROM relay_job"))
    assert states == {"succeeded": JOBS}
    assert set(history) == set(by_delivery)  # every delivery reached exactly one claimer
    assert len(leases) > JOBS  # abandoned leases expired and the jobs went out again

    expires = {(r["job_id"], r["attempt"]): r["lease_expires_at_ms"] for r in leases}
    per_job: dict[str, list[int]] = collections.defaultdict(list)
    for job_id, attempt in history:
        per_job[job_id].append(attempt)
    for job_id, attempts in per_job.items():
        attempts.sort()
        for prev, nxt in itertools.pairwise(attempts):
            _, ended, outcome = history[(job_id, prev)]
            valid_until = min(expires[(job_id, prev)], ended)
            started = history[(job_id, nxt)][0]
            assert started >= valid_until, (job_id, prev, outcome, valid_until, started)
            assert outcome == "lease_expired", (job_id, prev, outcome)
        last = attempts[-1]
        _, ended, outcome = history[(job_id, last)]
        assert outcome == "succeeded" and ended < expires[(job_id, last)], (job_id, last)

    acks = collections.Counter(r["job_id"] for r in records if r["kind"] == "ack")
    assert set(acks.values()) == {1} and len(acks) == JOBS
    last_attempt = {job_id: max(attempts) for job_id, attempts in per_job.items()}
    assert all(r["attempt"] == last_attempt[r["job_id"]] for r in records if r["kind"] == "ack")
