"""Crash/restart recovery with real processes and real SIGKILLs.

* ``test_chaos_*``: 1,000 jobs; the server, a worker, or everything is SIGKILLed at random
  points four times and restarted; ``tests.audit.audit`` runs after every kill and restart. At
  the end every job is SUCCEEDED or DEAD as its payload dictates, none is lost, no lease is
  acked twice, and the extra deliveries are no more than the leases in flight at the kills
  (see ``tests/chaos/scenario.py``; ``python -m tests.chaos.run`` is the long, opt-in run).
* ``test_killed_worker_*``: the lease-expiry path on its own: a worker SIGKILLed mid-job, its
  jobs expire, count one failure, and another worker completes them.
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_core.client import RelayClient
from tests.audit import audit
from tests.chaos.scenario import ChaosConfig, run_chaos
from tests.procs import Spawner, spawner

pytestmark = [pytest.mark.slow, pytest.mark.crash]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Spawner]:
    """Processes on a database file of their own (the server creates and migrates it)."""
    with spawner(str(tmp_path / "relay.db")) as s:
        yield s


def test_chaos_kills_lose_nothing_and_bound_duplicates(tmp_path: Path) -> None:
    lines: list[str] = []
    result = run_chaos(
        ChaosConfig(
            db=tmp_path / "chaos.db",
            cycles=4,
            jobs=1000,
            kinds=("all", "worker", "server", "worker"),
            seed=20261129,
        ),
        log=lines.append,
    )
    report = "\n".join([*lines, result.summary()])
    assert result.ok, report
    assert result.kills == ["all", "worker", "server", "worker"], report
    assert result.lost == 0 and sum(result.final_states.values()) == 1000, report
    assert result.audits >= 2 * 4 + 1, report  # after every kill, every restart, and the end
    # The kills did interrupt work, so the bound on duplicates was really exercised.
    assert result.in_flight_at_kills > 0, report
    assert result.duplicates <= result.allowed_duplicates, report


def test_killed_worker_jobs_expire_count_a_failure_and_complete_elsewhere(
    procs: Spawner, tmp_path: Path
) -> None:
    db = tmp_path / "relay.db"
    _, port = procs.server(RELAY_REAPER_INTERVAL_MS="100")
    address = f"127.0.0.1:{port}"
    with RelayClient(address) as client:
        ids = [
            client.submit("q", {"i": i, "sleep_ms": 1000}, max_retries=3)["job"]["id"]
            for i in range(4)
        ]
    first = procs(
        "relay_worker",
        *("--address", address, "--queue", "q", "--concurrency", "4"),
        *("--lease-ms", "1500", "--worker-id", "doomed"),
        name="doomed",
    )
    held: set[str] = set()
    while len(held) < len(ids):  # every job delivered to the first worker
        record = first.wait_for(lambda r: r.get("event") == "leased" and r["job_id"] not in held)
        assert record["attempt"] == 1
        held.add(record["job_id"])
    assert held == set(ids)
    first.kill()  # SIGKILL in the middle of every handler
    audit(db)
    second = procs(
        "relay_worker",
        *("--address", address, "--queue", "q", "--concurrency", "4"),
        *("--lease-ms", "1500", "--worker-id", "heir"),
        name="heir",
    )
    done: set[str] = set()
    while done != set(ids):
        record = second.wait_for(
            lambda r: r.get("event") == "acked" and r["job_id"] not in done, timeout=30
        )
        done.add(record["job_id"])
    second.signal(signal.SIGTERM)
    assert second.wait_exit(30) == 0
    audit(db)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        for job_id in ids:
            state, attempt, failures = conn.execute(
                "SELECT state, attempt, failures FROM relay_job WHERE id = ?", (job_id,)
            ).fetchone()
            history = conn.execute(
                "SELECT attempt, worker_id, outcome FROM relay_attempt WHERE job_id = ?"
                " ORDER BY attempt",
                (job_id,),
            ).fetchall()
            assert (state, attempt, failures) == ("succeeded", 2, 1), job_id
            assert history == [(1, "doomed", "lease_expired"), (2, "heir", "succeeded")]
