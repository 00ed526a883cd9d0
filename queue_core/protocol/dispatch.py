"""The op table: op name -> argument schema + handler, in the style of Faktory's command set.

The ops, their argument schemas and how each is scheduled are declared once, in
``queue_core.protocol.ops``; ``VERBS`` pairs each with its handler here. ``lookup`` finds a
verb (``UnknownOp`` otherwise), ``validate`` checks argument names and types
(``InvalidArgument`` with ``details["field"]`` naming the argument), and the handler calls
``QueueService`` and shapes its result as ``docs/protocol.md`` says. An op without a handler
of its own calls the service method of its name with the checked arguments. Handlers never
decide transitions; only the service does.

Each handler returns an ``Outcome``: the wire result plus what the commit made ready or due,
so the server knows whom to wake. ``handle`` runs one request synchronously (no long-poll
wait): the loopback transport and tests use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from queue_core import auth, errors, metrics
from queue_core.protocol.codec import Request
from queue_core.protocol.ops import OPS, Arg, Kind, check_args, required_args
from queue_core.service import PRUNABLE_STATES, PRUNE_BATCH, QueueService
from queue_core.states import JobState

__all__ = [
    "CONTROLS",
    "ON_LOOP",
    "REFUSED_WHILE_DRAINING",
    "VERBS",
    "Context",
    "Kind",
    "Outcome",
    "Verb",
    "check_args",
    "handle",
    "lookup",
    "validate",
]


class Context(NamedTuple):
    """Who is asking.

    Attributes:
        peer: the connection's peer address (``host:port``); the default ``worker_id`` of
            ``lease``.
        actor: recorded as the actor of ``dead_retry`` / ``dead_purge`` / ``cancel`` (None
            when unknown).
    """

    peer: str = "local"
    actor: str | None = None


class Outcome(NamedTuple):
    """A handler's result and its effects on waiting leases.

    Attributes:
        result: the wire result object.
        ready_queues: queues that got READY jobs in this request (their waiters are woken).
        due_at_ms: the earliest epoch ms at which a job this request scheduled becomes due
            (the server's reaper promotes it then), or for a lease, when the next rate token
            of a queue it found or left dry comes (the reaper wakes its long-polls then), or
            None.
        events: what to count in the metrics once the request has committed
            (``metrics.record``).
    """

    result: dict[str, Any]
    ready_queues: frozenset[str] = frozenset()
    due_at_ms: int | None = None
    events: tuple[metrics.Event, ...] = ()


Handler = Callable[[QueueService, dict[str, Any], Context], Outcome]


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
    due: int | None = None
    counts: dict[tuple[str, str], int] = {}  # one metrics event per (kind, queue)
    for job, deduplicated in jobs:
        queues, at_ms = _job_effects(job)
        ready |= queues
        if at_ms is not None and (due is None or at_ms < due):
            due = at_ms
        key = ("deduplicated" if deduplicated else "submitted", job["queue"])
        counts[key] = counts.get(key, 0) + 1
    events = tuple(metrics.Event(kind, queue, n) for (kind, queue), n in counts.items())
    return Outcome(result, frozenset(ready), due, events)


def _hello(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    # The server checks the key itself and remembers it on the connection; this handler
    # serves the loopback transport and direct callers, which have no connection state.
    principal = auth.authenticate(args["api_key"], surface="tcp", peer=ctx.peer)
    return Outcome({**principal.describe(), "server_time_ms": svc.clock.now_ms()})


def _ping(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    return Outcome({"pong": True, "server_time_ms": svc.clock.now_ms()})


def _submit(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    # Never change ``args``: a call may run twice (the flat group commit's second round).
    options = (
        {k: v for k, v in args.items() if k not in ("queue", "payload")} if len(args) > 2 else {}
    )
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
    # A queue this claim found or left out of rate tokens: when its next one comes (the
    # server's reaper wakes a long-poll of it then; ``QueueService.sweep``). With jobs too: a
    # long-poll that got the last token wakes no other (``Wakeups.leave``), which would have
    # found the queue dry and asked for that instant itself.
    due = svc.next_token_ms(args["queues"])
    return Outcome({"jobs": leases}, due_at_ms=due, events=_leased(svc, leases))


def _leased(
    svc: QueueService, leases: list[dict[str, Any]], *, with_ack: bool = False
) -> tuple[metrics.Event, ...]:
    """The metrics of jobs just leased (by ``lease``, or ``with_ack``: by ``lease_next``)."""
    events: list[metrics.Event] = []
    if leases:
        now = svc.clock.now_ms()
        for lease in leases:
            events.append(metrics.Event("leased", lease["queue"]))
            if with_ack:
                events.append(metrics.Event("leased_next", lease["queue"]))
            if lease["attempt"] == 1:
                delay_s = (now - lease["created_at_ms"]) / 1000
                events.append(metrics.Event("start_delay", lease["queue"], delay_s))
    return tuple(events)


def _next(
    svc: QueueService, out: Mapping[str, Any], result: dict[str, Any]
) -> tuple[metrics.Event, ...]:
    """Copy an ack's or fail's ``next`` leases (asked for with ``lease_next``) into its wire
    result; return their metrics."""
    if "next" not in out:
        return ()
    result["next"] = out["next"]
    return _leased(svc, out["next"], with_ack=True)


def _lease_ids(args: Mapping[str, Any]) -> dict[str, Any]:
    return {"worker_id": args["worker_id"], "lease_token": args["lease_token"]}


def _renew(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.renew(args["job_id"], **_lease_ids(args), lease_ms=args.get("lease_ms"))
    # A timed-out attempt goes to RETRYING (the reaper's sweep promotes it) or DEAD: nothing
    # to wake.
    return Outcome(
        {k: out[k] for k in ("job_id", "lease_expires_at_ms", "stop")},
        events=_timed_out(out),
    )


def _renew_batch(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.renew_batch(args["renews"])
    events: list[metrics.Event] = []
    results = []
    for entry in out["results"]:
        if entry["ok"]:
            events.extend(_timed_out(entry))
        results.append({k: entry[k] for k in _RENEW_ENTRY})
    return Outcome({"results": results}, events=tuple(events))


_RENEW_ENTRY = ("job_id", "ok", "lease_expires_at_ms", "stop", "error")


def _timed_out(out: Mapping[str, Any]) -> tuple[metrics.Event, ...]:
    """The metrics of a renew that failed its attempt for its time limit (``stop:
    "timeout"``, with the job's ``queue`` and new ``state``), else none."""
    if out["stop"] != "timeout":
        return ()
    queue = _queue(out)
    ended = {
        JobState.RETRYING: ("failed",),
        JobState.DEAD: ("failed", "dead"),
        JobState.CANCELLED: ("cancelled",),
    }[out["state"]]
    return tuple(metrics.Event(e, queue) for e in ("timed_out", *ended))


def _ack(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.ack(
        args["job_id"],
        **_lease_ids(args),
        result=args.get("result"),
        lease_next=args.get("lease_next"),
    )
    events: tuple[metrics.Event, ...] = ()
    if not out["duplicate"]:
        events = (metrics.Event("acked", _queue(out)),)
    result = {k: out[k] for k in ("job_id", "state", "duplicate")}
    events += _next(svc, out, result)
    return Outcome(result, _freed(svc, out), events=events)


def _ack_batch(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.ack_batch(args["acks"], lease_next=args.get("lease_next"))
    events: list[metrics.Event] = []
    freed: set[str] = set()
    results = []
    for entry in out["results"]:
        if entry["ok"] and not entry["duplicate"]:
            events.append(metrics.Event("acked", _queue(entry)))
            freed |= _freed(svc, entry)
        results.append({k: entry[k] for k in ("job_id", "ok", "state", "duplicate", "error")})
    events.extend(_leased(svc, out["next"], with_ack=True))
    return Outcome(
        {"results": results, "next": out["next"]}, frozenset(freed), events=tuple(events)
    )


def _freed(svc: QueueService, out: Mapping[str, Any]) -> frozenset[str]:
    """The queue an ack or fail freed a slot in, when a claim left jobs there for its cap
    (``QueueService.held_back``): its long-polls look again."""
    queue = out.get("queue")
    if queue is not None and not out["duplicate"] and svc.held_back(queue):
        return frozenset({queue})
    return frozenset()


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
        exception_class=args.get("exception_class"),
        traceback=args.get("traceback"),
        lease_next=args.get("lease_next"),
    )
    result = {k: out[k] for k in ("job_id", "state", "retry_at_ms", "dead_reason", "duplicate")}
    due = out["retry_at_ms"] if out["state"] == JobState.RETRYING else None
    events: tuple[metrics.Event, ...] = ()
    if not out["duplicate"]:
        queue = _queue(out)
        if out["state"] == JobState.CANCELLED:
            events = (metrics.Event("cancelled", queue),)
        else:
            events = (metrics.Event("failed", queue),)
        if out["state"] == JobState.DEAD:
            events += (metrics.Event("dead", queue),)
    events += _next(svc, out, result)
    return Outcome(result, _freed(svc, out), due_at_ms=due, events=events)


def _release(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.release(args["job_id"], **_lease_ids(args))
    if out["state"] == JobState.CANCELLED:
        return Outcome(
            {"job_id": out["job_id"], "state": out["state"]},
            events=(metrics.Event("cancelled", out["queue"]),),
        )
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


def _queue_controls(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    # Paged on the wire as stats is: thousands of controlled queues would not fit one frame.
    limit = args.get("limit", STATS_PAGE)
    out = svc.queue_controls(args.get("queue"), limit=limit, after=args.get("after"))
    return Outcome(out)


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


def _cancel(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.cancel(args["job_id"], actor=ctx.actor)
    job = out["job"]
    events = (metrics.Event("cancelled", job["queue"]),) if out["cancelled"] else ()
    return Outcome({"job": job, "cancelled": out["cancelled"]}, events=events)


def _pause(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    return Outcome(svc.pause(args["queue"], actor=ctx.actor))


def _resume(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    # The queue's waiting long-polls look again (the service marks it ready for other servers).
    out = svc.resume(args["queue"], actor=ctx.actor)
    return Outcome(out, frozenset({out["queue"]}))


def _set_queue_limits(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    limits = {k: args[k] for k in ("max_leased", "rate_per_s", "burst") if k in args}
    out = svc.set_queue_limits(args["queue"], actor=ctx.actor, **limits)
    # A raised cap or rate may let a waiting long-poll claim: it looks again either way.
    return Outcome(out, frozenset({out["queue"]}))


def _dead_purge(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    out = svc.purge(args["job_id"], actor=ctx.actor, dead_only=True)
    return Outcome({"job_id": out["job_id"], "purged": True})


def _prune(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
    state, age = args.get("state", "all"), args["older_than_ms"]
    ages = dict.fromkeys(PRUNABLE_STATES, age) if state == "all" else {state: age}
    limit = args.get("limit", PRUNE_BATCH)
    deleted = svc.prune_batch(ages, limit=limit, actor=ctx.actor)
    return Outcome({"deleted": deleted, "more": sum(deleted.values()) >= limit})


# ---------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True, slots=True)
class Verb:
    """One operation: its name, argument schema, handler and how the server schedules it."""

    op: str
    args: Mapping[str, Arg]
    handler: Handler
    kind: Kind
    required: tuple[str, ...] = ()  # ``required_args(args)``


# Handlers that do more than call the service method of the op's name (``_by_name``).
_HANDLERS: dict[str, Handler] = {
    "ping": _ping,
    "hello": _hello,
    "submit": _submit,
    "submit_batch": _submit_batch,
    "lease": _lease,
    "renew": _renew,
    "renew_batch": _renew_batch,
    "ack": _ack,
    "ack_batch": _ack_batch,
    "fail": _fail,
    "release": _release,
    "inspect": _inspect,
    "stats": _stats,
    "dead_list": _dead_list,
    "dead_retry": _dead_retry,
    "dead_purge": _dead_purge,
    "prune": _prune,
    "queue_controls": _queue_controls,
    "cancel": _cancel,
    "pause": _pause,
    "resume": _resume,
    "set_queue_limits": _set_queue_limits,
}


def _by_name(name: str) -> Handler:
    """The handler of an op without one of its own: ``QueueService.<name>(**args)``, whose
    dict is the wire result."""

    def handler(svc: QueueService, args: dict[str, Any], ctx: Context) -> Outcome:
        return Outcome(getattr(svc, name)(**args))

    return handler


VERBS: dict[str, Verb] = {
    name: Verb(
        name, op.args, _HANDLERS.get(name) or _by_name(name), op.kind, required_args(op.args)
    )
    for name, op in OPS.items()
}

# Refused with UNAVAILABLE while the server drains: they would start new work.
REFUSED_WHILE_DRAINING = frozenset(name for name, op in OPS.items() if op.refused_while_draining)
CONTROLS = frozenset(name for name, op in OPS.items() if op.controls)
ON_LOOP = frozenset(name for name, op in OPS.items() if op.on_loop)


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
    return check_args(verb.args, args, required=verb.required)


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
