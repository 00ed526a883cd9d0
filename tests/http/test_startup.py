"""Hardening items 3 and 10 on the HTTP side: gunicorn.conf.py refuses, with one line and a
stable exit code, an address beyond loopback while no API key exists (5) and a start without a
private SECRET_KEY while DEBUG is off (6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from queue_api.startup import EXIT_NO_SECRET_KEY
from queue_core import auth, exposure
from tests.http.conftest import start_gunicorn
from tests.procs import FUTURE_MIGRATION, ROOT, Spawner, command_env, record_future_migration

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def run_gunicorn(spawn: Spawner, bind: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run gunicorn with gunicorn.conf.py expecting it to refuse; return how it ended."""
    return subprocess.run(
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--bind", bind],
        cwd=ROOT,
        env=command_env(spawn.db_path, RELAY_HTTP_ACCESS_LOG="0", **env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "secret", ["", "relay-insecure-dev-key-change-me-in-production-0123456789"]
)
def test_http_side_refuses_to_start_without_a_private_secret_key(
    spawn: Spawner, secret: str
) -> None:
    out = run_gunicorn(
        spawn, "127.0.0.1:0", RELAY_SECRET_KEY=secret, RELAY_SECRET_KEY_FILE="/nonexistent/key"
    )
    assert out.returncode == EXIT_NO_SECRET_KEY, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("NO_SECRET_KEY: the HTTP API refuses to start"), out.stderr
    assert "RELAY_SECRET_KEY" in last
    assert "http_ready" not in out.stderr


def test_secret_key_from_the_key_file_or_debug_lets_it_start(
    spawn: Spawner, tmp_path: Path
) -> None:
    key_file = tmp_path / "secret"
    key_file.write_text("a-private-key-written-by-bin-setup-0123456789abcdef\n")
    server = start_gunicorn(spawn, RELAY_SECRET_KEY="", RELAY_SECRET_KEY_FILE=str(key_file))
    assert server.request("GET", "/api/v1/health")[0] == 200
    server.proc.kill()
    debug = start_gunicorn(spawn, RELAY_SECRET_KEY="", RELAY_SECRET_KEY_FILE="/no", RELAY_DEBUG="1")
    assert debug.request("GET", "/api/v1/health")[0] == 200


def test_http_side_refuses_a_public_address_without_keys(spawn: Spawner) -> None:
    spawn.migrate()
    out = run_gunicorn(spawn, "0.0.0.0:0")
    assert out.returncode == exposure.EXIT_PUBLIC_WITHOUT_KEYS, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("PUBLIC_WITHOUT_KEYS: the HTTP API refuses to listen on 0.0.0.0:0")
    assert "http_ready" not in out.stderr


@pytest.mark.parametrize("how", ["setting", "key"])
def test_opt_in_or_a_key_lets_the_http_side_listen_publicly(spawn: Spawner, how: str) -> None:
    env = {"RELAY_ALLOW_PUBLIC_WITHOUT_KEYS": "1"} if how == "setting" else {}
    if how == "key":
        auth.create_key("ops", ["operator"])
    server = start_gunicorn(spawn, "--bind", "0.0.0.0:0", **env)
    assert server.request("GET", "/api/v1/health")[0] == 200  # over loopback


def test_http_side_refuses_a_database_behind_or_ahead_of_its_code(
    spawn: Spawner, tmp_path: Path
) -> None:
    # An upgrade review: the HTTP API on a file not yet migrated answered every submit with
    # 500 INTERNAL ("no column named unique_scope"). Behind: exit 1, which the unit retries
    # while relay-server migrates; migrated by a newer Relay: exit 9, which it does not.
    db = str(tmp_path / "behind.db")
    spawn.migrate("queue_core", "0015_console_indexes_in_state", RELAY_DB=db)
    behind = run_gunicorn(spawn, "127.0.0.1:0", RELAY_DB=db)
    assert behind.returncode == 1, behind.stderr
    last = behind.stderr.strip().splitlines()[-1]
    assert last.startswith("UNAVAILABLE: the HTTP API refuses to start: database"), last
    assert "unapplied migration(s)" in last and "run `relay migrate`" in last
    assert "http_ready" not in behind.stderr
    spawn.migrate(RELAY_DB=db)
    record_future_migration(db)
    ahead = run_gunicorn(spawn, "127.0.0.1:0", RELAY_DB=db)
    assert ahead.returncode == 9, ahead.stderr
    assert "NEWER_SCHEMA: the HTTP API refuses to start" in ahead.stderr
    assert f"queue_core.{FUTURE_MIGRATION}" in ahead.stderr


def test_http_side_refuses_a_sqlite_file_that_does_not_exist(
    spawn: Spawner, tmp_path: Path
) -> None:
    # An audit of docs/http-api.md: started on a path with no file (a typo; `bin/http`
    # migrates first, gunicorn run by hand does not), it listened, its first request made an
    # empty file there, and every request answered 500 INTERNAL ("no such table").
    db = tmp_path / "typo.db"
    out = run_gunicorn(spawn, "127.0.0.1:0", RELAY_DB=str(db))
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last == (
        f"UNAVAILABLE: the HTTP API refuses to start: database {db} does not exist: run "
        "`relay migrate` (or start `relay server`, which makes and migrates it)"
    ), last
    assert "http_ready" not in out.stderr
    assert not db.exists()
