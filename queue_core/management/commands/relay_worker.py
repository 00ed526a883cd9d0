"""``relay worker --queue Q [--queue Q2] [--concurrency N]``: run a pull worker (the demo one).

``--app package.module.HANDLERS`` runs an application's handlers instead, routed by the
payload's ``task`` field (``queue_core.worker.app``); ``--tasks`` runs Django tasks enqueued
through ``queue_core.tasks_backend.RelayBackend``: without ``--queue`` it serves every queue in
the backends' ``QUEUES`` (``worker_queues``), and before leasing it checks that a
shared-database backend's database is the server's (``check_worker_setup``), exiting 1 with one
line when not. When every backend is networked with one ``ADDRESS``, that is the default
``--address`` (before ``RELAY_ADDRESS``). The other two refuse Django tasks' jobs
(``handlers.TaskJobRefused``).

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
from django.core.management.base import CommandParser

from queue_core.client import RelayClient
from queue_core.conf import relay_settings
from queue_core.management.relay_command import (
    RelayBaseCommand,
    add_connection_arguments,
    ensure_log_output,
    invalid_argument,
    make_client,
    relay_errors,
    resolve_address,
)
from queue_core.worker import Handler, Worker, WorkerClient, demo_handler
from queue_core.worker.runner import logger


class Command(RelayBaseCommand):
    """Build a ``Worker`` from the options, wire the signals, run it."""

    help = (
        "Run a pull worker; by default with the safe demonstration handler: {'sleep_ms': N} "
        "sleeps, "
        "{'fail': true, 'error': '...', 'retryable': false} fails, anything else succeeds. "
        "Logs on stderr (JSON lines under relayproject's settings), starting with "
        "event=worker_ready."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Define the worker options."""
        parser.add_argument(
            "--queue",
            action="append",
            metavar="QUEUE",
            help="Queue to lease from; repeat for several (default: default; with --tasks, "
            "every queue in the RelayBackends' QUEUES, and default for one whose QUEUES is "
            "empty).",
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=8,
            metavar="N",
            help="Most jobs held and run at once, 1..1000, a thread each (default 8).",
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
        executor = parser.add_mutually_exclusive_group()
        executor.add_argument(
            "--app",
            metavar="PATH",
            help="Run application handlers: PATH is package.module.attribute naming a mapping of "
            "task name to handler(payload, ctx); each job goes to the handler its payload's "
            "'task' field names (default: the demonstration handler).",
        )
        executor.add_argument(
            "--tasks",
            action="store_true",
            help="Run Django tasks enqueued with queue_core.tasks_backend.RelayBackend (a "
            "shared-database backend needs this project to share Relay's database; networked "
            "backends read over TCP, and their common ADDRESS is the default --address).",
        )
        add_connection_arguments(
            parser, json_help="On exit, print the worker's counters as JSON on stdout."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the worker until a signal stops it."""
        ensure_log_output()
        given = options["address"]
        if not given and options.get("tasks"):
            given = _networked_address()
        address = resolve_address(given)

        def client_factory() -> WorkerClient:
            return make_client(address, api_key=options.get("api_key"))

        try:
            handler = _handler(options)
        except (ImportError, TypeError, ValueError) as exc:
            option = "--app" if options.get("app") else "--tasks"
            raise invalid_argument(f"{option}: {exc}") from exc
        queues = options["queue"] or ["default"]
        if options.get("tasks"):
            served = _check_tasks_setup(make_client(address, api_key=options.get("api_key")))
            queues = options["queue"] or served
        try:
            worker = Worker(
                client_factory,
                queues,
                handler=handler,
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


def _handler(options: dict[str, Any]) -> Handler:
    """Return the handler that ``--app`` / ``--tasks`` select (the demo handler by default)."""
    if options.get("app"):
        from queue_core.worker.app import load_handlers

        return load_handlers(options["app"])
    if options.get("tasks"):
        from django.tasks import task_backends

        from queue_core.tasks_backend import RelayBackend, execute_task

        if not any(isinstance(backend, RelayBackend) for backend in task_backends.all()):
            raise ValueError("TASKS has no queue_core.tasks_backend.RelayBackend")
        return execute_task
    return demo_handler


def _networked_address() -> str | None:
    """The ``ADDRESS`` every ``RelayBackend`` names when all are networked and agree (the
    ``--tasks`` worker's default before ``RELAY_ADDRESS``), else None."""
    from queue_core.tasks_backend import relay_backends

    try:
        backends = relay_backends()
    except Exception:  # noqa: BLE001 - a bad TASKS setting is reported by _handler
        return None
    addresses = {backend.address for backend in backends}
    if len(addresses) == 1 and backends and backends[0].networked:
        return backends[0].address
    return None


def _check_tasks_setup(client: RelayClient) -> list[str]:
    """Check the ``--tasks`` worker's database against the server's; return the queues it
    serves without ``--queue``.

    Raises:
        CommandError: ``--tasks: ...`` (exit 1) when the database is not usable or not the
            server's.
    """
    from django.core.exceptions import ImproperlyConfigured

    from queue_core.tasks_backend import check_worker_setup, relay_backends, worker_queues

    backends = relay_backends()
    try:
        for warning in check_worker_setup(backends, client):
            logger.warning(
                "event=tasks_setup_unchecked reason=%s",
                warning,
                extra={"event": "tasks_setup_unchecked", "reason": warning},
            )
    except ImproperlyConfigured as exc:
        raise invalid_argument(f"--tasks: {exc}") from exc
    finally:
        client.close()
    return worker_queues(backends)


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
