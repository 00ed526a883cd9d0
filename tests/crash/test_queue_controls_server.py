"""Queue controls against a real ``relay server`` process, on SQLite and on PostgreSQL
(``relay_db``): ``relay pause`` / ``relay resume`` / ``relay queue-limits`` through the
console script, the pause surviving a server restart, the admin pausing and resuming the
queue a real server serves (waking its long-poll), and real worker processes on a capped
queue never holding more leases than the cap (checked from the attempt history)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.test.utils import override_settings
from prometheus_client.parser import text_string_to_metric_families

from queue_core.client import RelayClient
from tests.procs import ROOT, Spawner, command_env
from tests.relay_db import DATABASES, RelayDb

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

RELAY = str(Path(sys.executable).parent / "relay")


def cli(spawn: Spawner, port: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = command_env(spawn.db_path, RELAY_ADDRESS=f"127.0.0.1:{port}", **spawn.env)
    return subprocess.run(
        [RELAY, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )


class LongPoll:
    """A lease long-poll in a thread; ``result(timeout)`` joins it."""

    def __init__(self, address: str, queue: str, wait_ms: int) -> None:
        self.jobs: list[Any] | None = None
        self.took_s = 0.0
        self._thread = threading.Thread(target=self._run, args=(address, queue, wait_ms))
        self._thread.start()

    def _run(self, address: str, queue: str, wait_ms: int) -> None:
        started = time.monotonic()
        with RelayClient(address) as client:
            self.jobs = list(client.lease([queue], worker_id="poller", wait_ms=wait_ms))
        self.took_s = time.monotonic() - started

    def result(self, timeout_s: float) -> list[Any]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the long-poll never returned"
        assert self.jobs is not None
        return self.jobs


def test_pause_resume_and_limits_from_the_cli(spawn: Spawner, relay_db: RelayDb) -> None:
    server, port = spawn.server()
    address = f"127.0.0.1:{port}"
    with RelayClient(address) as client:
        for i in range(5):
            client.submit("mail", {"i": i})
    out = cli(spawn, port, "pause", "mail")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("mail: paused")
    with RelayClient(address) as client:
        assert client.lease(["mail"], worker_id="w") == []
        client.submit("mail", {"i": 5})  # still accepted
    stats = cli(spawn, port, "--json", "stats")
    assert orjson.loads(stats.stdout)["controls"]["mail"]["paused"] is True
    assert "Queue controls" in cli(spawn, port, "stats").stdout

    # The pause is in the database: a restarted server still leases nothing.
    server.signal(15)
    assert server.wait_exit(30) == 0
    server, port = spawn.server()
    address = f"127.0.0.1:{port}"
    with RelayClient(address) as client:
        assert client.lease(["mail"], worker_id="w") == []

    poll = LongPoll(address, "mail", wait_ms=15_000)
    resumed = cli(spawn, port, "resume", "mail")
    assert resumed.returncode == 0, resumed.stderr
    assert len(poll.result(30)) == 1
    assert poll.took_s < 10  # woken by the resume, not by its deadline

    limits = cli(spawn, port, "queue-limits", "mail", "--max-leased", "2", "--json")
    assert limits.returncode == 0, limits.stderr
    assert orjson.loads(limits.stdout)["max_leased"] == 2
    with RelayClient(address) as client:
        got = client.lease(["mail"], worker_id="w2", max_jobs=5)
        assert len(got) == 1  # the long-poll's job is still leased: 2 in all
        assert client.lease(["mail"], worker_id="w3", max_jobs=5) == []
        client.ack(got[0]["job_id"], worker_id="w2", lease_token=got[0]["lease_token"])
        assert len(client.lease(["mail"], worker_id="w3", max_jobs=5)) == 1
    shown = cli(spawn, port, "queue-limits", "mail")
    assert shown.stdout.strip().startswith("mail: running, cap 2, no rate"), shown.stdout
    bad = cli(spawn, port, "queue-limits", "mail", "--burst", "0")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    relay_db.audit()


def test_the_admin_pauses_and_resumes_a_queue_a_real_server_serves(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    with RelayClient(address) as client:
        client.submit("reports", {"n": 1})
    alias = "default" if relay_db.backend == "sqlite" else "postgresql"
    admin = Client()
    admin.force_login(User.objects.create_superuser("root", "root@example.com", None))
    control = "/admin/queue_core/job/overview/queue/reports/{}/"
    with override_settings(RELAY_DATABASE=alias):
        assert admin.post(control.format("pause"), {"post": "yes"}).status_code == 302
        with RelayClient(address) as client:
            assert client.lease(["reports"], worker_id="w") == []
        poll = LongPoll(address, "reports", wait_ms=15_000)
        assert admin.post(control.format("resume"), {"post": "yes"}).status_code == 302
    assert len(poll.result(30)) == 1
    assert poll.took_s < 10  # the server saw the admin's commit and woke its long-poll
    events = relay_db.rows(
        "SELECT event, actor FROM relay_event WHERE job_id = %s ORDER BY id", ["queue:reports"]
    )
    assert events == [("paused", "root"), ("resumed", "root")]


def overlap(intervals: list[tuple[int, int]]) -> int:
    """The most intervals ``[start, end)`` (epoch ms) open at one instant."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in edges:  # at a tie an end (-1) sorts before a start (+1)
        now += step
        most = max(most, now)
    return most


def test_worker_processes_on_a_capped_queue_never_pass_the_cap(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    cap, total = 3, 40
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    with RelayClient(address) as client:
        client.set_queue_limits("capped", max_leased=cap)
        client.submit_batch(
            [{"queue": "capped", "payload": {"i": i, "sleep_ms": 40}} for i in range(total)]
        )
    workers = [
        spawn(
            "relay_worker",
            "--address",
            address,
            "--queue",
            "capped",
            "--concurrency",
            "4",
            name=f"worker{n}",
        )
        for n in range(2)
    ]
    for worker in workers:
        worker.wait_event("worker_ready")
    deadline = time.monotonic() + 120
    most = 0  # the most leased jobs any stats snapshot saw
    with RelayClient(address) as client:
        while (stats := client.stats("capped"))["totals"]["succeeded"] < total:
            most = max(most, stats["totals"]["leased"])
            assert time.monotonic() < deadline, stats
            time.sleep(0.01)
    assert most <= cap
    rows = relay_db.rows(
        "SELECT a.started_at_ms, a.ended_at_ms FROM relay_attempt a "
        "JOIN relay_job j ON j.id = a.job_id WHERE j.queue = %s",
        ["capped"],
    )
    assert len(rows) == total
    assert overlap([(int(s), int(e)) for s, e in rows]) == cap  # reached, never passed
    for worker in workers:
        worker.signal(15)
        assert worker.wait_exit(30) == 0
    relay_db.audit()


def test_a_rate_limited_long_poll_wakes_when_its_next_token_is_due(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    # The reaper's own pass is 30 s away: only the token's due time can wake the poll sooner.
    _, port = spawn.server(RELAY_REAPER_INTERVAL_MS="30000")
    address = f"127.0.0.1:{port}"
    with RelayClient(address) as client:
        client.set_queue_limits("slow", rate_per_s=2.0, burst=1)
        for i in range(2):
            client.submit("slow", {"i": i})
        assert len(client.lease(["slow"], worker_id="w")) == 1  # the one token
    poll = LongPoll(address, "slow", wait_ms=20_000)
    jobs = poll.result(30)
    assert len(jobs) == 1, "the second job never came"
    assert poll.took_s < 10, poll.took_s  # at the next token (~0.5 s), not at wait_ms's end


def _claims(metrics_port: int) -> float:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "relay_claim_duration_seconds_count"
    )


def test_long_polls_of_a_throttled_queue_claim_once_a_token(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    # At each token the reaper woke one long-poll, and each that got the token woke two more,
    # which found none: 8 long-polls of a queue at 4 jobs/s made 6.5 claims a job. A
    # long-poll that took a queue's last token now wakes no other (Wakeups.leave).
    proc, port = spawn.server("--metrics-address", "127.0.0.1:0", RELAY_REAPER_INTERVAL_MS="30000")
    metrics_port = int(proc.wait_event("metrics_ready")["port"])
    address = f"127.0.0.1:{port}"
    polls = 6
    with RelayClient(address) as client:
        client.set_queue_limits("r", rate_per_s=10.0, burst=1)
        for i in range(polls + 1):
            client.submit("r", {"i": i})
        assert len(client.lease(["r"], worker_id="w")) == 1  # the one token
    before = _claims(metrics_port)
    waiting = [LongPoll(address, "r", wait_ms=20_000) for _ in range(polls)]
    assert all(len(poll.result(30)) == 1 for poll in waiting)  # one a token, 100 ms apart
    claims = _claims(metrics_port) - before
    # Each long-poll's first claim and one a token, and a few where a token came as a
    # long-poll claimed on its own; with the hand-ons it was 6 + 6 + 11.
    assert claims <= 2 * polls + 4, claims
