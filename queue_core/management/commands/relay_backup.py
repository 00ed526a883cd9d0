"""``relay backup PATH [--force]``: a consistent copy of the SQLite database while the
server runs (SQLite's online backup API), checked with ``PRAGMA integrity_check``.
How to restore: docs/failure-model.md, "Backup and restore".

A local command: it opens the database file itself (``RELAY_DB``, or the global ``--db``).
Exit codes: 0 copied and checked; 1 ``PATH`` exists without ``--force``, the copy failed its
check, the storage failed, or the database is PostgreSQL (use ``pg_dump``).
"""

from __future__ import annotations

from typing import Any

import orjson
from django.core.management.base import CommandError, CommandParser

from queue_core import errors
from queue_core.management.relay_command import EXIT_ERROR, RelayBaseCommand, command_error
from queue_core.service import QueueService


class Command(RelayBaseCommand):
    """Copy the SQLite database to PATH and check the copy."""

    help = (
        "Copy the SQLite database to PATH while the server runs (SQLite's backup API) and "
        "check the copy with PRAGMA integrity_check. PostgreSQL: use pg_dump."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Define PATH, --force and --json."""
        parser.add_argument("path", metavar="PATH", help="the file to write (its folder exists).")
        parser.add_argument("--force", action="store_true", help="replace PATH if it exists.")
        parser.add_argument("--json", action="store_true", help="print the result as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Back up and print the copy's path and size.

        Raises:
            CommandError: exit 1 (see the module docstring).
        """
        service = QueueService()
        try:
            if service.capabilities.vendor != "sqlite":
                raise CommandError(
                    "UNSUPPORTED: relay backup copies SQLite databases; back up PostgreSQL "
                    "with pg_dump (docs/failure-model.md, Backup and restore)",
                    returncode=EXIT_ERROR,
                )
            result = service.backup(options["path"], overwrite=options["force"])
        except FileExistsError as exc:
            raise CommandError(f"INVALID_ARGUMENT: {exc}", returncode=EXIT_ERROR) from None
        except ValueError as exc:
            raise CommandError(f"CORRUPT: {exc}", returncode=EXIT_ERROR) from None
        except errors.RelayError as exc:
            raise command_error(exc) from None
        finally:
            service.close()
        if options["json"]:
            self.stdout.write(orjson.dumps(result).decode())
            return
        self.stdout.write(
            f"backed up to {result['path']}: {result['bytes']} bytes, integrity_check ok"
        )
