"""Leases committed without their own fsync survive a SIGKILL of the server.

A lease-only commit does not wait for the disk (docs/design-decisions.md, "Leases without
their own fsync"), but a crash of the process alone loses nothing: the operating system
holds every write the server made. So with the server SIGKILLed mid-run, again and again,
and restarted on the same file (``tests/chaos/scenario.py``, server kills only):

* no acked job is lost or goes back to run again, none succeeds twice, every job ends in the
  state its payload dictates;
* no delivery is handed out twice (the attempt numbers of leases made just before a kill are
  not reused: those leases were still in the file at restart, which released them);
* the extra deliveries are bounded by the leases in flight at the kills, and
  ``tests.audit.audit`` finds the invariants intact after every kill and restart.

What an OS crash or power loss may take back (the leases after the last durable commit) is
simulated in ``tests/storage/test_durability.py``.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from tests.chaos.scenario import ChaosConfig, run_chaos

pytestmark = [pytest.mark.slow, pytest.mark.crash]


def test_server_kills_lose_no_relaxed_lease_and_no_ack(tmp_path: Path) -> None:
    db = tmp_path / "durable.db"
    lines: list[str] = []
    result = run_chaos(
        ChaosConfig(db=db, cycles=3, jobs=400, kinds=("server",), seed=20261202),
        log=lines.append,
    )
    report = "\n".join([*lines, result.summary()])
    assert result.ok, report
    assert result.kills == ["server"] * 3, report
    assert result.lost == 0 and sum(result.final_states.values()) == 400, report
    assert result.audits >= 2 * 3 + 1, report
    # The kills cut leases short, and the restarts found them in the file: leases committed
    # without an fsync were there after the SIGKILL, their attempts closed as "recovered".
    assert result.recovered_leases > 0, report
    assert result.duplicates <= result.allowed_duplicates, report
    with contextlib.closing(sqlite3.connect(db)) as conn:
        succeeded = conn.execute(
            "SELECT job_id, COUNT(*) FROM relay_attempt WHERE outcome = 'succeeded' "
            "GROUP BY job_id HAVING COUNT(*) > 1"
        ).fetchall()
        # Attempt numbers count every delivery: one history row per attempt, 1..attempt.
        gaps = conn.execute(
            "SELECT j.id FROM relay_job j WHERE j.attempt != "
            "(SELECT COUNT(*) FROM relay_attempt a WHERE a.job_id = j.id)"
        ).fetchall()
    assert succeeded == [], report
    assert gaps == [], report
