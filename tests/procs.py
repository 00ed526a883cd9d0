"""Real child processes for end-to-end and crash tests.

``spawn()`` starts ``manage.py <command>`` against the test database and collects the JSON log
lines it writes to stderr (``Proc``, the benchmark's ``relay_bench.child.Child``), so a test
waits for a readiness line (``event=ready port=...``, as River's test signals do) instead of
sleeping. Every process a test starts is killed at teardown, whatever happened.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from relay_bench.child import Child

ROOT = Path(__file__).resolve().parents[1]


# The tests' name for the process wrapper they share with the benchmark.
Proc = Child


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

    def migrate(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """Run ``manage.py migrate *args`` as a test's set-up step; fail the test unless it
        exits 0."""
        out = self.run("migrate", *args, timeout=120.0, **env)
        assert out.returncode == 0, out.stderr
        return out

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


FUTURE_MIGRATION = "0999_from_the_future"


def record_future_migration(db_path: str) -> None:
    """Record in a SQLite file a ``queue_core`` migration this code does not have, as a
    newer Relay's migrate would have left it (``FUTURE_MIGRATION``)."""
    with contextlib.closing(sqlite3.connect(db_path)) as sql, sql:
        sql.execute(
            "INSERT INTO django_migrations (app, name, applied) "
            "VALUES ('queue_core', ?, CURRENT_TIMESTAMP)",
            (FUTURE_MIGRATION,),
        )
