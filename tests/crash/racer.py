"""A child process that races other processes and threads on one database, directly through
``QueueService`` (no server): ``python -m tests.crash.racer claim|submit ...``.

It prints ``ready`` on stdout, waits for a line on stdin (a barrier across processes, so every
racer starts at the same moment), runs, and prints one JSON object per result line, then
``done``. The environment names the database (``RELAY_DB``), as ``tests.procs.command_env``
builds it. The test side is ``Racer``.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import orjson

from tests.procs import ROOT, command_env


def _setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relayproject.settings")
    import django

    django.setup()


def _emit(out: IO[str], record: dict[str, Any]) -> None:
    out.write(orjson.dumps(record).decode() + "\n")
    out.flush()


BUSY_TRIES = 20


def not_busy[T](call: Callable[[], T]) -> T:
    """``call()``, made again while it fails ``StoreBusy`` (BUSY: nothing changed, try again,
    as a client does), at most ``BUSY_TRIES`` times: a racer on a machine loaded enough for
    SQLite's lock to outlast the retry budget."""
    from queue_core import errors

    for _ in range(BUSY_TRIES - 1):
        try:
            return call()
        except errors.StoreBusy:
            continue
    return call()


def claim_loop(args: argparse.Namespace, out: IO[str], held: IO[str] | None = None) -> None:
    """Claim until ``--jobs`` jobs of the queue are done; ack some, abandon the rest.

    With ``held`` (stdin), it waits there for a second line once its first claim that leased
    anything is acked or abandoned: the test then knows every racer won the lock once
    before any of them can drain the queue (one racer leased nothing before the two others
    had finished all 240 jobs: once in 14 runs)."""
    from queue_core import errors
    from queue_core.service import QueueService

    service = QueueService()
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        claim = functools.partial(
            service.claim,
            [args.queue],
            worker_id=args.worker_id,
            max_jobs=rng.randint(1, 3),
            lease_ms=args.lease_ms,
        )
        leases = not_busy(claim)
        for lease in leases:
            _emit(out, {"kind": "lease", "worker": args.worker_id, **lease})
            if rng.random() < args.abandon:
                continue  # as a crashed worker would: the lease has to expire
            try:
                ack = functools.partial(
                    service.ack,
                    lease["job_id"],
                    worker_id=args.worker_id,
                    lease_token=lease["lease_token"],
                )
                not_busy(ack)
                _emit(out, {"kind": "ack", "job_id": lease["job_id"], "attempt": lease["attempt"]})
            except (errors.LeaseExpired, errors.StaleToken) as exc:
                _emit(out, {"kind": "ack_rejected", "job_id": lease["job_id"], "code": exc.code})
        if leases and held is not None:
            held.readline()  # the second barrier (``Racer.go``)
            held = None
        if not leases:
            totals = not_busy(functools.partial(service.stats, args.queue))["totals"]
            if totals["succeeded"] + totals["dead"] >= args.jobs:
                return
    raise SystemExit(f"the jobs were not done within {args.timeout_s} s")


def submit_loop(args: argparse.Namespace, out: IO[str]) -> None:
    """Submit the same idempotency key ``--count`` times."""
    from queue_core.service import QueueService

    service = QueueService()
    for _ in range(args.count):
        result = service.submit(args.queue, {"key": args.key}, idempotency_key=args.key)
        _emit(out, {"job_id": result["job"]["id"], "deduplicated": result["deduplicated"]})


def main() -> None:
    """Parse, set Django up, wait for the go line, run."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    claim = sub.add_parser("claim")
    claim.add_argument("--queue", required=True)
    claim.add_argument("--worker-id", required=True)
    claim.add_argument("--jobs", type=int, required=True)
    claim.add_argument("--lease-ms", type=int, default=1000)
    claim.add_argument("--abandon", type=float, default=0.3)
    claim.add_argument("--seed", type=int, default=0)
    claim.add_argument("--timeout-s", type=float, default=120.0)
    claim.add_argument(
        "--hold-after-first", action="store_true", help="wait for a second go line (claim_loop)"
    )
    submit = sub.add_parser("submit")
    submit.add_argument("--queue", required=True)
    submit.add_argument("--key", required=True)
    submit.add_argument("--count", type=int, default=10)
    args = parser.parse_args()
    _setup()
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    sys.stdin.readline()  # the barrier
    if args.command == "claim":
        claim_loop(args, out, sys.stdin if args.hold_after_first else None)
    else:
        submit_loop(args, out)
    out.write("done\n")
    out.flush()


class Racer:
    """The test side: start ``python -m tests.crash.racer *args`` on ``db``, then ``go()``."""

    def __init__(self, db: str, *args: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.crash.racer", *args],
            cwd=ROOT,
            env=command_env(db, **env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until the child is set up
        if line != "ready\n":
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"racer did not start: {line!r}\n{err}")
        self.first_lines: list[str] = []  # read by first(), returned by results()

    def go(self) -> None:
        """Release the barrier (a second call: the one ``--hold-after-first`` waits at)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def first(self) -> dict[str, Any]:
        """Wait for the child's first record (after ``go()``) and return it; ``results()``
        returns it too."""
        assert self.proc.stdout is not None
        # Byte by byte from the pipe: a buffered readline could take more than the line, and
        # communicate() in results() reads the pipe itself, past that buffer.
        fd, raw = self.proc.stdout.fileno(), b""
        while not raw.endswith(b"\n") and (byte := os.read(fd, 1)):
            raw += byte
        line = raw.decode()
        if not line or line == "done\n":
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"racer ended before its first record: {line!r}\n{err}")
        self.first_lines.append(line)
        return dict(orjson.loads(line))

    def results(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Wait for the child to finish; return its JSON records (fails on a bad exit)."""
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        lines = [line.rstrip("\n") for line in self.first_lines] + out.splitlines()
        assert lines and lines[-1] == "done", err
        return [orjson.loads(line) for line in lines[:-1]]

    def kill(self) -> None:
        """Kill the child if it still runs (teardown)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=30)


if __name__ == "__main__":
    main()
