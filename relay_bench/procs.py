"""Processes and files for the benchmark: databases, ``relay_server``, ``relay_worker``, RSS.

* ``template_db`` runs ``migrate`` once on an empty file; ``fresh_db`` copies it, so every
  scenario starts on a fresh SQLite file with the shipped schema.
* ``ServerProcess`` is a real ``relay_server`` subprocess on ``127.0.0.1:0``; the port comes
  from its JSON ``event=ready`` log line on stderr (no sleeps).
* ``WorkerProcess`` is a real ``relay_worker`` subprocess (the demo handler acks at once).
* ``peak_rss_mb`` reads ``VmHWM`` (the kernel's high-water mark of resident memory) from
  ``/proc/PID/status``; elsewhere it falls back to psutil's current RSS.
* ``fill_backlog`` writes READY jobs straight into a file before its server starts, and
  ``fill_finished`` SUCCEEDED ones with their attempts: test set-up (a recursive CTE in
  100,000-row transactions with ``synchronous=OFF``), not a measured path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from relay_bench.child import Child

READY_TIMEOUT_S = 120.0
FILL_CHUNK = 100_000


def django_cmd(*args: str) -> list[str]:
    """``python -m django ARGS`` with the running interpreter (works installed or in a checkout)."""
    return [sys.executable, "-m", "django", *args]


def child_env(db_path: str, **extra: str) -> dict[str, str]:
    """The environment for a Relay child process on ``db_path`` (JSON logs at info)."""
    env = dict(os.environ)
    env.setdefault("DJANGO_SETTINGS_MODULE", "relayproject.settings")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update({"RELAY_DB": db_path, "PYTHONUNBUFFERED": "1", "RELAY_LOG": "info"})
    env.update(extra)
    return env


def migrate(env: dict[str, str]) -> None:
    """Run ``migrate`` in a child with ``env`` (see ``child_env``), waiting up to 300 s.

    Raises:
        RuntimeError: ``migrate`` failed (the end of its stderr is in the message).
        subprocess.TimeoutExpired: it ran longer.
    """
    done = subprocess.run(
        django_cmd("migrate", "--no-input", "--verbosity", "0"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"migrate failed: {done.stderr.strip()[-2000:]}")


def template_db(directory: Path) -> Path:
    """Create ``directory/template.db`` with ``migrate`` and return its path.

    Raises:
        RuntimeError: ``migrate`` failed (its output is in the message).
    """
    path = directory / "template.db"
    migrate(child_env(str(path)))
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


def fresh_db(template: Path, directory: Path, name: str) -> Path:
    """Copy the migrated template to ``directory/name.db`` and return the copy's path."""
    path = directory / f"{name}.db"
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{path}{suffix}")
    shutil.copyfile(template, path)
    return path


def peak_rss_mb(pid: int) -> float | None:
    """Return the peak resident set of ``pid`` in MiB (``VmHWM``), or its current RSS, or None."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    try:
        return round(float(psutil.Process(pid).memory_info().rss) / 2**20, 1)
    except psutil.Error:
        return None


def cpu_s(pid: int | None) -> float | None:
    """Return the user + system CPU seconds ``pid`` has used (all threads), or None."""
    if pid is None:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)


def rss_mb(pid: int) -> float | None:
    """Return the current resident set of ``pid`` in MiB, or None when it is gone."""
    try:
        return round(float(psutil.Process(pid).memory_info().rss) / 2**20, 1)
    except psutil.Error:
        return None


class _Process(Child):
    """A Relay child of the benchmark, ready on return (its ``ready_event`` line was logged).

    Only the ``ready``/``worker_ready`` records and the last 200 stderr lines are kept: a
    worker logs every job.

    Raises:
        LogWaitError (a RuntimeError): it exited, or gave no ``ready_event`` line in
        ``READY_TIMEOUT_S``; it is stopped first.
    """

    def __init__(self, argv: list[str], env: dict[str, str], name: str, ready_event: str) -> None:
        popen = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        super().__init__(popen, name, events=("ready", "worker_ready"), lines=200)
        try:
            self.ready = self.wait_event(ready_event, READY_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def peak_rss_mb(self) -> float | None:
        """The process's peak RSS so far in MiB (see ``peak_rss_mb``)."""
        return peak_rss_mb(self.pid)


class ServerProcess(_Process):
    """``relay_server --address 127.0.0.1:0 [--db PATH]`` as a subprocess, ready on return
    (``prefix``: a command it runs under, e.g. valgrind's).

    Attributes:
        port: the bound port; ``address``: ``127.0.0.1:PORT``.
    Raises:
        LogWaitError (a RuntimeError): the server exited or did not log ``event=ready`` in time.
    """

    def __init__(
        self, db_path: Path | None, *, prefix: list[str] | None = None, **env: str
    ) -> None:
        argv = [*(prefix or []), *django_cmd("relay_server", "--address", "127.0.0.1:0")]
        if db_path is not None:  # None: the database comes from env (RELAY_DATABASE_URL)
            argv += ["--db", str(db_path)]
        super().__init__(argv, child_env(str(db_path or ""), **env), "relay_server", "ready")
        self.port = int(self.ready["port"])
        self.address = f"127.0.0.1:{self.port}"


class CeilingProcess(_Process):
    """``python -m relay_bench.ceiling --db PATH --synchronous LEVEL --schema SCHEMA`` (the
    CPython ceiling, see ``relay_bench.ceiling``; ``schema`` ``"lean"`` on a lean floor file,
    ``"relay"`` on a migrated Relay file) as a subprocess on an ephemeral port, ready on return
    (``reader``: ``"streams"`` or ``"protocol"``, the ceiling's ``--reader``; ``prefix``: a
    command it runs under, e.g. valgrind's).

    Attributes:
        port: the bound port; ``address``: ``127.0.0.1:PORT``.
    Raises:
        LogWaitError (a RuntimeError): it exited or did not log ``event=ready`` in time.
    """

    def __init__(
        self,
        db_path: Path,
        synchronous: str,
        *,
        schema: str = "lean",
        reader: str = "streams",
        prefix: list[str] | None = None,
    ) -> None:
        argv = [*(prefix or []), sys.executable, "-m", "relay_bench.ceiling", "--db", str(db_path)]
        argv += ["--synchronous", synchronous, "--schema", schema, "--reader", reader]
        argv += ["--address", "127.0.0.1:0"]
        super().__init__(argv, child_env(str(db_path)), "ceiling", "ready")
        self.port = int(self.ready["port"])
        self.address = f"127.0.0.1:{self.port}"


class WorkerProcess(_Process):
    """``relay_worker --address ADDR --queue Q --concurrency N`` as a subprocess, ready on return.

    It runs the shipped demo handler (acks at once) and logs at the shipped ``info`` level.

    Raises:
        LogWaitError (a RuntimeError): the worker exited or did not log ``event=worker_ready``.
    """

    def __init__(self, address: str, queue: str, concurrency: int, db_path: Path) -> None:
        argv = django_cmd(
            "relay_worker",
            "--address",
            address,
            "--queue",
            queue,
            "--concurrency",
            str(concurrency),
            "--wait-ms",
            "250",
            "--shutdown-timeout-ms",
            "5000",
        )
        super().__init__(argv, child_env(str(db_path)), "relay_worker", "worker_ready")


def count_state(db_path: Path, state: str, queue: str = "bench") -> int:
    """Count ``queue``'s jobs in ``state`` with a read-only connection (an index range count)."""
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as conn:
        conn.execute("PRAGMA busy_timeout=5000")
        row = conn.execute(
            "SELECT COUNT(*) FROM relay_job WHERE queue = ? AND state = ?", (queue, state)
        ).fetchone()
    return int(row[0])


_FILL = """
WITH RECURSIVE c(n) AS (SELECT :lo UNION ALL SELECT n + 1 FROM c WHERE n + 1 < :hi)
INSERT INTO relay_job (
    id, queue, state, priority, payload, idempotency_key, idempotency_expires_at_ms,
    attempt, failures, max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter,
    created_at_ms, available_at_ms, ready_since_ms, updated_at_ms)
SELECT printf('job_%026d', n), :queue, 'ready', n % 4,
       '{"n":' || n || ',"pad":"' || :pad || '"}', NULL, NULL,
       0, 0, 3, 'exponential', 1000, 300000, 1,
       :now - (n * 7919) % :spread, NULL, :now - (n * 7919) % :spread, :now
  FROM c
"""


_FILL_FINISHED = """
WITH RECURSIVE c(n) AS (SELECT :lo UNION ALL SELECT n + 1 FROM c WHERE n + 1 < :hi)
INSERT INTO relay_job (
    id, queue, state, priority, payload, idempotency_key, idempotency_expires_at_ms,
    attempt, failures, max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter,
    created_at_ms, available_at_ms, ready_since_ms, finished_at_ms, updated_at_ms)
SELECT printf('job_f%025d', n), :queue, 'succeeded', n % 4,
       '{"n":' || n || ',"pad":"' || :pad || '"}', NULL, NULL,
       1, 0, 3, 'exponential', 1000, 300000, 1,
       :finished - 1000, NULL, NULL, :finished - (n * 7919) % 3600000, :finished
  FROM c
"""
_FILL_ATTEMPTS = """
INSERT INTO relay_attempt (
    job_id, attempt, worker_id, lease_token, started_at_ms, ended_at_ms, outcome)
SELECT id, 1, 'bench-filled', 'filled', finished_at_ms - 10, finished_at_ms, 'succeeded'
  FROM relay_job WHERE id >= printf('job_f%025d', :lo) AND id < printf('job_f%025d', :hi)
"""


def fill_finished(
    db_path: Path,
    count: int,
    *,
    finished_at_ms: int,
    queue: str = "bench-done",
    tick: Callable[[int], None] | None = None,
) -> float:
    """Insert ``count`` SUCCEEDED jobs, each with one succeeded attempt, finished in the hour
    before ``finished_at_ms`` (scattered, so deletes do not follow insertion order). Test
    set-up for the retention scenario, as ``fill_backlog``.

    Returns:
        The seconds the fill took.
    """
    from queue_core.storage.sqlite.driver import NAMED_QUERIES  # Django is set up here

    start = time.perf_counter()
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute("PRAGMA cache_size=-262144")
        for lo in range(0, count, FILL_CHUNK):
            hi = min(count, lo + FILL_CHUNK)
            params = {"lo": lo, "hi": hi, "queue": queue, "pad": "x" * 70}
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(_FILL_FINISHED, params | {"finished": finished_at_ms})
            conn.execute(_FILL_ATTEMPTS, {"lo": lo, "hi": hi})
            conn.execute(
                NAMED_QUERIES["count_added"], {"queue": queue, "state": "succeeded", "n": hi - lo}
            )
            conn.execute("COMMIT")
            if tick is not None:
                tick(hi - lo)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return round(time.perf_counter() - start, 2)


def fill_backlog(
    db_path: Path,
    count: int,
    *,
    queue: str = "bench",
    spread_ms: int = 600_000,
    tick: Callable[[int], None] | None = None,
    first: int = 0,
) -> float:
    """Insert ``count`` READY jobs over the four priority classes, aged 0..``spread_ms``.

    Job ids are numbered from ``first`` (a second fill of the same file starts after the
    first one's last number).

    Ages are scattered (``n * 7919 mod spread``), so rows do not arrive in index order, and
    with a ten-minute spread aging lifts many of them to higher effective classes, as on a
    queue that has fallen behind. Test set-up, not a measured path.

    Returns:
        The seconds the fill took.
    """
    from queue_core.storage.sqlite.driver import NAMED_QUERIES  # Django is set up here

    count_added = NAMED_QUERIES["count_added"]
    start = time.perf_counter()
    now = time.time_ns() // 1_000_000
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute("PRAGMA cache_size=-262144")  # 256 MiB for the index builds
        for lo in range(first, first + count, FILL_CHUNK):
            hi = min(first + count, lo + FILL_CHUNK)
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                _FILL,
                {
                    "lo": lo,
                    "hi": hi,
                    "queue": queue,
                    "pad": "x" * 70,
                    "now": now,
                    "spread": spread_ms,
                },
            )
            # Rows inserted by hand are counted by hand (migration 0008).
            conn.execute(count_added, {"queue": queue, "state": "ready", "n": hi - lo})
            conn.execute("COMMIT")
            if tick is not None:
                tick(hi - lo)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return round(time.perf_counter() - start, 2)
