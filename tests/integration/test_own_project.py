"""Relay inside a Django project of one's own (issue 14): the ``relay`` script on that
project's settings, the standalone default ``relay.db`` in the current directory, the system
checks under plain ``manage.py check``, the admin left unbranded, and the server's log lines
under a project that configures no logging.

Each test writes a small project (``hostproj``) into a temporary folder and runs real
processes on it from that folder, as a user would: ``relay`` is this virtualenv's console
script, and nothing of Relay's own settings is in the environment.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import Proc

pytestmark = pytest.mark.slow

RELAY = Path(sys.executable).with_name("relay")

HOST_SETTINGS = """\
import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "host-project-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "queue_core.apps.QueueCoreConfig",
    "queue_admin",
    {tasks_app}
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "hostproj.urls"
TEMPLATES = [
    {{
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {{
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        }},
    }},
]
DATABASES = {{
    "default": {{
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("HOST_DB", str(BASE_DIR / "host.db")),
        "OPTIONS": {{"transaction_mode": "IMMEDIATE"}},
    }}
}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
STATIC_URL = "static/"
TASKS = {{"default": {{"BACKEND": "queue_core.tasks_backend.RelayBackend"}}}}
"""

HOST_URLS = """\
from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
"""

# Run inside the host project: the admin home and the queue overview, as a superuser.
ADMIN_PROBE = """\
import django
django.setup()
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
call_command("migrate", verbosity=0)
client = Client()
client.force_login(User.objects.create_superuser("root"))
home = client.get("/admin/")
overview = client.get("/admin/queue_core/job/overview/")
print(home.status_code, overview.status_code)
print(home.content.decode())
"""


def write_project(folder: Path, *, tasks_app: bool = True) -> Path:
    """Write ``hostproj`` (settings, urls) into ``folder``; return ``folder``."""
    package = folder / "hostproj"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    app = '"relay_tasks.apps.RelayTasksConfig",' if tasks_app else ""
    (package / "settings.py").write_text(HOST_SETTINGS.format(tasks_app=app))
    (package / "urls.py").write_text(HOST_URLS)
    return folder


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: none of pytest's, Django's or Relay's variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "DJANGO_", "RELAY_")) and k != "PYTHONPATH"
    }
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def tables(db: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}


def test_relay_runs_on_the_settings_given_by_option_or_environment(tmp_path: Path) -> None:
    project = write_project(tmp_path / "site")
    done = run([str(RELAY), "--settings", "hostproj.settings", "migrate"], project, user_env())
    assert done.returncode == 0, done.stderr
    assert "relay_job" in tables(project / "host.db")
    other = tmp_path / "other.db"
    done = run(
        [str(RELAY), "migrate"],
        project,
        user_env(DJANGO_SETTINGS_MODULE="hostproj.settings", HOST_DB=str(other)),
    )
    assert done.returncode == 0, done.stderr
    assert "relay_result" in tables(other)
    assert sorted(p.name for p in project.iterdir()) == ["host.db", "hostproj"]  # no relay.db


def test_standalone_relay_keeps_relay_db_in_the_current_directory(tmp_path: Path) -> None:
    done = run([str(RELAY), "migrate"], tmp_path, user_env(RELAY_SECRET_KEY="x"))
    assert done.returncode == 0, done.stderr
    assert "relay_job" in tables(tmp_path / "relay.db")


def test_manage_py_check_runs_relays_tasks_checks(tmp_path: Path) -> None:
    project = write_project(tmp_path / "site", tasks_app=False)
    with (project / "hostproj" / "settings.py").open("a") as settings:
        settings.write('TASKS["default"]["OPTIONS"] = {"ADDRESS": "no-port-here", "TIMEOUT": 0}\n')
    args = [sys.executable, "-m", "django", "check", "--settings", "hostproj.settings"]
    done = run(args, project, user_env(PYTHONPATH=str(project)))
    assert done.returncode == 1
    assert "relay.E106" in done.stderr and "'no-port-here'" in done.stderr
    assert "TIMEOUT must be a number of seconds > 0" in done.stderr


def test_queue_admin_leaves_the_projects_admin_site_unbranded(tmp_path: Path) -> None:
    project = write_project(tmp_path / "site")
    env = user_env(DJANGO_SETTINGS_MODULE="hostproj.settings", PYTHONPATH=str(project))
    done = run([sys.executable, "-c", ADMIN_PROBE], project, env)
    assert done.returncode == 0, done.stderr
    statuses, page = done.stdout.split("\n", 1)
    assert statuses == "200 200"
    assert "Django administration" in page
    assert "View site" in page
    assert "Relay operator console" not in page
    assert "/admin/queue_core/deadletter/" in page  # queue_admin's pages are on the site


def test_server_and_worker_log_under_a_project_without_logging(tmp_path: Path) -> None:
    project = write_project(tmp_path / "site")
    env = user_env(DJANGO_SETTINGS_MODULE="hostproj.settings")
    procs: list[Proc] = []

    def start(*args: str) -> Proc:
        popen = subprocess.Popen(
            [str(RELAY), *args],
            cwd=project,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        procs.append(Proc(popen, args[0]))
        return procs[-1]

    try:
        server = start("server", "--address", "127.0.0.1:0")
        server.wait_line(r"INFO relay.server event=recovered ")
        port = server.wait_line(r"event=ready .*port=(\d+)").group(1)
        worker = start("--address", f"127.0.0.1:{port}", "worker", "--tasks")
        worker.wait_line(r"INFO relay.worker event=worker_ready ")
        for proc in (worker, server):
            assert proc.stop() == 0, proc.stderr_text()  # stop() reads stderr to its end
    finally:
        for proc in procs:
            proc.kill()
    assert re.search(r"INFO relay.worker event=worker_stopped ", worker.stderr_text())
    assert re.search(r"INFO relay.server event=stopped$", server.stderr_text(), re.M)
    for proc in procs:
        lines = [line.split(" ", 2)[2] for line in proc.raw]  # without the time stamp
        assert len(lines) == len(set(lines)), lines  # each line once
