"""Retries to DEAD and delayed jobs through a real ``relay_server`` process (server clock).

* Each retry delay the server grants (``retry_at_ms`` minus the failure's end in the history)
  is exactly the policy's bounded delay without jitter, within 50-100% of it with jitter; the
  job is not delivered again before that instant; it is dead after exactly ``max_retries + 1``
  deliveries, or after one when the failure is not retryable.
* A ``relay_worker`` process takes every failing job to DEAD in exactly its attempts, with the
  gaps between attempts never shorter than the policy allows.
* A delayed job is never delivered before its due time, neither to a worker already waiting on
  the queue nor to a lease request made the moment it was submitted.

Each test runs on SQLite and on PostgreSQL (``relay_db``). The injected-clock versions are
``tests/property/test_service_properties.py`` and ``tests/storage/test_service_contract.py``
(aging, FIFO, exact boundaries).
"""

from __future__ import annotations

import itertools
import signal
import time
from typing import Any

import pytest

from queue_core.client import RelayClient
from tests.procs import Spawner
from tests.relay_db import DATABASES, RelayDb

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

# (max_retries, backoff, base_ms, cap_ms, jitter, non-retryable at delivery n or None)
POLICIES = [
    (2, "fixed", 150, 150, False, None),
    (3, "exponential", 100, 300, True, None),
    (3, "exponential", 50, 1_000, False, None),
    (1, "fixed", 200, 200, True, None),
    (5, "exponential", 100, 1_000, True, 2),
    (0, "fixed", 100, 100, False, None),
]


def bounded_ms(backoff: str, base_ms: int, cap_ms: int, failure: int) -> int:
    return base_ms if backoff == "fixed" else min(cap_ms, base_ms * 2 ** (failure - 1))


def attempts_of(db: RelayDb, job_id: str) -> list[tuple[Any, ...]]:
    return db.rows(
        "SELECT attempt, started_at_ms, ended_at_ms, outcome FROM relay_attempt"
        " WHERE job_id = %s ORDER BY attempt",
        (job_id,),
    )


def test_server_grants_retry_delays_within_the_policy_then_dead_letters(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    _, port = spawn.server()
    db = relay_db
    with RelayClient(f"127.0.0.1:{port}") as client:
        specs: dict[str, tuple[Any, ...]] = {}
        for retries, backoff, base, cap, jitter, hard_at in POLICIES:
            job = client.submit(
                "retry",
                {"policy": [retries, backoff, base, cap, jitter]},
                max_retries=retries,
                backoff=backoff,
                backoff_base_ms=base,
                backoff_cap_ms=cap,
                jitter=jitter,
            )["job"]
            specs[job["id"]] = (retries, backoff, base, cap, jitter, hard_at)
        retry_at: dict[tuple[str, int], int] = {}
        dead: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 60
        while len(dead) < len(specs):
            assert time.monotonic() < deadline, f"not all dead: {len(dead)}/{len(specs)}"
            for lease in client.lease(["retry"], worker_id="w", max_jobs=10, wait_ms=5_000):
                job_id, n = lease["job_id"], lease["attempt"]
                retries, backoff, base, cap, jitter, hard_at = specs[job_id]
                result = client.fail(
                    job_id,
                    worker_id="w",
                    lease_token=lease["lease_token"],
                    error=f"boom {n}",
                    retryable=hard_at != n,
                )
                if result["state"] == "dead":
                    dead[job_id] = result | {"deliveries": n}
                else:
                    retry_at[(job_id, n)] = result["retry_at_ms"]
    for job_id, (retries, backoff, base, cap, jitter, hard_at) in specs.items():
        want = hard_at or retries + 1
        reason = "non-retryable" if hard_at else "attempts exhausted"
        assert dead[job_id]["deliveries"] == want, job_id
        assert dead[job_id]["dead_reason"] == f"{reason}: boom {want}"
        history = attempts_of(db, job_id)
        assert [(a, o) for a, _, _, o in history] == [(n, "failed") for n in range(1, want + 1)]
        for (n, _, ended, _), (_, started_next, _, _) in itertools.pairwise(history):
            assert ended is not None
            granted = retry_at[(job_id, n)] - ended  # the server's own instants
            bounded = bounded_ms(backoff, base, cap, n)
            if jitter:
                assert 0.5 * bounded - 0.5 <= granted <= bounded, (job_id, n, granted)
            else:
                assert granted == bounded, (job_id, n, granted)
            assert started_next >= retry_at[(job_id, n)], "delivered before the retry was due"
    db.audit()


def test_worker_process_takes_failing_jobs_to_dead_in_exactly_their_attempts(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    expected: dict[str, tuple[str, int, int, bool]] = {}  # state, deliveries, base_ms, jitter
    with RelayClient(address) as client:
        for i in range(24):
            retries, jitter, base = i % 4, i % 2 == 0, 20 + 10 * (i % 3)
            common = {"backoff": "exponential", "backoff_base_ms": base, "jitter": jitter}
            if i % 6 == 5:
                payload = {"i": i, "fail": True, "error": "bad", "retryable": False}
                job = client.submit("demo", payload, max_retries=retries, **common)["job"]
                expected[job["id"]] = ("dead", 1, base, jitter)
            elif i % 6 == 4:
                job = client.submit("demo", {"i": i}, max_retries=retries, **common)["job"]
                expected[job["id"]] = ("succeeded", 1, base, jitter)
            else:
                payload = {"i": i, "fail": True, "error": f"e{i}"}
                job = client.submit("demo", payload, max_retries=retries, **common)["job"]
                expected[job["id"]] = ("dead", retries + 1, base, jitter)
        worker = spawn(
            "relay_worker",
            *("--address", address, "--queue", "demo", "--concurrency", "4"),
            name="relay_worker",
        )
        deadline = time.monotonic() + 60
        while True:
            totals = client.stats("demo")["totals"]
            if totals["succeeded"] + totals["dead"] == len(expected):
                break
            assert time.monotonic() < deadline, totals
            time.sleep(0.05)
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(30) == 0
        for job_id, (state, deliveries, base, jitter) in expected.items():
            job = client.inspect(job_id)["job"]
            assert (job["state"], job["attempt"]) == (state, deliveries), job_id
            history = job["history"]
            assert len(history) == deliveries
            for n, (prev, nxt) in enumerate(itertools.pairwise(history), 1):
                floor = bounded_ms("exponential", base, 300_000, n) * (0.5 if jitter else 1.0)
                assert nxt["started_at_ms"] - prev["ended_at_ms"] >= floor - 0.5, (job_id, n)
    relay_db.audit()


def test_delayed_jobs_are_never_delivered_before_they_are_due(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    worker = spawn(
        "relay_worker",
        *("--address", address, "--queue", "later", "--concurrency", "4"),
        name="relay_worker",
    )
    worker.wait_event("worker_ready")
    due: dict[str, int] = {}
    with RelayClient(address) as client:
        for delay_ms in (300, 600, 900, 1_200):  # a worker is already waiting on the queue
            job = client.submit("later", {"d": delay_ms}, delay_ms=delay_ms)["job"]
            assert job["state"] == "pending"
            due[job["id"]] = job["available_at_ms"]
        now = client.ping()["server_time_ms"]
        job = client.submit("soon", {"n": 1}, run_at_ms=now + 800)["job"]
        due[job["id"]] = job["available_at_ms"]
        # Asked for at once (empty, unless this machine stalled past the due time), then with
        # a long-poll: either way not before it is due (checked against the history below).
        early = client.lease(["soon"], worker_id="eager")
        got = early or client.lease(["soon"], worker_id="eager", wait_ms=10_000)
        assert [x["job_id"] for x in got] == [job["id"]]
        client.ack(job["id"], worker_id="eager", lease_token=got[0]["lease_token"])
        deadline = time.monotonic() + 30
        while client.stats("later")["totals"]["succeeded"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    for job_id, due_at in due.items():
        (attempt, started, _, outcome), *_ = attempts_of(relay_db, job_id)
        assert attempt == 1 and outcome == "succeeded"
        assert started >= due_at, f"{job_id} delivered {due_at - started} ms early"
    relay_db.audit()
