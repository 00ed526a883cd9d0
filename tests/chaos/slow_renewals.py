"""Measure a worker's leases over a slow link (a script, not a test): a real ``relay server``
(SQLite in a temporary folder), the chaos proxy holding every ``renew``/``renew_batch`` reply
400 ms, and a real ``relay worker --concurrency 16 --lease-ms 6000`` running 16 jobs of 20 s.

Usage (from a checkout whose code is under test; the proxy comes from this file's tree)::

    python -m tests.chaos.slow_renewals <tree> <port>

Prints one JSON line: the drain time (s), the worker's counters, the attempts made (16 when
no lease was lost), the renew requests through the proxy, and the ``LEASE_EXPIRED`` and
``renew_error`` lines the worker logged. docs/failure-model.md has the figures.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from typing import Any

from tests.chaos.proxy import Action, Proxy

JOBS = 16
DELAY_S = 0.4


def _slow(frame: dict[str, Any]) -> Action:
    return Action.DELAY_REPLY if frame.get("op") in ("renew", "renew_batch") else Action.FORWARD


def main(tree: str, port: int) -> None:
    relay = os.path.join(os.path.dirname(sys.executable), "relay")
    tmp = tempfile.mkdtemp(prefix="slow-renewals")
    env = {
        **os.environ,
        "RELAY_DB": f"{tmp}/relay.db",
        "RELAY_ADDRESS": f"127.0.0.1:{port}",
        "PYTHONPATH": tree,
    }

    def run(*args: str) -> str:
        done = subprocess.run([relay, *args], cwd=tree, env=env, check=True, capture_output=True)
        return done.stdout.decode()

    run("migrate")
    server = subprocess.Popen(
        [relay, "server"], cwd=tree, env=env, stderr=subprocess.PIPE, text=True
    )
    atexit.register(lambda: (server.send_signal(signal.SIGTERM), server.wait(30)))
    assert server.stderr is not None
    for line in server.stderr:
        if "event=ready" in line:
            break
    proxy = Proxy(port, _slow, reply_delay_s=DELAY_S)
    for _ in range(JOBS):
        run("submit", "slow", "--payload", json.dumps({"sleep_ms": 20_000}))
    started = time.monotonic()
    worker = subprocess.Popen(
        [
            relay,
            "worker",
            "--queue",
            "slow",
            "--concurrency",
            str(JOBS),
            "--lease-ms",
            "6000",
            "--address",
            proxy.address,
            "--json",
        ],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while time.monotonic() - started < 90:  # bounded: the jobs take about 20 s
        if json.loads(run("--json", "stats"))["totals"].get("succeeded", 0) == JOBS:
            break
        time.sleep(0.5)  # polling a real process's progress: the measurement's own clock
    elapsed = time.monotonic() - started
    worker.send_signal(signal.SIGTERM)
    out, err = worker.communicate(timeout=60)
    proxy.close()
    counters = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    db = sqlite3.connect(f"{tmp}/relay.db")
    attempts = db.execute("SELECT count(*), max(attempt) FROM relay_attempt").fetchone()
    renews = [op for op, _ in proxy.frames if op in ("renew", "renew_batch")]
    report = {
        "elapsed_s": round(elapsed, 1),
        "counters": {k: counters.get(k) for k in ("acked", "renewed", "lost", "released")},
        "attempts": attempts[0],
        "most_attempts_of_a_job": attempts[1],
        "renew_requests": len(renews),
        "lease_expired_lines": err.count("LEASE_EXPIRED"),
        "renew_error_lines": err.count("renew_error"),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
