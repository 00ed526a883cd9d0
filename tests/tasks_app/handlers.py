"""Application handlers for ``relay_worker --app tests.tasks_app.handlers.HANDLERS``."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import orjson

from queue_core.worker import JobContext, NonRetryableError, StoredResult


def echo(payload: Any, ctx: JobContext) -> dict[str, Any]:
    """Succeed (the return value is ignored by the worker)."""
    return {"echo": payload, "attempt": ctx.attempt}


def stored(payload: Any, ctx: JobContext) -> StoredResult:
    """Succeed with a result the worker sends with its ack."""
    return StoredResult({"doubled": payload["n"] * 2})


def boom(payload: Any, ctx: JobContext) -> None:
    """Fail with the payload's message (retried)."""
    raise RuntimeError(payload.get("message", "boom"))


def refuse(payload: Any, ctx: JobContext) -> None:
    """Fail for good (dead-lettered at once)."""
    raise NonRetryableError("refused: bad input")


async def async_ok(payload: Any, ctx: JobContext) -> None:
    """An ``async def`` handler."""
    await asyncio.sleep(0)


def hang(payload: Any, ctx: JobContext) -> None:
    """Ignore the shutdown event and block for ``payload["seconds"]`` (60 by default)."""
    threading.Event().wait(float(payload.get("seconds", 60)))


HANDLERS = {
    "echo": echo,
    "stored": stored,
    "boom": boom,
    "refuse": refuse,
    "async_ok": async_ok,
    "hang": hang,
}


def record_meta(payload: Any, ctx: JobContext) -> None:
    """Write the job's ``ctx.meta`` as JSON to ``payload["out"]`` (what a tracing handler
    would continue its trace from), so a test can see what the handler received."""
    Path(payload["out"]).write_bytes(orjson.dumps({"meta": ctx.meta, "job_id": ctx.job_id}))


META_HANDLERS = {"record_meta": record_meta}
"""``relay_worker --app tests.tasks_app.handlers.META_HANDLERS``."""
