"""Real child processes for end-to-end and crash tests.

``spawn()`` starts ``manage.py <command>`` against the test database and collects the JSON log
lines it writes to stderr, so a test waits for a readiness line (``event=ready port=...``, as
River's test signals do) instead of sleeping. Every process a test starts is killed at
teardown, whatever happened.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]


class Proc:
    """A child process whose stderr JSON log records are collected as they arrive.

    Args:
        popen: the started process (stderr must be a pipe).
        name: a label for failure messages.
    """

    def __init__(self, popen: subprocess.Popen[bytes], name: str) -> None:
        self.popen = popen
        self.name = name
        self.records: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            text = line.decode("utf-8", "replace").rstrip("\n")
            try:
                record = orjson.loads(text)
            except orjson.JSONDecodeError:
                record = None
            with self._cond:
                self.raw.append(text)
                if isinstance(record, dict):
                    self.records.append(record)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 30.0
    ) -> dict[str, Any]:
        """Return the first log record matching ``predicate``; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for record in self.records[seen:]:
                    if predicate(record):
                        return record
                seen = len(self.records)
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    tail = "\n".join(self.raw[-20:])
                    why = "exited" if self._eof else "timed out"
                    raise AssertionError(f"{self.name} {why} before the expected log line:\n{tail}")
                self._cond.wait(left)

    def wait_event(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        """Return the first record with ``event == event``."""
        return self.wait_for(lambda r: r.get("event") == event, timeout)

    def stderr_text(self) -> str:
        """All stderr lines so far."""
        with self._cond:
            return "\n".join(self.raw)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the process to exit; return its exit code."""
        code = self.popen.wait(timeout)
        self._reader.join(timeout)
        return code

    def signal(self, sig: int) -> None:
        """Send ``sig`` (e.g. ``signal.SIGKILL`` for a real kill -9)."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, reap, and close the stderr pipe."""
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self._reader.join(10)
        if self.popen.stderr is not None:
            self.popen.stderr.close()


def _set_nofile(n: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def command_env(db_path: str, **extra: str) -> dict[str, str]:
    """The environment for a child: the test database, quick reaper, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "relayproject.settings",
            "RELAY_DB": db_path,
            "PYTHONUNBUFFERED": "1",
            "RELAY_LOG": "info",
            # Children read relayproject.settings: give them a key (the HTTP side needs one).
            "RELAY_SECRET_KEY": "relay-tests-only-secret-key-not-for-any-deployment-3f9c1e7a",
        }
    )
    env.update(extra)
    return env


class Spawner:
    """Starts ``manage.py`` commands and kills whatever is left at teardown."""

    def __init__(self, db_path: str) -> None:
        self.db_path = db_path
        self.env: dict[str, str] = {}  # for every child (``RELAY_DATABASE_URL`` on PostgreSQL)
        self.procs: list[Proc] = []

    def __call__(
        self, *args: str, name: str | None = None, nofile: int | None = None, **env: str
    ) -> Proc:
        """Start ``manage.py *args`` with stdout discarded and stderr collected.

        ``nofile`` sets the child's file-descriptor limit (soft and hard), as ``ulimit -n``.
        """
        limit = None if nofile is None else functools.partial(_set_nofile, nofile)
        popen = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), *args],
            cwd=ROOT,
            env=command_env(self.db_path, **{**self.env, **env}),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=limit,
        )
        proc = Proc(popen, name or args[0])
        self.procs.append(proc)
        return proc

    def run(
        self, *args: str, timeout: float = 60.0, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """Run ``manage.py *args`` to completion and return its output."""
        return subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), *args],
            cwd=ROOT,
            env=command_env(self.db_path, **{**self.env, **env}),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def server(self, *args: str, nofile: int | None = None, **env: str) -> tuple[Proc, int]:
        """Start ``relay_server`` on a free loopback port; return it and its port once ready."""
        proc = self(
            "relay_server",
            "--address",
            "127.0.0.1:0",
            *args,
            name="relay_server",
            nofile=nofile,
            **env,
        )
        ready = proc.wait_event("ready", timeout=60)
        return proc, int(ready["port"])

    def cleanup(self) -> None:
        """Kill every process still running."""
        for proc in self.procs:
            proc.kill()


@contextlib.contextmanager
def spawner(db_path: str) -> Iterator[Spawner]:
    """A Spawner whose processes are all killed on exit."""
    s = Spawner(db_path)
    try:
        yield s
    finally:
        s.cleanup()
