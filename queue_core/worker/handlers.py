"""Job handlers for the pull worker, and the safe demonstration executor.

A handler is ``handler(payload, ctx) -> object``: it returns normally when the job is done
(the worker acks it) and raises when it failed (the worker records a failure). Delivery is
at-least-once, so a handler may run twice for one job and must make its effects idempotent;
``ctx.attempt`` never decreases and can serve as a fencing epoch in the handler's own storage
(but for an OS crash or power loss, which may take back the latest leases and repeat their
attempt numbers unless ``RELAY_DURABLE_LEASES`` is set: docs/design-decisions.md).

Raise ``NonRetryableError`` for failures a retry cannot fix (the job goes straight to dead), and
``JobInterrupted`` to give the job back untouched when ``ctx.shutdown`` is set.

Results: a handler that returns ``StoredResult(value)`` has the worker send ``value`` with its
ack, and the service stores it with the job (the ``result`` op reads it); any other return
value is ignored. A failure is sent with its exception's class and traceback
(``reported_error``), which the service keeps per attempt beside the error text.

``ctx.stop`` (a ``StopSignal``) is set when the handler should stop now, with its ``reason``:
``"cancelled"`` (an operator cancelled the job: the worker learned it at a renew),
``"timeout"`` (the attempt reached its time limit) or ``"shutdown"`` (the worker is stopping).
Stopping is cooperative, as with Celery's soft time limit and Oban's cancellation: a thread
cannot be killed, so a long handler should wait on ``ctx.stop`` (or check it) and raise
``JobInterrupted``. The worker then ends the job as the reason says: a cancelled job becomes
CANCELLED, a timed-out attempt is failed with reason ``timeout`` (the retry policy applies),
a shut-down job is released. A handler that ignores it runs on; past a time limit the server
stops renewing its lease and its late result is refused.

A job enqueued through ``django.tasks`` (``is_django_task``) runs only under ``relay worker
--tasks``: the demonstration handler and application routers refuse it (``TaskJobRefused``)
rather than ack a task whose body never ran.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from traceback import format_exception
from typing import Any

from queue_core import types

__all__ = [
    "DemoFailure",
    "Handler",
    "JobContext",
    "JobInterrupted",
    "NonRetryableError",
    "ReportedError",
    "StopSignal",
    "StoredResult",
    "TaskJobRefused",
    "demo_handler",
    "is_django_task",
    "refuse_django_task",
    "reported_error",
]


class NonRetryableError(Exception):
    """A failure that retrying cannot fix: the job is dead-lettered at once."""


class JobInterrupted(Exception):
    """The handler stopped early because ``ctx.stop`` or ``ctx.shutdown`` was set.

    The worker releases the job (back to ready, no failure counted) instead of failing it;
    after a cancel the release ends it CANCELLED, and past its time limit the worker fails it
    with reason ``timeout`` instead. Raised when nothing asked the handler to stop, it is a
    failure like any other exception (retried with backoff): a release would hand the job
    straight back, in a loop that never ends.
    """


class StopSignal:
    """Tells a running handler to stop, and why (``reason``): ``"cancelled"``, ``"timeout"``
    or ``"shutdown"``. Set once; the first reason stays. Thread-safe."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.reason: str | None = None

    def set(self, reason: str) -> bool:
        """Ask the handler to stop for ``reason``; True when this call set it (first time)."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason = reason
        self._event.set()
        return True

    def is_set(self) -> bool:
        """Whether the handler was asked to stop."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: forever) for a stop; True if asked to."""
        return self._event.wait(timeout)


class TaskJobRefused(NonRetryableError):
    """A job enqueued through ``django.tasks`` reached a worker without the task runner.

    Failing it non-retryably (dead, reason naming ``relay worker --tasks``) rather than
    releasing it: a release would hand it straight back to the same wrong worker, in a loop
    that counts no attempts; a dead task is visible (``FAILED``) and ``relay dead retry``
    replays it once a ``--tasks`` worker serves its queue.
    """


def is_django_task(payload: Any) -> bool:
    """Whether ``payload`` has the shape ``RelayBackend.enqueue`` gives a Django task's job:
    an object with string ``task`` and ``backend`` and a list ``args`` (or, for arguments that
    Relay's JSON cannot hold natively, a string ``call_json``)."""
    return (
        isinstance(payload, dict)
        and isinstance(payload.get("task"), str)
        and isinstance(payload.get("backend"), str)
        and (isinstance(payload.get("args"), list) or isinstance(payload.get("call_json"), str))
    )


def refuse_django_task(payload: Any) -> None:
    """Raise ``TaskJobRefused`` when ``payload`` is a Django task's job (``is_django_task``).

    Raises:
        TaskJobRefused: with the reason ``"Django task <module path> needs the task runner:
            run relay worker --tasks"``.
    """
    if is_django_task(payload):
        raise TaskJobRefused(
            f"Django task {payload['task']} needs the task runner: run relay worker --tasks"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class StoredResult:
    """What a handler returns to have ``value`` stored with its job: the worker sends it with
    the ack (``result``), at most ``RELAY_MAX_RESULT_BYTES`` as compact JSON. A value the
    server refuses (too large, or NaN, ±Infinity, a lone surrogate in it) fails the attempt
    non-retryably instead: another run would return the same kind of value.

    Attributes:
        value: any JSON value (dicts, lists, strings, numbers, booleans, None).
    """

    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class ReportedError:
    """The exception a failed attempt is stored with (the ``fail`` op's ``exception_class``
    and ``traceback``).

    Attributes:
        exception_class: ``module.QualName`` of the exception.
        traceback: its formatted traceback (the worker keeps the end of a long one).
    """

    exception_class: str
    traceback: str


def reported_error(exc: BaseException) -> ReportedError:
    """The class and traceback a failure is reported with: the exception's own, unless it
    carries a ``reported_error`` attribute holding a ``ReportedError`` (the Django task runner
    reports the task's exception, not the ``NonRetryableError`` that wraps it)."""
    own = getattr(exc, "reported_error", None)
    if isinstance(own, ReportedError):
        return own
    return ReportedError(
        exception_class=f"{type(exc).__module__}.{type(exc).__qualname__}",
        traceback="".join(format_exception(exc)),
    )


class DemoFailure(RuntimeError):
    """The failure ``demo_handler`` raises for ``{"fail": true}`` payloads."""


@dataclasses.dataclass(frozen=True, slots=True)
class JobContext:
    """What a handler knows about the job it runs.

    Attributes:
        job_id: the job's id.
        queue: the queue it was leased from.
        attempt: delivery number, from 1; never decreases (a fencing epoch; an OS crash
            may repeat the latest ones: docs/design-decisions.md, decision 3).
        worker_id: the id this worker leases with.
        shutdown: set when the worker is stopping; long handlers should watch it and raise
            ``JobInterrupted`` (or finish quickly).
        lease: the raw lease dict from the server (``docs/protocol.md``, "Lease"); its
            ``time_limit_ms`` is the attempt's time limit (None: none).
        stop: set when this handler should stop now: cancelled, past its time limit, or the
            worker shutting down (``StopSignal.reason`` says which).
        meta: (property) the job's ``meta`` map, ``{}`` when it has none.
    """

    job_id: str
    queue: str
    attempt: int
    worker_id: str
    shutdown: threading.Event
    lease: types.Lease
    stop: StopSignal = dataclasses.field(default_factory=StopSignal)

    @property
    def meta(self) -> dict[str, str]:
        """The job's ``meta`` map as its producer submitted it (``{}`` when none; a copy).

        Carries context across the queue, such as the W3C ``traceparent`` of the producer's
        span: a handler continues the trace from it (docs/protocol.md, "Job metadata").
        """
        return dict(self.lease.get("meta") or {})


Handler = Callable[[Any, JobContext], object]
"""``handler(payload, ctx)``: return to ack, raise to fail (see the module docstring)."""


def demo_handler(payload: Any, ctx: JobContext) -> None:
    """Run the seed's demonstration job; safe to point at any queue.

    * ``{"sleep_ms": N}`` waits N ms, or raises ``JobInterrupted`` as soon as the worker
      starts shutting down, or the job is cancelled or reaches its time limit (``ctx.stop``),
      so a stop never waits on a demo sleep.
    * ``{"fail": true, "error": "demo", "retryable": false}`` raises ``DemoFailure("demo")``,
      or ``NonRetryableError("demo")`` when ``retryable`` is false; ``error`` defaults to
      ``"demo failure"``.
    * A Django task's job (``is_django_task``) is refused: ``TaskJobRefused``.
    * Anything else, including a payload that is not an object, succeeds at once.

    Args:
        payload: the job's payload.
        ctx: the job context; only ``ctx.shutdown`` and ``ctx.stop`` are used.
    Raises:
        JobInterrupted, DemoFailure, NonRetryableError, TaskJobRefused.
    """
    if not isinstance(payload, dict):
        return
    refuse_django_task(payload)
    if payload.get("fail") is True:
        message = str(payload.get("error") or "demo failure")
        if payload.get("retryable", True) is False:
            raise NonRetryableError(message)
        raise DemoFailure(message)
    sleep_ms = payload.get("sleep_ms")
    if not isinstance(sleep_ms, int | float) or isinstance(sleep_ms, bool) or sleep_ms <= 0:
        return
    if ctx.shutdown.is_set() or ctx.stop.wait(sleep_ms / 1000):
        why = ctx.stop.reason or "shutdown"
        raise JobInterrupted(f"stopped ({why}) after less than {sleep_ms} ms of sleep")
