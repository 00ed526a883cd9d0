"""The deployment files in ``deploy/`` run commands that exist, with flags their commands accept,
and their stop timeouts leave room for Relay's own drains (docs/django.md, "Deployment")."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import pytest
from django.core.management import get_commands, load_command_class

from queue_core import cli
from queue_core.worker import runner

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


def _procfile(name: str) -> dict[str, str]:
    lines = (DEPLOY / name).read_text().splitlines()
    entries = [line.split(":", 1) for line in lines if line.strip() and not line.startswith("#")]
    return {kind.strip(): command.strip() for kind, command in entries}


def _unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


def _check_relay_command(words: list[str]) -> None:
    """Parse ``relay ...`` as the console script would, then with the command's own parser."""
    invocation = cli.translate(words)
    _, name, *args = invocation.argv
    command = load_command_class(get_commands()[name], name)
    command.create_parser("relay", name).parse_args(args)  # SystemExit(2) on a bad flag


def _check(command: str) -> None:
    words = shlex.split(command.replace("%i", "emails"))
    program = Path(words[0]).name
    if program == "relay":
        _check_relay_command(words[1:])
    elif words[0].endswith("bin/http"):
        assert (ROOT / "bin" / "http").stat().st_mode & 0o111, "bin/http is not executable"
    else:
        assert program == "gunicorn", f"unexpected program in {command!r}"


@pytest.mark.parametrize("name", ["Procfile", "Procfile.django"])
def test_every_procfile_line_is_a_command_that_parses(name: str) -> None:
    entries = _procfile(name)
    assert entries, f"{name} declares no process"
    for command in entries.values():
        _check(command)


@pytest.mark.parametrize("path", UNITS, ids=[p.name for p in UNITS])
def test_every_unit_runs_a_command_that_parses(path: Path) -> None:
    service = _unit(path)["Service"]
    for key in ("ExecStartPre", "ExecStart"):
        if key in service:
            _check(service[key])
    assert service["KillSignal"] == "SIGTERM"


def test_three_units_cover_server_worker_and_http() -> None:
    assert [p.name for p in UNITS] == [
        "relay-http.service",
        "relay-server.service",
        "relay-worker@.service",
    ]


def _env_file() -> dict[str, str]:
    found = {}
    for line in (DEPLOY / "relay.env").read_text().splitlines():
        match = re.fullmatch(r"#?\s*(RELAY_[A-Z_]+)=(.*)", line.strip())
        if match:
            found[match[1]] = match[2]
    return found


def test_every_variable_in_relay_env_is_one_relay_reads() -> None:
    readers = "".join(
        (ROOT / path).read_text()
        for path in (
            "relayproject/settings.py",
            "queue_core/conf.py",
            "relayproject/gunicorn_conf.py",
        )
    )
    env = _env_file()
    assert "RELAY_SHUTDOWN_GRACE_MS" in env
    for name in env:
        assert f'"{name}"' in readers, f"{name} in deploy/relay.env is read nowhere"


def test_stop_timeouts_leave_room_for_the_drains() -> None:
    grace_s = int(_env_file()["RELAY_SHUTDOWN_GRACE_MS"]) / 1000
    server = _unit(DEPLOY / "systemd" / "relay-server.service")["Service"]
    assert int(server["TimeoutStopSec"]) > grace_s
    worker = _unit(DEPLOY / "systemd" / "relay-worker@.service")["Service"]
    shutdown = re.search(r"--shutdown-timeout-ms (\d+)", worker["ExecStart"])
    assert shutdown is not None
    # Past the handlers' timeout: the releases' budget and the two margins (Worker's docstring).
    after_s = runner._RELEASE_BUDGET_S + 2 * runner._MARGIN_S
    assert int(worker["TimeoutStopSec"]) > int(shutdown[1]) / 1000 + after_s
