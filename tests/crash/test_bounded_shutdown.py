"""Bounded shutdown: a worker holding long jobs exits within its shutdown timeout on SIGTERM, and
its jobs are delivered again later; none is lost.

* ``relay_worker`` (whose demo handler stops when asked) releases its jobs at once and exits 0;
  the jobs are READY again with no failure counted, and the next worker gets them.
* A worker whose handlers ignore the shutdown waits for them the whole timeout, no longer (plus
  the documented margin for the releases), then releases the jobs and exits.
* When those releases cannot reach the server, the worker still exits on time, and the jobs
  come back by lease expiry (counted as a failure).
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import sqlite3
import subprocess
import sys
import time
from typing import Any

import pytest

from queue_core.client import RelayClient
from tests.audit import audit
from tests.chaos.proxy import Proxy
from tests.procs import ROOT, Proc, Spawner, command_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# Worker.run() returns within the shutdown timeout plus a margin for the releases (see
# queue_core/worker/runner.py; here it is about 0.1 s). Allow some for a busy machine.
EXIT_MARGIN_S = 2.5
# A process's exit after ``Worker.run`` returns (threads, the interpreter's teardown), on top.
TEARDOWN_S = 2.0


def hang_worker(spawn: Spawner, address: str, **options: str) -> Proc:
    """Start ``tests.crash.hang_worker`` like ``spawn`` starts commands (killed at teardown)."""
    args = [f"--{key.replace('_', '-')}={value}" for key, value in options.items()]
    popen = subprocess.Popen(
        [sys.executable, "-m", "tests.crash.hang_worker", address, *args],
        cwd=ROOT,
        env=command_env(spawn.db_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    proc = Proc(popen, "hang_worker")
    spawn.procs.append(proc)
    return proc


def wait_leased(worker: Proc, n: int) -> set[str]:
    """Wait until ``worker`` logged ``n`` distinct leased jobs; return their ids."""
    held: set[str] = set()
    while len(held) < n:
        record = worker.wait_for(lambda r: r.get("event") == "leased" and r["job_id"] not in held)
        held.add(record["job_id"])
    return held


def stop_and_time(worker: Proc) -> tuple[int, float]:
    began = time.monotonic()
    worker.signal(signal.SIGTERM)
    code = worker.wait_exit(60)
    return code, time.monotonic() - began


def logged_s(record: dict[str, Any]) -> float:
    """A JSON log line's ``ts`` (``2026-12-07 21:28:50,929``, the writer's wall clock) in s."""
    return datetime.datetime.strptime(record["ts"], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def jobs(db: str, ids: set[str]) -> dict[str, tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return {
            job_id: conn.execute(
                "SELECT state, attempt, failures FROM relay_job WHERE id = ?", (job_id,)
            ).fetchone()
            for job_id in ids
        }


def finish_elsewhere(address: str, ids: set[str], attempt: int) -> None:
    """Another worker gets every job again (delivery ``attempt``) and completes it."""
    done: set[str] = set()
    deadline = time.monotonic() + 30
    with RelayClient(address) as client:
        while done != ids:
            assert time.monotonic() < deadline, f"not delivered again: {ids - done}"
            for lease in client.lease(["hang"], worker_id="heir", max_jobs=10, wait_ms=5_000):
                assert lease["job_id"] in ids and lease["attempt"] == attempt
                client.ack(lease["job_id"], worker_id="heir", lease_token=lease["lease_token"])
                done.add(lease["job_id"])


def submit(address: str, n: int, payload: dict[str, Any]) -> set[str]:
    with RelayClient(address) as client:
        return {client.submit("hang", payload | {"i": i})["job"]["id"] for i in range(n)}


def test_relay_worker_releases_long_jobs_and_exits_on_time(spawn: Spawner) -> None:
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    ids = submit(address, 4, {"sleep_ms": 600_000})
    worker = spawn(
        "relay_worker",
        *("--address", address, "--queue", "hang", "--concurrency", "4"),
        *("--shutdown-timeout-ms", "3000"),
        name="relay_worker",
    )
    assert wait_leased(worker, 4) == ids
    code, took = stop_and_time(worker)
    assert code == 0 and took < 3.0 + EXIT_MARGIN_S, took
    released = {r["job_id"] for r in worker.records if r.get("event") == "released"}
    assert released == ids
    assert set(jobs(spawn.db_path, ids).values()) == {("ready", 1, 0)}  # no failure counted
    finish_elsewhere(address, ids, attempt=2)
    assert set(jobs(spawn.db_path, ids).values()) == {("succeeded", 2, 0)}
    audit(spawn.db_path)


def test_worker_with_deaf_handlers_waits_out_its_timeout_and_no_more(spawn: Spawner) -> None:
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    ids = submit(address, 3, {"n": 1})
    worker = hang_worker(spawn, address, concurrency=3, shutdown_timeout_ms=3_000)
    assert wait_leased(worker, 3) == ids
    code, took = stop_and_time(worker)
    assert code == 0
    stopped = worker.wait_event("worker_stopped")
    # The wait itself, by the worker's own log lines: from the signal to the end of
    # ``Worker.run``. It waited, and not twice; the process's exit after it (the interpreter's
    # teardown) took up to 1.6 s more on a loaded machine, so the whole is bounded apart.
    waited = logged_s(stopped) - logged_s(worker.wait_event("worker_stopping"))
    assert 3.0 * 0.9 <= waited < 3.0 + EXIT_MARGIN_S, waited
    assert took < 3.0 + EXIT_MARGIN_S + TEARDOWN_S, took
    assert stopped["abandoned"] == 3 and stopped["released"] == 3
    assert set(jobs(spawn.db_path, ids).values()) == {("ready", 1, 0)}
    finish_elsewhere(address, ids, attempt=2)
    audit(spawn.db_path)


def test_worker_that_cannot_release_still_exits_and_its_jobs_expire_back(
    spawn: Spawner,
) -> None:
    _, port = spawn.server(RELAY_REAPER_INTERVAL_MS="100")
    address = f"127.0.0.1:{port}"
    ids = submit(address, 2, {"n": 1})
    with Proxy(port) as proxy:
        worker = hang_worker(
            spawn, proxy.address, concurrency=2, shutdown_timeout_ms=1_000, lease_ms=1_000
        )
        assert wait_leased(worker, 2) == ids
        proxy.retarget(None)  # the server is unreachable from now on: releases cannot arrive
        code, took = stop_and_time(worker)
    assert code == 0 and took < 1.0 + EXIT_MARGIN_S, took
    assert not [r for r in worker.records if r.get("event") == "released"]
    finish_elsewhere(address, ids, attempt=2)  # back by lease expiry
    assert set(jobs(spawn.db_path, ids).values()) == {("succeeded", 2, 1)}
    audit(spawn.db_path)
