"""Run service calls as one group commit, as the TCP server's writer does (``GroupCommit``),
from a test's own thread and connection."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from queue_core.protocol import limits
from queue_core.protocol.writer import Call, GroupCommit
from queue_core.service import QueueService


def run_group(
    service: QueueService,
    fns: Sequence[Callable[[], Any]],
    *,
    claims: bool = False,
    durable: Sequence[bool] | None = None,
    queues: Sequence[Sequence[str]] | None = None,
    alone: Sequence[bool] | None = None,
    jobs: Sequence[Sequence[str]] | None = None,
) -> tuple[list[tuple[bool, Any]], GroupCommit]:
    """Run ``fns`` as one group commit (flat first, as the server does); return each call's
    ``(ok, result or exception)`` and the ``GroupCommit`` (its ``commits``, ``flat``).

    Args:
        claims: every call is a claim (its batch sweeps first).
        durable: each call's ``durable`` (default: all True).
        queues: each claim's queues (default: none named).
        alone: each call's ``alone`` (default: all False).
        jobs: each call's ``jobs``, the rows it updates (default: none named).
    """
    loop = asyncio.new_event_loop()
    try:
        levels = durable if durable is not None else [True] * len(fns)
        named = queues if queues is not None else [()] * len(fns)
        apart = alone if alone is not None else [False] * len(fns)
        rows = jobs if jobs is not None else [()] * len(fns)
        calls = [
            Call(
                fn,
                loop.create_future(),
                loop,
                claims=claims,
                durable=level,
                queues=names,
                alone=own,
                jobs=ids,
            )
            for fn, level, names, own, ids in zip(fns, levels, named, apart, rows, strict=True)
        ]
        group = GroupCommit(
            service,
            sweep=lambda: set(service.sweep()),
            on_ready=lambda queues: None,
            failures=limits.Every(limits.FAILURE_LOG_EVERY_S),
        )
        return group.run(calls), group
    finally:
        loop.close()
