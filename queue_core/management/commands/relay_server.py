"""``manage.py relay_server``: check the database, migrate, recover leases, serve over TCP.

On SQLite (one server per file) it takes the file's lock, checks its integrity, migrates and
releases every lease. On PostgreSQL (any number of servers on one database) it checks that
the database answers and is fully migrated, and releases nothing: other servers' workers
hold their leases, and lost ones come back by expiry.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError, connections

from queue_core import exposure, metrics, schema
from queue_core.client import parse_address
from queue_core.conf import relay_settings
from queue_core.errors import MIGRATION_ROLLED_BACK, StorageFull, StorageIO, storage_exit_code
from queue_core.management.relay_command import (
    RelayBaseCommand,
    check_migrations,
    describe_database,
    ensure_log_output,
)
from queue_core.protocol.loops import loop_factory
from queue_core.protocol.server import RelayServer
from queue_core.service import QueueService
from queue_core.storage import AlreadyServed

log = logging.getLogger("relay.server")

EXIT_CORRUPT = 3


class Command(RelayBaseCommand):
    """Run the Relay TCP server until SIGTERM/SIGINT, then drain and exit 0.

    Exit codes: 0 after a graceful shutdown, 3 when the database fails its integrity check,
    4 when another server holds the SQLite file, 5 when asked to listen beyond loopback while
    no API key exists (``PUBLIC_WITHOUT_KEYS``; ``--allow-public-without-keys`` opts in), 7 when
    its disk is full, 8 when it cannot be read or written (an I/O error, or a read-only file,
    folder or file system).
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
        parser.add_argument(
            "--metrics-address",
            default=s.metrics_address,
            metavar="HOST:PORT",
            help="Serve Prometheus /metrics for this process on HOST:PORT, e.g. 127.0.0.1:7401 "
            f"(RELAY_METRICS_ADDRESS, default {s.metrics_address or 'off'}).",
        )
        parser.add_argument(
            "--allow-public-without-keys",
            action="store_true",
            default=s.allow_public_without_keys,
            help="Listen on an address that is not loopback even though no API key exists "
            "(RELAY_ALLOW_PUBLIC_WITHOUT_KEYS=1); without it such a start is refused (exit 5).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Check, migrate, recover, then serve until signalled.

        Raises:
            CommandError: ``CORRUPT`` (exit code 3) when ``PRAGMA integrity_check`` (or
                ``quick_check``, ``RELAY_STARTUP_CHECK=quick``) fails or the
                file is not a database; ``ALREADY_SERVED`` (exit code 4) when another relay
                server holds this database; ``STORAGE_FULL`` (exit code 7) when the disk
                holding it is full; ``STORAGE_IO`` (exit code 8) when it cannot be read or
                written (I/O error; read-only file, folder or file system);
                ``INVALID_ARGUMENT`` for a bad address, grace or
                database path; ``UNAVAILABLE`` when the database cannot be written, or (on
                PostgreSQL) has unapplied migrations; ``NEWER_SCHEMA`` (exit code 9) when a
                newer Relay migrated it; ``PUBLIC_WITHOUT_KEYS`` (exit code 5) for an
                ``--address`` beyond loopback while no API key exists.
        """
        ensure_log_output()
        try:
            host, port = parse_address(options["address"], allow_port_zero=True)
        except ValueError as exc:
            raise CommandError(f"INVALID_ARGUMENT: {exc}") from exc
        if options["shutdown_grace_ms"] < 0:
            raise CommandError("INVALID_ARGUMENT: --shutdown-grace-ms must be >= 0")
        metrics_at: tuple[str, int] | None = None
        if options["metrics_address"]:
            try:
                metrics_at = parse_address(options["metrics_address"], allow_port_zero=True)
            except ValueError as exc:
                raise CommandError(f"INVALID_ARGUMENT: --metrics-address: {exc}") from exc
        if options["db"]:
            use_database(options["db"])
        # The observer counts the lease expiries the service's sweeps commit.
        # On a shared database its clock keeps the database's time (AnchoredClock), read
        # before its first instant (QueueService._read_database_time).
        service = QueueService(observer=metrics.observe)
        where = describe_database(service)
        try:  # SQLite: the migration turn _claim takes ends with _migrate, or here
            try:
                problems = self._prepare(service, where)
            except (StorageFull, StorageIO) as exc:
                raise _storage_exit(exc, where) from None
            if problems:
                if service.capabilities.single_writer:
                    raise CommandError(
                        f"CORRUPT: database {where} failed integrity check: "
                        f"{'; '.join(problems[:5])}",
                        returncode=EXIT_CORRUPT,
                    )
                raise CommandError(f"UNAVAILABLE: database {where}: {'; '.join(problems[:5])}")
            if service.capabilities.single_writer:
                _migrate(where, service)  # the key table must exist before it's read
                check_migrations(service, where)  # a file a newer Relay migrated
        finally:
            schema.end_server_turn(service.driver.alias)
        # /metrics is read-only and takes no key: only the protocol address counts here.
        refused = exposure.refusal(
            "relay server", [(host, port)], allowed=options["allow_public_without_keys"]
        )
        if refused:
            raise CommandError(refused, returncode=exposure.EXIT_PUBLIC_WITHOUT_KEYS)
        try:
            recovered = service.recover()
            repaired = service.repair_counts()
        except (StorageFull, StorageIO) as exc:
            raise _storage_exit(exc, where) from None
        except DatabaseError as exc:
            fault = service.driver.storage_error(exc)
            if isinstance(fault, StorageFull | StorageIO):
                raise _storage_exit(fault, where) from None
            if "malformed" in str(exc) or "corrupt" in str(exc).lower():
                # Damage the start-up check cannot see (with RELAY_STARTUP_CHECK=quick, an
                # index entry out of step with its row)
                # surfaces when recovery touches it: still corruption, still never served.
                raise CommandError(
                    f"CORRUPT: database {where} is damaged: {exc}", returncode=EXIT_CORRUPT
                ) from exc
            raise CommandError(f"UNAVAILABLE: cannot write database {where}: {exc}") from exc
        if repaired:
            log.warning(
                "event=counts_repaired pairs=%d first=%s db=%s",
                len(repaired),
                repaired[:5],
                where,
                extra={"event": "counts_repaired", "pairs": repaired[:50], "db": where},
            )
        if service.capabilities.single_writer:
            log.info(
                "event=recovered leases=%d db=%s",
                recovered,
                where,
                extra={"event": "recovered", "leases": recovered, "db": where},
            )
        else:  # leases belong to workers; lost ones come back by expiry
            log.info(
                "event=shared_database db=%s",
                where,
                extra={"event": "shared_database", "db": where},
            )
        connections.close_all()  # the server's threads open their own connections
        server = RelayServer(
            service, host=host, port=port, shutdown_grace_ms=options["shutdown_grace_ms"]
        )
        try:
            factory = loop_factory(relay_settings().event_loop)
        except ImportError as exc:
            raise CommandError(
                f"RELAY_EVENT_LOOP=uvloop, but uvloop cannot be imported: {exc}"
            ) from None
        exporter = start_metrics(metrics_at) if metrics_at else None
        try:
            asyncio.run(server.serve(handle_signals=True), loop_factory=factory)
        except OSError as exc:
            raise CommandError(f"UNAVAILABLE: cannot listen on {host}:{port}: {exc}") from exc
        finally:
            if exporter is not None:
                exporter.stop()

    def _prepare(self, service: QueueService, where: str) -> list[str]:
        """Claim the database (SQLite: the file lock; PostgreSQL: the server's session limits,
        then a check of its migrations), then run the start-up check; return its problems.

        Raises:
            CommandError: as ``_claim`` and ``check_migrations``.
            StorageFull, StorageIO: the storage failed, whatever the file holds.
        """
        if service.capabilities.single_writer:
            self.lock = _claim(service, where)
        else:
            self.lock = service.claim_storage()  # the server's session limits, no lock
            check_migrations(service, where)
        return service.check_storage(full=relay_settings().startup_check != "quick")


def _storage_exit(exc: StorageFull | StorageIO, where: str, doing: str = "") -> CommandError:
    """The one-line start-up error for a storage fault: its code, the database, what the
    server was doing (``doing``, if said), the cause."""
    what = f"{doing}: " if doing else ""
    return CommandError(
        f"{exc.code}: database {where}: {what}{exc.message}", returncode=storage_exit_code(exc)
    )


def _migrate(where: str, service: QueueService) -> None:
    """Bring a SQLite database's tables up to date (``service``'s database, ``RELAY_DATABASE``).

    Raises:
        CommandError: ``CORRUPT`` (exit code 3) when migrating finds damage, ``STORAGE_FULL``
            (7) or ``STORAGE_IO`` (8) when the storage fails (a migration that rebuilds a
            table needs up to about three times the file's size free: docs/failure-model.md),
            ``UNAVAILABLE`` when the database cannot be written otherwise.
    """
    try:
        call_command("migrate", database=service.driver.alias, interactive=False, verbosity=0)
    except DatabaseError as exc:
        fault = service.driver.storage_error(exc)
        if isinstance(fault, StorageFull | StorageIO):
            raise _storage_exit(fault, where, MIGRATION_ROLLED_BACK) from exc
        if "malformed" in str(exc) or "corrupt" in str(exc).lower():
            raise CommandError(
                f"CORRUPT: database {where} is damaged: {exc}", returncode=EXIT_CORRUPT
            ) from exc
        raise CommandError(f"UNAVAILABLE: cannot write database {where}: {exc}") from exc


def start_metrics(address: tuple[str, int]) -> metrics.MetricsServer:
    """Serve this process's /metrics on ``address`` in a thread; log ``event=metrics_ready``.

    Raises:
        CommandError: ``UNAVAILABLE`` when the address cannot be bound.
    """
    host, port = address
    try:
        exporter = metrics.MetricsServer(host, port).start()
    except OSError as exc:
        raise CommandError(f"UNAVAILABLE: cannot serve metrics on {host}:{port}: {exc}") from exc
    log.info(
        "event=metrics_ready host=%s port=%s",
        host,
        exporter.port,
        extra={"event": "metrics_ready", "host": host, "port": exporter.port},
    )
    return exporter


EXIT_ALREADY_SERVED = 4


def _claim(service: QueueService, path: str) -> Any:
    """Check a SQLite path, then hold the one-server-per-file lock for the process's life.

    Raises:
        CommandError: ``INVALID_ARGUMENT`` for a path that cannot be a database file,
            ``ALREADY_SERVED`` (exit code 4) when another server holds the file.
    """
    folder = Path(path).resolve().parent
    if Path(path).is_dir() or not folder.is_dir():
        raise CommandError(f"INVALID_ARGUMENT: --db {path}: no such file or folder to create it")
    schema.take_server_turn(service.driver.alias)  # before the file, until _migrate has ended
    try:
        held = service.claim_storage()
    except AlreadyServed as exc:
        raise CommandError(f"ALREADY_SERVED: {exc}", returncode=EXIT_ALREADY_SERVED) from None
    _warn_if_shared(path)
    return held


def _warn_if_shared(path: str) -> None:
    """Log ``event=database_file_shared`` (a warning) when users other than the file's owner
    may read or write the SQLite file at ``path``: they can read every job and API key in it,
    and one who can read it can hold a lock on it that stops every later start (the migration
    turn's byte, the file's ``flock``). Relay makes new files 0600; an older one keeps its
    mode, so the operator is told, as PostgreSQL and OpenSSH tell of open key files (a warning
    rather than a refusal: a group-readable file may be deliberate)."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:  # served already: its faults surface where it is used
        return
    if mode & 0o077:
        log.warning(
            "event=database_file_shared db=%s mode=%04o advice=%s",
            path,
            mode,
            "chmod 600 it (and its -wal and -shm)",
            extra={"event": "database_file_shared", "db": path, "mode": f"{mode:04o}"},
        )


def use_database(path: str) -> None:
    """Point the default database at ``path`` before anything uses it."""
    connections.close_all()
    settings.DATABASES["default"]["NAME"] = path
    connections["default"].settings_dict["NAME"] = path
