"""Shared plumbing for the ``relay_*`` management commands that talk to a Relay server.

Exit codes, the same for every command:

* 0: done;
* 1: Relay answered with an error, or an argument is invalid (stderr: ``CODE: message``, e.g.
  ``NOT_FOUND: no job has this id``);
* 2: the server cannot be reached or the connection failed (stderr: ``cannot reach relay server
  at HOST:PORT ...``), or argparse rejected the command line;
* 130: stopped by Ctrl-C (stderr: one ``INTERRUPTED: ...`` line);
* 141: the reader of the output went away (``relay stats | head -1``), without a word.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import io
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO, cast

import orjson
from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
from django.db import DatabaseError, connections
from rich.console import Console, RenderableType

from queue_core import errors, schema
from queue_core.auth import client_api_key
from queue_core.cli import EXIT_INTERRUPTED, INTERRUPTED
from queue_core.client import (
    RelayClient,
    RelayConnectionError,
    RelayUnreachable,
    parse_addresses,
)
from queue_core.conf import relay_settings
from queue_core.service import QueueService

EXIT_ERROR = 1
EXIT_UNREACHABLE = 2
# The reader of the command's output went away (``relay stats | head -1``): 128 + SIGPIPE, the
# status a shell tool killed by SIGPIPE ends with.
EXIT_BROKEN_PIPE = 141
EXIT_NEWER_SCHEMA = 9  # NEWER_SCHEMA: a newer Relay migrated the database


def add_connection_arguments(parser: CommandParser | Any, *, json_help: str | None = None) -> None:
    """Add ``--address HOST:PORT`` (default ``RELAY_ADDRESS``), ``--api-key`` and ``--json``."""
    parser.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="Relay server address; several servers of one PostgreSQL database separated by "
        f"commas, failed over in turn (default: RELAY_ADDRESS, now {relay_settings().address}).",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="API key sent in a hello on connect, needed once the server has keys (default: "
        "RELAY_API_KEY; prefer the variable, a command line is visible to other users).",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help=json_help or "Print the server's result as JSON instead of text.",
    )


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def ensure_log_output() -> None:
    """Make the ``relay`` loggers' lines (INFO and up) reach stderr if nothing else would.

    For a long-running command (``relay_server``, ``relay_worker``) in a project whose logging
    gives the ``relay`` logger no handler, on it or above it (Django's default logging has
    none on the root logger, so INFO lines such as ``event=ready`` were lost): attach a plain
    stderr handler, at INFO unless the project set a level for ``relay``. A project that
    configures any handler on the way (``relayproject.settings``' JSON one, a root handler)
    keeps its choice, so no line is printed twice.
    """
    relay = logging.getLogger("relay")
    if relay.hasHandlers():
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    relay.addHandler(handler)
    if relay.level == logging.NOTSET:
        relay.setLevel(logging.INFO)


def command_error(exc: errors.RelayError) -> CommandError:
    """Return ``CommandError("CODE: message", returncode=1)`` for a Relay error; an
    ``UNAUTHENTICATED`` one also says how a ``relay`` command sends a key (the server's
    message names only the protocol's ways)."""
    message = exc.message
    if exc.code == errors.Unauthenticated.code:
        message += " (relay commands: --api-key or RELAY_API_KEY)"
    return CommandError(f"{exc.code}: {message}", returncode=EXIT_ERROR)


def invalid_argument(message: str) -> CommandError:
    """Return ``CommandError("INVALID_ARGUMENT: message", returncode=1)``."""
    return command_error(errors.InvalidArgument(message))


def resolve_address(address: str | None) -> str:
    """Return ``address`` or ``RELAY_ADDRESS``, checked.

    Raises:
        CommandError: malformed address (exit 1, ``INVALID_ARGUMENT``).
    """
    address = address or relay_settings().address
    try:
        parse_addresses(address)
    except ValueError as exc:
        raise invalid_argument(f"--address: {exc}") from exc
    return address


def make_client(
    address: str, *, timeout_s: float = 30.0, api_key: str | None = None
) -> RelayClient:
    """Build a ``RelayClient`` for ``address`` using ``RELAY_MAX_FRAME_BYTES``.

    Args:
        api_key: the key to send in ``hello`` (default ``RELAY_API_KEY``; none when unset).
    """
    return RelayClient(
        address,
        timeout_s=timeout_s,
        max_frame_bytes=relay_settings().max_frame_bytes,
        api_key=api_key or client_api_key(),
    )


def describe_database(service: QueueService) -> str:
    """The database, for messages: a SQLite file's path, or PostgreSQL's host and name."""
    conf = connections[service.driver.alias].settings_dict
    if service.capabilities.vendor == "sqlite":
        return str(conf["NAME"])
    return (
        f"postgresql://{conf.get('HOST') or 'localhost'}:{conf.get('PORT') or 5432}/{conf['NAME']}"
    )


def check_migrations(service: QueueService, where: str) -> None:
    """Refuse a database whose migrations are not this code's: behind (on a shared
    PostgreSQL database none migrates it on its own at start: the operator runs ``relay
    migrate`` once), or migrated by a newer Relay (an older server on it answered ``stats``
    with ``INTERNAL`` once a job was CANCELLED, and ignored pauses: an upgrade review).

    Raises:
        CommandError: ``NEWER_SCHEMA`` (exit code 9) for a database a newer Relay migrated;
            ``UNAVAILABLE`` when it cannot be reached or is behind.
    """
    try:
        found = schema.problem(service.driver.alias)
    except DatabaseError as exc:
        raise CommandError(f"UNAVAILABLE: cannot reach database {where}: {exc}") from exc
    if found is not None and found.newer:
        raise CommandError(
            f"NEWER_SCHEMA: database {where} {found.message}", returncode=EXIT_NEWER_SCHEMA
        )
    if found is not None:
        raise CommandError(f"UNAVAILABLE: database {where} {found.message}")


def local_service() -> QueueService:
    """A ``QueueService`` on the settings' database for a command that opens it itself
    (``relay prune``), once it is known to be one this code serves.

    Raises:
        CommandError: ``INVALID_ARGUMENT`` for a SQLite file that is not there (opening it
            would create an empty one: ``relay --db typo.db prune`` did, then failed with a
            traceback), a ``RelayError`` of the storage as ``CODE: message``, and as
            ``check_migrations``.
    """
    service = QueueService()
    try:
        where = describe_database(service)
        if service.capabilities.vendor == "sqlite" and not os.path.isfile(where):
            raise CommandError(f"INVALID_ARGUMENT: there is no database at {where}")
        try:
            check_migrations(service, where)
        except errors.RelayError as exc:  # the storage refused (STORAGE_IO: two names, ...)
            raise command_error(exc) from None
    except BaseException:
        service.close()
        raise
    return service


@contextlib.contextmanager
def relay_errors(address: str) -> Iterator[None]:
    """Turn Relay and connection errors raised inside the block into ``CommandError``.

    Raises:
        CommandError: ``CODE: message`` (exit 1) for a ``RelayError``; ``cannot reach relay
            server at HOST:PORT`` (exit 2) for a connection failure.
    """
    try:
        yield
    except errors.RelayError as exc:
        raise command_error(exc) from exc
    except RelayUnreachable as exc:
        raise CommandError(
            f"cannot reach relay server at {exc.address} ({exc.reason}); is `relay server` "
            "running there? (set --address or RELAY_ADDRESS)",
            returncode=EXIT_UNREACHABLE,
        ) from exc
    except RelayConnectionError as exc:
        raise CommandError(
            f"lost the connection to relay server at {exc.address} ({exc.reason}); the request "
            "may or may not have been applied",
            returncode=EXIT_UNREACHABLE,
        ) from exc
    except BrokenPipeError:
        # The client wraps its socket's errors (RelayConnectionError above): this one is the
        # command's own output, closed by its reader; RelayBaseCommand.execute ends quietly.
        raise
    except ConnectionError as exc:
        raise CommandError(
            f"cannot reach relay server at {address} ({exc})", returncode=EXIT_UNREACHABLE
        ) from exc


class RelayBaseCommand(BaseCommand):
    """Base of every ``relay_*`` command: ``relay submit`` in usage lines, and errors printed as
    ``CODE: message`` (without Django's ``CommandError:`` prefix) when run from a shell.
    ``call_command`` still raises ``CommandError``."""

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        """Name the parser ``relay <command>`` when run through the ``relay`` script, before
        ``add_arguments`` makes any subcommand's parser (``relay dead purge``, not ``relay
        relay_dead purge``)."""
        if os.path.basename(prog_name) == "relay":  # relay_queue_limits: relay queue-limits
            subcommand = subcommand.removeprefix("relay_").replace("_", "-")
        return super().create_parser(prog_name, subcommand, **kwargs)

    def execute(self, *args: Any, **options: Any) -> Any:
        """Run the command; from a shell, print ``CODE: message`` and exit on CommandError;
        exit ``EXIT_BROKEN_PIPE`` without a word once the reader of stdout has gone (Python's
        "Note on SIGPIPE": stdout is pointed at /dev/null so the exit's flush does not fail
        again); and with one line and ``EXIT_ERROR`` when the output cannot be written (a
        full disk, a closed stdout: the command runs, and fails when it writes)."""
        shell = getattr(self, "_called_from_command_line", False)
        if shell and not options.get("stdout"):
            # Started with stdout closed (``relay stats >&-``): a command that writes fails
            # when it does; one that does not (``relay server``) runs.
            self.stdout = _Output(sys.stdout or cast(TextIO, _ClosedOutput()))
        try:
            return super().execute(*args, **options)
        except CommandError as exc:
            if not shell or options.get("traceback"):
                raise
            self.stderr.write(str(exc))
            sys.exit(exc.returncode)
        except BrokenPipeError:
            if not shell:
                raise
            _quiet_stdout()
            sys.exit(EXIT_BROKEN_PIPE)
        except OutputFailed as exc:  # ``relay stats > /dev/full``: one line, no traceback
            if not shell or options.get("traceback"):
                raise
            _quiet_stdout()
            _say(f"cannot write the output: {exc.cause.strerror or exc.cause}")
            sys.exit(EXIT_ERROR)
        except KeyboardInterrupt:  # Ctrl-C while waiting for a reply: one line, no traceback
            if not shell or options.get("traceback"):
                raise
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no traceback
            _say(INTERRUPTED)
            sys.exit(EXIT_INTERRUPTED)


def _say(line: str) -> None:
    """Write one line to stderr, if there is one."""
    if sys.stderr is not None:
        print(line, file=sys.stderr)


class OutputFailed(Exception):
    """Writing a command's output failed (``cause``: the OSError; not a closed pipe)."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Output(OutputWrapper):
    """Django's stdout wrapper whose write failures say they are the output's
    (``OutputFailed``), so they are told apart from the client's; a closed pipe stays a
    ``BrokenPipeError`` (exit 141)."""

    def write(  # type: ignore[override]  # as Django's stub declares it
        self,
        msg: str = "",
        style_func: Callable[[str], str] | None = None,
        ending: str | None = None,
    ) -> None:
        """Write as Django does.

        Raises:
            BrokenPipeError: the reader has gone; OutputFailed: any other write error.
        """
        try:
            super().write(msg, style_func, ending)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(exc) from exc


def _quiet_stdout() -> None:
    """Point stdout's descriptor at /dev/null, so the flush at exit cannot fail again."""
    if sys.stdout is None:  # closed at start: nothing to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


class _ClosedOutput(io.TextIOBase):
    """Where a command's output goes when it started with stdout closed: every write fails."""

    def write(self, s: str) -> int:
        """Raises:
        OSError: EBADF, always."""
        raise OSError(errno.EBADF, "standard output is closed")


class RelayClientCommand(RelayBaseCommand):
    """A command that opens one ``RelayClient`` and maps its errors to exit codes.

    Subclasses implement ``run(client, **options)`` and call ``super().add_arguments``.
    """

    # A network client: no database, and the server checks its own settings.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        """Add ``--address`` and ``--json``."""
        add_connection_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        """Connect, call ``run`` and map errors (see the module docstring for exit codes)."""
        address = resolve_address(options.get("address"))
        with relay_errors(address), make_client(address, api_key=options.get("api_key")) as client:
            self.run(client, **options)

    def run(self, client: RelayClient, **options: Any) -> None:
        """Do the command's work with ``client``."""
        raise NotImplementedError

    def print_json(self, value: Any) -> None:
        """Write ``value`` to stdout as indented JSON."""
        self.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode())

    def print_rich(self, *renderables: RenderableType) -> None:
        """Render rich tables/text to stdout (colour only on a terminal)."""
        stream: Any = self.stdout
        tty = bool(getattr(stream, "isatty", lambda: False)())
        buffer = io.StringIO()
        console = Console(
            file=buffer,
            force_terminal=tty,
            color_system="auto" if tty else None,
            width=console_width(),
            highlight=False,
            markup=False,  # job data ("cannot read [/tmp/x]") is text, never rich markup
        )
        for renderable in renderables:
            console.print(renderable)
        self.stdout.write(buffer.getvalue(), ending="")


def console_width() -> int:
    """Return the terminal width, or 120 columns when not on a terminal."""
    import shutil

    return shutil.get_terminal_size((120, 24)).columns


def fmt_ms(at_ms: int | None) -> str:
    """Format an epoch-ms instant as ISO 8601 UTC (``2026-01-01T00:00:00.000Z``), or ``-``."""
    if at_ms is None:
        return "-"
    instant = dt.datetime.fromtimestamp(at_ms / 1000, tz=dt.UTC)
    return instant.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def fmt_duration(ms: int | None) -> str:
    """Format a duration in ms for people: ``850ms``, ``12.3s``, ``4m05s``, ``2h03m``, or ``-``."""
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f}s"
    seconds = ms // 1000
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86_400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86_400}d{seconds % 86_400 // 3600:02d}h"


def compact_json(value: Any, *, limit: int = 0) -> str:
    """Return ``value`` as compact JSON, cut to ``limit`` characters (with ``…``) when > 0."""
    text = orjson.dumps(value).decode()
    if limit and len(text) > limit:
        return text[: limit - 1] + "…"
    return text
