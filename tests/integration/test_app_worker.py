"""Real processes: ``relay_server`` plus ``relay_worker --app`` / ``--tasks`` over TCP.

The producer side runs in the test process: ``RelayClient`` for application payloads, and
Django's own task API (``.enqueue()``, ``get_result``) for Django tasks, on the database the
child processes share. Waiting is on log lines and on job states, never on fixed sleeps.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import transaction
from django.tasks import TaskResultStatus

from queue_core.client import RelayClient
from queue_core.models import Job, JobAttempt
from tests.procs import Proc, Spawner
from tests.tasks_app import tasks

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WAIT_S = 60.0


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll ``predicate`` (a database read) until it is truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def start(spawn: Spawner, *worker_args: str, **env: str) -> tuple[str, Proc]:
    """Start a server and a worker with ``worker_args`` and ``env``; return the address and
    the worker."""
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    worker = spawn(
        "relay_worker",
        "--address",
        address,
        "--concurrency",
        "4",
        "--wait-ms",
        "1000",
        *worker_args,
        name="relay_worker",
        **env,
    )
    worker.wait_event("worker_ready")
    return address, worker


def settled(client: RelayClient, job_id: str) -> dict[str, Any] | None:
    job: dict[str, Any] = client.inspect(job_id)["job"]
    return job if job["state"] in ("succeeded", "dead") else None


def test_app_worker_routes_jobs_to_handlers(spawn: Spawner) -> None:
    address, worker = start(spawn, "--app", "tests.tasks_app.handlers.HANDLERS")
    with RelayClient(address) as client:
        fixed = {"backoff": "fixed", "backoff_base_ms": 10, "jitter": False}
        ids = {
            name: client.submit("default", payload, max_retries=1, **fixed)["job"]["id"]
            for name, payload in {
                "echo": {"task": "echo", "n": 1},
                "stored": {"task": "stored", "n": 21},
                "async_ok": {"task": "async_ok"},
                "boom": {"task": "boom", "message": "smtp down"},
                "refuse": {"task": "refuse"},
                "unknown": {"task": "nope"},
            }.items()
        }
        jobs = {
            name: wait_for(lambda job_id=job_id: settled(client, job_id), name)
            for name, job_id in ids.items()
        }
        results = {name: client.result(job_id) for name, job_id in ids.items()}
    assert results["stored"]["return_value"] == {"doubled": 42}
    assert results["echo"]["return_value"] is None  # a plain return value is not sent
    assert [e["exception_class"] for e in results["boom"]["errors"]] == [
        "builtins.RuntimeError"
    ] * 2
    assert "RuntimeError: smtp down" in results["boom"]["errors"][1]["traceback"]
    assert jobs["echo"]["state"] == "succeeded"
    assert jobs["async_ok"]["state"] == "succeeded"
    assert jobs["boom"]["state"] == "dead"
    assert jobs["boom"]["attempt"] == 2  # retried once
    assert jobs["boom"]["dead_reason"] == "attempts exhausted: smtp down"
    assert jobs["refuse"]["dead_reason"] == "non-retryable: refused: bad input"
    assert jobs["refuse"]["attempt"] == 1
    assert jobs["unknown"]["dead_reason"] == (
        "non-retryable: unknown task 'nope'; this worker handles: "
        "async_ok, boom, echo, hang, refuse, stored"
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0


def test_app_worker_shuts_down_within_its_timeout(spawn: Spawner) -> None:
    address, worker = start(
        spawn, "--app", "tests.tasks_app.handlers.HANDLERS", "--shutdown-timeout-ms", "500"
    )
    with RelayClient(address) as client:
        job_id = client.submit("default", {"task": "hang", "seconds": 60})["job"]["id"]
        worker.wait_for(lambda r: r.get("event") == "leased" and r.get("job_id") == job_id)
        began = time.monotonic()
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(timeout=30) == 0
        assert time.monotonic() - began < 10  # 0.5 s timeout + release + exit
        worker.wait_for(lambda r: r.get("event") == "released" and r.get("job_id") == job_id)
        job = client.inspect(job_id)["job"]
    assert job["state"] == "ready"  # given back, no failure counted
    assert job["failures"] == 0


def test_bad_app_path_is_a_usage_error(spawn: Spawner) -> None:
    done = spawn.run("relay_worker", "--address", "127.0.0.1:1", "--app", "tests.nope.HANDLERS")
    assert done.returncode == 1
    assert "INVALID_ARGUMENT: --app:" in done.stderr
    done = spawn.run(
        "relay_worker",
        "--tasks",
        DJANGO_SETTINGS_MODULE="tests.tasks_app.immediate_settings",
    )
    assert done.returncode == 1
    assert "INVALID_ARGUMENT: --tasks: TASKS has no queue_core.tasks_backend.RelayBackend" in (
        done.stderr
    )
    done = spawn.run("relay_worker", "--app", "x.Y", "--tasks")
    assert done.returncode == 2  # argparse: not allowed together
    assert "not allowed with argument" in done.stderr


def test_tasks_worker_runs_django_tasks(spawn: Spawner) -> None:
    _, worker = start(spawn, "--tasks", "--queue", "default", "--queue", "emails")
    results = {
        "add": tasks.add.enqueue(2, 3),
        "welcome": tasks.send_welcome.enqueue(7, greeting="hi"),
        "context": tasks.attempt_number.enqueue(),
        "async": tasks.async_double.enqueue(21),
        "refuse": tasks.refuse.enqueue("no thanks"),
    }
    for name, result in results.items():
        wait_for(lambda result=result: (result.refresh(), result.is_finished)[1], name)
    assert results["add"].return_value == 5
    assert results["welcome"].return_value == {"user_id": 7, "greeting": "hi"}
    assert results["context"].return_value == 1
    assert results["async"].return_value == 42
    refused = results["refuse"]
    assert refused.status == TaskResultStatus.FAILED
    assert "NonRetryableError: no thanks" in refused.errors[0].traceback
    assert all(len(result.worker_ids) == 1 for result in results.values())
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0


def test_tasks_enqueued_in_a_transaction_run_only_if_it_commits(spawn: Spawner) -> None:
    start(spawn, "--tasks")
    with transaction.atomic():
        rolled_back = tasks.add.enqueue(100, 1)
        transaction.set_rollback(True)
    with transaction.atomic():
        committed = tasks.add.enqueue(1, 1)
    wait_for(lambda: (committed.refresh(), committed.is_finished)[1], "the committed task")
    assert committed.status == TaskResultStatus.SUCCESSFUL
    assert committed.return_value == 2
    assert list(Job.objects.values_list("id", flat=True)) == [committed.id]
    assert not Job.objects.filter(pk=rolled_back.id).exists()


def test_tasks_worker_reports_an_error_text_with_a_lone_surrogate(spawn: Spawner) -> None:
    # The task's error text holds "\udcff", which has no UTF-8 form: recording the traceback
    # and cutting the text to size both raised, so the failure went unreported.
    _, worker = start(spawn, "--tasks")
    result = tasks.fail_with_surrogate.enqueue()
    worker.wait_for(lambda r: r.get("event") == "failed" and r.get("job_id") == result.id)
    first = JobAttempt.objects.get(job_id=result.id, attempt=1)  # retries may run meanwhile
    assert (first.outcome, first.error) == ("failed", "cannot read file name bad-\\udcff")
    result.refresh()
    error = result.errors[0]
    assert error.exception_class is ValueError
    assert "ValueError: cannot read file name bad-\\udcff" in error.traceback
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0


@pytest.mark.parametrize("executor", [[], ["--app", "tests.tasks_app.handlers.HANDLERS"]])
def test_worker_without_the_task_runner_refuses_django_tasks(
    spawn: Spawner, executor: list[str]
) -> None:
    # The demo worker used to ack a task job: SUCCESSFUL, return_value None, body never run.
    _, worker = start(spawn, *executor)
    result = tasks.add.enqueue(2, 3)
    worker.wait_for(lambda r: r.get("event") == "failed" and r.get("job_id") == result.id)
    refused = worker.wait_for(
        lambda r: r.get("event") == "handler_failed" and r.get("job_id") == result.id
    )
    assert refused["level"] == "WARNING", refused
    job = Job.objects.get(pk=result.id)
    assert job.state == "dead"
    assert job.attempt == 1  # not retried: another attempt on this worker cannot fix it
    assert job.dead_reason == (
        "non-retryable: Django task tests.tasks_app.tasks.add needs the task runner: "
        "run relay worker --tasks"
    )
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0


def test_tasks_worker_without_queue_serves_every_queue_in_queues(spawn: Spawner) -> None:
    _, worker = start(spawn, "--tasks", DJANGO_SETTINGS_MODULE="tests.tasks_app.queues_settings")
    ready = worker.wait_event("worker_ready")
    assert ready["queues"] == "default,emails,reports"
    emails = tasks.send_welcome.enqueue(7)  # queue_name="emails"
    reports = tasks.add.using(queue_name="reports").enqueue(1, 2)
    for result in (emails, reports):
        wait_for(lambda result=result: (result.refresh(), result.is_finished)[1], result.id)
        assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0


def test_tasks_worker_on_another_database_exits_at_start(spawn: Spawner, tmp_path: Any) -> None:
    # It used to lease the server's jobs and fail every one: "cannot load the task".
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    other = str(tmp_path / "other.db")
    done = spawn.run("relay_worker", "--tasks", "--address", address, RELAY_DB=other)
    assert done.returncode == 1, done.stderr
    assert "INVALID_ARGUMENT: --tasks: database 'default' cannot hold task results" in (done.stderr)
    assert spawn.run("migrate", RELAY_DB=other).returncode == 0
    done = spawn.run("relay_worker", "--tasks", "--address", address, RELAY_DB=other)
    assert done.returncode == 1, done.stderr
    assert "INVALID_ARGUMENT: --tasks: database 'default' is not the one the server uses" in (
        done.stderr
    )
    result = tasks.add.enqueue(1, 2)
    assert Job.objects.get(pk=result.id).state == "ready"  # nothing leased it
