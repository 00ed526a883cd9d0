"""The HTTP submission scenario: gunicorn serving ``queue_api`` on a fresh file.

It runs only when the HTTP API has its submit route (``POST /api/v1/queues/{queue}/jobs``)
and gunicorn is installed; otherwise the report says why it was skipped. gunicorn gets the
shipped settings (``relayproject.gunicorn_conf``: one asgi worker) bound to a free
loopback port, with a ``relay_server`` on the same file as in a deployment. Each producer
thread keeps one HTTP/1.1 keep-alive connection and POSTs ``{"payload": ...}``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from relay_bench import load, procs

SUBMIT_PATH = "/api/v1/queues/bench/jobs"
START_TIMEOUT_S = 60.0


def unavailable_reason() -> str | None:
    """Return why the HTTP scenario cannot run, or None when it can."""
    if importlib.util.find_spec("gunicorn") is None:
        return "skipped: gunicorn not installed"
    from django.urls import Resolver404, resolve

    try:
        resolve(SUBMIT_PATH)
    except Resolver404:
        return "skipped: HTTP API not available (no POST /api/v1/queues/{queue}/jobs route)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GunicornProcess:
    """``gunicorn relayproject.wsgi`` on ``127.0.0.1:PORT`` for ``db_path``, ready on return.

    Raises:
        RuntimeError: it exited or did not accept connections within ``START_TIMEOUT_S``.
    """

    def __init__(self, db_path: Path) -> None:
        root = Path(__file__).resolve().parents[1]
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # The shipped settings, from the package: an installed Relay has no gunicorn.conf.py
        # (without them gunicorn's default sync worker answered every request with a 500).
        argv = [sys.executable, "-m", "gunicorn", "--config", "python:relayproject.gunicorn_conf"]
        argv += ["--bind", self.address, "relayproject.asgi:application"]
        self.popen = subprocess.Popen(
            argv,
            cwd=root,
            # A throw-away key: the HTTP side refuses to start without a private one.
            env=procs.child_env(
                str(db_path),
                RELAY_LOG="warning",
                RELAY_SECRET_KEY=os.environ.get("RELAY_SECRET_KEY") or secrets.token_urlsafe(48),
            ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.pid = self.popen.pid
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.popen.returncode}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("gunicorn did not listen in time")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def submit(
    db_path: Path,
    *,
    concurrencies: tuple[int, ...],
    ops_per_thread: dict[int, int],
    deadline_s: float,
) -> list[dict[str, Any]]:
    """Single-job HTTP submissions at each concurrency level against one gunicorn."""
    from relay_bench.scenarios import _load_result, _processes

    # As deployed (docs/architecture.md), relay_server has the same file open. Without it
    # each HTTP request's connection is the file's last one, and closing it checkpoints the
    # WAL: 29 instead of 74 submits/s with one producer on this machine.
    relay = procs.ServerProcess(db_path)
    try:
        server = GunicornProcess(db_path)
    except BaseException:
        relay.stop()
        raise
    rows = []
    try:
        for concurrency in concurrencies:
            result = load.run(
                server.address,
                "http_submit",
                concurrency=concurrency,
                processes=_processes(concurrency),
                ops_per_thread=ops_per_thread[concurrency],
                deadline_s=deadline_s,
                queue="bench",
            )
            out = _load_result(result)
            out.update(transport="http", mode="single")
            rows.append(out)
    finally:
        server.stop()
        relay.stop()
    return rows
