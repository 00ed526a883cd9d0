"""Issue 14's done-when test for the networked tasks backend, as a new user would run it.

Relay's wheel, built from this checkout, goes into a fresh virtualenv. A Relay service runs
standalone (``relay server`` in a folder of its own, on its own ``relay.db``). A fresh Django 6
project (``django-admin startproject``) on PostgreSQL (a database of its own, created for this
test and dropped after it, never Relay's) installs the wheel's ``queue_core`` only for the
``relay_worker`` command and configures ``TASKS`` with the networked ``RelayBackend``
(``OPTIONS["ADDRESS"]``). A view enqueues a ``@task`` inside ``transaction.atomic()`` beside
an order row; one request commits, one rolls back. ``manage.py relay_worker --tasks`` runs the
task against the server, and ``get_result`` reads ``SUCCESSFUL`` with the return value over
TCP; the rolled-back enqueue never reached the server (``stats`` counts one job) and never ran.

pip installs the dependencies from wherever this machine's pip configuration points; without
them, or without PostgreSQL on 127.0.0.1:5432, the test fails: it never skips. About a minute.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.procs import Proc
from tests.wheel import build_and_install, run, start

pytestmark = pytest.mark.slow

PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"

# Appended to the settings.py that startproject wrote: docs/django.md's networked set-up.
PROJECT_SETTINGS = """
INSTALLED_APPS += ["queue_core.apps.QueueCoreConfig", "shop"]
ALLOWED_HOSTS = ["testserver"]
DATABASES = {{
    "default": {{
        "ENGINE": "django.db.backends.postgresql",
        "NAME": {db!r},
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": "5432",
    }}
}}
TASKS = {{
    "default": {{
        "BACKEND": "queue_core.tasks_backend.RelayBackend",
        "OPTIONS": {{"ADDRESS": {address!r}, "TIMEOUT": 10}},
    }}
}}
"""

SHOP_MODELS = """\
from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=50)
    task_result_id = models.CharField(max_length=200)
"""

SHOP_TASKS = """\
from django.tasks import task


@task
def price(quantity, unit):
    return {"total": quantity * unit}
"""

SHOP_VIEWS = """\
from django.db import transaction
from django.http import JsonResponse

from shop.models import Order
from shop.tasks import price


def order(request):
    with transaction.atomic():
        result = price.enqueue(int(request.GET["quantity"]), int(request.GET["unit"]))
        Order.objects.create(item=request.GET["item"], task_result_id=result.id)
        if request.GET.get("cancel"):
            transaction.set_rollback(True)
    return JsonResponse({"result_id": result.id})
"""

SHOP_URLS = """\
from django.urls import path

from shop.views import order

urlpatterns = [path("order", order)]
"""

# Run in the project (manage.py shell): two orders through the view, one rolled back.
PLACE_ORDERS = """\
import json
from django.test import Client
client = Client()
kept = client.get("/order", {"item": "tea", "quantity": 3, "unit": 4}).json()["result_id"]
cancelled = client.get(
    "/order", {"item": "gin", "quantity": 1, "unit": 9, "cancel": 1}
).json()["result_id"]
print(json.dumps({"kept": kept, "cancelled": cancelled}))
"""

# Run in the project: wait (bounded) for the kept task to finish, then report what
# get_result reads and what the project's own database holds.
READ_RESULTS = """\
import json, time
from django.tasks import default_task_backend
from django.tasks.exceptions import TaskResultDoesNotExist
from shop.models import Order
ids = json.loads({ids!r})
deadline = time.monotonic() + 60
result = default_task_backend.get_result(ids["kept"])
while not result.is_finished and time.monotonic() < deadline:
    time.sleep(0.1)
    result.refresh()
try:
    default_task_backend.get_result(ids["cancelled"])
    cancelled = "exists"
except TaskResultDoesNotExist:
    cancelled = "missing"
print(json.dumps({{
    "status": str(result.status),
    "return_value": result.return_value if result.is_finished else None,
    "attempts": result.attempts,
    "cancelled": cancelled,
    "orders": list(Order.objects.values_list("item", "task_result_id")),
}}))
"""


def last_json(out: str) -> dict[str, Any]:
    """The JSON object on the last line of ``out`` (``shell`` may print a banner first)."""
    value: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return value


@pytest.fixture
def project_db() -> Iterator[str]:
    """A fresh PostgreSQL database for the project, named with this process's id; dropped."""
    name = f"relay_netproj_{os.getpid()}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def write_project(bin_dir: Path, tmp_path: Path, db: str, address: str) -> Path:
    run([bin_dir / "django-admin", "startproject", "mysite"], tmp_path)
    project = tmp_path / "mysite"
    shop = project / "shop"
    (shop / "migrations").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "migrations/__init__.py": "",
        "models.py": SHOP_MODELS,
        "tasks.py": SHOP_TASKS,
        "views.py": SHOP_VIEWS,
        "urls.py": SHOP_URLS,
    }.items():
        (shop / name).write_text(text)
    with (project / "mysite" / "settings.py").open("a") as settings:
        settings.write(PROJECT_SETTINGS.format(db=db, address=address))
    urls = project / "mysite" / "urls.py"
    urls.write_text(
        urls.read_text()
        .replace("from django.urls import path", "from django.urls import include, path")
        .replace("urlpatterns = [", 'urlpatterns = [\n    path("", include("shop.urls")),')
    )
    return project


def test_a_fresh_postgresql_project_runs_tasks_through_a_networked_relay_service(
    tmp_path: Path, project_db: str
) -> None:
    bin_dir = build_and_install(tmp_path)
    python = bin_dir / "python"

    # The Relay service, standalone, on its own SQLite database in its own folder.
    service_dir = tmp_path / "relay-service"
    service_dir.mkdir()
    server = start(
        [bin_dir / "relay", "server", "--address", "127.0.0.1:0"],
        service_dir,
        "relay server",
        RELAY_SECRET_KEY="networked-project-test-only",
    )
    worker: Proc | None = None
    try:
        port = server.wait_line(r"event=ready .*port=(\d+)", timeout=60).group(1)
        address = f"127.0.0.1:{port}"

        project = write_project(bin_dir, tmp_path, project_db, address)
        run([python, "manage.py", "makemigrations", "shop", "-v0"], project)
        run([python, "manage.py", "migrate", "-v0"], project)
        assert "no issues" in run([python, "manage.py", "check"], project)

        ids = last_json(run([python, "manage.py", "shell", "-c", PLACE_ORDERS], project))
        assert ids["kept"].startswith("default/") and ids["cancelled"].startswith("default/")

        worker = start(
            [python, "manage.py", "relay_worker", "--tasks", "--address", address],
            project,
            "relay_worker",
        )
        worker.wait_line(r"worker_ready", timeout=60)
        out = run(
            [python, "manage.py", "shell", "-c", READ_RESULTS.format(ids=json.dumps(ids))],
            project,
        )
        seen = last_json(out)
        assert seen["status"] == "SUCCESSFUL", (seen, worker.stderr_text()[-3000:])
        assert seen["return_value"] == {"total": 12}
        assert seen["attempts"] == 1
        assert seen["cancelled"] == "missing"
        assert seen["orders"] == [["tea", ids["kept"]]]  # the cancelled order rolled back too

        stats = json.loads(
            run([bin_dir / "relay", "--address", address, "--json", "stats"], service_dir)
        )
        assert stats["totals"]["succeeded"] == 1
        assert sum(stats["totals"].values()) == 1  # the rolled-back enqueue never arrived
        # The project's database is its own: Relay's service keeps its jobs elsewhere.
        assert sorted(p.name for p in service_dir.iterdir())[0] == "relay.db"
        with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={project_db}") as conn:
            jobs = conn.execute("SELECT count(*) FROM relay_job").fetchone()
        assert jobs == (0,)
    finally:
        if worker is not None:
            worker.kill()
        server.kill()
