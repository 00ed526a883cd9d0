"""A worker process whose handler ignores shutdown: ``python -m tests.crash.hang_worker ADDRESS``.

The demo handler of ``relay_worker`` stops sleeping as soon as the worker shuts down; this one
blocks for an hour whatever happens, the worst case for a bounded shutdown. SIGTERM calls
``Worker.stop()``, as ``relay_worker`` does. Logs are Relay's JSON lines on stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any


def hang(payload: Any, ctx: Any) -> None:
    """Block for an hour, deaf to ``ctx.shutdown``."""
    threading.Event().wait(3600)


def main() -> None:
    """Run a Worker with the hanging handler until SIGTERM."""
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--queue", default="hang")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--lease-ms", type=int, default=30_000)
    parser.add_argument("--shutdown-timeout-ms", type=int, default=1_000)
    parser.add_argument("--worker-id", default="hang-worker")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relayproject.settings")
    import django

    django.setup()  # Relay's logging configuration: JSON lines on stderr
    from queue_core.client import RelayClient
    from queue_core.worker import Worker

    worker = Worker(
        lambda: RelayClient(args.address),
        [args.queue],
        concurrency=args.concurrency,
        handler=hang,
        lease_ms=args.lease_ms,
        wait_ms=1_000,
        shutdown_timeout_ms=args.shutdown_timeout_ms,
        worker_id=args.worker_id,
    )
    signal.signal(signal.SIGTERM, lambda signum, frame: worker.stop())
    worker.run()


if __name__ == "__main__":
    main()
