"""The documented install (README, "Use in your own Django project"), exactly as a new user
runs it: a wheel built from this checkout, installed with its pinned dependencies into a fresh
virtualenv, a fresh ``django-admin startproject`` with Relay's apps and ``TASKS`` backend added,
``migrate``, ``check``, then ``relay --settings`` serving that project's database and answering
``stats``. Nothing may be written inside site-packages.

pip installs the dependencies from wherever this machine's pip configuration points (a package
index, or local wheel folders); without them the test fails, it never skips. About 30-60 s.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.wheel import build_and_install, run, start

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


def files_under(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*") if "__pycache__" not in path.parts}


def test_the_wheel_installs_into_a_fresh_virtualenv_and_serves_a_new_project(
    tmp_path: Path,
) -> None:
    bin_dir = build_and_install(tmp_path)  # README: pip wheel, then pip install the wheel
    python = bin_dir / "python"
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

    server = start(
        [bin_dir / "relay", "--settings", "mysite.settings", "server", "--address", "127.0.0.1:0"],
        project,
        "relay server",
    )
    try:
        port = server.wait_line(r"event=ready .*port=(\d+)", timeout=60).group(1)
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

    # The HTTP API from the package's own gunicorn settings (the wheel has no gunicorn.conf.py;
    # relay bench's HTTP scenario starts it so): without them every request was a 500.
    http = start(
        [
            bin_dir / "gunicorn",
            "-c",
            "python:relayproject.gunicorn_conf",
            "--bind",
            "127.0.0.1:0",
            "relayproject.asgi:application",
        ],
        elsewhere,
        "gunicorn",
        RELAY_SECRET_KEY="wheel-test-" + "k" * 40,
        RELAY_HTTP_ACCESS_LOG="0",
    )
    try:
        port = http.wait_line(r'"event": "http_ready".*"port": (\d+)', timeout=60).group(1)
        body = json.dumps({"payload": {"n": 1}}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/v1/queues/wheel/jobs",
            body,
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 201
            assert json.loads(response.read())["job"]["queue"] == "wheel"
    finally:
        http.kill()
    assert files_under(site) == installed  # nothing written inside site-packages
