"""The documented install (README, "Use in your own Django project"), exactly as a new user
runs it: a wheel built from this checkout, installed with its pinned dependencies into a fresh
virtualenv, a fresh ``django-admin startproject`` with Relay's apps and ``TASKS`` backend added,
``migrate``, ``check``, then ``relay --settings`` serving that project's database and answering
``stats``. Nothing may be written inside site-packages.

pip installs the dependencies from wherever this machine's pip configuration points (a package
index, or local wheel folders); without them the test fails, it never skips. About 30-60 s.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import ROOT, Proc

pytestmark = pytest.mark.slow

# Appended to the settings.py that startproject wrote: docs/django.md's set-up, on SQLite.
RELAY_SETTINGS = """
INSTALLED_APPS += [
    "queue_core.apps.QueueCoreConfig",
    "queue_admin",
    "relay_tasks.apps.RelayTasksConfig",
]
DATABASES["default"]["OPTIONS"] = {"transaction_mode": "IMMEDIATE"}
TASKS = {"default": {"BACKEND": "queue_core.tasks_backend.RelayBackend"}}
"""


def clean_env() -> dict[str, str]:
    """A user's shell: none of pytest's, Django's, Relay's or this virtualenv's variables."""
    drop = ("PYTEST_", "DJANGO_", "RELAY_", "VIRTUAL_ENV", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(args: list[str | Path], cwd: Path, timeout: float = 180) -> str:
    """Run ``args``; return stdout; fail the test with stderr on a non-zero exit."""
    done = subprocess.run(
        [str(arg) for arg in args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{args}: {done.stderr[-3000:]}"
    return done.stdout


def files_under(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*") if "__pycache__" not in path.parts}


def test_the_wheel_installs_into_a_fresh_virtualenv_and_serves_a_new_project(
    tmp_path: Path,
) -> None:
    # The wheel, built from a copy of the tracked files (no build/ or egg-info in the checkout).
    source = tmp_path / "source"
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in tracked)):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", source],
        tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("relay_queue-*.whl")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    # README: pip install relay_queue-*.whl (here with the checkout's pins, as bin/setup does).
    run([python, "-m", "pip", "install", "-q", wheel, "-c", ROOT / "requirements.lock"], tmp_path)
    site = Path(
        run(
            [python, "-c", "import django, os; print(os.path.dirname(django.__path__[0]))"],
            tmp_path,
        ).strip()
    )
    assert (site / "queue_core").is_dir()
    installed = files_under(site)

    run([bin_dir / "django-admin", "startproject", "mysite"], tmp_path)
    project = tmp_path / "mysite"
    with (project / "mysite" / "settings.py").open("a") as settings:
        settings.write(RELAY_SETTINGS)
    run([python, "manage.py", "migrate", "-v0"], project)
    out = run([python, "manage.py", "check"], project)
    assert "no issues" in out

    popen = subprocess.Popen(
        [bin_dir / "relay", "--settings", "mysite.settings", "server", "--address", "127.0.0.1:0"],
        cwd=project,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    server = Proc(popen, "relay server")
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None:
            if match := re.search(r"event=ready .*port=(\d+)", server.stderr_text()):
                port = match.group(1)
                break
            assert popen.poll() is None, server.stderr_text()
            assert time.monotonic() < deadline, server.stderr_text()
            time.sleep(0.05)
        stats = run(
            [
                bin_dir / "relay",
                "--settings",
                "mysite.settings",
                "--address",
                f"127.0.0.1:{port}",
                "--json",
                "stats",
            ],
            project,
        )
        assert '"queues"' in stats
        assert server.stop() == 0, server.stderr_text()
    finally:
        server.kill()
    assert "event=stopped" in server.stderr_text()
    assert sorted(p.name for p in project.iterdir()) == ["db.sqlite3", "manage.py", "mysite"]

    # The standalone service, run anywhere: relay.db lands in the current directory.
    elsewhere = tmp_path / "standalone"
    elsewhere.mkdir()
    run([bin_dir / "relay", "migrate"], elsewhere)
    assert (elsewhere / "relay.db").is_file()
    assert files_under(site) == installed  # nothing written inside site-packages
