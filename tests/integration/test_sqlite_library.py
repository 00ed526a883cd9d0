"""SQLite's memory statistics, turned off per process (``queue_core.storage.sqlite.library``).

Each case runs in a process of its own: the setting is process-wide and is made once, before
the first connection.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.procs import command_env

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, tmp_path: Path, *argv: str) -> str:
    env = command_env(str(tmp_path / "relay.db"), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, *argv, code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_a_relay_process_writes_through_sqlite_without_memory_statistics(
    tmp_path: Path,
) -> None:
    """Django's set-up (``QueueCoreConfig.ready``) turns them off before any connection:
    with a connection open and a row written, SQLite reports no memory in use."""
    code = (
        "from django.db import connection\n"
        "from queue_core.storage.sqlite import library\n"
        "with connection.cursor() as c:\n"
        "    c.execute('CREATE TABLE t (x)')\n"
        "    c.execute('INSERT INTO t VALUES (1)')\n"
        "    c.execute('SELECT count(*) FROM t')\n"
        "    rows = c.fetchone()[0]\n"
        "print(library.memory_statistics_off(), library.memory_statistics_on(), rows)\n"
    )
    assert _run(code, tmp_path, "manage.py", "shell", "-c") == "True False 1"


def test_an_open_connection_keeps_them_on_and_keeps_working(tmp_path: Path) -> None:
    """With a connection open, shutting SQLite down would break it: the statistics stay
    on, the connection works on, and a later call gives the same answer."""
    code = (
        "import sqlite3\n"
        "from queue_core.storage.sqlite import library\n"
        "db = sqlite3.connect(':memory:')\n"
        "db.execute('CREATE TABLE t (x)')\n"
        "first = library.memory_statistics_off()\n"
        "db.execute('INSERT INTO t VALUES (1)')\n"
        "rows = db.execute('SELECT count(*) FROM t').fetchone()[0]\n"
        "print(first, library.memory_statistics_off(), library.memory_statistics_on(), rows)\n"
    )
    assert _run(code, tmp_path, "-c") == "False False True 1"


def test_without_django_the_first_call_turns_them_off(tmp_path: Path) -> None:
    """As ``relay_bench.ceiling`` calls it: before any connection, without Django."""
    code = (
        "import sqlite3\n"
        "from queue_core.storage.sqlite import library\n"
        "first = library.memory_statistics_off()\n"
        "db = sqlite3.connect(':memory:')\n"
        "db.execute('CREATE TABLE t (x)')\n"
        "db.executemany('INSERT INTO t VALUES (?)', [(n,) for n in range(1000)])\n"
        "rows = db.execute('SELECT count(*) FROM t').fetchone()[0]\n"
        "print(first, library.memory_statistics_on(), rows)\n"
    )
    assert _run(code, tmp_path, "-c") == "True False 1000"
