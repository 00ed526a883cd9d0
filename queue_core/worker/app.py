"""Application workers: route each job to a handler by the ``task`` field of its payload.

An application submits payloads such as ``{"task": "send_email", "to": "a@example.com"}`` and
runs a worker with its handlers::

    from queue_core.worker.app import Worker

    def send_email(payload, ctx):
        ...  # return to ack; raise to fail (retried), NonRetryableError to dead-letter

    Worker(queues=["emails"], handlers={"send_email": send_email}, concurrency=4).run()

``Worker`` is the pull worker of ``queue_core.worker.runner`` (the same slots, lease renewal,
ack/fail and bounded shutdown) with a ``Router`` as its handler. ``manage.py relay_worker --app
PATH`` runs one from the command line (see ``load_handlers`` for what ``PATH`` must name).

A handler is ``handler(payload, ctx)`` (``ctx`` is a ``JobContext``: job id, attempt, shutdown
event, and ``ctx.meta``, the job's metadata map such as a ``traceparent``); an ``async def``
handler is run to completion on its own event loop. Its return value is ignored unless it is a
``StoredResult``, whose value the worker sends with its ack (stored with the job; the
``result`` op reads it). Delivery is at-least-once, so handlers must be idempotent.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from queue_core.worker import runner
from queue_core.worker.handlers import JobContext, NonRetryableError, refuse_django_task

__all__ = ["AppHandler", "Router", "UnknownTask", "Worker", "load_handlers"]

AppHandler = Callable[[Any, JobContext], object]
"""``handler(payload, ctx)``, or an ``async def`` with the same arguments."""

TASK_FIELD = "task"


class UnknownTask(NonRetryableError):
    """The payload names no task this worker has a handler for (the job is dead-lettered)."""


class Router:
    """A worker handler that calls ``handlers[payload["task"]](payload, ctx)``.

    A payload that is not a JSON object, has no string ``task`` field, or names a task with no
    handler raises ``UnknownTask``, a ``NonRetryableError``: another attempt cannot fix it, so
    the job goes straight to dead with that text as its reason. A Django task's job
    (``handlers.is_django_task``) raises ``TaskJobRefused`` (also non-retryable): only
    ``relay worker --tasks`` runs those.

    Args:
        handlers: task name -> handler; copied, so later changes to the mapping have no effect.
        task_field: the payload key that names the task (default ``"task"``).
    Raises:
        TypeError: ``handlers`` is not a mapping of non-empty strings to callables.
    """

    def __init__(self, handlers: Mapping[str, AppHandler], *, task_field: str = TASK_FIELD):
        if not isinstance(handlers, Mapping):
            raise TypeError(
                f"handlers must be a mapping of task name to callable, not {handlers!r}"
            )
        for name, handler in handlers.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"task names must be non-empty strings, not {name!r}")
            if not callable(handler):
                raise TypeError(f"the handler of task {name!r} is not callable: {handler!r}")
        self.handlers: dict[str, AppHandler] = dict(handlers)
        self.task_field = task_field

    def task_of(self, payload: Any) -> str:
        """Return the task name of ``payload``.

        Raises:
            UnknownTask: no string task field, or no handler for it.
            TaskJobRefused: the payload is a Django task's job.
        """
        refuse_django_task(payload)
        if not isinstance(payload, dict):
            raise UnknownTask(f"payload is not an object with a {self.task_field!r} field")
        name = payload.get(self.task_field)
        if not isinstance(name, str):
            raise UnknownTask(f"payload has no string {self.task_field!r} field")
        if name not in self.handlers:
            known = ", ".join(sorted(self.handlers)) or "none"
            raise UnknownTask(f"unknown task {name!r}; this worker handles: {known}")
        return name

    def __call__(self, payload: Any, ctx: JobContext) -> object:
        """Run the handler of the payload's task; its exceptions fail the job."""
        handler = self.handlers[self.task_of(payload)]
        result = handler(payload, ctx)
        if inspect.isawaitable(result):
            return asyncio.run(_await(result))
        return result


async def _await(awaitable: Any) -> object:
    return await awaitable


def load_handlers(path: str) -> Router:
    """Import the handlers that ``relay_worker --app PATH`` runs.

    ``PATH`` is a dotted path ``package.module.attribute`` (``package.module:attribute`` works
    too). The attribute must be a ``Router`` or a mapping of task name to handler; it is
    imported after Django is set up, so handlers may use the ORM and settings.

    Raises:
        ImportError: the module or attribute does not exist (with the path in the message).
        TypeError: the attribute is not a mapping of task names to callables.
    """
    from django.utils.module_loading import import_string

    target = import_string(path.replace(":", ".", 1) if ":" in path else path)
    if isinstance(target, Router):
        return target
    if not isinstance(target, Mapping):
        raise TypeError(
            f"{path} is a {type(target).__name__}; --app needs a mapping of task name to "
            "handler (or a queue_core.worker.app.Router)"
        )
    return Router(target)


class Worker(runner.Worker):
    """A pull worker that routes jobs to ``handlers`` by the payload's ``task`` field.

    Return from a handler to ack, raise to fail with the exception text (retried with backoff
    until the job's ``max_retries`` is spent), raise ``NonRetryableError`` to dead-letter at
    once, raise ``JobInterrupted`` to give the job back during a shutdown. Unknown tasks are
    dead-lettered (``UnknownTask``), and so are Django tasks' jobs (``TaskJobRefused``).

    Args:
        queues: queue names to lease from (1..16).
        handlers: task name -> ``handler(payload, ctx)``, or a ``Router``.
        concurrency: most jobs held and run at once (default 8).
        address: the server, ``HOST:PORT`` (default ``RELAY_ADDRESS``); ignored when
            ``client_factory`` is given.
        client_factory: builds the clients (default a ``RelayClient`` on ``address``).
        **options: the other keyword arguments of ``runner.Worker``: ``lease_ms``, ``wait_ms``,
            ``shutdown_timeout_ms`` (30 000 ms), ``worker_id``, ``clock``, ...
    Raises:
        ValueError, TypeError: an argument is out of range or of the wrong type.
    """

    def __init__(
        self,
        *,
        queues: Sequence[str],
        handlers: Mapping[str, AppHandler] | Router,
        concurrency: int = 8,
        address: str | None = None,
        client_factory: Callable[[], runner.WorkerClient] | None = None,
        **options: Any,
    ) -> None:
        self.router = handlers if isinstance(handlers, Router) else Router(handlers)
        if client_factory is None:
            from queue_core.client import RelayClient
            from queue_core.conf import relay_settings

            settings = relay_settings()
            target = address or settings.address
            max_frame_bytes = settings.max_frame_bytes

            def default_factory() -> runner.WorkerClient:
                return RelayClient(target, max_frame_bytes=max_frame_bytes)

            client_factory = default_factory
        super().__init__(
            client_factory, queues, concurrency=concurrency, handler=self.router, **options
        )
