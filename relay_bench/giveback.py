"""``python -m relay_bench.giveback``: what a mass give-back costs the other clients.

A connection reset with lease replies its kernel never sent gives their jobs back READY
(docs/failure-model.md, "A shutdown does not wait for a client that reads slowly"). This
measures what that costs everyone else, on a real ``relay_server`` over loopback:

1. ``ghosts`` clients, each with a 4 KiB receive buffer, pipeline ``each`` one-job leases (of
   jobs with a 100-byte payload and a 10-minute lease) and read nothing, until the server's
   count of LEASED jobs stops growing;
2. a sentinel client submits, leases and acks one job every 20 ms (``SENTINEL_PAUSE_S``);
3. after 0.5 s every ghost resets its connection at once (``SO_LINGER`` 0);
4. the LEASED count is read every 20 ms until it has not moved for 1 s (``SETTLE_S``).

Reported per run: the sentinel's worst and median round trip (submit + lease + ack) from the
resets on, the worst before them, the time until the LEASED count last moved, and the jobs left
LEASED (those whose replies the ghosts' kernels took: they stay leased until expiry, by design).
``--worker-ids per-lease`` makes each ghost lease name a worker id of its own (a client may).
Each run has a fresh database: an SQLite file, or with ``--database-url`` a database of its
own on that PostgreSQL server, dropped at the end. ``--runs`` (3) repeats it; the summary gives
each figure's median and min-max (``stats.spread``) and the load average at each run's start.
"""

from __future__ import annotations

import argparse
import secrets
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from queue_core.client import RelayClient
from relay_bench import procs, scenarios
from relay_bench.runner import loadavg
from relay_bench.stats import percentile, spread

QUEUE = "giveback"
GHOST_RCVBUF = 4096  # bytes: the ghosts' receive buffer (their kernels hold a little)
LEASE_MS = 600_000  # the ghosts' leases outlive the run
SENTINEL_PAUSE_S = 0.02
BEFORE_RESET_S = 0.5
POLL_S = 0.02
SETTLE_S = 1.0
SETTLE_LIMIT_S = 30.0  # a run gives up waiting for the count to settle after this
# The server's shutdown grace (ms): the jobs the ghosts' kernels took stay leased, and a run
# need not wait the default 5 s for them after it has measured.
SHUTDOWN_GRACE_MS = "0"


class Ghost:
    """A client that pipelines lease requests through a small receive buffer and reads none
    of the replies (raw: ``RelayClient`` reads each reply before its next request)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, GHOST_RCVBUF)
        self.sock.connect(("127.0.0.1", port))

    def reset(self) -> None:
        """Close with a reset (``SO_LINGER`` 0), as a crashed client's kernel would."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def leased(client: RelayClient) -> int:
    """The server's count of LEASED jobs in ``QUEUE``."""
    counts = client.stats(QUEUE)["queues"].get(QUEUE)
    return 0 if counts is None else int(counts["leased"])


def settle(client: RelayClient) -> tuple[int, float]:
    """Poll the LEASED count until it has not moved for ``SETTLE_S``; return it and when it
    last moved (``time.monotonic``)."""
    last, moved = leased(client), time.monotonic()
    began = moved
    while time.monotonic() - moved < SETTLE_S and time.monotonic() - began < SETTLE_LIMIT_S:
        time.sleep(POLL_S)
        now = leased(client)
        if now != last:
            last, moved = now, time.monotonic()
    return last, moved


def scenario(port: int, ghosts: int, each: int, *, per_lease: bool = False) -> dict[str, Any]:
    """Run the give-back scenario once on the server at ``127.0.0.1:port`` (module doc);
    ``per_lease``: each ghost lease names a worker id of its own (else all name one).

    Returns:
        ``{"leased", "left_leased", "settled_ms", "sentinel_max_ms", "sentinel_p50_ms",
        "sentinel_before_max_ms", "sentinel_calls"}`` (times in ms).
    Raises:
        RelayError: a request was refused; RuntimeError: the sentinel failed.
    """
    address = f"127.0.0.1:{port}"
    scenarios.prefill(address, QUEUE, ghosts * each)
    admin = RelayClient(address, timeout_s=60.0)

    def lease(i: int) -> bytes:
        worker_id = f"ghost-{i}" if per_lease else "ghost"
        args = {"queues": [QUEUE], "worker_id": worker_id, "lease_ms": LEASE_MS}
        return orjson.dumps({"id": i, "op": "lease", "args": args}) + b"\n"

    pipelined = b"".join(lease(i) for i in range(each))
    clients = []
    for _ in range(ghosts):
        ghost = Ghost(port)
        ghost.sock.sendall(pipelined)
        clients.append(ghost)
    held, _ = settle(admin)

    rounds: list[tuple[float, float]] = []
    stop = threading.Event()
    failures: list[BaseException] = []

    def sentinel() -> None:
        try:
            client = RelayClient(address, timeout_s=60.0)
            while not stop.is_set():
                began = time.monotonic()
                client.submit("sentinel", {})
                (job,) = client.lease(["sentinel"], worker_id="s")
                client.ack(job["job_id"], worker_id="s", lease_token=job["lease_token"])
                rounds.append((began, time.monotonic() - began))
                stop.wait(SENTINEL_PAUSE_S)
            client.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            failures.append(exc)

    thread = threading.Thread(target=sentinel, name="sentinel")
    thread.start()
    time.sleep(BEFORE_RESET_S)  # the sentinel's rounds before the resets, for comparison
    reset_at = time.monotonic()
    for ghost in clients:
        ghost.reset()
    left, moved = settle(admin)
    stop.set()
    thread.join()
    admin.close()
    if failures:
        raise RuntimeError(f"the sentinel failed: {failures[0]!r}")
    after = sorted(d * 1000 for t, d in rounds if t >= reset_at)
    before = sorted(d * 1000 for t, d in rounds if t < reset_at)
    return {
        "leased": held,
        "left_leased": left,
        "settled_ms": round(max(0.0, moved - reset_at) * 1000, 1),
        "sentinel_max_ms": round(after[-1], 1),
        "sentinel_p50_ms": round(percentile(after, 50), 1),
        "sentinel_before_max_ms": round(before[-1], 1) if before else None,
        "sentinel_calls": len(after),
    }


def one_run(
    ghosts: int, each: int, database_url: str | None, workdir: Path, *, per_lease: bool = False
) -> dict[str, Any]:
    """A fresh database and server, ``scenario`` on it, the server stopped (SIGTERM)."""
    if database_url is None:
        template = workdir / "template.db"
        if not template.exists():
            procs.template_db(workdir)
        db = procs.fresh_db(template, workdir, "giveback")
        server = procs.ServerProcess(db, RELAY_SHUTDOWN_GRACE_MS=SHUTDOWN_GRACE_MS)
        try:
            return scenario(server.port, ghosts, each, per_lease=per_lease)
        finally:
            server.stop()
    import psycopg

    from relay_bench.postgresql import with_database

    name = f"relay_giveback_{secrets.token_hex(3)}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = with_database(database_url, name)
        procs.migrate(procs.child_env("", RELAY_DATABASE_URL=url))
        server = procs.ServerProcess(
            None, RELAY_DATABASE_URL=url, RELAY_SHUTDOWN_GRACE_MS=SHUTDOWN_GRACE_MS
        )
        try:
            return scenario(server.port, ghosts, each, per_lease=per_lease)
        finally:
            server.stop()
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_bench.giveback", description=__doc__)
    parser.add_argument("--ghosts", type=int, default=10, help="clients that reset (10)")
    parser.add_argument("--each", type=int, default=1000, help="leases each pipelines (1000)")
    parser.add_argument("--runs", type=int, default=3, help="fresh database and server each (3)")
    parser.add_argument("--database-url", help="postgresql://... (default: an SQLite file)")
    parser.add_argument(
        "--worker-ids",
        choices=("one", "per-lease"),
        default="one",
        help="the ghosts' leases name one worker id, or one each (one)",
    )
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="relay-giveback-") as tmp:
        for run in range(args.runs):
            load = loadavg()
            per_lease = args.worker_ids == "per-lease"
            result = one_run(
                args.ghosts, args.each, args.database_url, Path(tmp), per_lease=per_lease
            )
            result["loadavg"] = load
            results.append(result)
            print(f"run {run + 1}: {orjson.dumps(result).decode()}", flush=True)
    for key in ("sentinel_max_ms", "sentinel_p50_ms", "settled_ms", "left_leased"):
        print(f"{key}: {orjson.dumps(spread([r[key] for r in results], 1)).decode()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
