"""The op catalogue: every protocol op declared once.

Each op is one method of ``Ops``, decorated with ``@op(...)``. The decorator records what the
server needs (``OPS[name]``: the wire argument schema, the result's ``TypedDict``, the scopes
that may call it, how the server schedules it, whether a draining server refuses it), and the
method itself is the client's signature: its docstring gives each argument's units and bounds,
and it returns the ``Call`` to send. From this:

* ``dispatch.VERBS`` (the server's op table), ``dispatch.REFUSED_WHILE_DRAINING``,
  ``auth.SCOPE_OPS`` and ``auth.OPEN_OPS`` are derived;
* ``RelayClient`` and ``AsyncRelayClient`` inherit ``Ops``: on a client whose ``send`` blocks
  (``Blocking``) ``client.ack(...)`` returns the result, on one whose ``send`` is a coroutine
  (``Asynchronous``) it returns an awaitable of the same typed result (``OpMethod``);
  the worker's ``WorkerClient`` is ``BlockingClient``, the same methods;
* ``queue_api.schemas`` builds the HTTP response bodies from the results' ``TypedDict`` classes
  (``queue_core.types``); its request bodies are checked against the arguments here by
  ``tests/unit/test_ops.py``.

A new op is one method here plus its ``QueueService`` method; ``dispatch`` calls the service
method of the same name with the checked arguments unless it has a handler of its own
(``docs/architecture.md`` shows the diff). Only the names and JSON types of arguments are
checked here, by cheap hand-written functions (the TCP hot path validates no models); ranges
(queue names, lease lengths, payload size) are the service's, except ``wait_ms`` and the
number of ``queues`` of a lease: the long-poll wait is the server's job.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any, cast, overload

from queue_core import errors, types, validation
from queue_core.conf import relay_settings

__all__ = [
    "OPS",
    "Arg",
    "Asynchronous",
    "Blocking",
    "BlockingClient",
    "Call",
    "Kind",
    "Op",
    "OpMethod",
    "Ops",
    "check_args",
    "required_args",
]


class Kind(enum.Enum):
    """How the server schedules an op."""

    READ = "read"  # read-only: runs in the reader pool
    WRITE = "write"  # changes state: group-committed (writer.Database)
    LEASE = "lease"  # a group-committed claim, plus the server's long-poll wait


# ---------------------------------------------------------------------- argument checks

Check = Callable[[str, Any], Any]


def _bad(field: str, message: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"{field}: {message}", field=field)


def _str(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _bad(field, f"must be a string, got {type(value).__name__}")
    return value


def _int(field: str, value: Any) -> int:
    return validation.integer(field, value)


def _bool(field: str, value: Any) -> bool:
    return validation.boolean(field, value)


def _any(field: str, value: Any) -> Any:
    return value


def _object(field: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(field, f"must be an object, got {type(value).__name__}")
    return value


def _str_or_int(field: str, value: Any) -> str | int:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _bad(field, f"must be a string or an integer, got {type(value).__name__}")
    return value


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(field, f"must be a number, got {type(value).__name__}")
    return float(value)


def _str_list(field: str, value: Any) -> list[str]:
    if not isinstance(value, list):
        raise _bad(field, f"must be a list of strings, got {type(value).__name__}")
    for item in value:
        if not isinstance(item, str):
            raise _bad(field, f"must be a list of strings, got a {type(item).__name__} in it")
    return value


def _age_ms(field: str, value: Any) -> int:
    return validation.integer(field, value, lo=1)


def _wait_ms(field: str, value: Any) -> int:
    return validation.integer(field, value, lo=0, hi=relay_settings().max_wait_ms)


def _queues(field: str, value: Any) -> list[str]:
    names = _str_list(field, value)
    validation.queue_count(names, relay_settings(), field)
    return names


def _jobs(field: str, value: Any) -> list[dict[str, Any]]:
    # Each job's names, types and ranges are checked once, by QueueService.submit_batch (it
    # names a bad one ``jobs[3].priority``): a batch is the hot path of bulk submission.
    if not isinstance(value, list):
        raise _bad(field, f"must be a list of job objects, got {type(value).__name__}")
    for index, spec in enumerate(value):
        if not isinstance(spec, dict):
            raise _bad(f"{field}[{index}]", "must be an object")
    return value


def _entries(field: str, value: Any) -> list[dict[str, Any]]:
    # A batch's entries (``acks``, ``renews``): each one's fields are checked by the service
    # method (``QueueService.ack_batch`` names ``acks[2].job_id``).
    if not isinstance(value, list):
        raise _bad(field, f"must be a list of objects, got {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise _bad(f"{field}[{index}]", "must be an object")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class Arg:
    """One argument of an op: its type check and whether it must be present (non-null)."""

    check: Check
    required: bool = False


def check_args(
    schema: Mapping[str, Arg],
    args: Mapping[str, Any],
    prefix: str = "",
    required: Collection[str] | None = None,
) -> dict[str, Any]:
    """Check argument names and types against ``schema``.

    Args:
        schema: ``{name: Arg}``.
        args: the request's ``args`` object.
        prefix: prepended to field names in errors (``"jobs[3]."`` for a batch entry).
        required: the names of ``schema``'s required arguments (``required_args``), when the
            caller has them at hand: the arguments given are then checked one by one, not the
            schema's every name (a submit names 2 of its 15).
    Returns:
        The arguments with ``null`` optional ones dropped (so the service's defaults apply).
    Raises:
        InvalidArgument: an unknown name, a missing (or null) required one, or a wrong type;
            ``details["field"]`` names it. With several faults, the same one whether or not
            ``required`` is given: an unknown name first, then the schema's order.
    """
    if required is not None:
        out: dict[str, Any] = {}
        clean = True
        try:
            for name, value in args.items():
                arg = schema[name]  # an unknown name, even a null one, is refused below
                if value is not None:
                    out[name] = arg.check(prefix + name, value)
        except Exception:  # noqa: BLE001 - raised again below, or an earlier fault
            clean = False  # in the schema's order, as the checks always named it
        if clean:
            for name in required:
                if name not in out:
                    break
            else:
                return out
    unknown = sorted(set(args) - set(schema))
    if unknown:
        name = prefix + unknown[0]
        raise errors.InvalidArgument(f"{name}: unknown argument", field=name)
    out = {}
    for name, arg in schema.items():
        value = args.get(name)
        if value is None:
            if arg.required:
                raise _bad(prefix + name, "is required")
            continue
        out[name] = arg.check(prefix + name, value)
    return out


def required_args(schema: Mapping[str, Arg]) -> tuple[str, ...]:
    """The names of ``schema``'s required arguments (``check_args``'s ``required``)."""
    return tuple(name for name, arg in schema.items() if arg.required)


SUBMIT_OPTIONS: dict[str, Arg] = {
    "priority": Arg(_str_or_int),
    "max_retries": Arg(_int),
    "backoff": Arg(_str),
    "backoff_base_ms": Arg(_int),
    "backoff_cap_ms": Arg(_int),
    "jitter": Arg(_bool),
    "delay_ms": Arg(_int),
    "run_at_ms": Arg(_int),
    "idempotency_key": Arg(_str),
    "unique": Arg(_str),
    "meta": Arg(_object),
    "time_limit_ms": Arg(_int),
}
"""A job's options (``submit``, each ``submit_batch`` job, ``POST /queues/{queue}/jobs``)."""

_LEASE_IDS = {
    "job_id": Arg(_str, required=True),
    "worker_id": Arg(_str, required=True),
    "lease_token": Arg(_str, required=True),
}
_LEASE_NEXT = {"lease_next": Arg(_object)}
"""``{"queues", "max_jobs", "lease_ms", "worker_id"}``: lease in the same commit (fields
checked by ``QueueService._next_claim``)."""
_JOB_ID = {"job_id": Arg(_str, required=True)}
_PAGE = {"queue": Arg(_str), "limit": Arg(_int), "after": Arg(_str)}

PRODUCER = frozenset({"producer"})
WORKER = frozenset({"worker"})

# ---------------------------------------------------------------------- calls and ops


def _plain(lease_next: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A ``lease_next`` as sent: a plain dict, its ``queues`` a list, None fields left out."""
    if lease_next is None:
        return None
    out = {k: val for k, val in lease_next.items() if val is not None}
    if isinstance(out.get("queues"), tuple):
        out["queues"] = list(out["queues"])
    return out


def _required(schema: Mapping[str, Arg], name: str) -> bool:
    arg = schema.get(name)
    return arg is not None and arg.required


@dataclasses.dataclass(frozen=True, slots=True)
class Call[T]:
    """One request as a client sends it, and how to read its reply.

    Attributes:
        op: the op name.
        args: the arguments, ``None`` ones left out (the server's defaults apply).
        wait_ms: how long the server may hold the request (a long-poll), in ms; clients add
            it to their reply timeout.
        unwrap: the result's member a client returns instead of the whole result (``lease``
            returns its ``jobs`` list), or None.
    """

    op: str
    args: dict[str, Any]
    wait_ms: int = 0
    unwrap: str | None = None

    @classmethod
    def of(cls, op: str, args: Mapping[str, Any], **how: Any) -> Call[Any]:
        """A call of ``op`` with ``args`` (``locals()`` of an ``Ops`` method), optional
        arguments that are None left out (a required one is sent, null or not: the server
        names it)."""
        schema = OPS[op].args
        kept = {k: v for k, v in args.items() if v is not None or _required(schema, k)}
        return cls(op, kept, **how)

    def decode(self, result: Any) -> T:
        """The client's return value from the reply's ``result``.

        Raises:
            ValueError: the result is not an object (or has no ``unwrap`` list); clients turn
                it into ``RelayConnectionError``.
        """
        if not isinstance(result, dict):
            raise ValueError(f"{self.op} reply has no result object")
        if self.unwrap is None:
            return cast(T, result)
        inner = result.get(self.unwrap)
        if not isinstance(inner, list):
            raise ValueError(f"{self.op} reply has no {self.unwrap} list")
        return cast(T, inner)


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One protocol op as ``@op`` declared it (see the module docstring).

    Attributes:
        name: the wire name.
        args: ``{name: Arg}``: what the server accepts.
        result: the ``TypedDict`` of the reply's ``result``.
        kind: how the server schedules it.
        scopes: the API-key scopes that may call it (``operator`` may call every op).
        open: callable without a key (``ping``, ``hello``).
        refused_while_draining: a draining server answers ``UNAVAILABLE`` (it starts work).
        controls: it changes its ``queue`` argument's controls, whose row it locks (a group
            commit locks every such row first, in name order: ``GroupCommit``).
        on_loop: its handler touches no table: the server runs it on its event loop, never
            behind the reader pool's queue.
        client: the ``Ops`` method: the client's signature and docstring.
    """

    name: str
    args: Mapping[str, Arg]
    result: type
    kind: Kind
    scopes: frozenset[str]
    open: bool
    refused_while_draining: bool
    controls: bool
    on_loop: bool
    client: Callable[..., Call[Any]]


OPS: dict[str, Op] = {}
"""Every op by name, in declaration order (filled as ``Ops`` is defined)."""


class Blocking:
    """A client whose ``send`` returns the result: ``Ops`` methods return results."""

    def send[T](self, call: Call[T], *, deadline: float | None = None) -> T:
        """Send ``call`` and return ``call.decode(result)``, by ``deadline`` (a
        ``time.monotonic()`` instant, connecting included) when given."""
        raise NotImplementedError


class Asynchronous:
    """A client whose ``send`` is a coroutine: ``Ops`` methods return awaitables."""

    async def send[T](self, call: Call[T]) -> T:
        """Send ``call`` and return ``call.decode(result)``."""
        raise NotImplementedError


class OpMethod[**P, T]:
    """An ``Ops`` method: on a client instance it builds the ``Call`` and ``send``s it.

    On the class (``RelayClient.ack``) it is the declared function itself, which returns the
    ``Call`` without sending it (its signature and docstring are the method's).
    """

    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Callable[P, Call[T]]: ...
    @overload
    def __get__(self, obj: Blocking, owner: type[Any]) -> Callable[P, T]: ...
    @overload
    def __get__(
        self, obj: Asynchronous, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self.build
        build, send = self.build, obj.send

        def method(*args: P.args, **kwargs: P.kwargs) -> Any:
            return send(build(*args, **kwargs))

        method.__name__ = method.__qualname__ = build.__name__
        method.__doc__ = build.__doc__
        return method


class op:
    """Declare an ``Ops`` method as a protocol op (above ``@staticmethod``).

    Args:
        kind: how the server schedules it.
        args: ``{name: Arg}``: the wire arguments.
        result: the ``TypedDict`` of its result.
        scopes: API-key scopes that may call it besides ``operator``.
        open: callable without a key.
        refused_while_draining: refused with ``UNAVAILABLE`` while the server drains.
        controls: changes the controls of its ``queue`` argument.
        on_loop: touches no table (run on the server's event loop).
    """

    def __init__(
        self,
        kind: Kind,
        args: Mapping[str, Arg],
        result: Any,
        *,
        scopes: frozenset[str] = frozenset(),
        open: bool = False,
        refused_while_draining: bool = False,
        controls: bool = False,
        on_loop: bool = False,
    ) -> None:
        self.fields: dict[str, Any] = {
            "args": args,
            "result": result,
            "kind": kind,
            "scopes": scopes,
            "open": open,
            "refused_while_draining": refused_while_draining,
            "controls": controls,
            "on_loop": on_loop,
        }

    def __call__[**P, T](self, method: Callable[P, Call[T]]) -> OpMethod[P, T]:
        build: Callable[P, Call[T]] = getattr(method, "__func__", method)  # the staticmethod's
        name = build.__name__
        OPS[name] = Op(name=name, client=build, **self.fields)
        return OpMethod(build)


class Ops:
    """Every protocol op, as the clients' methods (``docs/protocol.md`` has the wire shapes).

    Each method returns the op's result (``queue_core.types``), awaitable on an async client.
    Every method may also raise ``RelayConnectionError`` (no complete reply: the outcome is
    unknown) and, when the server has API keys, ``Unauthenticated`` or ``PermissionDenied``.
    """

    @op(Kind.READ, {}, types.PingResult, open=True, on_loop=True)
    @staticmethod
    def ping() -> Call[types.PingResult]:
        """Check the server is up.

        Returns:
            ``{"pong": true, "server_time_ms": int}``.
        """
        return Call.of("ping", {})

    @op(Kind.READ, {"api_key": Arg(_str, required=True)}, types.HelloResult, open=True)
    @staticmethod
    def hello(api_key: str) -> Call[types.HelloResult]:
        """Tie an API key to this connection (clients given ``api_key`` send it themselves).

        Args:
            api_key: ``rk_<12 hex>_<secret>``.
        Returns:
            ``{"authenticated", "name", "prefix", "scopes", "server_time_ms"}``.
        Raises:
            Unauthenticated: unknown or revoked key (the connection forgets any earlier one).
        """
        return Call.of("hello", locals())

    @op(
        Kind.WRITE,
        {"queue": Arg(_str, required=True), "payload": Arg(_any, required=True), **SUBMIT_OPTIONS},
        types.SubmitResult,
        scopes=PRODUCER,
        refused_while_draining=True,
    )
    @staticmethod
    def submit(
        queue: str,
        payload: Any,
        *,
        priority: str | int | None = None,
        max_retries: int | None = None,
        backoff: str | None = None,
        backoff_base_ms: int | None = None,
        backoff_cap_ms: int | None = None,
        jitter: bool | None = None,
        delay_ms: int | None = None,
        run_at_ms: int | None = None,
        idempotency_key: str | None = None,
        unique: str | None = None,
        meta: dict[str, str] | None = None,
        time_limit_ms: int | None = None,
    ) -> Call[types.SubmitResult]:
        """Enqueue one job (none -> ready, or -> pending when delayed).

        Options left as ``None`` take the server's defaults.

        Args:
            queue: queue name (``[A-Za-z0-9][A-Za-z0-9_.:-]*``, at most 128 characters).
            payload: any JSON value but null, at most ``RELAY_MAX_PAYLOAD_BYTES`` as compact
                JSON.
            priority: ``"low"``, ``"normal"``, ``"high"`` or ``"critical"`` (or 0-3).
            max_retries: failures that are retried before the job goes dead
                (0..``RELAY_MAX_RETRIES``).
            backoff: ``"fixed"`` or ``"exponential"``.
            backoff_base_ms, backoff_cap_ms: retry delay base and cap, in ms
                (0..``RELAY_MAX_DELAY_MS``, cap >= base).
            jitter: scale retry delays into 50-100%.
            delay_ms: run no sooner than this many ms from now (exclusive with ``run_at_ms``).
            run_at_ms: run no sooner than this epoch-ms instant.
            idempotency_key: deduplicate resubmits with the same key and payload (1..255
                characters) within ``RELAY_IDEMPOTENCY_WINDOW_MS``.
            unique: ``"window"`` (default: the key stays bound for the window whatever the
                job's state) or ``"active"`` (the key is also freed when the job succeeds,
                goes dead or is cancelled: unique while active, as Sidekiq Enterprise's unique
                jobs).
            meta: a small map of strings stored with the job and returned with its lease
                (``RELAY_MAX_META_KEYS`` keys, ``RELAY_MAX_META_BYTES`` encoded), e.g. the
                W3C ``traceparent`` of the producer's span.
            time_limit_ms: the most one attempt may run, in ms from its lease
                (1..``RELAY_MAX_DELAY_MS``); past it renew stops extending the lease and the
                attempt fails with reason ``timeout``. Default: the queue's
                ``RELAY_QUEUE_TIME_LIMITS`` entry, else no limit.
        Returns:
            ``{"job": Job, "deduplicated": bool}``.
        Raises:
            InvalidArgument, FrameTooLarge, IdempotencyConflict, TooManyQueues (a queue
            that holds no jobs while ``RELAY_MAX_QUEUES`` others do), StoreBusy, Unavailable,
            RelayConnectionError (resubmit with an idempotency key to be safe).
        """
        return Call.of("submit", locals())

    @op(
        Kind.WRITE,
        {"jobs": Arg(_jobs, required=True)},
        types.SubmitBatchResult,
        scopes=PRODUCER,
        refused_while_draining=True,
    )
    @staticmethod
    def submit_batch(jobs: Sequence[Mapping[str, Any]]) -> Call[types.SubmitBatchResult]:
        """Enqueue several jobs in one transaction (all or none).

        Args:
            jobs: submit args dicts (``{"queue", "payload", ...}`` with the wire names used
                by ``submit``), sent as given; at most ``RELAY_MAX_BATCH_SUBMIT``.
        Returns:
            ``{"results": [{"job_id", "queue", "state", "available_at_ms", "deduplicated"},
            ...]}`` in input order (ids, not whole jobs: ``inspect`` reads one).
        Raises:
            as ``submit``.
        """
        return Call.of("submit_batch", {"jobs": [dict(job) for job in jobs]})

    @op(
        Kind.LEASE,
        {
            "queues": Arg(_queues, required=True),
            "worker_id": Arg(_str),
            "max_jobs": Arg(_int),
            "lease_ms": Arg(_int),
            "wait_ms": Arg(_wait_ms),
        },
        types.LeaseResult,
        scopes=WORKER,
        refused_while_draining=True,
    )
    @staticmethod
    def lease(
        queues: Sequence[str],
        *,
        worker_id: str,
        max_jobs: int = 1,
        lease_ms: int | None = None,
        wait_ms: int = 0,
    ) -> Call[list[types.Lease]]:
        """Lease up to ``max_jobs`` ready jobs (ready -> leased), waiting up to ``wait_ms``.

        On an async client other calls go on while a lease waits; give a blocking client's
        long-poll its own client so it does not hold up acks.

        Args:
            queues: queue names to take from (1..``RELAY_MAX_QUEUES_PER_LEASE``, 16).
            worker_id: a stable id for this worker (``host:pid``); renew/ack/fail must repeat
                it (the server's default, when a raw request leaves it out: the peer address).
            max_jobs: the most jobs to take (1..100).
            lease_ms: lease length in ms (server default ``RELAY_VISIBILITY_TIMEOUT_MS``).
            wait_ms: long-poll: how long the server may wait for a job, in ms
                (0..``RELAY_MAX_WAIT_MS``, 20 000).
        Returns:
            Lease dicts (``job_id``, ``lease_token``, ``attempt``, ``payload``, ...): the
            wire result's ``jobs``; empty when nothing was ready in time.
        Raises:
            InvalidArgument, StoreBusy, Unavailable, RelayConnectionError (jobs leased by a
            lost reply come back when their lease expires).
        """
        if isinstance(queues, str):  # a str is a Sequence[str]: "ab" would lease from a and b
            raise _bad("queues", f"must be a list of queue names, not a string: [{queues!r}]")
        args = {**locals(), "queues": list(queues)}
        return Call.of("lease", args, wait_ms=wait_ms, unwrap="jobs")

    @op(Kind.WRITE, {**_LEASE_IDS, "lease_ms": Arg(_int)}, types.RenewResult, scopes=WORKER)
    @staticmethod
    def renew(
        job_id: str, *, worker_id: str, lease_token: str, lease_ms: int | None = None
    ) -> Call[types.RenewResult]:
        """Extend a live lease (leased -> leased).

        Args:
            job_id: the leased job.
            worker_id: the id sent with the lease.
            lease_token: the token from the lease.
            lease_ms: new lease length from now, in ms (server default: the visibility
                timeout; never past ``RELAY_MAX_LEASE_MS``).
        Returns:
            ``{"job_id", "lease_expires_at_ms", "stop"}``: ``stop`` is None, or tells the
            worker to stop the handler: ``"cancelled"`` (a cancel was asked for; the lease
            was renewed; fail or release the job to end it cancelled) or ``"timeout"`` (past
            the time limit: the attempt was failed, ``lease_expires_at_ms`` is None and the
            token is spent).
        Raises:
            JobNotFound, StaleToken, LeaseExpired, StoreBusy, RelayConnectionError.
        """
        return Call.of("renew", locals())

    @op(
        Kind.WRITE,
        {"renews": Arg(_entries, required=True)},
        types.RenewBatchResult,
        scopes=WORKER,
    )
    @staticmethod
    def renew_batch(renews: Sequence[Mapping[str, Any]]) -> Call[types.RenewBatchResult]:
        """Extend several live leases in one commit, each fenced by its own token (SQS's
        ``ChangeMessageVisibilityBatch``).

        Args:
            renews: 1..100 ``{"job_id", "worker_id", "lease_token", "lease_ms"?}``
                (``renew``'s arguments; ``lease_ms`` in ms).
        Returns:
            ``{"results": [{"job_id", "ok", "lease_expires_at_ms", "stop", "error"}, ...]}``:
            one entry per renew, in order, ``ok`` with ``renew``'s ``lease_expires_at_ms``
            and ``stop``; a refused renew (``error``: ``{"code", "message", "retryable"}``,
            such as ``STALE_TOKEN`` or ``LEASE_EXPIRED``: that lease is gone) does not undo
            the others.
        Raises:
            InvalidArgument (not a list of 1..100 renew objects), StoreBusy,
            RelayConnectionError (repeat it: a renew is safe to repeat).
        """
        return Call.of("renew_batch", {"renews": [dict(r) for r in renews]})

    @op(
        Kind.WRITE,
        {**_LEASE_IDS, "result": Arg(_any), **_LEASE_NEXT},
        types.AckResult,
        scopes=WORKER,
    )
    @staticmethod
    def ack(
        job_id: str,
        *,
        worker_id: str,
        lease_token: str,
        result: Any = None,
        lease_next: Mapping[str, Any] | None = None,
    ) -> Call[types.AckResult]:
        """Mark a leased job as done (leased -> succeeded). Safe to repeat.

        Args:
            job_id, worker_id, lease_token: as for ``renew``.
            result: the handler's result, any JSON value of at most
                ``RELAY_MAX_RESULT_BYTES`` (64 KiB) as compact JSON, stored with the job
                (``result`` reads it back); None stores nothing. A repeat stores nothing.
            lease_next: ``{"queues": [...], "max_jobs": 1..100 (1), "lease_ms": ms,
                "worker_id": str (this ack's)}``: also lease up to ``max_jobs`` ready jobs
                in the same commit, without waiting (a draining server leases none).
        Returns:
            ``{"job_id", "state": "succeeded", "duplicate": bool}``, plus ``"next": [Lease,
            ...]`` (possibly empty) with ``lease_next``.
        Raises:
            JobNotFound, StaleToken, LeaseExpired, StoreBusy, RelayConnectionError;
            FrameTooLarge (a result over the limit) or InvalidArgument (NaN, ±Infinity, a
            lone surrogate in it): nothing changed, the lease is still held.
        """
        return Call.of("ack", {**locals(), "lease_next": _plain(lease_next)})

    @op(
        Kind.WRITE,
        {"acks": Arg(_entries, required=True), **_LEASE_NEXT},
        types.AckBatchResult,
        scopes=WORKER,
    )
    @staticmethod
    def ack_batch(
        acks: Sequence[Mapping[str, Any]], *, lease_next: Mapping[str, Any] | None = None
    ) -> Call[types.AckBatchResult]:
        """Acknowledge several leased jobs in one commit, each fenced by its own token.

        Args:
            acks: 1..100 ``{"job_id", "worker_id", "lease_token", "result"?}`` (``ack``'s
                arguments).
            lease_next: as ``ack``'s; its ``worker_id`` defaults to the first ack's.
        Returns:
            ``{"results": [{"job_id", "ok", "state", "duplicate", "error"}, ...], "next":
            [Lease, ...]}``: one entry per ack, in order; a refused ack (``error``: ``{"code",
            "message", "retryable"}``) does not undo the others.
        Raises:
            InvalidArgument (not a list of 1..100 ack objects; ``lease_next``), StoreBusy,
            RelayConnectionError (repeat it: acks are safe to repeat).
        """
        return Call.of(
            "ack_batch",
            {"acks": [dict(a) for a in acks], "lease_next": _plain(lease_next)},
        )

    @op(
        Kind.WRITE,
        {
            **_LEASE_IDS,
            "error": Arg(_str, required=True),
            "retryable": Arg(_bool),
            "exception_class": Arg(_str),
            "traceback": Arg(_str),
            **_LEASE_NEXT,
        },
        types.FailResult,
        scopes=WORKER,
    )
    @staticmethod
    def fail(
        job_id: str,
        *,
        worker_id: str,
        lease_token: str,
        error: str,
        retryable: bool = True,
        exception_class: str | None = None,
        traceback: str | None = None,
        lease_next: Mapping[str, Any] | None = None,
    ) -> Call[types.FailResult]:
        """Record a failed attempt (leased -> retrying, or -> dead). Safe to repeat.

        Args:
            job_id, worker_id, lease_token: as for ``renew``.
            error: failure text, at most ``RELAY_MAX_ERROR_BYTES`` UTF-8 bytes.
            retryable: False dead-letters the job at once.
            exception_class: the exception's class path (``module.QualName``, 1..255
                characters); given, the error joins the job's stored errors (``result``).
            traceback: its formatted traceback, at most ``RELAY_MAX_RESULT_BYTES`` UTF-8
                bytes (stored only with ``exception_class``).
            lease_next: as ``ack``'s.
        Returns:
            ``{"job_id", "state", "retry_at_ms", "dead_reason", "duplicate"}``; ``state`` is
            ``"cancelled"`` when a cancel had been asked for; plus ``"next"`` with
            ``lease_next``.
        Raises:
            JobNotFound, StaleToken, LeaseExpired, InvalidArgument, StoreBusy,
            RelayConnectionError.
        """
        return Call.of("fail", {**locals(), "lease_next": _plain(lease_next)})

    @op(Kind.WRITE, _LEASE_IDS, types.ReleaseResult, scopes=WORKER)
    @staticmethod
    def release(job_id: str, *, worker_id: str, lease_token: str) -> Call[types.ReleaseResult]:
        """Give a leased job back without counting a failure (leased -> ready).

        Args:
            job_id, worker_id, lease_token: as for ``renew``.
        Returns:
            ``{"job_id", "state": "ready"}``, or ``"cancelled"`` when a cancel had been asked
            for.
        Raises:
            JobNotFound, StaleToken, LeaseExpired, StoreBusy, RelayConnectionError.
        """
        return Call.of("release", locals())

    @op(Kind.READ, _JOB_ID, types.JobResult, scopes=PRODUCER | WORKER)
    @staticmethod
    def inspect(job_id: str) -> Call[types.JobResult]:
        """Read one job with its attempt history and events.

        Returns:
            ``{"job": Job}`` with ``history``, ``events`` and ``history_omitted`` (the newest
            that fit one frame).
        Raises:
            JobNotFound, RelayConnectionError.
        """
        return Call.of("inspect", locals())

    @op(
        Kind.READ,
        {"job_id": Arg(_str), "queue": Arg(_str), "idempotency_key": Arg(_str)},
        types.ResultResult,
        scopes=PRODUCER | WORKER,
    )
    @staticmethod
    def result(
        job_id: str | None = None,
        *,
        queue: str | None = None,
        idempotency_key: str | None = None,
    ) -> Call[types.ResultResult]:
        """Read a job with its result: the value its worker sent with the ack and the
        structured errors (exception class, traceback) sent with its fails.

        Args:
            job_id: the job; or, instead,
            queue, idempotency_key: the queue and the idempotency key it was submitted with.
        Returns:
            ``{"job": Job (as inspect), "return_value": any | None, "errors":
            [{"attempt", "exception_class", "traceback"}, ...]}``.
        Raises:
            InvalidArgument (neither or both ways of naming the job), JobNotFound,
            RelayConnectionError.
        """
        return Call.of("result", locals())

    @op(Kind.READ, _PAGE, types.StatsResult, scopes=PRODUCER)
    @staticmethod
    def stats(
        queue: str | None = None, *, limit: int | None = None, after: str | None = None
    ) -> Call[types.StatsResult]:
        """Count jobs by state, per queue, a page of queues at a time.

        Args:
            queue: only this queue (default: every queue).
            limit: queues per page, 1..1000 (the server's default: 1000, and no more than
                fit a frame).
            after: the previous page's ``next_after``.
        Returns:
            ``{"queues": {name: {state counts..., "oldest_ready_age_ms"}}, "totals" (every
            queue), "server_time_ms", "servers", "next_after"}``; ``next_after`` is None on
            the last page.
        Raises:
            InvalidArgument, RelayConnectionError.
        """
        return Call.of("stats", locals())

    @op(Kind.READ, _PAGE, types.DeadListResult)
    @staticmethod
    def dead_list(
        queue: str | None = None, limit: int = 100, after: str | None = None
    ) -> Call[types.DeadListResult]:
        """List dead-lettered jobs, oldest id first, a page at a time.

        Args:
            queue: only this queue.
            limit: page size (1..1000).
            after: the ``next_after`` cursor of the previous page.
        Returns:
            ``{"jobs": [Job, ...], "next_after": str | None}``.
        Raises:
            InvalidArgument, RelayConnectionError.
        """
        return Call.of("dead_list", locals())

    @op(Kind.WRITE, _JOB_ID, types.JobResult)
    @staticmethod
    def dead_retry(job_id: str) -> Call[types.JobResult]:
        """Replay a dead or cancelled job (dead/cancelled -> ready); its history is kept.

        Returns:
            ``{"job": Job}``.
        Raises:
            JobNotFound, InvalidState (neither dead nor cancelled), StoreBusy,
            RelayConnectionError.
        """
        return Call.of("dead_retry", locals())

    @op(Kind.WRITE, _JOB_ID, types.DeadPurgeResult)
    @staticmethod
    def dead_purge(job_id: str) -> Call[types.DeadPurgeResult]:
        """Delete a dead (or cancelled) job for good.

        Returns:
            ``{"job_id", "purged": true}``.
        Raises:
            JobNotFound, InvalidState (not dead or cancelled), StoreBusy,
            RelayConnectionError.
        """
        return Call.of("dead_purge", locals())

    @op(
        Kind.WRITE,
        {"older_than_ms": Arg(_age_ms, required=True), "state": Arg(_str), "limit": Arg(_int)},
        types.PruneResult,
    )
    @staticmethod
    def prune(older_than_ms: int, state: str = "all", limit: int = 100) -> Call[types.PruneResult]:
        """Delete finished jobs that finished more than ``older_than_ms`` ago, with their
        attempts, events and task results: one short transaction of at most ``limit`` jobs
        (1..10 000), so the write lock is never held for long; call again while ``more``.
        What the server's retention does by itself (``RELAY_RETENTION_SUCCEEDED``/``_DEAD``;
        cancelled jobs are kept as long as dead ones).

        Args:
            older_than_ms: age in ms (>= 1) past which finished jobs go.
            state: ``succeeded``, ``dead``, ``cancelled`` or ``all``.
            limit: the most jobs this call deletes.
        Returns:
            ``{"deleted": {"succeeded": n, "dead": m, "cancelled": k}, "more": bool}``.
        Raises:
            InvalidArgument, StoreBusy, RelayConnectionError.
        """
        return Call.of("prune", locals())

    @op(Kind.WRITE, _JOB_ID, types.CancelResult)
    @staticmethod
    def cancel(job_id: str) -> Call[types.CancelResult]:
        """Cancel a job: ready, pending or retrying -> cancelled at once; a leased job is
        marked, and its worker is told to stop at its next renew (then it ends cancelled,
        unless the handler finishes and acks first).

        Returns:
            ``{"job": Job, "cancelled": bool}`` (``cancelled`` false while a leased job's
            worker has yet to stop).
        Raises:
            JobNotFound, JobFinished (succeeded, dead or cancelled already), StoreBusy,
            RelayConnectionError.
        """
        return Call.of("cancel", locals())

    @op(Kind.WRITE, {"queue": Arg(_str, required=True)}, types.QueueControls, controls=True)
    @staticmethod
    def pause(queue: str) -> Call[types.QueueControls]:
        """Pause a queue: submits are still accepted and leased jobs finish, but nothing new
        is leased from it (long-polls on it wait) until ``resume``; survives restarts.

        Args:
            queue: the queue name.
        Returns:
            ``{"queue", "paused": true, "max_leased", "rate_per_s", "burst",
            "updated_at_ms", "updated_by"}``.
        Raises:
            InvalidArgument, StoreBusy, RelayConnectionError.
        """
        return Call.of("pause", locals())

    @op(Kind.WRITE, {"queue": Arg(_str, required=True)}, types.QueueControls, controls=True)
    @staticmethod
    def resume(queue: str) -> Call[types.QueueControls]:
        """Resume a paused queue; its waiting long-polls wake.

        Args:
            queue: the queue name.
        Returns:
            The queue's controls, as ``pause``.
        Raises:
            InvalidArgument, StoreBusy, RelayConnectionError.
        """
        return Call.of("resume", locals())

    @op(
        Kind.WRITE,
        {
            "queue": Arg(_str, required=True),
            "max_leased": Arg(_int),
            "rate_per_s": Arg(_number),
            "burst": Arg(_int),
        },
        types.QueueControls,
        controls=True,
    )
    @staticmethod
    def set_queue_limits(
        queue: str,
        *,
        max_leased: int | None = None,
        rate_per_s: float | None = None,
        burst: int | None = None,
    ) -> Call[types.QueueControls]:
        """Cap a queue's leased jobs across every worker, and/or limit how many start per
        second (a token bucket); an argument left out keeps its value.

        Args:
            queue: the queue name.
            max_leased: 1..1 000 000 jobs leased at once; 0 removes the cap.
            rate_per_s: jobs started per second (10^-4..10^6, fractions allowed); 0 removes it.
            burst: 1..1 000 000 jobs that may start at once after a quiet spell (default 1).
        Returns:
            The queue's controls, as ``pause``.
        Raises:
            InvalidArgument, StoreBusy, RelayConnectionError.
        """
        return Call.of("set_queue_limits", locals())

    @op(Kind.READ, {**_PAGE, "queue": Arg(_str)}, types.QueueControlsResult, scopes=PRODUCER)
    @staticmethod
    def queue_controls(
        queue: str | None = None, limit: int | None = None, after: str | None = None
    ) -> Call[types.QueueControlsResult]:
        """Read one queue's controls (its defaults when nobody set any), or a page of the
        paused, capped or rate-limited queues' (in name order).

        Args:
            queue: one queue (default: the controlled queues).
            limit: queues per page, 1..1000 (default 1000; a page also ends before one
                frame).
            after: the previous page's ``next_after``.
        Returns:
            ``{"queues": {name: {"queue", "paused", "max_leased", "rate_per_s", "burst",
            "updated_at_ms", "updated_by"}}, "next_after": str | None}``.
        Raises:
            InvalidArgument, RelayConnectionError.
        """
        return Call.of("queue_controls", locals())


class BlockingClient(Ops, Blocking):
    """A blocking client: every op as a method returning its result (``RelayClient``).

    ``Worker`` takes one (``WorkerClient``); it calls ``lease``, ``renew``, ``ack``, ``fail``,
    ``release`` and ``close``, so a test double may define just those, and ``stop_sending``
    (``RelayClient.stop_sending``) when the client has it.
    """

    def close(self) -> None:
        """Close the connection; safe from another thread, where it aborts a blocked call."""
        raise NotImplementedError
