"""The application worker: routing by the payload's ``task`` field, on the in-memory fake relay
of ``test_worker`` (no sockets, no database), plus ``load_handlers`` for ``--app``."""

from __future__ import annotations

import threading
from typing import Any, cast

import pytest

from queue_core.clock import FakeClock
from queue_core.worker import JobContext, NonRetryableError, TaskJobRefused
from queue_core.worker.app import Router, UnknownTask, Worker, load_handlers
from tests.tasks_app import handlers
from tests.unit.test_worker import WAIT_S, FakeRelay, Running


def context(job_id: str = "job_1") -> JobContext:
    return JobContext(
        job_id=job_id, queue="q", attempt=1, worker_id="w", shutdown=threading.Event(), lease={}
    )


def test_router_calls_the_handler_named_by_the_payload() -> None:
    calls: list[tuple[Any, JobContext]] = []
    router = Router({"a": lambda payload, ctx: calls.append((payload, ctx)) or "done"})
    ctx = context()
    assert router({"task": "a", "x": 1}, ctx) == "done"
    assert calls == [({"task": "a", "x": 1}, ctx)]


def test_router_runs_async_handlers() -> None:
    seen: list[int] = []

    async def handler(payload: Any, ctx: JobContext) -> int:
        seen.append(payload["n"])
        return payload["n"] * 2

    assert Router({"double": handler})({"task": "double", "n": 4}, context()) == 8
    assert seen == [4]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"task": "nope"}, "unknown task 'nope'; this worker handles: a, b"),
        ({"no_task": 1}, "payload has no string 'task' field"),
        ({"task": 7}, "payload has no string 'task' field"),
        ([1, 2], "payload is not an object with a 'task' field"),
    ],
)
def test_router_refuses_what_it_cannot_route(payload: Any, message: str) -> None:
    router = Router({"b": print, "a": print})
    with pytest.raises(UnknownTask) as caught:
        router(payload, context())
    assert str(caught.value) == message
    assert isinstance(caught.value, NonRetryableError)  # dead-lettered, never retried


def test_router_task_field_is_configurable() -> None:
    assert Router({"x": lambda p, c: p["kind"]}, task_field="kind")({"kind": "x"}, context()) == "x"


@pytest.mark.parametrize(
    "handlers_arg",
    [[("a", print)], {"": print}, {1: print}, {"a": "not callable"}],
)
def test_router_refuses_bad_handler_tables(handlers_arg: Any) -> None:
    with pytest.raises(TypeError):
        Router(handlers_arg)


def test_load_handlers_imports_a_mapping_or_router() -> None:
    router = load_handlers("tests.tasks_app.handlers.HANDLERS")
    assert router.handlers == handlers.HANDLERS
    assert load_handlers("tests.tasks_app.handlers:HANDLERS").handlers == handlers.HANDLERS
    with pytest.raises(ImportError):
        load_handlers("tests.tasks_app.handlers.MISSING")
    with pytest.raises(TypeError, match="needs a mapping"):
        load_handlers("tests.tasks_app.handlers.echo")


def test_worker_acks_fails_and_dead_letters_by_task() -> None:
    relay = FakeRelay()
    ids = relay.add(
        {"task": "echo"},
        {"task": "boom", "message": "smtp down"},
        {"task": "refuse"},
        {"task": "missing"},
        {"task": "async_ok"},
    )
    worker = Worker(
        queues=["q"],
        handlers=handlers.HANDLERS,
        concurrency=2,
        client_factory=relay.connect,
        lease_ms=3_000,
        wait_ms=100,
        clock=FakeClock(),
        worker_id="w1:1",
        max_error_bytes=4096,
        tick_s=0.005,
    )
    running = Running(worker)
    relay.wait_for(
        lambda: len(relay.calls_of("ack")) + len(relay.calls_of("fail")) == 5, "five outcomes"
    )
    running.stop()
    assert running.error is None
    assert sorted(call["job_id"] for call in relay.calls_of("ack")) == [ids[0], ids[4]]
    fails = {call["job_id"]: call for call in relay.calls_of("fail")}
    assert fails[ids[1]]["error"] == "smtp down"
    assert fails[ids[1]]["retryable"] is True
    assert fails[ids[2]]["error"] == "refused: bad input"
    assert fails[ids[2]]["retryable"] is False
    assert fails[ids[3]]["error"].startswith("unknown task 'missing'; this worker handles: ")
    assert fails[ids[3]]["retryable"] is False
    assert worker.router.handlers == handlers.HANDLERS
    assert running.thread.join(WAIT_S) is None


def test_worker_defaults_to_a_relay_client_on_relay_address() -> None:
    worker = Worker(queues=["q"], handlers={"a": print}, address="127.0.0.1:1", lease_ms=1_000)
    client = worker._client_factory()
    assert client.address == "127.0.0.1:1"  # type: ignore[attr-defined]
    client.close()


def test_router_refuses_django_task_jobs_even_with_a_matching_name() -> None:
    router = Router({"app.tasks.send": print})
    payload = {"task": "app.tasks.send", "args": [1], "kwargs": {}, "backend": "default"}
    with pytest.raises(TaskJobRefused, match="run relay worker --tasks"):
        router(payload, context())


def test_context_meta_is_the_leases_meta_or_empty() -> None:
    meta = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    ctx = JobContext(
        job_id="j",
        queue="q",
        attempt=1,
        worker_id="w",
        shutdown=threading.Event(),
        lease=cast(Any, {"meta": meta}),
    )
    assert ctx.meta == meta
    ctx.meta["other"] = "x"  # a copy: the lease is untouched
    assert ctx.meta == meta
    assert context().meta == {}  # a lease from a server without meta
