"""RelayBackend through Django's own task API (``@task``, ``.enqueue()``, ``get_result``).

In-process: the backend submits through QueueService on the test database; a test service
leases and settles the jobs, and ``execute_task`` (the ``relay_worker --tasks`` handler) runs
them, so every status is reached without a server. ``test_app_worker.py`` runs the same
tasks through real server and worker processes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import connections, transaction
from django.tasks import TaskResultStatus, default_task_backend, task_backends
from django.tasks.exceptions import (
    InvalidTask,
    InvalidTaskBackend,
    TaskResultDoesNotExist,
    TaskResultMismatch,
)
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.test import override_settings

from queue_core import tasks_backend
from queue_core.client import RelayConnectionError, RelayUnreachable
from queue_core.clock import FakeClock
from queue_core.conf import relay_settings
from queue_core.errors import FrameTooLarge, InvalidArgument, LeaseExpired, TooManyQueues
from queue_core.models import Job
from queue_core.service import QueueService
from queue_core.tasks_backend import (
    RelayBackend,
    ReturnValueRefused,
    TaskAttemptFailed,
    TimeLimitExceeded,
    execute_task,
    relay_priority,
)
from queue_core.worker import JobContext, NonRetryableError
from queue_core.worker.handlers import reported_error
from queue_core.worker.runner import error_text, truncate_utf8, truncate_utf8_tail
from tests.tasks_app import tasks
from tests.unit.canned_server import CannedServer, ok

pytestmark = pytest.mark.django_db(transaction=True)

BACKEND = "queue_core.tasks_backend.RelayBackend"


def relay_tasks(**options: Any) -> dict[str, Any]:
    """A TASKS setting with one RelayBackend and these OPTIONS."""
    return {"default": {"BACKEND": BACKEND, "QUEUES": [], "OPTIONS": options}}


@pytest.fixture
def worker_service() -> QueueService:
    """The worker side's service (system clock)."""
    return QueueService()


def run_next(
    service: QueueService, queue: str = "default", worker_id: str = "w1"
) -> tuple[dict[str, Any], BaseException | None]:
    """Lease the next job, run it as ``relay_worker --tasks`` does, then ack or fail it."""
    (lease,) = service.claim([queue], worker_id=worker_id)
    ctx = JobContext(
        job_id=lease["job_id"],
        queue=lease["queue"],
        attempt=lease["attempt"],
        worker_id=worker_id,
        shutdown=threading.Event(),
        lease=lease,
    )
    settle = {"worker_id": worker_id, "lease_token": lease["lease_token"]}
    try:
        stored = execute_task(lease["payload"], ctx)
    except BaseException as exc:
        reported = reported_error(exc)  # as the worker reports it
        service.fail(
            lease["job_id"],
            error=truncate_utf8(error_text(exc), 4096),
            retryable=not isinstance(exc, NonRetryableError),
            exception_class=reported.exception_class,
            traceback=truncate_utf8_tail(reported.traceback, relay_settings().max_result_bytes),
            **settle,
        )
        return lease, exc
    service.ack(lease["job_id"], result=stored.value, **settle)
    return lease, None


@pytest.fixture
def signals() -> Iterator[list[tuple[str, str]]]:
    """Record (signal, status) of every task signal sent."""
    seen: list[tuple[str, str]] = []

    def on(name: str) -> Any:
        def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
            seen.append((name, str(task_result.status)))

        return receiver

    receivers = {
        task_enqueued: on("enqueued"),
        task_started: on("started"),
        task_finished: on("finished"),
    }
    for signal, receiver in receivers.items():
        signal.connect(receiver)
    yield seen
    for signal, receiver in receivers.items():
        signal.disconnect(receiver)


# -- the backend contract ------------------------------------------------------------------


def test_backend_is_configured_and_its_flags_are_truthful() -> None:
    backend = task_backends["default"]
    assert isinstance(backend, RelayBackend)
    assert backend.supports_defer
    assert backend.supports_async_task
    assert backend.supports_get_result
    assert backend.supports_priority
    assert backend.check() == []


@pytest.mark.parametrize(
    ("priority", "relay_class"),
    [
        (-100, "low"),
        (-34, "low"),
        (-33, "normal"),
        (0, "normal"),
        (33, "normal"),
        (34, "high"),
        (66, "high"),
        (67, "critical"),
        (100, "critical"),
    ],
)
def test_priority_maps_onto_relay_classes(priority: int, relay_class: str) -> None:
    assert relay_priority(priority) == relay_class
    result = tasks.add.using(priority=priority).enqueue(1, 2)
    assert Job.objects.get(pk=result.id).get_priority_display() == relay_class
    assert result.task.priority == priority
    assert tasks.add.get_result(result.id).task.priority == priority


@pytest.mark.parametrize(("priority", "stored"), [(5.0, 5), (True, 1), (-34.0, -34)])
def test_a_whole_number_priority_of_another_type_runs_as_its_int(
    worker_service: QueueService, priority: float, stored: int
) -> None:
    """Django admits 5.0 and True as priorities (``validate_task``); the worker took only an int
    for a task's, so such a task was dead-lettered and its result read as missing."""
    result = tasks.add.using(priority=priority).enqueue(2, 3)
    lease, error = run_next(worker_service)
    assert error is None
    assert lease["payload"]["priority"] == stored
    assert type(lease["payload"]["priority"]) is int
    assert lease["priority"] == relay_priority(stored)
    fetched = tasks.add.get_result(result.id)
    assert fetched.status == TaskResultStatus.SUCCESSFUL
    assert fetched.return_value == 5
    assert fetched.task.priority == stored


def test_enqueue_submits_a_relay_job(signals: list[tuple[str, str]]) -> None:
    result = tasks.send_welcome.enqueue(42, greeting="hi")
    assert result.id.startswith("job_")
    assert result.status == TaskResultStatus.READY
    assert result.enqueued_at is not None
    assert result.args == [42]
    assert result.kwargs == {"greeting": "hi"}
    assert result.backend == "default"
    job = Job.objects.get(pk=result.id)
    assert job.queue == "emails"
    assert job.state == "ready"
    assert job.get_priority_display() == "high"  # priority=50
    assert signals == [("enqueued", "READY")]
    fetched = tasks.send_welcome.get_result(result.id)
    assert fetched.status == TaskResultStatus.READY
    assert fetched.task.queue_name == "emails"
    assert fetched.args == [42]
    assert fetched.kwargs == {"greeting": "hi"}
    assert fetched.attempts == 0
    assert not fetched.is_finished
    with pytest.raises(ValueError, match="not finished"):
        _ = fetched.return_value


def test_run_after_defers_the_job() -> None:
    run_after = dt.datetime.now(tz=dt.UTC) + dt.timedelta(hours=1, microseconds=500)
    result = tasks.add.using(run_after=run_after).enqueue(1, 1)
    job = Job.objects.get(pk=result.id)
    assert job.state == "pending"
    assert job.available_at_ms == math.ceil(run_after.timestamp() * 1000)
    fetched = default_task_backend.get_result(result.id)
    assert fetched.status == TaskResultStatus.READY
    assert fetched.task.run_after is not None
    assert abs(fetched.task.run_after - run_after) < dt.timedelta(milliseconds=1)


def test_a_cancelled_task_is_failed() -> None:
    result = tasks.add.enqueue(1, 1)
    QueueService().cancel(result.id)
    fetched = default_task_backend.get_result(result.id)
    assert fetched.status == TaskResultStatus.FAILED
    assert fetched.finished_at is not None


@pytest.mark.parametrize("queue_name", ["bad queue", "-leading", "x" * 129])
def test_queue_name_must_be_a_relay_queue(queue_name: str) -> None:
    with pytest.raises(InvalidTask, match="not a Relay queue name"):
        tasks.add.using(queue_name=queue_name)


def test_queues_setting_limits_queue_names() -> None:
    with override_settings(TASKS={"default": {"BACKEND": BACKEND, "QUEUES": ["default"]}}):
        with pytest.raises(InvalidTask, match="not valid for backend"):
            tasks.add.using(queue_name="emails")
        assert tasks.add.enqueue(1, 2).status == TaskResultStatus.READY


@override_settings(RELAY_MAX_QUEUES=1)
def test_a_queue_past_relay_max_queues_is_refused_at_enqueue() -> None:
    assert tasks.add.using(queue_name="held").enqueue(1, 2).status == TaskResultStatus.READY
    with pytest.raises(TooManyQueues) as caught:
        tasks.add.using(queue_name="one-too-many").enqueue(1, 2)
    assert caught.value.details == {"limit": 1, "queue": "one-too-many"}
    assert tasks.add.using(queue_name="held").enqueue(3, 4).status == TaskResultStatus.READY
    assert sorted(Job.objects.values_list("queue", flat=True)) == ["held", "held"]


def test_naive_run_after_and_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidTask, match="aware"):
        tasks.add.using(run_after=dt.datetime(2030, 1, 1))
    # Hostile review: a Relay InvalidArgument escaped Django's contract here.
    with pytest.raises(InvalidTask, match="before 1970"):
        tasks.add.using(run_after=dt.datetime(1969, 12, 31, tzinfo=dt.UTC)).enqueue(1, 1)
    with pytest.raises(TypeError, match="Unsupported type"):
        tasks.add.enqueue(object(), 1)
    assert Job.objects.count() == 0


def test_system_checks_report_misconfiguration() -> None:
    backend = RelayBackend(
        "bad",
        {
            "QUEUES": ["ok", "not ok"],
            "OPTIONS": {"DATABASE": "nope", "MAX_RETRIES": -1, "TYPO": 1},
        },
    )
    ids = [message.id for message in backend.check()]
    assert ids == ["relay.E102", "relay.E103", "relay.E104", "relay.E105"]


def test_system_checks_report_malformed_shapes_and_a_database_no_server_serves() -> None:
    # OPTIONS None crashed `manage.py check` (AttributeError); QUEUES "default" passed as the
    # queues d, e, f, a, u, l, t; OPTIONS' DATABASE other than RELAY_DATABASE wrote tasks
    # where no server or worker looks, and `check` passed (a Django review).
    def ids(params: dict[str, Any]) -> list[str]:
        return [m.id for m in RelayBackend("bad", params).check() if isinstance(m.id, str)]

    assert ids({"OPTIONS": None}) == ["relay.E103"]
    assert ids({"OPTIONS": "x"}) == ["relay.E103"]
    assert ids({"QUEUES": "default"}) == ["relay.E105"]
    with override_settings(RELAY_DATABASE="postgresql"):
        assert ids({}) == ["relay.E107"]
        assert ids({"OPTIONS": {"DATABASE": "postgresql"}}) == []
    assert ids({}) == []


# -- results: every status, return values, errors ---------------------------------------


def test_lifecycle_ready_running_successful(
    worker_service: QueueService, signals: list[tuple[str, str]]
) -> None:
    result = tasks.add.enqueue(2, 3)
    (lease,) = worker_service.claim(["default"], worker_id="w1")
    running = tasks.add.get_result(result.id)
    assert running.status == TaskResultStatus.RUNNING
    assert running.worker_ids == ["w1"]
    assert running.started_at is not None
    assert running.started_at == running.last_attempted_at
    worker_service.release(lease["job_id"], worker_id="w1", lease_token=lease["lease_token"])

    _, error = run_next(worker_service, worker_id="w2")
    assert error is None
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5
    assert result.is_finished
    assert result.finished_at is not None
    assert result.errors == []
    assert result.worker_ids == ["w1", "w2"]  # one entry per delivery
    assert result.attempts == 2
    assert signals == [
        ("enqueued", "READY"),
        ("started", "RUNNING"),
        ("finished", "SUCCESSFUL"),
    ]


def test_purging_a_finished_task_job_deletes_its_result(worker_service: QueueService) -> None:
    from queue_core.models import JobResult

    kept, purged = tasks.add.enqueue(1, 2), tasks.add.enqueue(3, 4)
    for _ in range(2):
        _, error = run_next(worker_service)
        assert error is None
    assert JobResult.objects.count() == 2
    worker_service.purge(purged.id, actor="test")
    assert list(JobResult.objects.values_list("job_id", flat=True)) == [kept.id]
    assert tasks.add.get_result(kept.id).return_value == 3
    with pytest.raises(TaskResultDoesNotExist):
        tasks.add.get_result(purged.id)


def test_failures_are_retried_then_failed_with_errors(worker_service: QueueService) -> None:
    with override_settings(TASKS=relay_tasks(MAX_RETRIES=1)):
        result = tasks.fail.enqueue("bad input")
        _, error = run_next(worker_service)
        assert isinstance(error, ValueError)
        retrying = tasks.fail.get_result(result.id)
        assert retrying.status == TaskResultStatus.READY  # ready to be executed again
        assert len(retrying.errors) == 1
        Job.objects.filter(pk=result.id).update(available_at_ms=0)  # make the retry due now
        run_next(worker_service)
        result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.is_finished
    assert len(result.errors) == 2
    assert result.errors[-1].exception_class is ValueError
    assert "ValueError: bad input" in result.errors[-1].traceback
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value


def test_non_retryable_error_fails_at_once(worker_service: QueueService) -> None:
    result = tasks.refuse.enqueue("no way")
    run_next(worker_service)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class is NonRetryableError
    assert Job.objects.get(pk=result.id).dead_reason == "non-retryable: no way"


def test_return_value_that_is_not_json_fails_the_attempt(worker_service: QueueService) -> None:
    with override_settings(TASKS=relay_tasks(MAX_RETRIES=0)):
        result = tasks.not_json.enqueue()
        run_next(worker_service)
        result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class is TypeError


ROUND_TRIPS = [
    # (argument, what Django's serialisation, normalize_json then json, gives back)
    ({1: "one", None: 2}, {"1": "one", "null": 2}),
    (2**70, 2**70),
    (-(2**64), -(2**64)),
    ([1.5, (2, 3)], [1.5, [2, 3]]),
    (b"bytes", "bytes"),
    ("\ud800 lone surrogate", "\ud800 lone surrogate"),
    ({"deep": [float("inf"), -float("inf")]}, {"deep": [float("inf"), -float("inf")]}),
]


@pytest.mark.parametrize(("value", "expected"), ROUND_TRIPS)
def test_arguments_and_return_values_follow_djangos_json_rules(
    worker_service: QueueService, value: Any, expected: Any
) -> None:
    # Relay refused {1: "one"} and 2**70, which Django accepts.
    result = tasks.identity.enqueue(
        value,
    )
    assert result.args == [expected]
    _, error = run_next(worker_service)
    assert error is None
    result.refresh()
    assert result.args == [expected]
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == expected


def test_nan_round_trips() -> None:
    result = tasks.identity.enqueue(float("nan"))
    run_next(QueueService())
    result.refresh()
    assert math.isnan(result.args[0])
    assert math.isnan(result.return_value)


def test_what_django_refuses_is_refused_at_enqueue_with_djangos_error() -> None:
    with pytest.raises(TypeError, match="Unsupported type"):
        tasks.identity.enqueue(object())
    with pytest.raises(ValueError, match="Unsupported value"):
        tasks.identity.enqueue(b"\xff")
    assert Job.objects.count() == 0


def test_return_value_that_cannot_be_stored_fails_at_once_after_one_run(
    worker_service: QueueService,
) -> None:
    # The body ran 4 times under 3 retries; Django's backends run it once.
    tasks.RUNS.clear()
    with override_settings(TASKS=relay_tasks(MAX_RETRIES=3)):
        result = tasks.not_json_counted.enqueue()
        _, error = run_next(worker_service)
        result.refresh()
    assert isinstance(error, ReturnValueRefused)
    assert tasks.RUNS == {"not_json_counted": 1}
    job = Job.objects.get(pk=result.id)
    assert job.state == "dead"
    assert job.dead_reason.startswith("non-retryable: the return value cannot be stored:")
    assert result.status == TaskResultStatus.FAILED
    (recorded,) = result.errors
    assert recorded.exception_class is TypeError
    assert "TypeError: Unsupported type" in recorded.traceback


def test_a_task_that_cannot_be_loaded_records_the_exception_and_traceback(
    worker_service: QueueService, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = tasks.add.enqueue(1, 2)
    real_import = tasks_backend.import_string
    # The worker's code lacks the task's module (the producer's has it).
    monkeypatch.setattr(
        tasks_backend, "import_string", lambda path: real_import(path.replace("tasks_app", "gone"))
    )
    _, error = run_next(worker_service)
    monkeypatch.undo()
    assert isinstance(error, NonRetryableError)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    (recorded,) = result.errors
    assert recorded.exception_class is ModuleNotFoundError
    assert "Traceback (most recent call last)" in recorded.traceback
    assert "No module named 'tests.gone'" in recorded.traceback


@override_settings(USE_TZ=False)
def test_times_are_naive_without_use_tz(worker_service: QueueService) -> None:
    run_after = dt.datetime.now() + dt.timedelta(hours=1)
    deferred = tasks.add.using(run_after=run_after).enqueue(1, 1)
    assert Job.objects.get(pk=deferred.id).available_at_ms == math.ceil(
        run_after.timestamp() * 1000
    )
    read_after = tasks.add.get_result(deferred.id).task.run_after
    assert read_after is not None and read_after.tzinfo is None
    assert abs(read_after - run_after) < dt.timedelta(milliseconds=1)
    result = tasks.add.enqueue(2, 3)
    before = dt.datetime.now()
    run_next(worker_service)
    result.refresh()
    times = [result.enqueued_at, result.started_at, result.last_attempted_at, result.finished_at]
    assert all(t is not None and t.tzinfo is None for t in times), times
    assert result.finished_at is not None
    assert abs(result.finished_at - before) < dt.timedelta(seconds=60)


def test_run_after_beyond_relays_max_delay_is_an_invalid_task() -> None:
    now = dt.datetime.now(tz=dt.UTC)
    with pytest.raises(InvalidTask, match="RELAY_MAX_DELAY_MS"):
        tasks.add.using(run_after=now + dt.timedelta(days=30, minutes=1))
    with (
        override_settings(RELAY_MAX_DELAY_MS=60_000),
        pytest.raises(InvalidTask, match=r"RELAY_MAX_DELAY_MS \(60000 ms\)"),
    ):
        tasks.add.using(run_after=now + dt.timedelta(minutes=2))
    result = tasks.add.using(run_after=now + dt.timedelta(days=29)).enqueue(1, 1)
    assert Job.objects.get(pk=result.id).state == "pending"


def test_results_name_the_enqueuing_alias() -> None:
    both = {**relay_tasks(), "other": {"BACKEND": BACKEND, "QUEUES": []}}
    with override_settings(TASKS=both):
        result = tasks.add.using(backend="other").enqueue(1, 2)
        assert result.backend == "other"
        assert task_backends["default"].get_result(result.id).backend == "other"
        assert task_backends["other"].get_result(result.id).backend == "other"


def test_error_text_with_a_lone_surrogate_is_recorded_and_reported(
    worker_service: QueueService, signals: list[tuple[str, str]]
) -> None:
    with override_settings(TASKS=relay_tasks(MAX_RETRIES=0)):
        result = tasks.fail_with_surrogate.enqueue()
        _, error = run_next(worker_service)
        result.refresh()
    assert isinstance(error, ValueError)  # the task's own error, not one from recording it
    assert result.status == TaskResultStatus.FAILED
    (recorded,) = result.errors
    assert recorded.exception_class is ValueError
    assert "cannot read file name bad-\\udcff" in recorded.traceback
    job = Job.objects.get(pk=result.id)
    assert job.last_error == "cannot read file name bad-\\udcff"
    assert signals[-1] == ("finished", "FAILED")


def test_takes_context_sees_the_delivery_number(worker_service: QueueService) -> None:
    with override_settings(TASKS=relay_tasks(MAX_RETRIES=2)):
        result = tasks.attempt_number.enqueue(fail_until=1)
        run_next(worker_service)
        Job.objects.filter(pk=result.id).update(available_at_ms=0)
        run_next(worker_service)
        result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 2
    assert [error.exception_class for error in result.errors] == [RuntimeError]


def test_a_task_sees_its_own_result_id_in_its_context(worker_service: QueueService) -> None:
    result = tasks.own_id.enqueue()
    run_next(worker_service)
    result.refresh()
    assert result.return_value == result.id


def test_async_task_runs(worker_service: QueueService) -> None:
    result = tasks.async_double.enqueue(21)
    run_next(worker_service)
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42


def test_expired_lease_reads_as_an_error() -> None:
    clock = FakeClock()
    clock.set_ms(QueueService().clock.now_ms())  # the backend reads times on the wall clock
    service = QueueService(clock=clock)
    with override_settings(TASKS=relay_tasks(MAX_RETRIES=0)):
        result = tasks.add.enqueue(1, 2)
        service.claim(["default"], worker_id="w1", lease_ms=1_000)
        clock.advance(seconds=2)
        service.expire_leases()
        result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class is LeaseExpired


def test_a_delivery_a_server_restart_cut_short_reads_as_an_error() -> None:
    # Its attempt's outcome "recovered" was left out: attempts 2, errors [] (a Django review).
    service = QueueService()
    result = tasks.add.enqueue(1, 2)
    service.claim(["default"], worker_id="w1")
    assert service.recover() == 1  # what a SQLite server does at its start
    run_next(service, worker_id="w2")
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.attempts == 2
    (error,) = result.errors
    assert error.exception_class is LeaseExpired
    assert error.traceback.startswith("recovered: the server restarted")


def test_an_attempt_past_its_time_limit_reads_as_an_error() -> None:
    # Its attempt's outcome "timeout" was left out: FAILED with errors == [] (hostile review).
    clock = FakeClock()
    clock.set_ms(QueueService().clock.now_ms())  # the backend reads times on the wall clock
    with override_settings(
        TASKS=relay_tasks(MAX_RETRIES=0), RELAY_QUEUE_TIME_LIMITS="default=1000ms"
    ):
        service = QueueService(clock=clock)
        result = tasks.add.enqueue(1, 2)
        (lease,) = service.claim(["default"], worker_id="w1", lease_ms=5_000)
        clock.advance(seconds=1)  # at the limit exactly: not extended
        ids = {"worker_id": "w1", "lease_token": lease["lease_token"]}
        assert service.renew(lease["job_id"], **ids)["stop"] == "timeout"
        result.refresh()
    assert result.status == TaskResultStatus.FAILED
    (error,) = result.errors
    assert error.exception_class is TimeLimitExceeded
    assert error.traceback.startswith("timeout:")


def test_failure_without_a_recorded_traceback_keeps_the_error_text(
    worker_service: QueueService,
) -> None:
    with override_settings(TASKS=relay_tasks(MAX_RETRIES=0)):
        result = tasks.add.enqueue(1, 2)
        (lease,) = worker_service.claim(["default"], worker_id="w1")
        worker_service.fail(
            lease["job_id"], worker_id="w1", lease_token=lease["lease_token"], error="oom"
        )
        result.refresh()
    assert result.errors[0].exception_class is TaskAttemptFailed
    assert result.errors[0].traceback == "oom"


def test_unknown_foreign_and_mismatched_results() -> None:
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("job_01JD000000000000000000000")
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("not an id")
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("task_01JD000000000000000000000")
    plain = QueueService().submit("default", {"hello": "world"})["job"]
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(plain["id"])
    result = tasks.add.enqueue(1, 2)
    with pytest.raises(TaskResultMismatch):
        tasks.fail.get_result(result.id)


def test_worker_refuses_payloads_that_are_not_tasks(worker_service: QueueService) -> None:
    worker_service.submit("default", {"task": "tests.tasks_app.tasks.nope"})
    _, error = run_next(worker_service)
    assert isinstance(error, NonRetryableError)
    assert "cannot load the task" in str(error)
    worker_service.submit("default", {"task": TASK, "args": [], "kwargs": {}, "backend": "zz"})
    _, error = run_next(worker_service)
    assert isinstance(error, NonRetryableError)
    assert "no task backend 'zz'" in str(error)
    worker_service.submit("default", [1, 2])
    _, error = run_next(worker_service)
    assert isinstance(error, NonRetryableError)


# Jobs shaped like a task, but not as enqueue makes them (a hostile review: get_result raised
# KeyError, TypeError, JSONDecodeError, ValueError or InvalidTask, and the worker retried).
TASK = "tests.tasks_app.tasks.add"
NOT_QUITE_TASKS = [
    {"task": TASK, "call_json": "{}"},
    {"task": TASK, "call_json": "[1]"},
    {"task": TASK, "call_json": "not json"},
    {"task": TASK, "call_json": 5},
    {"task": TASK, "call_json": '{"args": [], "kwargs": []}'},
    {"task": TASK, "args": [1, 2], "kwargs": {}, "run_after_ms": "soon"},
    {"task": TASK, "args": [1, 2], "kwargs": {}, "run_after_ms": 10**18},
    {"task": TASK, "args": [1, 2], "kwargs": {}, "run_after_ms": -1},
    # Past year 9999 in local time east of UTC, under USE_TZ = False (a second review).
    {"task": TASK, "args": [1, 2], "kwargs": {}, "run_after_ms": 253_402_300_799_999},
    {"task": ".tasks.add", "args": [1, 2], "kwargs": {}},  # relative: TypeError
    {"task": ".x", "args": [], "kwargs": {}},  # ValueError
    {"task": "add", "args": [1, 2], "kwargs": {}},
    {"task": "tests.tasks_app.__main__.add", "args": [], "kwargs": {}},
    {"task": TASK, "args": [1, 2], "kwargs": {}, "priority": 1000},
    {"task": TASK, "args": [1, 2], "kwargs": {}, "priority": True},
    {"task": TASK, "args": [1, 2], "kwargs": {}, "backend": ["default"]},
]


@pytest.mark.parametrize("payload", NOT_QUITE_TASKS)
def test_a_job_only_shaped_like_a_task_is_no_task_result_and_is_not_retried(
    worker_service: QueueService, payload: dict[str, Any]
) -> None:
    job = worker_service.submit("default", payload)["job"]
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(job["id"])
    _, error = run_next(worker_service)
    assert isinstance(error, NonRetryableError), error
    assert worker_service.get(job["id"], history=False)["state"] == "dead"


def test_a_task_whose_module_fails_to_import_here_is_an_import_error_and_not_retried(
    worker_service: QueueService,
) -> None:
    # A second review: ImproperlyConfigured (no Oracle driver) reached get_result's caller,
    # and the worker retried the job.
    job = worker_service.submit("default", {"task": "django.db.backends.oracle.base.X"})["job"]
    with pytest.raises(ImportError, match="ImproperlyConfigured"):
        default_task_backend.get_result(job["id"])
    _, error = run_next(worker_service)
    assert isinstance(error, NonRetryableError), error
    assert "cannot load the task" in str(error)
    assert worker_service.get(job["id"], history=False)["state"] == "dead"


def test_a_task_as_enqueue_shapes_it_reads_back_with_every_field(
    worker_service: QueueService,
) -> None:
    for made in (
        {"task": TASK, "args": [1, 2], "kwargs": {}, "priority": 100, "run_after_ms": 0},
        {"task": TASK, "call_json": '{"args": [1, 2], "kwargs": {}}', "priority": -100},
    ):
        job = worker_service.submit("default", made)["job"]
        result = default_task_backend.get_result(job["id"])
        assert (result.args, result.kwargs) == ([1, 2], {})
        run_next(worker_service)
        assert default_task_backend.get_result(job["id"]).return_value == 3


def test_aenqueue_and_aget_result(worker_service: QueueService) -> None:
    async def enqueue() -> str:
        result = await tasks.add.aenqueue(20, 22)
        return result.id

    result_id = asyncio.run(enqueue())
    run_next(worker_service)

    async def fetch() -> Any:
        result = await tasks.add.aget_result(result_id)
        await result.arefresh()
        return result

    result = asyncio.run(fetch())
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42


# -- transactional enqueue ----------------------------------------------------------------


def committed_elsewhere(job_id: str) -> bool:
    """Whether another connection (another thread) sees the job: only committed rows."""
    seen: list[bool] = []

    def look() -> None:
        try:
            seen.append(Job.objects.filter(pk=job_id).exists())
        finally:
            connections.close_all()

    thread = threading.Thread(target=look)
    thread.start()
    thread.join()
    return seen == [True]


def test_enqueue_inside_a_committed_transaction_appears_at_commit(
    worker_service: QueueService, signals: list[tuple[str, str]]
) -> None:
    with transaction.atomic():
        result = tasks.add.enqueue(1, 2)
        assert result.id.startswith("job_")
        assert Job.objects.filter(pk=result.id).exists()  # in this transaction only
        assert not committed_elsewhere(result.id)
        assert signals == []  # sent on commit
    assert committed_elsewhere(result.id)
    assert signals == [("enqueued", "READY")]
    assert tasks.add.get_result(result.id).status == TaskResultStatus.READY
    run_next(worker_service)
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 3


def test_enqueue_inside_a_rolled_back_transaction_never_appears(
    worker_service: QueueService, signals: list[tuple[str, str]]
) -> None:
    with transaction.atomic():
        result = tasks.add.enqueue(1, 2)
        transaction.set_rollback(True)
    assert Job.objects.count() == 0
    assert worker_service.claim(["default"], worker_id="w1") == []
    assert signals == []
    with pytest.raises(TaskResultDoesNotExist):
        tasks.add.get_result(result.id)


def test_enqueue_in_a_savepoint_rolls_back_alone(worker_service: QueueService) -> None:
    with transaction.atomic():
        kept = tasks.add.enqueue(1, 2)
        with transaction.atomic():
            tasks.add.enqueue(3, 4)
            transaction.set_rollback(True)
    assert list(Job.objects.values_list("id", flat=True)) == [kept.id]


def test_missing_immediate_transaction_mode_is_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(settings.DATABASES["default"]["OPTIONS"], "transaction_mode")
    backend = RelayBackend("default", {"QUEUES": []})
    assert [message.id for message in backend.check()] == ["relay.W106"]


def test_immediate_transaction_mode_is_asked_of_sqlite_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 'transaction_mode' is an option of Django's SQLite backend; PostgreSQL has none.
    postgres = {"ENGINE": "django.db.backends.postgresql", "NAME": "relay", "OPTIONS": {}}
    monkeypatch.setitem(settings.DATABASES, "pg", postgres)
    backend = RelayBackend("default", {"QUEUES": [], "OPTIONS": {"DATABASE": "pg"}})
    with override_settings(RELAY_DATABASE="pg"):  # Relay's tables there too (else relay.E107)
        assert [message.id for message in backend.check()] == []


# -- results stored by the service, and the networked mode without a server ----------------


def test_a_return_value_over_relay_max_result_bytes_fails_at_once(
    worker_service: QueueService,
) -> None:
    with override_settings(TASKS=relay_tasks(MAX_RETRIES=3), RELAY_MAX_RESULT_BYTES=100):
        # {"return_value":"xx…"} is 19 bytes + the text: 81 x's make exactly 100, 82 make 101.
        fits = tasks.identity.enqueue("x" * 81)
        over = tasks.identity.enqueue("x" * 82)
        assert run_next(worker_service)[1] is None
        _, error = run_next(worker_service)
    assert isinstance(error, ReturnValueRefused)
    assert "over RELAY_MAX_RESULT_BYTES (100)" in str(error)
    assert tasks.identity.get_result(fits.id).return_value == "x" * 81
    refused = tasks.identity.get_result(over.id)
    assert refused.status == TaskResultStatus.FAILED
    assert refused.errors[0].exception_class is ValueError


def test_networked_options_are_checked() -> None:
    good = RelayBackend("net", {"OPTIONS": {"ADDRESS": "127.0.0.1:7400,10.0.0.2:7400"}})
    # queue_admin, installed here, shows this database's jobs, not the service's (a Django
    # review): a warning, which the backend's first use does not refuse.
    (warning,) = good.check()
    assert warning.id == "relay.W109" and not warning.is_serious()
    assert "127.0.0.1:7400,10.0.0.2:7400" in warning.msg
    apps = [app for app in settings.INSTALLED_APPS if app != "queue_admin"]
    with override_settings(INSTALLED_APPS=apps):
        assert good.networked and good.check() == []
    bad = RelayBackend("net", {"OPTIONS": {"ADDRESS": "no-port", "API_KEY": 7, "TIMEOUT": True}})
    found = [m for m in bad.check() if m.is_serious()]
    messages = [m.msg for m in found]
    assert [m.id for m in found] == ["relay.E106"] * 3
    assert "ADDRESS 'no-port'" in messages[0]
    assert "API_KEY must be a string" in messages[1]
    assert "TIMEOUT must be a number of seconds > 0, got True" in messages[2]


def test_a_misspelt_options_key_or_an_empty_address_is_an_error_not_the_shared_mode() -> None:
    # Either left ADDRESS unread: enqueue wrote the job into this project's own relay_job,
    # which no server served, and `manage.py check` said nothing (a Django review).
    typo = RelayBackend("net", {"OPTION": {"ADDRESS": "127.0.0.1:7400"}})
    (error,) = [m for m in typo.check() if m.id == "relay.E108"]
    assert "unknown keys ['OPTION']" in error.msg and "'OPTIONS'" in error.msg
    for empty in ("", None):
        backend = RelayBackend("net", {"OPTIONS": {"ADDRESS": empty}})
        (error,) = [m for m in backend.check() if m.id == "relay.E106"]
        assert f"OPTIONS['ADDRESS'] is {empty!r}" in error.msg
    jobs = Job.objects.count()
    with (
        override_settings(TASKS={"default": {"BACKEND": BACKEND, "OPTIONS": {"ADDRESS": ""}}}),
        pytest.raises(InvalidTaskBackend, match=r"relay\.E106: .*ADDRESS'\] is ''"),
    ):
        tasks.add.enqueue(1, 2)
    assert Job.objects.count() == jobs


def test_a_backend_that_fails_its_checks_is_refused_at_first_use() -> None:
    # A docs audit: Django 6.0 runs the tasks checks only once django.tasks is imported, so
    # a networked producer without queue_core passed `manage.py check` with ADDRESS "nohost"
    # and TIMEOUT 0; its enqueue then went on with them.
    with override_settings(TASKS=relay_tasks(ADDRESS="nohost", TIMEOUT=0)):
        for use in (
            lambda: tasks.add.enqueue(1, 2),
            lambda: default_task_backend.get_result("default/key"),
            lambda: asyncio.run(default_task_backend.aget_result("default/key")),
            lambda: asyncio.run(tasks.add.aenqueue(1, 2)),
        ):
            with pytest.raises(InvalidTaskBackend) as refused:
                use()
            assert "relay.E106" in str(refused.value) and "'nohost'" in str(refused.value)
            assert "TIMEOUT must be a number of seconds > 0, got 0" in str(refused.value)
    with (
        override_settings(TASKS=relay_tasks(DATABASE="nope")),
        pytest.raises(InvalidTaskBackend, match=r"relay\.E102: .*'nope'"),
    ):
        tasks.add.enqueue(1, 2)
    assert Job.objects.count() == 0


def test_networked_enqueue_waits_for_the_commit_and_a_rollback_never_connects() -> None:
    # Port 9 (discard) on loopback: nothing listens, so any connection attempt would fail.
    with override_settings(TASKS=relay_tasks(ADDRESS="127.0.0.1:9", TIMEOUT=1)):
        sent: list[str] = []
        task_enqueued.connect(receiver := lambda sender, task_result, **kw: sent.append("x"))
        try:
            with transaction.atomic():
                result = tasks.add.enqueue(1, 2)
                assert result.id.startswith("default/") and result.enqueued_at is None
                transaction.set_rollback(True)
            with (
                pytest.raises(FrameTooLarge),
                transaction.atomic(),
                override_settings(RELAY_MAX_PAYLOAD_BYTES=50),
            ):
                tasks.identity.enqueue("x" * 100)  # refused inside the transaction
        finally:
            task_enqueued.disconnect(receiver)
        assert sent == []
        backend = tasks.add.get_backend()
        assert isinstance(backend, RelayBackend) and backend._client is None  # never connected


def test_a_networked_submit_that_fails_at_commit_raises_and_skips_the_hooks_after_it() -> None:
    """As docs/django.md says: the commit raises, the hooks registered before the enqueue ran,
    and those after it did not, robust or not (Django stops at the first non-robust hook that
    raises)."""
    ran: list[str] = []

    def transact() -> None:
        with transaction.atomic():
            transaction.on_commit(lambda: ran.append("before"))
            tasks.add.enqueue(1, 2)
            transaction.on_commit(lambda: ran.append("after, robust"), robust=True)
            transaction.on_commit(lambda: ran.append("after"))

    # Port 9 (discard) on loopback: nothing listens.
    with (
        override_settings(TASKS=relay_tasks(ADDRESS="127.0.0.1:9", TIMEOUT=0.5)),
        pytest.raises(RelayUnreachable),
    ):
        transact()
    assert ran == ["before"]


def test_results_written_before_0013_are_read_from_the_legacy_table(
    worker_service: QueueService,
) -> None:
    from relay_tasks.models import TaskResultRecord

    done, failed = tasks.add.enqueue(1, 2), tasks.add.enqueue(3, 4)
    for result in (done, failed):
        (lease,) = worker_service.claim(["default"], worker_id="old-worker")
        ids = {"worker_id": "old-worker", "lease_token": lease["lease_token"]}
        if result is done:  # an old worker: it acked without a result
            worker_service.ack(lease["job_id"], **ids)
        else:
            worker_service.fail(lease["job_id"], error="old", retryable=False, **ids)
    TaskResultRecord.objects.create(job_id=done.id, return_value="3", updated_at_ms=0)
    TaskResultRecord.objects.create(
        job_id=failed.id,
        errors='[{"attempt": 1, "exception_class_path": "builtins.KeyError", "traceback": "tb"}]',
        updated_at_ms=0,
    )
    assert tasks.add.get_result(done.id).return_value == 3
    (error,) = tasks.add.get_result(failed.id).errors
    assert (error.exception_class_path, error.traceback) == ("builtins.KeyError", "tb")


def test_the_workers_database_check_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # psycopg's message for a table that does not exist goes on with "LINE 1: ..." and a
    # caret line: the worker's start-up error spanned three lines (a Django review).
    from django.core.exceptions import ImproperlyConfigured
    from django.db import DatabaseError

    def unmigrated(self: QueueService) -> list[dict[str, Any]]:
        raise DatabaseError(
            'relation "relay_server" does not exist\nLINE 1: SELECT id FROM relay_server\n   ^'
        )

    class Stats:
        def stats(self, queue: str | None = None, **kwargs: Any) -> dict[str, Any]:
            return {"servers": [{"id": "srv_1"}]}

    monkeypatch.setattr(QueueService, "servers", unmigrated)
    backend = RelayBackend("default", {"QUEUES": []})
    with pytest.raises(ImproperlyConfigured) as info:
        tasks_backend.check_worker_setup([backend], Stats())
    assert "\n" not in str(info.value)
    assert 'cannot hold task results (relation "relay_server" does not exist);' in str(info.value)


def _nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("leaf", [1, 2**70], ids=["native", "call_json"])
def test_arguments_nest_as_deep_with_or_without_call_json(leaf: int) -> None:
    # Arguments Relay's JSON cannot hold (2**70) travel as call_json text, whose depth the
    # service cannot see: that path escaped the bound (a Django review). The payload object
    # and the args list are the first two of the 64 levels.
    deepest = tasks.identity.enqueue(_nested(62, leaf))
    assert deepest.args == [_nested(62, leaf)]
    with pytest.raises(InvalidArgument, match="nested deeper than 64 levels"):
        tasks.identity.enqueue(_nested(63, leaf))
    assert Job.objects.count() == 1


def test_a_faulty_servers_replies_raise_no_key_error() -> None:
    # A reply without the job's time raised KeyError from enqueue after the job was made (a
    # caller that retried enqueued the task twice), and one without the job from get_result
    # (a review).
    def script(request: dict[str, Any], conn: int) -> bytes:
        if request["op"] == "submit":
            return ok(request, {"job": {"id": "job_1"}, "deduplicated": False})
        return ok(request, {"job": {"id": "job_1"}})  # result: no payload, no state

    server = CannedServer(script)
    try:
        with override_settings(TASKS=relay_tasks(ADDRESS=server.address)):
            result = tasks.add.enqueue(1, 2)
            assert result.enqueued_at is not None
            with pytest.raises(RelayConnectionError, match="malformed result reply"):
                tasks.add.get_result(result.id)
            with pytest.raises(RelayConnectionError, match="malformed result reply"):
                asyncio.run(default_task_backend.aget_result(result.id))
    finally:
        server.close()


def test_a_submit_whose_reply_was_lost_then_unreachable_is_outcome_unknown() -> None:
    # The first try's submit reached the server and its reply was lost; the later tries found
    # it gone. RelayUnreachable ("nothing was sent") had callers enqueue again: 17 of 128
    # enqueues that raised in a server's outage had their job (a review).
    tries: list[str] = []

    def call(deadline: float) -> None:
        tries.append("try")
        if len(tries) == 1:
            raise RelayConnectionError("connection closed by the server", address="a:1")
        raise RelayUnreachable("cannot connect: refused", address="a:1")

    with pytest.raises(RelayConnectionError) as raised:
        tasks_backend._again(call, 0.4)
    assert not isinstance(raised.value, RelayUnreachable)
    assert "may have been applied" in str(raised.value) and len(tries) >= 2
    tries.clear()  # never sent at all: still RelayUnreachable
    tries.append("lost none")
    with pytest.raises(RelayUnreachable):
        tasks_backend._again(call, 0.4)


def test_a_networked_enqueue_that_raises_names_its_result_id() -> None:
    # Outside a transaction enqueue returns nothing when it raises, and the key it drew was
    # the caller's only way to ask whether the job was made after all (a review).
    with override_settings(TASKS=relay_tasks(ADDRESS="127.0.0.1:9", TIMEOUT=0.3)):
        with pytest.raises(RelayUnreachable) as raised:
            tasks.add.enqueue(1, 2)
        result_id = raised.value.task_result_id  # type: ignore[attr-defined]
        assert result_id.startswith("default/")
        assert any(result_id in note for note in raised.value.__notes__)


def test_aenqueue_from_many_coroutines_runs_them_at_once() -> None:
    # Django's default ran every coroutine's enqueue on one thread outside a request's
    # context: 8 calls to a service that was down, TIMEOUT 1 s, ended 0.9, 1.8 ... 7.3 s in.
    async def main() -> list[float]:
        async def one() -> float:
            began = time.monotonic()
            with pytest.raises(RelayUnreachable):
                await tasks.add.aenqueue(1, 2)
            return time.monotonic() - began

        # Four: fewer than the default executor's threads (min(32, CPUs + 4)) on any machine.
        return list(await asyncio.gather(*(one() for _ in range(4))))

    with override_settings(TASKS=relay_tasks(ADDRESS="127.0.0.1:9", TIMEOUT=1)):
        took = asyncio.run(main())
    assert max(took) < 2.5, took  # each within its TIMEOUT (one after another: 4 s)
