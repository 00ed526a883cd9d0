"""Django's ``migrate``, one at a time per database (``queue_core.schema.migration_lock``).

Relay's systemd unit runs ``relay migrate`` before each server's start, so with several
servers on one PostgreSQL database two could run at once: an upgrade review saw one fail
halfway (``duplicate key ... pg_class_relname_nsp_index``) and ``django_migrations`` rows
written twice. On SQLite a migration ran under a server still serving the file (one of an
older Relay, whose inserts then went uncounted). This command is Django's own with that lock
around it; everything else (options, output) is Django's.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError
from django.core.management.commands.migrate import Command as DjangoMigrate

from queue_core.errors import RelayError
from queue_core.management.relay_command import command_error
from queue_core.schema import MigrationRefused, migration_lock

EXIT_ALREADY_SERVED = 4  # as relay server's


class Command(DjangoMigrate):
    help = DjangoMigrate.help + " (one at a time per database: Relay's migration lock)"

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            with migration_lock(options["database"], options):
                super().handle(*args, **options)
        except MigrationRefused as exc:
            raise CommandError(f"ALREADY_SERVED: {exc}", returncode=EXIT_ALREADY_SERVED) from None
        except RelayError as exc:  # a file with two names, one the turn cannot open
            raise command_error(exc) from None
