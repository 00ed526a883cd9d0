"""The example shop of ``docs/django.md`` runs as documented: its own settings and database, a
relay_server and a ``relay_worker --tasks`` from its manage.py, and a transaction that commits
(the receipt task runs) or rolls back (no task exists)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import ROOT, Proc

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "example"


def example_env(db: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DJANGO_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="exampleproject.settings",
        EXAMPLE_DB=str(db),
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def start(env: dict[str, str], *args: str) -> Proc:
    popen = subprocess.Popen(
        [sys.executable, "manage.py", *args],
        cwd=EXAMPLE,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    return Proc(popen, args[0])


def test_example_shop_runs_its_tasks_on_relay(tmp_path: Path) -> None:
    env = example_env(tmp_path / "shop.db")
    manage(env, "migrate", "-v0")
    procs: list[Proc] = []
    try:
        server = start(env, "relay_server", "--address", "127.0.0.1:0")
        procs.append(server)
        port = server.wait_line(r"event=ready .*port=(\d+)").group(1)
        env["RELAY_ADDRESS"] = f"127.0.0.1:{port}"
        worker = start(env, "relay_worker", "--tasks", "--queue", "emails")
        procs.append(worker)
        worker.wait_line(r"event=worker_ready")
        kept = manage(env, "place_order", "ann@example.com", "1250")
        dropped = manage(env, "place_order", "bob@example.com", "990", "--rollback")
        deadline = time.monotonic() + 60
        while not (status := manage(env, "order_status", kept)).startswith("SUCCESSFUL"):
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert status == (
            # Stored as canonical JSON (sorted keys), as jsonb would give them back.
            "SUCCESSFUL attempts=1 return_value={'email': 'ann@example.com', 'order_id': 1}"
        )
        assert manage(env, "order_status", dropped) == "DOES_NOT_EXIST"
    finally:
        for proc in procs:
            proc.kill()
