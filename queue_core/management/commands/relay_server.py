"""``manage.py relay_server``: check the database, migrate, recover leases, serve over TCP."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from queue_core.client import parse_address
from queue_core.conf import relay_settings
from queue_core.protocol.server import RelayServer
from queue_core.service import QueueService

log = logging.getLogger("relay.server")

EXIT_CORRUPT = 3


class Command(BaseCommand):
    """Run the Relay TCP server until SIGTERM/SIGINT, then drain and exit 0.

    Exit codes: 0 after a graceful shutdown, 3 when the database fails its integrity check.
    """

    help = "Serve Relay's NDJSON protocol over TCP (see docs/protocol.md)."

    def add_arguments(self, parser: CommandParser) -> None:
        """Declare --address, --db and --shutdown-grace-ms."""
        s = relay_settings()
        parser.add_argument(
            "--address",
            default=s.address,
            help=f"HOST:PORT to listen on (RELAY_ADDRESS, default {s.address}).",
        )
        parser.add_argument(
            "--db", default=None, help="SQLite database file (RELAY_DB; default from settings)."
        )
        parser.add_argument(
            "--shutdown-grace-ms",
            type=int,
            default=s.shutdown_grace_ms,
            help="After SIGTERM, how long ack/fail/renew/release are still served "
            f"(RELAY_SHUTDOWN_GRACE_MS, default {s.shutdown_grace_ms}).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Check, migrate, recover, then serve until signalled.

        Raises:
            CommandError: ``CORRUPT`` (exit code 3) when ``PRAGMA quick_check`` fails or the
                file is not a database; ``INVALID_ARGUMENT`` for a bad address or grace.
        """
        try:
            host, port = parse_address(options["address"], allow_port_zero=True)
        except ValueError as exc:
            raise CommandError(f"INVALID_ARGUMENT: {exc}") from exc
        if options["shutdown_grace_ms"] < 0:
            raise CommandError("INVALID_ARGUMENT: --shutdown-grace-ms must be >= 0")
        if options["db"]:
            use_database(options["db"])
        path = settings.DATABASES["default"]["NAME"]
        service = QueueService()
        problems = service.store.quick_check()
        if problems:
            raise CommandError(
                f"CORRUPT: database {path} failed integrity check: {'; '.join(problems[:5])}",
                returncode=EXIT_CORRUPT,
            )
        call_command("migrate", interactive=False, verbosity=0)
        recovered = service.recover()
        log.info(
            "event=recovered leases=%d db=%s",
            recovered,
            path,
            extra={"event": "recovered", "leases": recovered, "db": str(path)},
        )
        connections.close_all()  # the server's threads open their own connections
        server = RelayServer(
            service, host=host, port=port, shutdown_grace_ms=options["shutdown_grace_ms"]
        )
        try:
            asyncio.run(server.serve(handle_signals=True))
        except OSError as exc:
            raise CommandError(f"UNAVAILABLE: cannot listen on {host}:{port}: {exc}") from exc


def use_database(path: str) -> None:
    """Point the default database at ``path`` before anything uses it."""
    connections.close_all()
    settings.DATABASES["default"]["NAME"] = path
    connections["default"].settings_dict["NAME"] = path
