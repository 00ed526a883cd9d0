"""The quickstart, for real: a relay_server process, a relay_worker process (concurrency 8),
1,000 jobs mixing sleeps and failures over TCP, and every job ends exactly as its payload and
retry budget dictate: on SQLite and on PostgreSQL (``relay_db``)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from queue_core.client import RelayClient
from queue_core.models import Job, JobAttempt
from tests.procs import ROOT, Spawner, command_env
from tests.relay_db import DATABASES, RelayDb

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

RELAY = str(Path(sys.executable).parent / "relay")


def wait_until_settled(client: RelayClient, total: int, timeout_s: float = 180.0) -> dict[str, Any]:
    """Poll stats until every job is terminal (a condition wait with a deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        totals = client.stats()["totals"]
        if totals["succeeded"] + totals["dead"] == total:
            return totals
        assert time.monotonic() < deadline, f"jobs did not settle: {totals}"
        time.sleep(0.1)


def make_jobs(
    rng: random.Random, n: int
) -> tuple[list[dict[str, Any]], list[tuple[str, int, str | None]]]:
    """Job specs and, per job, the expected (state, attempts, dead reason prefix)."""
    specs: list[dict[str, Any]] = []
    expected: list[tuple[str, int, str | None]] = []
    for i in range(n):
        roll = rng.random()
        spec: dict[str, Any] = {
            "queue": "default",
            "backoff": "fixed",
            "backoff_base_ms": 10,
            "jitter": False,
        }
        if roll < 0.5:
            spec |= {"payload": {"i": i, "sleep_ms": rng.randint(0, 20)}, "max_retries": 2}
            expected.append(("succeeded", 1, None))
        elif roll < 0.75:
            retries = rng.randint(0, 2)
            spec |= {
                "payload": {"i": i, "fail": True, "error": f"demo {i}"},
                "max_retries": retries,
            }
            expected.append(("dead", retries + 1, f"attempts exhausted: demo {i}"))
        elif roll < 0.85:
            spec |= {
                "payload": {"i": i, "fail": True, "error": "bad input", "retryable": False},
                "max_retries": 5,
            }
            expected.append(("dead", 1, "non-retryable: bad input"))
        else:
            spec |= {"payload": {"i": i, "hello": "world"}, "priority": rng.choice(["low", "high"])}
            expected.append(("succeeded", 1, None))
        specs.append(spec)
    return specs, expected


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])  # RELAY_EVENT_LOOP
def test_thousand_jobs_through_real_server_and_worker(
    spawn: Spawner, relay_db: RelayDb, loop: str
) -> None:
    server, port = spawn.server(RELAY_EVENT_LOOP=loop)
    assert [r["loop"] for r in server.records if r.get("event") == "ready"] == [loop]
    address = f"127.0.0.1:{port}"
    worker = spawn(
        "relay_worker",
        "--address",
        address,
        "--queue",
        "default",
        "--concurrency",
        "8",
        "--shutdown-timeout-ms",
        "5000",
        name="relay_worker",
    )
    worker.wait_event("worker_ready")

    specs, expected = make_jobs(random.Random(20261129), 1000)
    with RelayClient(address) as client:
        ids: list[str] = []
        for start in range(0, len(specs), 100):
            results = client.submit_batch(specs[start : start + 100])["results"]
            ids.extend(r["job_id"] for r in results)
        assert len(set(ids)) == 1000
        totals = wait_until_settled(client, 1000)

    want_ok = sum(1 for state, _, _ in expected if state == "succeeded")
    assert totals["succeeded"] == want_ok
    assert totals["dead"] == 1000 - want_ok
    assert Job.objects.count() == 1000  # none lost, none duplicated
    jobs = {j.id: j for j in Job.objects.all()}
    for job_id, (state, attempts, reason) in zip(ids, expected, strict=True):
        job = jobs[job_id]
        assert (job.state, job.attempt) == (state, attempts), job_id
        assert job.dead_reason == reason, job_id
    # One history row per delivery, each closed with the outcome the payload asked for.
    assert JobAttempt.objects.count() == sum(a for _, a, _ in expected)
    assert not JobAttempt.objects.filter(ended_at_ms__isnull=True).exists()
    assert JobAttempt.objects.filter(outcome="succeeded").count() == want_ok
    relay_db.audit()

    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(30) == 0
    server.signal(signal.SIGTERM)
    assert server.wait_exit(30) == 0


def test_seed_cli_lines_work(spawn: Spawner) -> None:
    """The README's commands through the ``relay`` console script, against a real server."""
    _, port = spawn.server()
    env = command_env(spawn.db_path, RELAY_ADDRESS=f"127.0.0.1:{port}")

    def relay(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [RELAY, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    out = relay(
        "submit",
        "email",
        "--payload",
        '{"user_id":42}',
        "--priority",
        "high",
        "--retries",
        "5",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    job_id = orjson.loads(out.stdout)["job"]["id"]
    assert relay("submit", "default", "--payload", '{"hello":"world"}').returncode == 0

    stats = relay("stats")
    assert stats.returncode == 0, stats.stderr
    assert "email" in stats.stdout and "default" in stats.stdout

    inspect = relay("--address", f"127.0.0.1:{port}", "inspect", job_id, "--json")
    assert inspect.returncode == 0, inspect.stderr
    job = orjson.loads(inspect.stdout)
    assert (job["priority"], job["max_retries"], job["payload"]) == ("high", 5, {"user_id": 42})

    assert relay("dead", "list", "--queue", "email").returncode == 0
    missing = relay("inspect", "job_nope")
    assert missing.returncode != 0 and "NOT_FOUND" in missing.stderr
    bad = relay("submit", "email", "--payload", "{not json")
    assert bad.returncode != 0 and bad.stderr.strip()
    unreachable = relay("--address", "127.0.0.1:9", "stats")
    assert unreachable.returncode != 0 and "127.0.0.1:9" in unreachable.stderr
