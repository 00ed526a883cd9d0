"""A ``django.tasks`` backend on Relay: ``TASKS = {"default": {"BACKEND": RelayBackend}}``.

Django 6's Tasks framework defines ``@task``, ``.enqueue()`` and ``TaskResult`` but ships no
production backend. ``RelayBackend`` enqueues each task as a Relay job, and ``manage.py
relay_worker --tasks`` runs them (``execute_task``). Two modes:

* **Networked** (``OPTIONS["ADDRESS"]`` set): the backend talks to a Relay service over TCP
  (``RelayClient``; ``AsyncRelayClient`` for ``aget_result``); the producing project may use
  any database of its own, and Relay's tables need not be in it. Enqueue submits with an
  idempotency key the backend picks (a UUID), so it can return the ``TaskResult`` at once,
  before the job exists: the result id is ``"<queue>/<key>"``, and ``get_result`` finds the
  job by queue and key (the ``result`` op). Inside ``transaction.atomic()`` on
  ``OPTIONS["DATABASE"]`` (the caller's database) the submit is sent on commit
  (``transaction.on_commit``), so a rolled-back transaction never enqueues; a submit that
  fails then raises from the commit (the transaction itself is committed).
* **Shared database** (no ``ADDRESS``): the producing project uses Relay's own database
  (``queue_core`` in ``INSTALLED_APPS``, the same SQLite file or PostgreSQL database):
  enqueue goes through ``QueueService``, inside the caller's transaction (see below); result
  ids are Relay job ids (``job_…``).

Results (both modes): the worker sends the task's return value with its ack and each
failure's exception class and traceback with its fail; the service stores them with the job
(``relay_result``, bounded by ``RELAY_MAX_RESULT_BYTES``, deleted with the job) and
``get_result`` reads them back with the job (``QueueService.result``, or the ``result`` op
over TCP): one shape in both modes. The acked result is ``{"return_value": value}``, or
``{"return_json": text}`` for a value Relay's JSON cannot hold faithfully (NaN, ±Infinity,
integers beyond 64 bits), as ``call_json`` does for arguments.

Mapping (see ``docs/django.md``):

* **Payload**: ``{"task": "<module path>", "args": [...], "kwargs": {...}, "backend": alias,
  "priority": int}`` plus ``"run_after_ms"`` when deferred. Arguments and return values follow
  Django's rules: ``normalize_json`` (its ``TypeError``/``ValueError`` at enqueue), then a
  round trip through ``json`` (keys become strings, ``{1: "one"}`` reads back as
  ``{"1": "one"}``). Arguments Relay's native JSON cannot hold faithfully (integers beyond 64
  bits, NaN, ±Infinity, lone surrogates) travel as ``json`` text in ``"call_json"`` instead of
  ``"args"``/``"kwargs"``.
* **Priority** (Django's -100..100, larger runs sooner) onto Relay's classes: -100..-34 LOW,
  -33..33 NORMAL, 34..66 HIGH, 67..100 CRITICAL (``relay_priority``). Within a class Relay is
  FIFO with aging, so the finer Django value only picks the class.
* ``queue_name`` is the Relay queue (it must be a valid Relay queue name, and in ``QUEUES``
  when the backend lists them); ``run_after`` becomes ``run_at_ms``, at most
  ``RELAY_MAX_DELAY_MS`` (30 days) ahead (``InvalidTask`` beyond).
* **Times** are aware (UTC) under ``USE_TZ = True`` and naive local time otherwise, as Django's
  own backends give them.
* **Result ids** are Relay job ids (``job_…``) in the shared-database mode, so ``relay inspect
  <id>`` shows the job; ``"<queue>/<uuid>"`` in the networked mode (the job's queue and
  idempotency key; ``TaskResult`` has no other place for the job id until it exists). Both
  modes' ``get_result`` accept both forms.
* **Status**: pending, ready and retrying are READY; leased is RUNNING; succeeded is
  SUCCESSFUL; dead and cancelled (``relay cancel``) are FAILED. A failed attempt with retries
  left goes back to READY (Django's "ready to be executed again"); ``OPTIONS["MAX_RETRIES"]``
  (default ``RELAY_DEFAULT_MAX_RETRIES``) sets the budget, 0 fails a task on its first
  exception.
* ``worker_ids`` has one entry per delivery, so ``TaskResult.attempts`` and
  ``TaskContext.attempt`` count deliveries, like Relay's ``attempt``.

Transactions (shared-database mode): inside ``transaction.atomic()`` on Relay's database,
``enqueue`` joins the caller's transaction (the driver's write transaction becomes a
savepoint there): the job
becomes visible to workers when that transaction commits, and never exists if it rolls back;
``task_enqueued`` is sent on commit. Set ``"transaction_mode": "IMMEDIATE"`` on that database (check
``relay.W106``) so such a transaction takes SQLite's write lock when it begins rather than
failing with "database is locked" when it first writes; keep these transactions short, since
the server cannot commit while one holds the lock.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from traceback import format_exception
from typing import Any, ParamSpec, Protocol, TypeVar

import orjson
from asgiref.sync import sync_to_async
from django.apps import apps
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import (
    DatabaseError,
    close_old_connections,
    connections,
    transaction,
)
from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus, task_backends
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TASK_MAX_PRIORITY, TASK_MIN_PRIORITY, TaskError
from django.tasks.exceptions import InvalidTask, InvalidTaskBackend, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

from queue_core import types, validation
from queue_core.conf import relay_settings
from queue_core.errors import (
    InvalidArgument,
    JobNotFound,
    LeaseExpired,
    OutcomeUnknown,
    RelayError,
)
from queue_core.protocol.ops import Ops
from queue_core.service import QueueService
from queue_core.storage import driver_for
from queue_core.worker.handlers import (
    JobContext,
    JobInterrupted,
    NonRetryableError,
    ReportedError,
    StoredResult,
)

__all__ = [
    "PRIORITY_CLASSES",
    "STATUS_OF_STATE",
    "RelayBackend",
    "ReturnValueRefused",
    "TaskAttemptFailed",
    "TimeLimitExceeded",
    "check_worker_setup",
    "execute_task",
    "relay_backends",
    "relay_priority",
    "worker_queues",
]

# (lowest Django priority of the class, Relay class), highest first.
PRIORITY_CLASSES: tuple[tuple[int, str], ...] = (
    (67, "critical"),
    (34, "high"),
    (-33, "normal"),
    (-100, "low"),
)

STATUS_OF_STATE: dict[str, TaskResultStatus] = {
    "pending": TaskResultStatus.READY,
    "ready": TaskResultStatus.READY,
    "retrying": TaskResultStatus.READY,
    "leased": TaskResultStatus.RUNNING,
    "succeeded": TaskResultStatus.SUCCESSFUL,
    "dead": TaskResultStatus.FAILED,
    # Django's tasks have no cancelled status: a cancelled task did not succeed.
    "cancelled": TaskResultStatus.FAILED,
}

_OPTIONS = frozenset({"DATABASE", "MAX_RETRIES", "ADDRESS", "API_KEY", "TIMEOUT"})
# The keys of a TASKS entry Django reads (django.tasks.backends.base.BaseTaskBackend).
_PARAMS = frozenset({"BACKEND", "QUEUES", "OPTIONS"})


_P = ParamSpec("_P")
_R = TypeVar("_R")


# A networked call whose connection broke before its reply, or that the server refused for
# now (UNAVAILABLE, BUSY, OUTCOME_UNKNOWN), is sent again after these pauses (s; the last
# repeats) while the backend's TIMEOUT, counted from the first try, lasts.
NETWORK_PAUSES_S = (0.2, 0.5, 1.0, 2.0)


# A try is not worth starting with less time than this left (s).
LAST_TRY_S = 0.1


def _pause(tries: int, remaining_s: float) -> float | None:
    """The pause before try ``tries + 1`` (``NETWORK_PAUSES_S``), shortened to leave
    ``LAST_TRY_S`` for it; None when not even that is left (a review: with 0.24 s left the
    0.5 s pause was refused, and a call failed though the next server was healthy)."""
    if remaining_s < LAST_TRY_S:
        return None
    return min(NETWORK_PAUSES_S[min(tries, len(NETWORK_PAUSES_S) - 1)], remaining_s - LAST_TRY_S)


def _again[T](call: Callable[[float], T], within_s: float) -> T:
    """Run ``call(deadline)`` (a networked submit with its idempotency key, or a read: safe
    to repeat; ``deadline`` the ``time.monotonic()`` instant in s by which every try ends),
    again after each pause of ``NETWORK_PAUSES_S`` while it fails for a reason that can pass
    and ``within_s`` seconds from the first try leave room: every try ends by the first
    try's start plus ``within_s`` (the backend's TIMEOUT), connecting included. A review
    found three TIMEOUTs when each repeat had the client's whole timeout; with that fixed,
    a try begun late in the first TIMEOUT still had all of one, so a call could take two.

    Without it a reply lost to a blip raised from ``enqueue`` with the job committed, and
    the caller, who never learns the key the backend drew, made a second job by trying again;
    and a ``--tasks`` worker recorded a blip while loading the task's call as the task's own
    failure, its body never run (a hostile review).

    Raises:
        What the last try raised; a refusal that cannot pass (``retryable`` False) at once.
        But when an earlier try's reply was lost (its outcome unknown) and the last one's
        outcome is known (``RelayUnreachable``: nothing sent; a refusal), a
        ``RelayConnectionError`` saying so: the first try's submit may have been kept, and
        ``RelayUnreachable`` ("nothing was sent") had callers enqueue the task again (a
        review: 17 of 128 enqueues that raised in a server's outage had their job).
    """
    deadline = time.monotonic() + within_s
    lost: BaseException | None = None  # a try whose reply was lost: it may have been kept
    for tries in itertools.count():
        try:
            return call(deadline)
        except (ConnectionError, RelayError) as exc:
            pause = _pause(tries, deadline - time.monotonic())
            if (isinstance(exc, RelayError) and not exc.retryable) or pause is None:
                if lost is None or _outcome_unknown(exc):
                    raise
                raise _maybe_kept(exc, lost) from exc
            if _outcome_unknown(exc):
                lost = exc
            time.sleep(pause)  # a backoff before the next try, not a synchronisation
    raise AssertionError("unreachable")  # itertools.count() never ends


def _outcome_unknown(exc: BaseException) -> bool:
    """Whether the request that raised ``exc`` may have been applied: a connection lost after
    sending (not ``RelayUnreachable``), or ``OUTCOME_UNKNOWN``."""
    from queue_core.client import RelayConnectionError, RelayUnreachable

    if isinstance(exc, RelayConnectionError):
        return not isinstance(exc, RelayUnreachable)
    return isinstance(exc, OutcomeUnknown)


def _maybe_kept(last: BaseException, lost: BaseException) -> Exception:
    """The error of a call whose last try ended with ``last`` (nothing applied) after an
    earlier one lost its reply (``lost``): outcome unknown."""
    from queue_core.client import RelayConnectionError

    return RelayConnectionError(
        f"{last}; an earlier try's reply was lost, so it may have been applied ({lost})",
        address=str(getattr(last, "address", None) or getattr(lost, "address", "")),
    )


async def _again_async[T](call: Callable[[], Awaitable[T]], within_s: float, address: str) -> T:
    """``_again`` for an ``AsyncRelayClient`` call: the same repeats, all of them (connecting
    included) ended by ``asyncio.timeout`` at the first try's start plus ``within_s``.

    Raises:
        What the last try raised; ``RelayConnectionError`` when ``within_s`` ran out.
    """
    from queue_core.client import RelayConnectionError

    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    try:
        async with asyncio.timeout_at(deadline):
            for tries in itertools.count():
                try:
                    return await call()
                except (ConnectionError, RelayError) as exc:
                    pause = _pause(tries, deadline - loop.time())
                    if (isinstance(exc, RelayError) and not exc.retryable) or pause is None:
                        raise
                    await asyncio.sleep(pause)  # a backoff, not a synchronisation
    except TimeoutError:
        raise RelayConnectionError(f"no reply within {within_s:g} s", address=address) from None
    raise AssertionError("unreachable")  # itertools.count() never ends


class TaskAttemptFailed(Exception):
    """An attempt failed but the worker left no traceback (the error text is all there is)."""


# Attempts that lost their lease, each read as a LeaseExpired TaskError: the body may have run
# on. A recovered one's server restarted while it ran and released the lease (SQLite; a
# Django review found such deliveries counted with no error).
_LOST_LEASES = {
    "lease_expired": "lease expired: the worker neither finished nor renewed in time (it "
    "crashed, hung or lost its connection)",
    "recovered": "recovered: the server restarted while the attempt ran and released its lease",
}


class TimeLimitExceeded(Exception):
    """An attempt ran past its time limit (``RELAY_QUEUE_TIME_LIMITS``; the attempt's outcome
    ``timeout``): the server failed it at a renew. A task body cannot see the worker's stop
    signal, so it ran on; what it returned then was discarded."""


class ReturnValueRefused(NonRetryableError):
    """The task ran but its return value cannot be stored (Django's ``normalize_json``
    refused it): the task is FAILED at once, since another run would return the same kind of
    value. The recorded error keeps the ``TypeError``/``ValueError`` and its traceback."""


def relay_priority(priority: int) -> str:
    """Map a Django task priority (-100..100) to a Relay priority class name.

    -100..-34 -> ``"low"``, -33..33 -> ``"normal"``, 34..66 -> ``"high"``, 67..100 ->
    ``"critical"``.
    """
    for lowest, name in PRIORITY_CLASSES:
        if priority >= lowest:
            return name
    return "low"


def _instant(at_ms: int | None) -> dt.datetime | None:
    """Epoch ms as Django gives times: aware UTC under ``USE_TZ``, else naive local time."""
    if at_ms is None:
        return None
    if settings.USE_TZ:
        return dt.datetime.fromtimestamp(at_ms / 1000, tz=dt.UTC)
    return dt.datetime.fromtimestamp(at_ms / 1000)


# The latest ``run_after_ms`` taken (9999-01-01T00:00Z): a year short of what a datetime holds,
# so that local time east of UTC (``USE_TZ = False``) holds it too (a review: year 10000).
_MAX_INSTANT_MS = 253_370_764_800_000


def _task_call(payload: Any) -> tuple[list[Any], dict[str, Any]] | None:
    """The ``(args, kwargs)`` of a payload that has the shape ``enqueue`` gives a task's job
    (module docstring), else None. The shape:
    a ``task`` path, a call (``args``/``kwargs``, or ``call_json`` text holding them), and
    when present an integer ``priority`` in Django's range, an epoch-ms ``run_after_ms`` and
    a ``backend`` alias. Any job can be submitted with any payload: one that only looks like
    a task (a hostile review: ``call_json`` of ``"[1]"``, ``"run_after_ms": "soon"``) made
    ``get_result`` raise ``KeyError``, ``TypeError`` or ``ValueError`` and the worker retry
    it."""
    if not isinstance(payload, dict) or not isinstance(payload.get("task"), str):
        return None
    # A module path and a name: not relative (``".tasks.add"``), and no dunder part, so a
    # job cannot name a package's ``__main__`` (which may run its command line on import).
    parts = payload["task"].split(".")
    if len(parts) < 2 or not all(p.isidentifier() and not p.startswith("__") for p in parts):
        return None
    priority = payload.get("priority", 0)
    if type(priority) is not int or not TASK_MIN_PRIORITY <= priority <= TASK_MAX_PRIORITY:
        return None
    at_ms = payload.get("run_after_ms")
    if at_ms is not None and (type(at_ms) is not int or not 0 <= at_ms <= _MAX_INSTANT_MS):
        return None
    if not isinstance(payload.get("backend", ""), str):
        return None
    return _call_of(payload)


def _call_of(payload: dict[str, Any]) -> tuple[list[Any], dict[str, Any]] | None:
    """The ``(args, kwargs)`` a task payload carries (see ``_call_payload``), or None when
    they are not a list and an object of named arguments."""
    call: Any = payload
    if "call_json" in payload:
        try:
            call = json.loads(payload["call_json"])
        except (TypeError, ValueError, RecursionError):
            return None
        if not isinstance(call, dict) or "args" not in call or "kwargs" not in call:
            return None
    args, kwargs = call.get("args", []), call.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        return None
    if not all(isinstance(name, str) for name in kwargs):
        return None
    return args, kwargs


def _json_round_trip(value: Any) -> Any:
    """``value`` as Django's task serialisation stores it: ``normalize_json``, then through
    ``json`` (dict keys become strings; NaN, ±Infinity and integers of any size survive).

    Raises:
        TypeError, ValueError: ``normalize_json`` refused it (Django's errors).
    """
    return json.loads(json.dumps(normalize_json(value)))


def _call_payload(args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The payload fields for a call: native ``args``/``kwargs`` when Relay's JSON (orjson)
    holds them faithfully, else ``call_json``, their ``json`` text (ASCII).

    Raises:
        InvalidArgument: ``call_json`` arguments nested deeper than native ones may be (the
            call's object counts as the payload's level, as the service counts a payload's).
    """
    call = {"args": args, "kwargs": kwargs}
    try:
        orjson.dumps(call)  # raises on an integer beyond 64 bits or a lone surrogate
    except TypeError:
        pass
    else:
        if validation.unfaithful(call, encoded=True) is None:  # NaN, ±Infinity
            return call
    text = json.dumps(call)
    if validation.nests_deeper(text.encode("ascii"), validation.MAX_PAYLOAD_DEPTH):
        raise InvalidArgument(
            f"payload: is nested deeper than {validation.MAX_PAYLOAD_DEPTH} levels",
            field="payload",
        )
    return {"call_json": text}


def _task_error(exc: BaseException) -> TaskError:
    return TaskError(
        exception_class_path=f"{type(exc).__module__}.{type(exc).__qualname__}",
        traceback=_utf8("".join(format_exception(exc))),
    )


def _reporting(exc: BaseException, error: TaskError) -> BaseException:
    """``exc`` marked to be reported with ``error``'s class and traceback (the worker sends
    them with its fail: ``handlers.reported_error``)."""
    exc.reported_error = ReportedError(  # type: ignore[attr-defined]
        exception_class=error.exception_class_path, traceback=error.traceback
    )
    return exc


def _acked_result(value: Any) -> dict[str, Any]:
    """The result the worker acks a task's (round-tripped) return value with:
    ``{"return_value": value}`` when Relay's JSON holds it faithfully, else
    ``{"return_json": json text}``."""
    wrapped = {"return_value": value}
    try:
        orjson.dumps(wrapped)  # raises on an integer beyond 64 bits or a lone surrogate
    except TypeError:
        pass
    else:
        if validation.unfaithful(wrapped, encoded=True) is None:  # NaN, ±Infinity
            return wrapped
    return {"return_json": json.dumps(value)}


def _return_value_of(stored: Any) -> tuple[bool, Any]:
    """``(found, value)`` from an acked result (``_acked_result``'s shapes)."""
    if isinstance(stored, dict):
        if "return_value" in stored:
            return True, stored["return_value"]
        if isinstance(stored.get("return_json"), str):
            return True, json.loads(stored["return_json"])
    return False, None


def _split_result_id(result_id: str) -> tuple[str, str] | None:
    """``(queue, key)`` of a networked result id ``"<queue>/<key>"``; None for a job id."""
    if not isinstance(result_id, str) or "/" not in result_id:
        return None
    queue, _, key = result_id.rpartition("/")
    return (queue, key) if queue and key else None


class RelayBackend(BaseTaskBackend):
    """Run Django tasks on Relay.

    Settings::

        TASKS = {
            "default": {
                "BACKEND": "queue_core.tasks_backend.RelayBackend",
                "QUEUES": ["default", "emails"],  # optional; empty list: any valid name
                "OPTIONS": {
                    "ADDRESS": "relay-1:7400,relay-2:7400",  # networked mode; omit: shared DB
                    "API_KEY": "rk_...",  # networked mode, when the server has keys
                    "TIMEOUT": 10,  # networked mode: seconds a call may take
                    "DATABASE": "default",
                    "MAX_RETRIES": 3,
                },
            }
        }

    OPTIONS:
        ADDRESS: the Relay server(s), ``HOST:PORT`` or several comma-separated (as
            ``RELAY_ADDRESS``; the client fails over between servers of one PostgreSQL
            database). Given, the backend is networked (see the module docstring).
        API_KEY: the key (``rk_...``) the networked backend sends; it needs the ``producer``
            scope (``submit``, ``result``). Default none.
        TIMEOUT: how long a networked call may take, its repeats and connecting included, in
            seconds (default 10).
        DATABASE: networked: the alias of the caller's database whose transactions an
            enqueue follows (``on_commit``); shared: the alias of Relay's database. Default
            ``"default"``.
        MAX_RETRIES: failures retried before a task is FAILED (0..``RELAY_MAX_RETRIES``;
            default ``RELAY_DEFAULT_MAX_RETRIES``, 3).
    """

    supports_defer = True  # run_after -> run_at_ms
    supports_async_task = True  # the worker runs coroutines with async_to_sync
    supports_get_result = True  # from the service (networked) or Relay's database (shared)
    supports_priority = True  # onto Relay's four classes, see relay_priority

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # Shapes Django takes as they come: refused by check() (relay.E103, relay.E105),
        # rather than an AttributeError out of `manage.py check`, or a string of QUEUES
        # read as a set of one-letter queue names (a review).
        self._malformed: list[tuple[str, str]] = []  # (check id, problem)
        if not isinstance(self.options, Mapping):
            kind = type(self.options).__name__
            self._malformed.append(("relay.E103", f"OPTIONS must be a dict, got {kind}"))
            self.options = {}
        unknown = sorted(str(key) for key in set(params) - _PARAMS)
        if unknown:  # e.g. "OPTION": its ADDRESS unread, tasks went to the shared mode
            known = sorted(_PARAMS)
            self._malformed.append(("relay.E108", f"unknown keys {unknown}; known: {known}"))
        queues = params.get("QUEUES")
        if isinstance(queues, str | bytes):
            problem = f"QUEUES must be a list of queue names, got {queues!r}"
            self._malformed.append(("relay.E105", problem))
        self.database: str = self.options.get("DATABASE", "default")
        self.max_retries: int | None = self.options.get("MAX_RETRIES")
        self.address: str | None = self.options.get("ADDRESS") or None
        if "ADDRESS" in self.options and self.address is None:
            # os.environ.get("RELAY_ADDRESS", ""): the shared mode's enqueue wrote the job
            # into this project's database, which no server served (a Django review).
            problem = (
                f"OPTIONS['ADDRESS'] is {self.options['ADDRESS']!r}: give the service's "
                "host:port, or leave ADDRESS out for the shared-database mode"
            )
            self._malformed.append(("relay.E106", problem))
        self.api_key: str | None = self.options.get("API_KEY") or None
        self.timeout_s: Any = self.options.get("TIMEOUT", 10)
        self._service: QueueService | None = None
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._async_first = 0  # the server of ADDRESS aget_result's next client starts at
        self._checked = False  # _usable found no error

    @property
    def networked(self) -> bool:
        """Whether this backend talks to a Relay service over TCP (``OPTIONS["ADDRESS"]``)."""
        return self.address is not None

    @property
    def client(self) -> Any:
        """The networked backend's ``RelayClient`` (created on first use; thread-safe, one
        request at a time)."""
        with self._client_lock:
            if self._client is None:
                from queue_core.client import RelayClient

                self._client = RelayClient(
                    str(self.address),
                    timeout_s=float(self.timeout_s),
                    connect_timeout_s=self._connect_timeout_s(),
                    max_frame_bytes=relay_settings().max_frame_bytes,
                    api_key=self.api_key,
                )
            return self._client

    def _connect_timeout_s(self) -> float:
        """Each TCP connection attempt's share of ``TIMEOUT``: at most 5 s, and little enough
        that every server of ``ADDRESS`` can be tried with time left for the reply (a review:
        with the first of two servers not accepting, each ``aget_result``, on a new client
        that starts at the first, spent its whole TIMEOUT connecting there)."""
        from queue_core.client import parse_addresses

        servers = len(parse_addresses(str(self.address)))
        return min(5.0, float(self.timeout_s) / (servers + 1))

    @property
    def service(self) -> QueueService:
        """The ``QueueService`` on ``OPTIONS["DATABASE"]`` (created on first use)."""
        if self._service is None:
            self._service = QueueService(driver=driver_for(self.database))
        return self._service

    # -- configuration --------------------------------------------------------------------

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """System checks ``relay.E101``...: apps installed, database alias and its
        transaction mode (``relay.W106``), options and the keys around them, queue names, and
        ``queue_admin`` beside a networked backend (``relay.W109``)."""
        messages: list[checks.CheckMessage] = [
            checks.Error(f"TASKS[{self.alias!r}]: {problem}", id=check_id)
            for check_id, problem in self._malformed
        ]
        needed = () if self.networked else ("queue_core",)
        for app in needed:
            if not apps.is_installed(app):
                messages.append(
                    checks.Error(
                        f"TASKS[{self.alias!r}] uses RelayBackend, which needs {app!r} in "
                        "INSTALLED_APPS",
                        id="relay.E101",
                    )
                )
        if self.database not in settings.DATABASES:
            messages.append(
                checks.Error(
                    f"TASKS[{self.alias!r}]['OPTIONS']['DATABASE'] is {self.database!r}, which "
                    "is not in DATABASES",
                    id="relay.E102",
                )
            )
        else:
            database: dict[str, Any] = settings.DATABASES[self.database]
            mode = database.get("OPTIONS", {}).get("transaction_mode")
            sqlite = database.get("ENGINE") == "django.db.backends.sqlite3"
            shared = not self.networked  # only then does Relay write the caller's database
            if shared and self.database != relay_settings().database:
                messages.append(
                    checks.Error(
                        f"TASKS[{self.alias!r}]['OPTIONS']['DATABASE'] is {self.database!r} but "
                        f"RELAY_DATABASE is {relay_settings().database!r}: tasks would be written "
                        "where no relay server or worker looks",
                        hint="Give both the alias that holds Relay's tables (docs/django.md).",
                        id="relay.E107",
                    )
                )
            if shared and sqlite and str(mode).upper() != "IMMEDIATE":  # SQLite-only option
                messages.append(
                    checks.Warning(
                        f"DATABASES[{self.database!r}] has no 'transaction_mode': 'IMMEDIATE' "
                        "option, so a task enqueued inside transaction.atomic() after a read may "
                        "fail with 'database is locked' while another process writes",
                        hint="Add 'transaction_mode': 'IMMEDIATE' to its OPTIONS (docs/django.md).",
                        id="relay.W106",
                    )
                )
        unknown = sorted(set(self.options) - _OPTIONS)
        if unknown:
            messages.append(
                checks.Error(
                    f"TASKS[{self.alias!r}]['OPTIONS'] has unknown keys {unknown}; known: "
                    f"{sorted(_OPTIONS)}",
                    id="relay.E103",
                )
            )
        if self.networked:
            messages.extend(self._check_network_options())
            if apps.is_installed("queue_admin"):
                messages.append(
                    checks.Warning(
                        f"TASKS[{self.alias!r}] sends tasks to the Relay service at "
                        f"{self.address}, but queue_admin shows the jobs in this project's "
                        f"database ({relay_settings().database!r}), not the service's",
                        hint="See the service's jobs in its own console (its /admin/), or use "
                        "the shared-database mode (docs/django.md).",
                        id="relay.W109",
                    )
                )
        if self.max_retries is not None:
            try:
                validation.integer(
                    "MAX_RETRIES", self.max_retries, lo=0, hi=relay_settings().max_retries
                )
            except InvalidArgument as exc:
                messages.append(
                    checks.Error(f"TASKS[{self.alias!r}]: {exc.message}", id="relay.E104")
                )
        for queue in sorted(self.queues):
            try:
                validation.queue_name(queue, relay_settings())
            except InvalidArgument as exc:
                messages.append(
                    checks.Error(
                        f"TASKS[{self.alias!r}]['QUEUES'] has {queue!r}: {exc.message}",
                        id="relay.E105",
                    )
                )
        return messages

    def _usable(self) -> None:
        """Refuse a use of this backend while ``check()`` finds an error in it (``relay.E101``
        ...), once per instance. Django 6.0 runs the tasks checks only once ``django.tasks``
        is imported, which a project without ``queue_core`` may not do before ``manage.py
        check`` (a docs audit: a networked producer with ``ADDRESS "nohost"`` and ``TIMEOUT
        0`` passed it, and its enqueue went on with them).

        Raises:
            InvalidTaskBackend: naming each error.
        """
        if self._checked:
            return
        found = [message for message in self.check() if message.is_serious()]
        if found:
            raise InvalidTaskBackend("; ".join(f"{m.id}: {m.msg}" for m in found))
        self._checked = True

    def _check_network_options(self) -> list[checks.CheckMessage]:
        """``relay.E106``: ADDRESS, API_KEY and TIMEOUT of the networked mode."""
        from queue_core.client import parse_addresses

        problems: list[str] = []
        try:
            parse_addresses(str(self.address))
        except ValueError as exc:
            problems.append(f"ADDRESS {self.address!r}: {exc}")
        if self.api_key is not None and not isinstance(self.api_key, str):
            problems.append("API_KEY must be a string")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            problems.append(f"TIMEOUT must be a number of seconds > 0, got {timeout!r}")
        return [
            checks.Error(f"TASKS[{self.alias!r}]['OPTIONS']: {problem}", id="relay.E106")
            for problem in problems
        ]

    def validate_task(self, task: Task[..., Any]) -> None:
        """Django's checks, plus: ``queue_name`` must be a valid Relay queue name, and
        ``run_after`` not before 1970 and at most ``RELAY_MAX_DELAY_MS`` (30 days) from now.

        Raises:
            InvalidTask.
        """
        super().validate_task(task)
        s = relay_settings()
        try:
            validation.queue_name(task.queue_name, s)
        except InvalidArgument as exc:
            raise InvalidTask(
                f"queue_name {task.queue_name!r} is not a Relay queue name: {exc.message}"
            ) from exc
        if task.run_after is not None:
            at_ms = _epoch_ms(task.run_after)
            if at_ms < 0:  # Relay's instants are epoch ms: a job due before 1970 is none
                raise InvalidTask(f"run_after {task.run_after.isoformat()} is before 1970")
            delay_ms = at_ms - time.time_ns() // 1_000_000
            if delay_ms > s.max_delay_ms:
                raise InvalidTask(
                    f"run_after is {delay_ms} ms ahead; Relay defers a task at most "
                    f"RELAY_MAX_DELAY_MS ({s.max_delay_ms} ms)"
                )

    # -- enqueue --------------------------------------------------------------------------

    def enqueue(self, task: Task[_P, _R], args: Any, kwargs: Any) -> TaskResult[_P, _R]:
        """Submit ``task(*args, **kwargs)`` as a Relay job (∅ -> ready, or pending if deferred).

        Shared-database mode: inside ``transaction.atomic()`` on Relay's database the job is
        written in the caller's transaction: workers see it once that commits, and never if it
        rolls back. Networked mode: see ``_enqueue_over_network``.

        Raises:
            InvalidTask: the task does not fit this backend.
            TypeError, ValueError: ``normalize_json`` refused an argument (Django's errors).
            RelayError: Relay refused the job (``FrameTooLarge`` for a payload over
                ``RELAY_MAX_PAYLOAD_BYTES``; ``StoreBusy``).
            InvalidTaskBackend: the backend fails its checks (``_usable``).
        """
        self._usable()
        self.validate_task(task)
        args, kwargs = _json_round_trip(list(args)), _json_round_trip(dict(kwargs))
        # Django admits any whole number (5.0, True: BaseTaskBackend.validate_task); the
        # payload holds an int, the only priority the worker reads as a task's (a review:
        # 5.0 was dead-lettered as "not a Django task" and its result read as missing).
        priority = int(task.priority)
        payload: dict[str, Any] = {
            "task": task.module_path,
            **_call_payload(args, kwargs),
            "backend": self.alias,
            "priority": priority,
        }
        options: dict[str, Any] = {
            "priority": relay_priority(priority),
            "max_retries": self.max_retries,
        }
        if task.run_after is not None:
            run_at_ms = _epoch_ms(task.run_after)
            payload["run_after_ms"] = options["run_at_ms"] = run_at_ms
        if self.networked:
            return self._enqueue_over_network(task, args, kwargs, payload, options)
        job = self.service.submit(task.queue_name, payload, **options)["job"]
        result = self._new_result(
            task, job["id"], args, kwargs, enqueued_at=_instant(job["created_at_ms"])
        )
        if connections[self.database].in_atomic_block:
            # The job exists once (and if) the caller's transaction commits.
            transaction.on_commit(
                lambda: task_enqueued.send(type(self), task_result=result), using=self.database
            )
        else:
            task_enqueued.send(type(self), task_result=result)
        return result

    def _enqueue_over_network(
        self,
        task: Task[_P, _R],
        args: list[Any],
        kwargs: dict[str, Any],
        payload: dict[str, Any],
        options: dict[str, Any],
    ) -> TaskResult[_P, _R]:
        """Submit over TCP with a fresh UUID idempotency key; the result id is
        ``"<queue>/<key>"``. Inside ``transaction.atomic()`` on ``OPTIONS["DATABASE"]`` the
        submit is sent when that transaction commits (``on_commit``), never if it rolls back;
        the payload is checked against ``RELAY_MAX_PAYLOAD_BYTES`` here, so an oversized one
        fails inside the transaction. A submit repeated after a lost reply is safe (same key,
        same payload: the same job), so the backend repeats it itself after a broken
        connection or a refusal that can pass (``_again``). The ``enqueued_at`` of the
        returned result is filled in when the submit is answered.

        Raises:
            FrameTooLarge: the payload is over ``RELAY_MAX_PAYLOAD_BYTES``.
            RelayError, ConnectionError: the server refused or could not be reached (outside a
                transaction here; inside one, from the commit).
        """
        validation.payload(payload, relay_settings())
        key = str(uuid.uuid4())
        options = {k: v for k, v in options.items() if v is not None}
        result = self._new_result(task, f"{task.queue_name}/{key}", args, kwargs, enqueued_at=None)

        def submit() -> None:
            submitting = Ops.submit(task.queue_name, payload, idempotency_key=key, **options)
            reply = _again(
                lambda deadline: self.client.send(submitting, deadline=deadline),
                float(self.timeout_s),
            )
            # Submitted: a reply without the job's time (a faulty server) must not raise, as
            # a KeyError did, and have the caller enqueue the task twice (a review).
            job = reply.get("job")
            created = job.get("created_at_ms") if isinstance(job, dict) else None
            enqueued = _instant(created) if type(created) is int else timezone.now()
            object.__setattr__(result, "enqueued_at", enqueued)
            task_enqueued.send(type(self), task_result=result)

        def submit_naming_the_result() -> None:
            try:
                submit()
            except (ConnectionError, RelayError) as exc:
                # Whether it was enqueued after all (a reply lost, say): get_result(this id)
                # tells, so the caller can enqueue again without a second job (a review: a
                # retry drew a new key and made one).
                exc.task_result_id = result.id  # type: ignore[union-attr]
                exc.add_note(f"task result id: {result.id} (get_result tells if it was enqueued)")
                raise

        if connections[self.database].in_atomic_block:
            transaction.on_commit(submit_naming_the_result, using=self.database)
        else:
            submit_naming_the_result()
        return result

    def _new_result(
        self,
        task: Task[_P, _R],
        result_id: str,
        args: list[Any],
        kwargs: dict[str, Any],
        *,
        enqueued_at: dt.datetime | None,
    ) -> TaskResult[_P, _R]:
        return TaskResult(
            task=task,
            id=result_id,
            status=TaskResultStatus.READY,
            enqueued_at=enqueued_at,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )

    # -- results --------------------------------------------------------------------------

    def get_result(self, result_id: str) -> TaskResult[..., Any]:
        """Read a task's result: the job's state and history, and the return value and
        errors the worker sent (``QueueService.result``, or the ``result`` op when networked).

        Args:
            result_id: a job id (``job_…``), or a networked result id ``"<queue>/<key>"``.
        Raises:
            TaskResultDoesNotExist: no job has this id (never enqueued, rolled back, not yet
                committed, purged), or the job is not a Django task (its payload is not
                shaped as ``enqueue`` shapes one: ``_task_call``).
            ImportError: the task's module path cannot be imported here.
            InvalidTask: the task cannot run as the job says under this process's settings
                (its queue is not in the backend's ``QUEUES``, say).
            RelayError, ConnectionError: networked: the server refused or is unreachable.
            InvalidTaskBackend: the backend fails its checks (``_usable``).
        """
        self._usable()
        return self._from_result(result_id, self._read_result(result_id))

    def _read_result(self, result_id: str) -> dict[str, Any]:
        """The ``result`` op's answer for ``result_id`` (``get_result``'s errors)."""
        by = self._lookup(result_id)
        try:
            if self.networked:
                reading = Ops.result(**by)
                return dict(
                    _again(
                        lambda deadline: self.client.send(reading, deadline=deadline),
                        float(self.timeout_s),
                    )
                )
            return self._with_legacy_row(self.service.result(**by))
        except (JobNotFound, InvalidArgument):
            raise TaskResultDoesNotExist(result_id) from None

    @staticmethod
    def _enqueued_id(job: dict[str, Any]) -> str:
        """The id ``enqueue`` returned for ``job``: ``"<queue>/<key>"`` when it has an
        idempotency key (only a networked enqueue gives a task's job one), else its job id."""
        key = job.get("idempotency_key")
        if isinstance(key, str):
            result_id = f"{job['queue']}/{key}"
            if _split_result_id(result_id) == (job["queue"], key):
                return result_id
        return str(job["id"])

    def _with_legacy_row(self, found: dict[str, Any]) -> dict[str, Any]:
        """Shared-database mode: for a job finished before results moved to ``relay_result``
        (migration ``0013_task_results``), the row the worker wrote to ``relay_tasks``' table,
        in the same shape, while that app is installed."""
        if (
            found["return_value"] is not None
            or found["errors"]
            or not (apps.is_installed("relay_tasks"))
        ):
            return found
        from relay_tasks.models import TaskResultRecord

        row = TaskResultRecord.objects.using(self.database).filter(pk=found["job"]["id"]).first()
        if row is None:
            return found
        errors = [
            {
                "attempt": e["attempt"],
                "exception_class": e["exception_class_path"],
                "traceback": e["traceback"],
            }
            for e in orjson.loads(row.errors)
        ]
        value = None if row.return_value is None else {"return_json": row.return_value}
        return {**found, "return_value": value, "errors": errors}

    async def aenqueue(self, task: Task[_P, _R], args: Any, kwargs: Any) -> TaskResult[_P, _R]:
        """``enqueue`` from a coroutine. Networked: on a thread of the default executor
        (``sync_to_async(thread_sensitive=False)``), so that calls from many coroutines run
        at once, as many as its threads, each within ``TIMEOUT``; Django's default runs them
        on one thread outside a request's context, one after another (8 calls to a service
        that was down ended 0.9, 1.8 ... 7.3 s in with a TIMEOUT of 1 s: a review). A
        coroutine is never inside a synchronous ``atomic()``, so the submit goes at once, as
        ``enqueue``'s does outside one. Shared-database: Django's default."""
        if not self.networked:
            return await super().aenqueue(task, args, kwargs)
        return await sync_to_async(self.enqueue, thread_sensitive=False)(task, args, kwargs)

    async def aget_result(self, result_id: str) -> TaskResult[..., Any]:
        """``get_result`` without blocking the event loop; networked, over an
        ``AsyncRelayClient`` (one connection per call), repeated as ``get_result`` is and
        ended within ``TIMEOUT``."""
        self._usable()
        if not self.networked:
            return await super().aget_result(result_id)
        from queue_core.aclient import AsyncRelayClient
        from queue_core.client import format_addresses, parse_addresses

        by = self._lookup(result_id)
        servers = parse_addresses(str(self.address))
        start = self._async_first % len(servers)
        client = AsyncRelayClient(
            format_addresses(servers[start:] + servers[:start]),
            timeout_s=float(self.timeout_s),
            connect_timeout_s=self._connect_timeout_s(),
            max_frame_bytes=relay_settings().max_frame_bytes,
            api_key=self.api_key,
            connect_retries=0,  # _again_async repeats, within TIMEOUT
        )
        # Each call has a client of its own: the next starts at the server that answered
        # this one, or after the one this one failed on, so a server that accepts and never
        # answers costs one call, as the blocking client's persistent connection does
        # (reviews: every aget_result went back to it, or paid its hello timeout again).
        answered = start + 1
        try:
            found: dict[str, Any] = dict(
                await _again_async(
                    lambda: client.result(**by), float(self.timeout_s), client.address
                )
            )
            answered = start + client.server_index
        except RelayError as exc:  # an answer too
            answered = start + client.server_index
            if isinstance(exc, JobNotFound | InvalidArgument):
                raise TaskResultDoesNotExist(result_id) from None
            raise
        finally:
            self._async_first = answered
            await client.close()
        return self._from_result(result_id, found)

    @staticmethod
    def _lookup(result_id: str) -> dict[str, Any]:
        """The ``result`` op's arguments naming the job of ``result_id``."""
        split = _split_result_id(result_id)
        if split is None:
            return {"job_id": result_id}
        return {"queue": split[0], "idempotency_key": split[1]}

    def _from_result(self, result_id: str, found: dict[str, Any]) -> TaskResult[..., Any]:
        """The ``TaskResult`` of a ``result`` answer.

        Raises:
            TaskResultDoesNotExist: the job is not a task.
            RelayConnectionError: networked, the answer lacks what a result needs (a faulty
                server: a raw ``KeyError`` came out of ``get_result``, a review).
        """
        try:
            job = found["job"]
            call = _task_call(job["payload"])
            if call is None:
                raise TaskResultDoesNotExist(result_id)
            return self._build_result(result_id, job, found, call)
        except (KeyError, TypeError, ValueError) as exc:
            if not self.networked:
                raise
            from queue_core.client import RelayConnectionError

            raise RelayConnectionError(
                f"malformed result reply from the server: {exc!r}", address=str(self.address)
            ) from exc

    def _task_of(self, payload: dict[str, Any], job: dict[str, Any]) -> Task[..., Any]:
        try:
            task = import_string(payload["task"])
        except ImportError:
            raise
        except (Exception, SystemExit) as exc:  # its import failed (ImproperlyConfigured, say)
            raise ImportError(f"cannot import {payload['task']}: {exc!r}") from exc
        if not isinstance(task, Task):
            raise TaskResultDoesNotExist(f"{payload['task']} is not a task")
        alias = self._enqueuing_alias(payload)
        run_after = _instant(payload.get("run_after_ms"))
        changes: dict[str, Any] = {"queue_name": job["queue"], "backend": alias}
        if isinstance(payload.get("priority"), int):
            changes["priority"] = payload["priority"]
        if run_after is not None:
            changes["run_after"] = run_after
        return task.using(**changes)

    def _enqueuing_alias(self, payload: dict[str, Any]) -> str:
        """The alias the task was enqueued through, or this one when that is not configured
        here."""
        alias = payload.get("backend")
        configured = getattr(settings, "TASKS", {})
        return alias if isinstance(alias, str) and alias in configured else self.alias

    def _build_result(
        self,
        result_id: str,
        job: dict[str, Any],
        found: dict[str, Any],
        call: tuple[list[Any], dict[str, Any]],
    ) -> TaskResult[..., Any]:
        payload = job["payload"]
        status = STATUS_OF_STATE[job["state"]]
        history: list[dict[str, Any]] = job.get("history", [])
        recorded = {e["attempt"]: e for e in found.get("errors") or []}
        task_errors: list[TaskError] = []
        for attempt in history:
            if attempt["outcome"] not in ("failed", "timeout", *_LOST_LEASES):
                continue
            entry = recorded.get(attempt["attempt"])
            if entry is not None:
                error = TaskError(
                    exception_class_path=entry["exception_class"],
                    traceback=entry["traceback"],
                )
            elif attempt["outcome"] in _LOST_LEASES:
                error = TaskError(
                    exception_class_path=f"{LeaseExpired.__module__}.{LeaseExpired.__qualname__}",
                    traceback=_LOST_LEASES[attempt["outcome"]],
                )
            elif attempt["outcome"] == "timeout":
                error = TaskError(
                    exception_class_path=f"{__name__}.{TimeLimitExceeded.__qualname__}",
                    traceback="timeout: the attempt ran past its queue's time limit",
                )
            else:
                error = TaskError(
                    exception_class_path=f"{__name__}.{TaskAttemptFailed.__qualname__}",
                    traceback=attempt["error"] or "",
                )
            task_errors.append(error)
        finished = status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)
        args, kwargs = call
        result = TaskResult(
            task=self._task_of(payload, job),
            id=result_id,
            status=status,
            enqueued_at=_instant(job["created_at_ms"]),
            started_at=_instant(history[0]["started_at_ms"]) if history else None,
            finished_at=_instant(job["finished_at_ms"]) if finished else None,
            last_attempted_at=_instant(history[-1]["started_at_ms"]) if history else None,
            args=args,
            kwargs=kwargs,
            backend=self._enqueuing_alias(payload),
            errors=task_errors,
            worker_ids=[attempt["worker_id"] for attempt in history],
        )
        has_value, value = _return_value_of(found.get("return_value"))
        if status == TaskResultStatus.SUCCESSFUL and has_value:
            object.__setattr__(result, "_return_value", value)
        return result

    # -- running (the relay_worker --tasks side) -----------------------------------------

    def run(self, ctx: JobContext) -> StoredResult:
        """Run the task of leased job ``ctx.job_id``.

        Called by ``execute_task`` in a worker handler thread. Sends ``task_started`` and
        ``task_finished`` (once per attempt, with status SUCCESSFUL or FAILED for that
        attempt), then returns the return value as a ``StoredResult`` (the worker acks with
        it, ``_acked_result``'s shape) or re-raises (the worker fails the job with the
        exception's class and traceback: retried while the budget lasts, at once dead for a
        ``NonRetryableError``). The service stores either with the job.

        Raises:
            Whatever the task raised.
            NonRetryableError: the job is not a runnable task here; when its task cannot be
                loaded (``ImportError``, ``InvalidTask``) that error's class and traceback are
                recorded as the attempt's error.
            ReturnValueRefused: the task returned a value ``normalize_json`` refuses (the
                ``TypeError``/``ValueError`` is recorded), or one over ``RELAY_MAX_RESULT_BYTES``
                once encoded (as this process's settings say); the body ran once, and the task
                is FAILED without a retry.
        """
        try:
            found = self._read_result(ctx.job_id)
            # The id enqueue returned, as the task's context must show it.
            result = self._from_result(self._enqueued_id(found["job"]), found)
        except (ImportError, InvalidTask) as exc:
            raise _reporting(
                NonRetryableError(f"cannot load the task of {ctx.job_id}: {exc}"),
                _task_error(exc),
            ) from exc
        except TaskResultDoesNotExist as exc:
            raise NonRetryableError(f"cannot load the task of {ctx.job_id}: {exc}") from exc
        task = result.task
        object.__setattr__(result, "status", TaskResultStatus.RUNNING)
        task_started.send(type(self), task_result=result)
        try:
            if task.takes_context:
                raw = task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
            else:
                raw = task.call(*result.args, **result.kwargs)
        except JobInterrupted:
            raise
        except BaseException as exc:  # any task failure is reported, then re-raised
            self._finish_failed(result, exc)
            raise
        try:
            value = _json_round_trip(raw)
            acked = _acked_result(value)
            size = len(orjson.dumps(acked))
            limit = relay_settings().result_limit_bytes
            if size > limit:
                raise ValueError(
                    f"it is {size} bytes as JSON, over RELAY_MAX_RESULT_BYTES ({limit})"
                )
        except (TypeError, ValueError, RecursionError) as exc:
            error = self._finish_failed(result, exc)
            refused = ReturnValueRefused(f"the return value cannot be stored: {exc}")
            raise _reporting(refused, error) from exc
        object.__setattr__(result, "_return_value", value)
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "finished_at", timezone.now())
        task_finished.send(type(self), task_result=result)
        return StoredResult(acked)

    def _finish_failed(self, result: TaskResult[..., Any], exc: BaseException) -> TaskError:
        """Mark ``exc`` as the attempt's reported error and send ``task_finished`` (FAILED).

        Returns:
            The ``TaskError`` the worker reports (the exception's class and traceback).
        """
        error = _task_error(exc)
        _reporting(exc, error)
        result.errors.append(error)
        object.__setattr__(result, "status", TaskResultStatus.FAILED)
        object.__setattr__(result, "finished_at", timezone.now())
        task_finished.send(type(self), task_result=result)
        return error


def _epoch_ms(instant: dt.datetime) -> int:
    """``instant`` in epoch ms, rounded up; a naive one is local time (``USE_TZ = False``)."""
    return math.ceil(instant.timestamp() * 1000)


def _utf8(text: str) -> str:
    """``text`` with each lone surrogate (no UTF-8 form; JSON and the database refuse it) as
    its ``\\udXXX`` escape, so a traceback quoting one can be recorded."""
    return text.encode("utf-8", errors="backslashreplace").decode("utf-8")


def execute_task(payload: Any, ctx: JobContext) -> StoredResult:
    """The ``relay_worker --tasks`` handler: run the Django task a job carries.

    Looks up the backend named by the payload (it must be a ``RelayBackend``) and calls its
    ``run``; see there. Database connections are refreshed around each task, as Django does
    around each request.

    Raises:
        NonRetryableError: the payload is not a Django task, or names no Relay backend.
        Whatever the task raised.
    """
    if _task_call(payload) is None:
        raise NonRetryableError("payload is not a Django task ({'task', 'args', 'kwargs'})")
    alias = payload.get("backend", "default")
    try:
        backend = task_backends[alias]
    except InvalidTaskBackend as exc:
        raise NonRetryableError(f"no task backend {alias!r}: {exc}") from exc
    if not isinstance(backend, RelayBackend):
        raise NonRetryableError(f"task backend {alias!r} is not a RelayBackend")
    close_old_connections()
    try:
        return backend.run(ctx)
    finally:
        close_old_connections()


def relay_backends() -> list[RelayBackend]:
    """The ``RelayBackend``s configured in ``TASKS``, in settings order."""
    return [b for b in task_backends.all() if isinstance(b, RelayBackend)]


def worker_queues(backends: list[RelayBackend]) -> list[str]:
    """The queues ``relay_worker --tasks`` serves without ``--queue``: every queue the
    backends' ``QUEUES`` name, plus ``"default"`` for a backend whose ``QUEUES`` is empty (it
    allows any name, which no list can cover: name such queues with ``--queue``).

    Returns:
        Queue names, sorted.
    """
    queues: set[str] = set()
    for backend in backends:
        queues |= backend.queues or {"default"}
    return sorted(queues)


class _StatsClient(Protocol):
    def stats(
        self, queue: str | None = None, *, limit: int | None = None, after: str | None = None
    ) -> types.StatsResult: ...


def check_worker_setup(backends: list[RelayBackend], client: _StatsClient) -> list[str]:
    """Check, before ``relay_worker --tasks`` leases, that it can run what the server hands it.

    For each shared-database backend's ``DATABASE``: Relay's results table must be readable
    there (migrated), and the server's registry of live servers (``stats``) must share a server
    id with the one this database holds, or the server and this worker use different
    databases: every job leased would fail to load. Networked backends read results over TCP
    and need no database of Relay's here.

    Args:
        backends: the ``RelayBackend``s (``relay_backends()``), at least one.
        client: a ``RelayClient`` on the worker's server.
    Returns:
        Warnings about what could not be checked (the server unreachable yet, or the API key
        may not call ``stats``); empty when everything was checked.
    Raises:
        ImproperlyConfigured: a database is unreadable or is not the server's (one line).
    """
    from queue_core.models import JobResult

    warnings: list[str] = []
    shared = sorted({backend.database for backend in backends if not backend.networked})
    if not shared:
        return warnings
    try:
        served = {str(server["id"]) for server in client.stats(limit=1)["servers"]}
    except (ConnectionError, RelayError) as exc:
        served = set()
        warnings.append(f"could not ask the server for its database's servers ({exc})")
    for database in shared:
        try:
            JobResult.objects.using(database).exists()
            service = QueueService(driver=driver_for(database))
            here = {str(server["id"]) for server in service.servers()}
        except DatabaseError as exc:
            # One line: psycopg's message goes on with "LINE 1: ..." and a caret line.
            cause = " ".join(str(exc).split("\n", 1)[0].split())
            raise ImproperlyConfigured(
                f"database {database!r} cannot hold task results ({cause}); run manage.py "
                "migrate with the settings the server uses"
            ) from exc
        if served and not served & here:
            raise ImproperlyConfigured(
                f"database {database!r} is not the one the server uses (it knows none of the "
                f"server's ids {sorted(served)}): run the worker with the server's settings"
            )
    return warnings
