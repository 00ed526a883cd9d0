"""How HTTP views reach the service: through the op table, exactly as the TCP server does.

``run(request, op, args)`` looks the op up in ``queue_core.protocol.dispatch``, checks the
arguments with the same schema, calls the same handler (which calls ``QueueService``) and
records the same metrics. Views add only HTTP shape (status codes, headers, long-poll waits);
no transition logic lives in queue_api.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from django.http import HttpRequest

from queue_api.security import peer_of
from queue_core import auth, errors, metrics
from queue_core.protocol import dispatch
from queue_core.protocol.wakeups import ProcessWakeups
from queue_core.service import BULK_CHUNK, QueueService


@functools.cache
def service() -> QueueService:
    """The process's ``QueueService`` (thread-safe: each thread gets its own connection)."""
    return QueueService(observer=metrics.observe)


def key_ring() -> auth.KeyRing:
    """The key table's snapshot (``auth.cached_ring``); a stale one is read again as the TCP
    server reads it (``auth.read_ring``), so a locked or lost database gets the code TCP
    gives (``BUSY``, ``UNAVAILABLE``, ``STORAGE_*``), not 500 ``INTERNAL``.

    Raises:
        RelayError: the table cannot be read now.
    """
    return auth.cached_ring() or auth.read_ring(service().driver)


@functools.cache
def wakeups() -> ProcessWakeups:
    """The process's long-poll wake-ups (the TCP server's ``Wakeups`` and ``FeedFollower``),
    following ``service()``'s change feed. ``service`` is looked up at each call: a test's
    stand-in for it (a service on a fake clock) made while these were first built stayed in
    them for the rest of the process, and their due instants, read on that frozen clock,
    never came (three long-poll tests after it waited out their 15 s)."""
    return ProcessWakeups(lambda: service())


# Ops whose commit may make a job ready: waiting long-polls of this process look again.


def context(request: HttpRequest) -> dispatch.Context:
    """Who is asking: the peer (default worker id ``http:host:port``) and the actor."""
    principal = getattr(request, "auth", None)
    actor = principal.actor if isinstance(principal, auth.Principal) else "anonymous"
    peer = peer_of(request)
    return dispatch.Context(peer=f"http:{peer}", actor=f"http:{peer} {actor}"[:150])


def check(op: str, args: dict[str, Any]) -> tuple[dispatch.Verb, dict[str, Any]]:
    """Return the verb and its checked arguments (``None`` values dropped).

    Raises:
        InvalidArgument.
    """
    verb = dispatch.lookup(op)
    return verb, dispatch.validate(verb, {k: v for k, v in args.items() if v is not None})


def call(request: HttpRequest, verb: dispatch.Verb, args: dict[str, Any]) -> dispatch.Outcome:
    """Run checked ``args`` through ``verb``'s handler and count what it did.

    Raises:
        RelayError: whatever the service raises (counted when it is a stale token).
    """
    try:
        outcome = verb.handler(service(), dict(args), context(request))
    except errors.RelayError as exc:
        metrics.rejected(verb.op, exc)
        raise
    metrics.record(outcome.events)  # the service committed before returning
    if outcome.ready_queues:  # (also an ack that freed a slot under a queue's cap)
        wakeups().poke(outcome.ready_queues)
    return outcome


def run(request: HttpRequest, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """Check and run one op; return its wire result.

    Raises:
        RelayError.
    """
    verb, checked = check(op, args)
    return call(request, verb, checked).result


def run_each(
    request: HttpRequest, op: str, many: Sequence[dict[str, Any]]
) -> list[dict[str, Any] | errors.RelayError]:
    """Check and run ``op`` once per arguments of ``many``, ``BULK_CHUNK`` calls to a
    transaction (``QueueService.transaction``: each call a SAVEPOINT that rolls back alone,
    the TCP server's group commit), leaving the write lock to other writers after each
    (``QueueService.bulk_chunk``); return each call's wire result or its error, in order.

    One transaction a call, back to back, kept SQLite's write lock from the TCP server: 1,000
    replays held its writes up to 3.8 s (a hostile review). A chunk whose transaction fails
    (``BUSY`` at BEGIN, a storage fault) changed nothing: each of its calls gets that error.
    Metrics and long-poll wake-ups follow each chunk's COMMIT.
    """
    verb = dispatch.lookup(op)
    svc, ctx = service(), context(request)
    results: list[dict[str, Any] | errors.RelayError] = []
    for start in range(0, len(many), BULK_CHUNK):
        chunk = many[start : start + BULK_CHUNK]
        done: list[dispatch.Outcome | errors.RelayError] = []
        try:
            with svc.bulk_chunk(), svc.transaction():
                for args in chunk:
                    try:
                        done.append(verb.handler(svc, check(op, args)[1], ctx))
                    except errors.RelayError as exc:
                        done.append(exc)
        except errors.RelayError as exc:
            done += [exc] * (len(chunk) - len(done))
            done = [exc if isinstance(o, dispatch.Outcome) else o for o in done]
        ready: set[str] = set()
        for outcome in done:
            if isinstance(outcome, errors.RelayError):
                metrics.rejected(verb.op, outcome)
                results.append(outcome)
            else:
                metrics.record(outcome.events)
                ready |= outcome.ready_queues
                results.append(outcome.result)
        if ready:
            wakeups().poke(ready)
    return results
