"""The ``relay`` console script: the seed's CLI on top of the ``relay_*`` management commands.

``relay [GLOBAL OPTIONS] COMMAND [ARGS...]`` runs ``manage.py relay_COMMAND ARGS...``. Global
options may come before the command and are handed on to it:

* ``--address HOST:PORT`` becomes the command's ``--address`` (unless ARGS give one);
* ``--json`` becomes the command's ``--json`` (unless ARGS give it; not for ``server``);
* ``--api-key KEY`` becomes the command's ``--api-key`` (client commands only; prefer
  ``RELAY_API_KEY``, since a command line is visible to other users);
* ``--db PATH`` sets ``RELAY_DB`` before Django reads its settings (``relay server`` also
  takes ``--db`` itself);
* ``--database-url postgresql://user@host:port/dbname`` sets ``RELAY_DATABASE_URL``: Relay's
  tables live in that PostgreSQL database instead of the SQLite file;
* ``--settings MODULE`` sets ``DJANGO_SETTINGS_MODULE`` (Django's own ``--settings`` after the
  command works too).

The Django project: ``--settings`` or ``DJANGO_SETTINGS_MODULE`` names one's own (``relay
--settings mysite.settings worker --tasks``; the current directory is put on ``sys.path`` first,
as ``manage.py`` puts its own folder, so run it where ``manage.py`` is). With neither, ``relay``
runs the standalone service, ``relayproject.settings`` (its SQLite file ``RELAY_DB`` defaults to
``relay.db`` in the current directory). ``RELAY_DB`` and ``RELAY_DATABASE_URL`` are read only by
``relayproject.settings``: a project of one's own has its own ``DATABASES``.

Examples::

    relay server --db relay.db
    relay --database-url postgresql://relay@127.0.0.1:5432/relay migrate
    relay --database-url postgresql://relay@127.0.0.1:5432/relay server --address 127.0.0.1:7401
    relay worker --queue email --queue notifications --concurrency 16
    relay --address 10.0.0.5:7400 submit email --payload '{"user_id":42}' --priority high
    relay --json stats
    relay dead retry job_01J...
    relay pause email
    relay queue-limits email --max-leased 10 --rate 5 --burst 5
    relay prune --older-than 7d --dry-run
    relay --db relay.db backup /backups/relay-2026-01-01.db
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from queue_core.errors import StorageFull, StorageIO


@dataclasses.dataclass(frozen=True, slots=True)
class Subcommand:
    """One ``relay`` subcommand.

    Attributes:
        command: the Django management command it runs.
        summary: one line for ``relay --help``.
        takes_json: whether a global ``--json`` is handed on.
        takes_api_key: whether a global ``--api-key`` is handed on (commands that connect).
    """

    command: str
    summary: str
    takes_json: bool = True
    takes_api_key: bool = True


SUBCOMMANDS: dict[str, Subcommand] = {
    "server": Subcommand(
        "relay_server",
        "run the Relay server (NDJSON over TCP) on its database",
        takes_json=False,
        takes_api_key=False,
    ),
    "migrate": Subcommand(
        "migrate",
        "create or update Relay's tables (once per PostgreSQL database, before its servers)",
        takes_json=False,
        takes_api_key=False,
    ),
    "worker": Subcommand(
        "relay_worker", "run a pull worker (--queue, --concurrency; --app PATH or --tasks)"
    ),
    "submit": Subcommand("relay_submit", "submit a job: QUEUE --payload JSON [options]"),
    "inspect": Subcommand("relay_inspect", "show a job with its attempt history: JOB_ID"),
    "stats": Subcommand("relay_stats", "show job counts by state per queue"),
    "dead": Subcommand(
        "relay_dead", "dead letters: list | retry JOB_ID... | purge JOB_ID... (cancelled jobs too)"
    ),
    "cancel": Subcommand(
        "relay_cancel", "cancel jobs: JOB_ID... (a running one stops at its next renew)"
    ),
    "pause": Subcommand(
        "relay_pause", "stop leasing from queues (submits still accepted): QUEUE..."
    ),
    "resume": Subcommand("relay_resume", "lease from paused queues again: QUEUE..."),
    "queue-limits": Subcommand(
        "relay_queue_limits",
        "show or set a queue's limits: QUEUE [--max-leased N] [--rate R] [--burst B]",
    ),
    "prune": Subcommand(
        "relay_prune",
        "delete finished jobs by age now: --older-than 7d [--state succeeded|dead|cancelled] "
        "[--dry-run]",
        takes_api_key=False,
    ),
    "backup": Subcommand(
        "relay_backup",
        "copy the SQLite database while the server runs, and check the copy: PATH [--force]",
        takes_api_key=False,
    ),
    "bench": Subcommand(
        "relay_bench", "measure submit and lease+ack throughput and latency", takes_api_key=False
    ),
    "keys": Subcommand(
        "relay_keys",
        "API keys: create --name N --scope S... | list | revoke PREFIX",
        takes_api_key=False,
    ),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Invocation:
    """What ``main`` runs: environment to set, then Django's argv.

    Attributes:
        env: variables to set before Django starts (``RELAY_DB``, ``RELAY_DATABASE_URL``,
            ``DJANGO_SETTINGS_MODULE``).
        argv: ``["relay", "<command>", args...]`` for ``execute_from_command_line``.
    """

    env: dict[str, str]
    argv: list[str]


def build_parser() -> argparse.ArgumentParser:
    """Return the parser for the global options and the subcommand name."""
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"  {name:<{width}} {sub.summary}" for name, sub in SUBCOMMANDS.items()]
    parser = argparse.ArgumentParser(
        prog="relay",
        usage="relay [--address HOST:PORT[,HOST:PORT...]] [--api-key KEY] [--db PATH] "
        "[--database-url URL] [--settings MODULE] [--json] COMMAND [ARGS...]",
        description="Relay: a durable job queue with leases, retries and dead letters.",
        epilog="commands:\n"
        + "\n".join(lines)
        + "\n\n'relay COMMAND --help' shows a command's options. Exit codes: 0 ok, 1 Relay "
        "error or bad argument value (CODE: message on stderr), 2 server unreachable or bad usage, "
        "3 corrupt database (server), 4 database already served (server), 5 a public address "
        "without any API key (server, HTTP), 6 no private SECRET_KEY (HTTP), 7 disk full and 8 "
        "storage failing (server, migrate), 9 a newer Relay migrated the database, 130 "
        "interrupted (Ctrl-C), 141 output closed early (SIGPIPE).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="server to talk to, or listen on for 'server' (default RELAY_ADDRESS)",
    )
    parser.add_argument("--db", metavar="PATH", help="SQLite database file (sets RELAY_DB)")
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help="PostgreSQL database, postgresql://user@host:port/dbname (sets RELAY_DATABASE_URL)",
    )
    parser.add_argument(
        "--settings",
        metavar="MODULE",
        help="your Django project's settings, e.g. mysite.settings (sets DJANGO_SETTINGS_MODULE; "
        "default: DJANGO_SETTINGS_MODULE, else Relay's standalone relayproject.settings)",
    )
    parser.add_argument(
        "--api-key", metavar="KEY", help="API key for the server (default RELAY_API_KEY)"
    )
    parser.add_argument("--json", action="store_true", help="JSON output instead of text")
    parser.add_argument("command", choices=sorted(SUBCOMMANDS), metavar="COMMAND")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _has_option(args: Sequence[str], option: str) -> bool:
    return any(arg == option or arg.startswith(option + "=") for arg in args)


def translate(argv: Sequence[str]) -> Invocation:
    """Map ``relay`` arguments (without the program name) to an ``Invocation``.

    Raises:
        SystemExit: for ``--help`` or a usage error (argparse prints the message).
    """
    parser = build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        raise SystemExit(2)
    ns = parser.parse_args(list(argv))
    sub = SUBCOMMANDS[ns.command]
    args: list[str] = list(ns.args)
    env: dict[str, str] = {}
    if ns.db:
        env["RELAY_DB"] = ns.db
    if ns.database_url:
        env["RELAY_DATABASE_URL"] = ns.database_url
    if ns.settings:
        env["DJANGO_SETTINGS_MODULE"] = ns.settings
    # Explicit options after the command win over global ones.
    local = sub.command in ("migrate", "relay_prune", "relay_backup")  # no server address
    if ns.address and not local and not _has_option(args, "--address"):
        args += ["--address", ns.address]
    if ns.json and sub.takes_json and not _has_option(args, "--json"):
        args.append("--json")
    if ns.api_key and sub.takes_api_key and not _has_option(args, "--api-key"):
        args += ["--api-key", ns.api_key]
    return Invocation(env=env, argv=["relay", sub.command, *args])


STANDALONE_SETTINGS = "relayproject.settings"
# Stopped by Ctrl-C (SIGINT): 128 + SIGINT, as a shell reports a tool that SIGINT ended.
EXIT_INTERRUPTED = 130
INTERRUPTED = (
    "INTERRUPTED: stopped by Ctrl-C; a request already sent may or may not have been applied"
)


def use_settings(args: Sequence[str]) -> bool:
    """Choose the Django settings module before Django starts.

    The user's choice (``DJANGO_SETTINGS_MODULE``, or Django's ``--settings`` among ``args``,
    which Django itself applies later) also puts the current directory first on ``sys.path``,
    so that a project's settings import as they do under its ``manage.py``. With no choice,
    ``DJANGO_SETTINGS_MODULE`` becomes ``relayproject.settings`` (the standalone service).

    Args:
        args: the command's own arguments (``Invocation.argv[2:]``).
    Returns:
        Whether the user chose the settings.
    """
    if not os.environ.get("DJANGO_SETTINGS_MODULE") and not _has_option(args, "--settings"):
        os.environ["DJANGO_SETTINGS_MODULE"] = STANDALONE_SETTINGS
        return False
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    return True


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``relay``: parse global options, set up Django, run the management command."""
    invocation = translate(sys.argv[1:] if argv is None else argv)
    os.environ.update(invocation.env)  # before django.setup() reads the settings
    use_settings(invocation.argv[2:])
    from django.core.exceptions import ImproperlyConfigured

    try:
        _run(invocation.argv)
    except KeyboardInterrupt:  # Ctrl-C while Django loads, or past a command's own handling
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no traceback here
        print(INTERRUPTED, file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except ImproperlyConfigured as exc:  # a bad setting (--database-url mysql://...)
        print(f"INVALID_ARGUMENT: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def execute_from_command_line(argv: list[str]) -> None:
    """Django's ``execute_from_command_line``, imported when first run: a Ctrl-C while
    Django's modules load is then ``main``'s to report."""
    from django.core.management import execute_from_command_line as execute

    execute(argv)


def _run(argv: list[str]) -> None:
    """Run the management command ``argv[1]`` (``migrate``: a missing database in one line)."""
    if argv[1] != "migrate":
        execute_from_command_line(argv)
        return
    from django.db import DatabaseError

    try:
        execute_from_command_line(argv)
    except DatabaseError as exc:  # a database not there, or not one: one line, as relay server
        from queue_core.errors import MIGRATION_ROLLED_BACK, storage_exit_code

        fault = _storage_fault(exc)
        if fault is not None:  # a full disk or failing storage: as relay server exits
            print(f"{fault.code}: {MIGRATION_ROLLED_BACK}: {fault.message}", file=sys.stderr)
            raise SystemExit(storage_exit_code(fault)) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"UNAVAILABLE: cannot reach the database: {first}", file=sys.stderr)
        raise SystemExit(1) from None


def _storage_fault(exc: BaseException) -> StorageFull | StorageIO | None:
    """``StorageFull`` or ``StorageIO`` when ``exc`` is Relay's database's storage failing
    (``Driver.storage_error``); None for any other error."""
    from queue_core.conf import relay_settings
    from queue_core.errors import StorageFull, StorageIO
    from queue_core.storage import driver_for

    fault = driver_for(relay_settings().database).storage_error(exc)
    return fault if isinstance(fault, StorageFull | StorageIO) else None


if __name__ == "__main__":
    main()
