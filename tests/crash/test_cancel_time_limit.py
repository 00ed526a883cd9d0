"""Cancel and time limits through real processes: ``relay server``, a ``relay worker`` running
long demo jobs (``sleep_ms``), and the ``relay`` console script; on SQLite and on PostgreSQL
(``relay_db``).

* ``relay cancel`` of a running job: the worker learns it at its next renew, its handler's
  sleep is cut short, the job ends CANCELLED with an attempt outcome ``cancelled``; a second
  ``relay cancel`` answers ``JOB_FINISHED`` (exit 1). A waiting job is cancelled at once and
  never reaches the worker; ``relay dead retry`` replays a cancelled job.
* ``time_limit_ms``: the worker stops a job sleeping past its limit and fails it with
  ``timeout``; with no retries left it is DEAD with reason ``timeout``, with one left it runs
  again and times out again. A queue's default from ``RELAY_QUEUE_TIME_LIMITS`` applies too.

Synchronised on the worker's log lines (``Child.wait_for``), never on sleeps.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings

from queue_core.client import RelayClient
from tests.procs import ROOT, Proc, Spawner, command_env
from tests.relay_db import DATABASES, RelayDb

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

RELAY = str(Path(sys.executable).parent / "relay")
LONG = {"sleep_ms": 120_000}  # far longer than any test: only a stop ends it early


def relay_cli(spawn: Spawner, address: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the ``relay`` console script against ``address`` on the test database."""
    env = command_env(spawn.db_path, RELAY_ADDRESS=address, **spawn.env)
    return subprocess.run(
        [RELAY, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def event_for(worker: Proc, event: str, job_id: str, timeout: float = 30.0) -> dict[str, Any]:
    """The worker's first ``event`` log line about ``job_id``."""
    return worker.wait_for(
        lambda r: r.get("event") == event and r.get("job_id") == job_id,
        timeout,
        f"event={event} job_id={job_id}",
    )


def start(spawn: Spawner, queue: str, **env: str) -> tuple[str, Proc]:
    """A server and a worker (leases of 1.5 s, renewed every 0.5 s) on ``queue``."""
    _, port = spawn.server(**env)
    address = f"127.0.0.1:{port}"
    worker = spawn(
        "relay_worker",
        *("--address", address, "--queue", queue, "--concurrency", "2", "--lease-ms", "1500"),
        name="relay_worker",
    )
    worker.wait_event("worker_ready")
    return address, worker


def stop(worker: Proc) -> None:
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(30) == 0


def test_relay_cancel_stops_a_running_job_and_cancels_a_waiting_one(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    address, worker = start(spawn, "long")
    with RelayClient(address) as client:
        running = client.submit("long", LONG, max_retries=3)["job"]["id"]
        event_for(worker, "leased", running)
        out = relay_cli(spawn, address, "cancel", running)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().startswith(f"{running}: cancel requested;")
        assert event_for(worker, "handler_stop", running)["reason"] == "cancelled"
        assert event_for(worker, "released", running)["reason"] == "interrupted"
        job = client.inspect(running)["job"]
        assert job["state"] == "cancelled"
        assert job["failures"] == 0 and job["attempt"] == 1
        assert [a["outcome"] for a in job["history"]] == ["cancelled"]
        events = [(e["event"], e["actor"]) for e in job["events"]]
        assert events[0][0] == "cancel_requested"
        assert events[0][1].startswith("tcp:")  # the CLI's connection: its peer address
        assert events[-1][0] == "cancelled"
        # A second cancel is refused with a clear code and exit 1.
        again = relay_cli(spawn, address, "cancel", running)
        assert again.returncode == 1
        assert f"JOB_FINISHED: cannot cancel {running}: it is cancelled already" in again.stderr
        assert again.stderr.count("JOB_FINISHED") == 1  # said once

        # A waiting job (delayed, so the worker cannot take it first) is cancelled at once.
        waiting = client.submit("long", {"n": 1}, delay_ms=60_000)["job"]["id"]
        out = relay_cli(spawn, address, "--json", "cancel", waiting)
        assert out.returncode == 0, out.stderr
        [result] = orjson.loads(out.stdout)["results"]
        assert (result["ok"], result["cancelled"], result["job"]["state"]) == (
            True,
            True,
            "cancelled",
        )
        assert client.inspect(waiting)["job"]["state"] == "cancelled"
        # Replayed like a dead letter: it runs (and is cancelled again while it runs).
        out = relay_cli(spawn, address, "dead", "retry", running)
        assert out.returncode == 0, out.stderr
        assert client.inspect(running)["job"]["cancel_requested_at_ms"] is None
        worker.wait_for(
            lambda r: (
                r.get("event") == "leased" and r.get("job_id") == running and r.get("attempt") == 2
            ),
            30,
            "the replayed job leased again",
        )
        assert relay_cli(spawn, address, "cancel", running).returncode == 0
        worker.wait_for(
            lambda r: (
                r.get("event") == "released"
                and r.get("job_id") == running
                and r.get("attempt") == 2
            ),
            30,
            "the second cancel",
        )
        assert client.inspect(running)["job"]["state"] == "cancelled"
        stats = client.stats("long")["queues"]["long"]
        assert stats["cancelled"] == 2 and stats["leased"] == 0
    stop(worker)
    relay_db.audit()


def test_the_worker_stops_a_job_at_its_time_limit_and_it_fails_with_timeout(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    address, worker = start(spawn, "limited", RELAY_QUEUE_TIME_LIMITS="limited=800ms")
    with RelayClient(address) as client:
        # The queue's default (800 ms) applies; no retries left: DEAD with reason timeout.
        once = client.submit("limited", LONG, max_retries=0)["job"]
        assert once["time_limit_ms"] == 800
        # Its own limit, given on the CLI, one retry: times out twice, then DEAD.
        out = relay_cli(
            spawn,
            address,
            *("submit", "limited", "--payload", orjson.dumps(LONG).decode()),
            *("--time-limit-ms", "1000", "--retries", "1", "--backoff", "fixed"),
            *("--backoff-base-ms", "10", "--no-jitter"),
        )
        assert out.returncode == 0, out.stderr
        twice = client.inspect(out.stdout.strip())["job"]
        assert twice["time_limit_ms"] == 1_000
        for job_id, deliveries in ((once["id"], 1), (twice["id"], 2)):
            for attempt in range(1, deliveries + 1):
                stopped = worker.wait_for(
                    lambda r, j=job_id, a=attempt: (
                        r.get("event") == "handler_stop"
                        and r.get("job_id") == j
                        and r.get("attempt") == a
                    ),
                    30,
                    f"the time limit of {job_id} attempt {attempt}",
                )
                assert stopped["reason"] == "timeout"
                # The worker fails it ("failed"), unless a renew at the limit came first and
                # the server failed it already: the worker heard so from the renew
                # ("result_discarded"), or its own fail, sent at its local deadline, reached
                # the server after that renew and was refused ("fail_rejected", LEASE_EXPIRED;
                # seen once on PostgreSQL). Either way the job's history below says timeout.
                worker.wait_for(
                    lambda r, j=job_id, a=attempt, t=stopped["ts"]: (
                        r.get("job_id") == j
                        and (
                            (
                                r.get("event") in ("failed", "result_discarded")
                                and r.get("attempt") == a
                            )
                            or (
                                r.get("event") == "fail_rejected"  # names no attempt:
                                and r.get("code") == "LEASE_EXPIRED"  # this one's, by time
                                and r.get("ts", "") >= t
                            )
                        )
                    ),
                    30,
                    f"the failure of {job_id} attempt {attempt}",
                )
            job = client.inspect(job_id)["job"]
            assert job["state"] == "dead", job
            assert (job["last_error"], job["dead_reason"]) == (
                "timeout",
                "attempts exhausted: timeout",
            )
            history = job["history"]
            assert len(history) == deliveries
            limit = job["time_limit_ms"]
            for a in history:  # stopped at its limit, not after its two-minute sleep
                assert a["outcome"] in ("failed", "timeout") and a["error"] == "timeout"
                assert limit <= a["ended_at_ms"] - a["started_at_ms"] < limit + 10_000
    stop(worker)
    relay_db.audit()


def test_admin_cancel_stops_a_job_a_real_worker_runs(spawn: Spawner, relay_db: RelayDb) -> None:
    address, worker = start(spawn, "long")
    User.objects.create_superuser("ops", "ops@example.com", "pw")
    admin = Client()
    admin.force_login(User.objects.get(username="ops"))
    alias = "default" if relay_db.backend == "sqlite" else "postgresql"
    with RelayClient(address) as client, override_settings(RELAY_DATABASE=alias):
        job_id = client.submit("long", LONG)["job"]["id"]
        event_for(worker, "leased", job_id)
        page = f"/admin/queue_core/job/{job_id}/change/"
        assert "Cancel…" in admin.get(page).content.decode()
        ask = {"action": "cancel_selected", "index": "0", "select_across": "0"}
        confirmation = admin.post(
            "/admin/queue_core/job/", {**ask, "_selected_action": [job_id], "_from_detail": "1"}
        )
        assert confirmation.context["will"] == 1
        done = admin.post(
            "/admin/queue_core/job/",
            {**ask, "_selected_action": [job_id], "_from_detail": "1", "post": "yes"},
            follow=True,
        )
        assert done.redirect_chain[-1][0] == page
        assert "the worker stops it at its next renew" in done.content.decode()
        assert event_for(worker, "handler_stop", job_id)["reason"] == "cancelled"
        event_for(worker, "released", job_id)
        job = client.inspect(job_id)["job"]
        assert job["state"] == "cancelled"
        assert [(e["event"], e["actor"]) for e in job["events"]] == [
            ("cancel_requested", "ops"),
            ("cancelled", None),
        ]
        audit_log = admin.get("/admin/queue_core/jobevent/", {"q": job_id}).content.decode()
        assert "cancel_requested" in audit_log and "ops" in audit_log
    stop(worker)
    relay_db.audit()
