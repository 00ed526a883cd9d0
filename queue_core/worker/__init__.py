"""Relay's pull worker: lease jobs over TCP, run handlers, ack or fail, renew leases.

``Worker`` is the runner (``queue_core.worker.runner``); handlers and the demonstration
executor live in ``queue_core.worker.handlers``. ``manage.py relay_worker`` (``relay worker``)
wraps it in a process with signal handling.
"""

from queue_core.worker.handlers import (
    Handler,
    JobContext,
    JobInterrupted,
    NonRetryableError,
    StopSignal,
    StoredResult,
    TaskJobRefused,
    demo_handler,
)
from queue_core.worker.runner import Worker, WorkerClient

__all__ = [
    "Handler",
    "JobContext",
    "JobInterrupted",
    "NonRetryableError",
    "StopSignal",
    "StoredResult",
    "TaskJobRefused",
    "Worker",
    "WorkerClient",
    "demo_handler",
]
