"""``relay keys create --name N --scope S [--scope S2] | list | revoke PREFIX``: manage API keys.

Works on the database directly (like ``relay server``), not over the network. ``create`` prints
the new key on stdout, alone on its line, and says on stderr that it will not be shown again:
only its SHA-256 is stored. Exit codes: 0 done, 1 ``INVALID_ARGUMENT`` (also for a SQLite file
that is not there), ``NOT_FOUND`` or ``UNAVAILABLE`` (a database not migrated), 9 a database a
newer Relay migrated.
"""

from __future__ import annotations

import argparse
import io
from typing import Any

import orjson
from django.core.management.base import CommandError, CommandParser
from rich.console import Console
from rich.table import Table

from queue_core import auth, errors
from queue_core.management.relay_command import (
    RelayBaseCommand,
    command_error,
    console_width,
    fmt_ms,
    local_service,
)


class Command(RelayBaseCommand):
    """Create, list and revoke API keys."""

    help = (
        "Manage API keys for the HTTP API and the TCP protocol. Once any key exists, every "
        "request needs one. Scopes: producer (submit, inspect, stats), worker (lease, renew, "
        "ack, fail, release, inspect), operator (everything)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Define the create, list and revoke subcommands."""
        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        create = sub.add_parser("create", help="Make a key and print it once.")
        create.add_argument("--name", required=True, help="Who or what the key is for.")
        create.add_argument(
            "--scope",
            action="append",
            required=True,
            choices=auth.SCOPES,
            help="A scope to grant; repeat for several.",
        )
        create.add_argument("--json", action="store_true", help="Print the key as JSON.")
        listing = sub.add_parser("list", help="List keys (never their secrets).")
        listing.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
        revoke = sub.add_parser("revoke", help="Revoke a key by its prefix (or the whole key).")
        revoke.add_argument("prefix", metavar="PREFIX")
        revoke.add_argument("--json", action="store_true", help=argparse.SUPPRESS)

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the chosen action, once the database is known to be one this code serves
        (``local_service``: a mistyped ``--db`` made an empty file, then a traceback)."""
        action = options["action"]
        local_service().close()
        try:
            if action == "create":
                self._create(options)
            elif action == "list":
                self._list(options)
            else:
                self._revoke(options)
        except errors.RelayError as exc:
            raise command_error(exc) from exc

    def _create(self, options: dict[str, Any]) -> None:
        new = auth.create_key(options["name"], options["scope"])
        if options["json"]:
            body = {"key": new.key, "prefix": new.prefix, "name": new.name, "scopes": new.scopes}
            self.stdout.write(orjson.dumps(body).decode())
        else:
            self.stdout.write(new.key)
        self.stderr.write(
            f"created key {new.prefix} ({new.name}; scopes {','.join(new.scopes)}). Store it now: "
            "it is not shown again."
        )

    def _list(self, options: dict[str, Any]) -> None:
        rows: list[dict[str, Any]] = [
            {
                "prefix": key.prefix,
                "name": key.name,
                "scopes": key.scope_list,
                "created_at_ms": key.created_at_ms,
                "last_used_at_ms": key.last_used_at_ms,
                "revoked_at_ms": key.revoked_at_ms,
            }
            for key in auth.keys().order_by("created_at_ms", "id")
        ]
        if options["json"]:
            self.stdout.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
            return
        if not rows:
            self.stdout.write("no API keys: the HTTP API and the TCP protocol need none")
            return
        table = Table(width=console_width())
        for column in ("prefix", "name", "scopes", "created", "last used", "revoked"):
            table.add_column(column)
        for row in rows:
            table.add_row(
                row["prefix"],
                row["name"],
                ",".join(row["scopes"]),
                fmt_ms(row["created_at_ms"]),
                fmt_ms(row["last_used_at_ms"]),
                fmt_ms(row["revoked_at_ms"]),
            )
        buffer = io.StringIO()
        Console(file=buffer, width=console_width(), color_system=None, markup=False).print(table)
        self.stdout.write(buffer.getvalue(), ending="")

    def _revoke(self, options: dict[str, Any]) -> None:
        given = options["prefix"].strip()
        prefix = auth.parse_prefix(given) or given
        if not auth.revoke(prefix):
            raise CommandError(f"NOT_FOUND: no API key with prefix {prefix!r}", returncode=1)
        self.stdout.write(f"revoked {prefix}")
