"""The benchmark is an extra: the product never imports it, and ``relay bench`` without the
extra's psutil says so in one line.

Each case runs a fresh interpreter, since this one has already imported what it checks.
``sys.modules['psutil'] = None`` makes ``import psutil`` fail as it does where the extra is not
installed (``ModuleNotFoundError`` naming psutil).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from queue_core.management.commands.relay_bench import NEEDS_EXTRA
from tests.procs import ROOT, command_env


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=command_env(str(tmp_path / "relay.db")),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_relay_bench_without_the_extra_exits_1_with_one_line(tmp_path: Path) -> None:
    done = _python(
        "import sys\n"
        "sys.modules['psutil'] = None\n"
        "from queue_core.cli import main\n"
        "main(['bench', '--quick', '--no-progress'])\n",
        tmp_path,
    )
    assert (done.returncode, done.stderr, done.stdout) == (1, NEEDS_EXTRA + "\n", "")


def test_relay_bench_with_the_extra_gets_past_the_import(tmp_path: Path) -> None:
    # The same interpreter and command with psutil importable: the run starts, and is stopped
    # by an invalid argument checked after the import.
    done = _python(
        "from queue_core.cli import main\nmain(['bench', '--scale', '0'])\n",
        tmp_path,
    )
    assert (done.returncode, done.stderr) == (1, "INVALID_ARGUMENT: --scale must be > 0\n")


def test_the_product_imports_neither_the_bench_nor_psutil(tmp_path: Path) -> None:
    # Every module of every shipped package but relay_bench, the relay_bench command included.
    done = _python(
        "import importlib, pkgutil, sys\n"
        "import django\n"
        "django.setup()\n"
        "names = []\n"
        "for top in ('relayproject', 'queue_core', 'queue_api', 'queue_admin', 'relay_tasks'):\n"
        "    package = importlib.import_module(top)\n"
        "    names.append(top)\n"
        "    for info in pkgutil.walk_packages(package.__path__, top + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "        names.append(info.name)\n"
        "assert 'queue_core.management.commands.relay_bench' in names, names\n"
        "loaded = sorted(n for n in sys.modules if n.split('.')[0] in ('relay_bench', 'psutil'))\n"
        "print(len(names), loaded)\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    count, loaded = done.stdout.split(" ", 1)
    assert int(count) > 50
    assert loaded.strip() == "[]"
