"""``relay worker --queue Q [--queue Q2] [--concurrency N]``: run the demo pull worker.

SIGTERM or SIGINT stops it gracefully (``Worker.stop``): no new leases, running jobs get
``--shutdown-timeout-ms`` to finish, the rest are released back to ready. A second signal exits
at once, leaving held leases to expire.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any

import orjson
from django.core.management.base import BaseCommand, CommandParser

from queue_core.conf import relay_settings
from queue_core.management.relay_command import (
    add_connection_arguments,
    invalid_argument,
    make_client,
    relay_errors,
    resolve_address,
)
from queue_core.worker import Worker, WorkerClient
from queue_core.worker.runner import logger


class Command(BaseCommand):
    """Build a ``Worker`` from the options, wire the signals, run it."""

    help = (
        "Run a pull worker with the safe demonstration handler: {'sleep_ms': N} sleeps, "
        "{'fail': true, 'error': '...', 'retryable': false} fails, anything else succeeds. "
        "Logs JSON lines on stderr, starting with event=worker_ready."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Define the worker options."""
        parser.add_argument(
            "--queue",
            action="append",
            metavar="QUEUE",
            help="Queue to lease from; repeat for several (default: default).",
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=8,
            metavar="N",
            help="Most jobs held and run at once (default 8).",
        )
        parser.add_argument(
            "--shutdown-timeout-ms",
            type=int,
            default=30_000,
            metavar="MS",
            help="On SIGTERM/SIGINT, how long running jobs may finish before they are released "
            "(default 30000).",
        )
        parser.add_argument(
            "--lease-ms",
            type=int,
            default=None,
            metavar="MS",
            help="Lease length, renewed every third of it (default RELAY_VISIBILITY_TIMEOUT_MS, "
            f"now {relay_settings().visibility_timeout_ms}).",
        )
        parser.add_argument(
            "--wait-ms",
            type=int,
            default=5_000,
            metavar="MS",
            help="Long-poll wait of each lease request, 0..RELAY_MAX_WAIT_MS (default 5000).",
        )
        parser.add_argument(
            "--worker-id", metavar="ID", help="Id to lease with (default HOSTNAME:PID)."
        )
        add_connection_arguments(
            parser, json_help="On exit, print the worker's counters as JSON on stdout."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the worker until a signal stops it."""
        address = resolve_address(options["address"])

        def client_factory() -> WorkerClient:
            return make_client(address)

        try:
            worker = Worker(
                client_factory,
                options["queue"] or ["default"],
                concurrency=options["concurrency"],
                lease_ms=options["lease_ms"],
                wait_ms=options["wait_ms"],
                shutdown_timeout_ms=options["shutdown_timeout_ms"],
                worker_id=options["worker_id"],
            )
        except ValueError as exc:
            raise invalid_argument(str(exc)) from exc
        previous = _install_signal_handlers(worker)
        try:
            with relay_errors(address):
                worker.run()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        counters = worker.counters()
        if options["json"]:
            self.stdout.write(orjson.dumps(counters).decode())
        elif options["verbosity"] >= 2:
            self.stdout.write(" ".join(f"{key}={value}" for key, value in counters.items()))


def _install_signal_handlers(worker: Worker) -> dict[int, Any]:
    """Make SIGTERM/SIGINT stop ``worker`` gracefully, and a second one exit at once."""
    previous: dict[int, Any] = {}
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) > 1:
            logger.warning(
                "event=worker_killed signal=%s",
                name,
                extra={"event": "worker_killed", "signal": name},
            )
            sys.stderr.flush()
            os._exit(128 + signum)
        logger.info(
            "event=worker_signal signal=%s", name, extra={"event": "worker_signal", "signal": name}
        )
        worker.stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, on_signal)
    return previous
