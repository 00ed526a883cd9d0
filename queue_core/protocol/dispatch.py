"""The op table: op name -> argument schema + handler, in the style of Faktory's command set.

``lookup`` finds a verb (``UnknownOp`` otherwise), ``validate`` checks argument names and
types (``InvalidArgument`` with ``details["field"]`` naming the argument), and the handler
calls ``QueueService`` and shapes its result as ``docs/protocol.md`` says. Range checks (lease
length, queue name pattern, payload size...) belong to the service, so they are not repeated
here, except ``wait_ms`` and the number of ``queues`` of a lease: the long-poll wait is the
server's job. Handlers never decide transitions; only the service does.

Each handler returns an ``Outcome``: the wire result plus what the commit made ready or due,
so the server knows whom to wake. ``handle`` runs one request synchronously (no long-poll
wait): the loopback transport and tests use it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from queue_core import auth, errors, metrics, validation
from queue_core.conf import relay_settings
from queue_core.protocol.codec import Request
from queue_core.service import QueueService
from queue_core.states import JobState


class Kind(enum.Enum):
    """How the server schedules a verb."""

    READ = "read"  # read-only: runs in the reader pool
    WRITE = "write"  # changes state: runs on the writer thread, group-committed
    LEASE = "lease"  # a claim on the writer thread, plus the server's long-poll wait


@dataclasses.dataclass(frozen=True, slots=True)
class Context:
    """Who is asking.

    Attributes:
        peer: the connection's peer address (``host:port``); the default ``worker_id`` of
            ``lease``.
        actor: recorded as the actor of ``dead_retry`` / ``dead_purge`` (None when unknown).
    """

    peer: str = "local"
    actor: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """A handler's result and its effects on waiting leases.

    Attributes:
        result: the wire result object.
        ready_queues: queues that got READY jobs in this request (their waiters are woken).
        due_at_ms: the earliest epoch ms at which a job this request scheduled becomes due
            (the server's reaper promotes it then), or None.
        events: what to count in the metrics once the request has committed
            (``metrics.record``).
    """

    result: dict[str, Any]
    ready_queues: frozenset[str] = frozenset()
    due_at_ms: int | None = None
    events: tuple[metrics.Event, ...] = ()


Check = Callable[[str, Any], Any]
Handler = Callable[[QueueService, dict[str, Any], Context], Outcome]


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


def _str_or_int(field: str, value: Any) -> str | int:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _bad(field, f"must be a string or an integer, got {type(value).__name__}")
    return value


def _str_list(field: str, value: Any) -> list[str]:
    if not isinstance(value, list):
        raise _bad(field, f"must be a list of strings, got {type(value).__name__}")
    for item in value:
        if not isinstance(item, str):
            raise _bad(field, f"must be a list of strings, got a {type(item).__name__} in it")
    return value


def _wait_ms(field: str, value: Any) -> int:
    return validation.integer(field, value, lo=0, hi=relay_settings().max_wait_ms)


def _queues(field: str, value: Any) -> list[str]:
    names = _str_list(field, value)
    limit = relay_settings().max_queues_per_lease
    if not 1 <= len(names) <= limit:
        raise _bad(field, f"must name 1 to {limit} queues, got {len(names)}")
    return names


@dataclasses.dataclass(frozen=True, slots=True)
class Arg:
    """One argument of a verb: its type check and whether it must be present (non-null)."""

    check: Check
    required: bool = False


_SUBMIT_ARGS: dict[str, Arg] = {
    "queue": Arg(_str, required=True),
    "payload": Arg(_any, required=True),
    "priority": Arg(_str_or_int),
    "max_retries": Arg(_int),
    "backoff": Arg(_str),
    "backoff_base_ms": Arg(_int),
    "backoff_cap_ms": Arg(_int),
    "jitter": Arg(_bool),
    "delay_ms": Arg(_int),
    "run_at_ms": Arg(_int),
    "idempotency_key": Arg(_str),
}


def check_args(
    schema: Mapping[str, Arg], args: Mapping[str, Any], prefix: str = ""
) -> dict[str, Any]:
    """Check argument names and types against ``schema``.

    Args:
        schema: ``{name: Arg}``.
        args: the request's ``args`` object.
        prefix: prepended to field names in errors (``"jobs[3]."`` for a batch entry).
    Returns:
        The arguments with ``null`` optional ones dropped (so the service's defaults apply).
    Raises:
        InvalidArgument: an unknown name, a missing (or null) required one, or a wrong type;
            ``details["field"]`` names it.
    """
    unknown = sorted(set(args) - set(schema))
    if unknown:
        name = prefix + unknown[0]
        raise errors.InvalidArgument(f"{name}: unknown argument", field=name)
    out: dict[str, Any] = {}
    for name, arg in schema.items():
        value = args.get(name)
        if value is None:
            if arg.required:
                raise _bad(prefix + name, "is required")
            continue
        out[name] = arg.check(prefix + name, value)
    return out


def _jobs(field: str, value: Any) -> list[dict[str, Any]]:
    # Each job's names, types and ranges are checked once, by QueueService.submit_batch (it
    # names a bad one ``jobs[3].priority``): a batch is the hot path of bulk submission.
    if not isinstance(value, list):
        raise _bad(field, f"must be a list of job objects, got {type(value).__name__}")
    for index, spec in enumerate(value):
        if not isinstance(spec, dict):
            raise _bad(f"{field}[{index}]", "must be an object")
    return value


# ---------------------------------------------------------------------- handlers


def _job_effects(job: Mapping[str, Any]) -> tuple[set[str], int | None]:
    """The queue to wake, or the instant to promote at, for a job (or batch entry) just made."""
    if job["state"] == JobState.READY:
        return {job["queue"]}, None
    if job["state"] in (JobState.PENDING, JobState.RETRYING):
        return set(), job["available_at_ms"]
    return set(), None


def _submitted(jobs: Iterable[tuple[Mapping[str, Any], bool]], result: dict[str, Any]) -> Outcome:
    ready: set[str] = set()
    due: list[int] = []
    counts: Counter[tuple[str, str]] = Counter()  # one metrics event per (kind, queue)
    for job, deduplicated in jobs:
        queues, at_ms = _job_effects(job)
        ready |= queues
        if at_ms is not None:
            due.append(at_ms)
        counts["deduplicated" if deduplicated else "submitted", job["queue"]] += 1
    events = tuple(metrics.Event(kind, queue, n) for (kind, queue), n in counts.items())
    return Outcome(result, frozenset(ready), min(due, default=None), events)


def _hello(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    # The server checks the key itself and remembers it on the connection; this handler
    # serves the loopback transport and direct callers, which have no connection state.
    principal = auth.authenticate(args["api_key"], surface="tcp", peer=ctx.peer)
    return Outcome({**principal.describe(), "server_time_ms": svc.clock.now_ms()})


def _ping(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    return Outcome({"pong": True, "server_time_ms": svc.clock.now_ms()})


def _submit(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    # Never change ``args``: a call may run twice (the flat group commit's second round).
    options = {k: v for k, v in args.items() if k not in ("queue", "payload")}
    out = svc.submit(args["queue"], args["payload"], **options)
    return _submitted([(out["job"], out["deduplicated"])], out)


def _submit_batch(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    results = svc.submit_batch(args["jobs"])
    return _submitted([(r, r["deduplicated"]) for r in results], {"results": results})


def _lease(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    leases = svc.claim(
        args["queues"],
        worker_id=args.get("worker_id", ctx.peer),
        max_jobs=args.get("max_jobs", 1),
        lease_ms=args.get("lease_ms"),
    )
    events: list[metrics.Event] = []
    if leases:
        now = svc.clock.now_ms()
        for lease in leases:
            events.append(metrics.Event("leased", lease["queue"]))
            if lease["attempt"] == 1:
                delay_s = (now - lease["created_at_ms"]) / 1000
                events.append(metrics.Event("start_delay", lease["queue"], delay_s))
    return Outcome({"jobs": leases}, events=tuple(events))


def _lease_ids(args: Mapping[str, Any]) -> dict[str, Any]:
    return {"worker_id": args["worker_id"], "lease_token": args["lease_token"]}


def _renew(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.renew(args["job_id"], **_lease_ids(args), lease_ms=args.get("lease_ms"))
    return Outcome({"job_id": out["job_id"], "lease_expires_at_ms": out["lease_expires_at_ms"]})


def _ack(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.ack(args["job_id"], **_lease_ids(args))
    events = () if out["duplicate"] else (metrics.Event("acked", _queue(out)),)
    return Outcome({k: out[k] for k in ("job_id", "state", "duplicate")}, events=events)


def _queue(out: Mapping[str, Any]) -> str:
    # ack and fail name the queue of a first (non-duplicate) outcome; read it otherwise.
    queue = out.get("queue")
    return str(queue) if queue is not None else metrics.queue_of(out["job_id"])


def _fail(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.fail(
        args["job_id"],
        **_lease_ids(args),
        error=args["error"],
        retryable=args.get("retryable", True),
    )
    result = {k: out[k] for k in ("job_id", "state", "retry_at_ms", "dead_reason", "duplicate")}
    due = out["retry_at_ms"] if out["state"] == JobState.RETRYING else None
    events: tuple[metrics.Event, ...] = ()
    if not out["duplicate"]:
        queue = _queue(out)
        events = (metrics.Event("failed", queue),)
        if out["state"] == JobState.DEAD:
            events += (metrics.Event("dead", queue),)
    return Outcome(result, due_at_ms=due, events=events)


def _release(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.release(args["job_id"], **_lease_ids(args))
    return Outcome(
        {"job_id": out["job_id"], "state": out["state"]},
        frozenset({out["queue"]}),
        events=(metrics.Event("released", out["queue"]),),
    )


def _inspect(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    return Outcome({"job": svc.get(args["job_id"], history=True)})


STATS_PAGE = 1000  # queues per stats reply by default (and at most)


def _stats(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    # Paged on the wire: 10,000 queues would not fit one frame.
    limit = args.get("limit", STATS_PAGE)
    return Outcome(svc.stats(args.get("queue"), limit=limit, after=args.get("after")))


def _dead_list(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    return Outcome(
        svc.dead_list(args.get("queue"), limit=args.get("limit", 100), after=args.get("after"))
    )


def _dead_retry(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    job = svc.replay(args["job_id"], actor=ctx.actor)
    queues, _ = _job_effects(job)
    return Outcome(
        {"job": job}, frozenset(queues), events=(metrics.Event("replayed", job["queue"]),)
    )


def _dead_purge(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.purge(args["job_id"], actor=ctx.actor, dead_only=True)
    return Outcome({"job_id": out["job_id"], "purged": True})


# ---------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True, slots=True)
class Verb:
    """One operation: its name, argument schema, handler and how the server schedules it."""

    op: str
    args: Mapping[str, Arg]
    handler: Handler
    kind: Kind


_LEASE_IDS = {
    "job_id": Arg(_str, required=True),
    "worker_id": Arg(_str, required=True),
    "lease_token": Arg(_str, required=True),
}
_JOB_ID = {"job_id": Arg(_str, required=True)}

VERBS: dict[str, Verb] = {
    v.op: v
    for v in (
        Verb("ping", {}, _ping, Kind.READ),
        Verb("hello", {"api_key": Arg(_str, required=True)}, _hello, Kind.READ),
        Verb("submit", _SUBMIT_ARGS, _submit, Kind.WRITE),
        Verb("submit_batch", {"jobs": Arg(_jobs, required=True)}, _submit_batch, Kind.WRITE),
        Verb(
            "lease",
            {
                "queues": Arg(_queues, required=True),
                "worker_id": Arg(_str),
                "max_jobs": Arg(_int),
                "lease_ms": Arg(_int),
                "wait_ms": Arg(_wait_ms),
            },
            _lease,
            Kind.LEASE,
        ),
        Verb("renew", {**_LEASE_IDS, "lease_ms": Arg(_int)}, _renew, Kind.WRITE),
        Verb("ack", _LEASE_IDS, _ack, Kind.WRITE),
        Verb(
            "fail",
            {**_LEASE_IDS, "error": Arg(_str, required=True), "retryable": Arg(_bool)},
            _fail,
            Kind.WRITE,
        ),
        Verb("release", _LEASE_IDS, _release, Kind.WRITE),
        Verb("inspect", _JOB_ID, _inspect, Kind.READ),
        Verb(
            "stats",
            {"queue": Arg(_str), "limit": Arg(_int), "after": Arg(_str)},
            _stats,
            Kind.READ,
        ),
        Verb(
            "dead_list",
            {"queue": Arg(_str), "limit": Arg(_int), "after": Arg(_str)},
            _dead_list,
            Kind.READ,
        ),
        Verb("dead_retry", _JOB_ID, _dead_retry, Kind.WRITE),
        Verb("dead_purge", _JOB_ID, _dead_purge, Kind.WRITE),
    )
}

# Refused with UNAVAILABLE while the server drains: they would start new work.
REFUSED_WHILE_DRAINING = frozenset({"submit", "submit_batch", "lease"})


def lookup(op: str) -> Verb:
    """Return the verb for ``op``.

    Raises:
        UnknownOp: ``op`` is not in the table (``details["op"]`` echoes it).
    """
    try:
        return VERBS[op]
    except KeyError:
        raise errors.UnknownOp(f"unknown op {op[:64]!r}", op=op[:64]) from None


def validate(verb: Verb, args: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``args`` against ``verb``'s schema (see ``check_args``).

    Raises:
        InvalidArgument.
    """
    return check_args(verb.args, args)


def handle(service: QueueService, request: Request, ctx: Context | None = None) -> dict[str, Any]:
    """Run one request synchronously and return its wire result (a lease does not wait).

    Args:
        service: the queue service to call.
        request: a decoded request.
        ctx: who is asking (default ``Context()``).
    Returns:
        The ``result`` object of the reply.
    Raises:
        UnknownOp, InvalidArgument, and whatever the service raises (``RelayError``s).
    """
    verb = lookup(request.op)
    return verb.handler(service, validate(verb, request.args), ctx or Context()).result
