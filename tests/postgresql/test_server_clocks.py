"""Servers sharing one PostgreSQL database keep the database's time (``AnchoredClock``), so a
step of one server's machine clock moves nobody's leases or due times.

Found by a hostile review, before: a server whose clock was stepped an hour forward expired
the healthy leases the other server had renewed (every renewal after it refused with
``LEASE_EXPIRED``, the jobs dead on attempt 1), and one stepped an hour back had a job
submitted through it with a 10-minute delay leased through the other within 3 s. Here server
A runs on ``tests.stepclock``'s clock (``RELAY_CLOCK``), a real worker holds jobs through
server B and renews them every half second, and the test steps A's machine clock an hour
forward, then an hour back, while both reapers sweep every 100 ms.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from queue_core.client import RelayClient
from tests.crash.test_clock_step import JOBS, _WorkerEvents, events, renewer
from tests.postgresql.conftest import DATABASES, Server
from tests.relay_db import RelayDb
from tests.stepclock import STEP_FILE_ENV, step_to

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

__all__ = ["events"]  # the worker-events fixture, shared with tests/crash/test_clock_step.py

HOUR_MS = 3_600_000
DELAY_MS = 60_000


def saw_steps(server: Server, n: int, offset: int) -> list[dict[str, Any]]:
    """Wait for the ``n``-th record of ``server`` that reports a clock step; return them."""
    seen: list[dict[str, Any]] = []

    def saw(record: dict[str, Any]) -> bool:
        if record.get("event") in ("host_clock_off", "clock_step"):
            seen.append(record)
        return len(seen) >= n

    server.proc.wait_for(saw, timeout=30, what=f"the server seeing its clock stepped to {offset}")
    return seen


def test_a_step_of_one_servers_machine_clock_moves_no_lease_or_due_time(
    servers: Callable[..., list[Server]], tmp_path: Path, events: _WorkerEvents
) -> None:
    step_file = tmp_path / "clock-step"
    quick = {"RELAY_REAPER_INTERVAL_MS": "100", "RELAY_SERVER_HEARTBEAT_MS": "200"}
    (a,) = servers(
        1,
        RELAY_CLOCK="tests.stepclock.FileStepClock",
        **{STEP_FILE_ENV: str(step_file)},
        **quick,
    )
    (b,) = servers(1, **quick)
    with RelayClient(b.address) as client:
        ids = [client.submit("held", {"i": i}, max_retries=0)["job"]["id"] for i in range(JOBS)]

    early: list[str] = []
    with (
        renewer(b.address, "held", events) as held,
        RelayClient(a.address) as via_a,
        RelayClient(b.address) as via_b,
    ):
        for n, offset in enumerate((HOUR_MS, -HOUR_MS), start=1):
            step_to(step_file, offset)
            # A says it saw the step: host_clock_off (before this fix, clock_step).
            seen = saw_steps(a, n, offset)
            if seen[-1]["event"] == "host_clock_off":
                assert abs(seen[-1]["offset_ms"] - offset) < 1_000, seen
            # A delayed job submitted through the stepped server is not due early anywhere.
            delayed = via_a.submit("delayed", {"offset": offset}, delay_ms=DELAY_MS)
            assert delayed["job"]["available_at_ms"] - via_b.ping()["server_time_ms"] > (
                DELAY_MS - 5_000
            ), delayed
            early += [job["job_id"] for job in via_b.lease(["delayed"], worker_id="x")]
            held.renewed_again(f"a step of {offset} ms")
        held.finish()
    assert early == [], "a delayed job was leased before its time"
    stats = held.worker.counters()
    assert (stats["lost"], stats["acked"]) == (0, JOBS), stats
    db = RelayDb("postgresql", "")
    marks = ", ".join(["%s"] * JOBS)
    rows = db.rows(f"SELECT state, attempt FROM relay_job WHERE id IN ({marks})", ids)
    assert sorted(rows) == [("succeeded", 1)] * JOBS
    assert db.rows("SELECT COUNT(*) FROM relay_attempt WHERE outcome = 'lease_expired'") == [(0,)]
    for server in (a, b):
        assert not [r for r in server.proc.records if r.get("event") == "clock_step"]
    db.audit()
