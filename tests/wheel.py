"""A new user's install, for the tests that build Relay's wheel and use it from a fresh
virtualenv (``tests/integration/test_wheel_install.py``, ``test_networked_project.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT, Proc


def clean_env(**extra: str) -> dict[str, str]:
    """A user's shell: none of pytest's, Django's, Relay's or this virtualenv's variables,
    plus ``extra``."""
    drop = ("PYTEST_", "DJANGO_", "RELAY_", "VIRTUAL_ENV", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONUNBUFFERED"] = "1"
    return env | extra


def run(args: list[str | Path], cwd: Path, timeout: float = 180, **env: str) -> str:
    """Run ``args``; return stdout; fail the test with stderr on a non-zero exit."""
    done = subprocess.run(
        [str(arg) for arg in args],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{args}: {done.stderr[-3000:]}"
    return done.stdout


def start(args: list[str | Path], cwd: Path, name: str, **env: str) -> Proc:
    """Start ``args`` in a user's shell; its stderr is kept for ``wait_line``."""
    popen = subprocess.Popen(
        [str(arg) for arg in args],
        cwd=cwd,
        env=clean_env(**env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    return Proc(popen, name)


def build_and_install(tmp_path: Path) -> Path:
    """Build the wheel from the tracked files (no build/ or egg-info of the checkout) and
    install it with the checkout's pins (as ``bin/setup`` does) into a fresh virtualenv under
    ``tmp_path``; return that virtualenv's bin folder."""
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
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", wheel, "-c", ROOT / "requirements.lock"], tmp_path)
    return venv / "bin"
