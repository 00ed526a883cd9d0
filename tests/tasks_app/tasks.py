"""Django tasks used by the tests, enqueued with Django's own API (``.enqueue()``)."""

from __future__ import annotations

from typing import Any

from django.tasks import TaskContext, task

from queue_core.worker import NonRetryableError


@task
def add(a: int, b: int) -> int:
    """Return ``a + b``."""
    return a + b


@task(priority=50, queue_name="emails")
def send_welcome(user_id: int, *, greeting: str = "hello") -> dict[str, Any]:
    """Pretend to send a welcome email; return what was sent."""
    return {"user_id": user_id, "greeting": greeting}


@task
def fail(message: str) -> None:
    """Raise ``ValueError(message)`` (retried while the budget lasts)."""
    raise ValueError(message)


@task
def refuse(message: str) -> None:
    """Raise ``NonRetryableError(message)``: the task fails at once."""
    raise NonRetryableError(message)


@task(takes_context=True)
def own_id(context: TaskContext) -> str:
    """The result id the task sees in its context."""
    return context.task_result.id


@task(takes_context=True)
def attempt_number(context: TaskContext, fail_until: int = 0) -> int:
    """Fail on attempts ``1..fail_until``, then return the attempt number."""
    if context.attempt <= fail_until:
        raise RuntimeError(f"attempt {context.attempt} fails on purpose")
    return context.attempt


@task
async def async_double(x: int) -> int:
    """An ``async def`` task: return ``2 * x``."""
    return 2 * x


@task
def not_json() -> object:
    """Return something JSON cannot hold (the attempt fails with TypeError)."""
    return object()


@task
def not_a_number() -> float:
    """Return NaN, which JSON has no number for (the attempt fails with ValueError)."""
    return float("nan")


@task
def fail_with_surrogate() -> None:
    """Raise an error whose text holds a lone surrogate (as ``os.fsdecode`` makes of a stray
    byte), which no UTF-8 store can hold."""
    raise ValueError(f"cannot read file name {b'bad-\xff'.decode('utf-8', 'surrogateescape')}")


@task
def identity(value: Any) -> Any:
    """Return ``value`` (the argument and the return value both cross Relay's storage)."""
    return value


RUNS: dict[str, int] = {}
"""How often each counting task's body ran in this process, by task name."""


@task
def not_json_counted() -> object:
    """Count the run in ``RUNS``, then return something JSON cannot hold."""
    RUNS["not_json_counted"] = RUNS.get("not_json_counted", 0) + 1
    return object()
