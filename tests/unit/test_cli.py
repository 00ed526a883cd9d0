"""The ``relay`` console script: global options, subcommand mapping, the seed's command lines."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.management import load_command_class

from queue_core import cli


def argv_for(line: str) -> list[str]:
    """Translate a ``relay ...`` command line to the argv Django gets."""
    words = shlex.split(line)
    assert words[0] == "relay"
    return cli.translate(words[1:]).argv


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("relay stats", ["relay_stats"]),
        ("relay server --db relay.db", ["relay_server", "--db", "relay.db"]),
        (
            "relay worker --queue email --queue notifications --concurrency 16 "
            "--shutdown-timeout-ms 30000",
            [
                "relay_worker",
                "--queue",
                "email",
                "--queue",
                "notifications",
                "--concurrency",
                "16",
                "--shutdown-timeout-ms",
                "30000",
            ],
        ),
        (
            """relay submit email --payload '{"user_id":42}' --priority high --retries 5""",
            [
                "relay_submit",
                "email",
                "--payload",
                '{"user_id":42}',
                "--priority",
                "high",
                "--retries",
                "5",
            ],
        ),
        ("relay inspect job_01J", ["relay_inspect", "job_01J"]),
        ("relay dead list --queue email", ["relay_dead", "list", "--queue", "email"]),
        ("relay dead retry job_1 job_2", ["relay_dead", "retry", "job_1", "job_2"]),
        ("relay dead purge job_1", ["relay_dead", "purge", "job_1"]),
        ("relay bench --jobs 10", ["relay_bench", "--jobs", "10"]),
    ],
)
def test_seed_lines_map_to_management_commands(line: str, expected: list[str]) -> None:
    assert argv_for(line) == ["relay", *expected]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("relay --address 10.0.0.5:7400 stats", ["relay_stats", "--address", "10.0.0.5:7400"]),
        ("relay --address=[::1]:7400 stats", ["relay_stats", "--address", "[::1]:7400"]),
        ("relay --json stats --queue q", ["relay_stats", "--queue", "q", "--json"]),
        (
            "relay --json --address h:1 dead list --queue email",
            ["relay_dead", "list", "--queue", "email", "--address", "h:1", "--json"],
        ),
        (
            "relay --address h:1 submit q --payload {}",
            ["relay_submit", "q", "--payload", "{}", "--address", "h:1"],
        ),
        # The server takes --address (to listen on) but has no --json.
        ("relay --json --address h:9 server", ["relay_server", "--address", "h:9"]),
        # An option given after the command wins over the global one.
        ("relay --address a:1 stats --address b:2", ["relay_stats", "--address", "b:2"]),
        ("relay --address a:1 stats --address=b:2", ["relay_stats", "--address=b:2"]),
        ("relay --json stats --json", ["relay_stats", "--json"]),
        # Local commands open the database themselves: no server address, no API key.
        (
            "relay --address h:1 --api-key k --json prune --older-than 7d",
            ["relay_prune", "--older-than", "7d", "--json"],
        ),
        ("relay --address h:1 --api-key k backup b.db", ["relay_backup", "b.db"]),
    ],
)
def test_global_options_are_handed_to_the_command(line: str, expected: list[str]) -> None:
    assert argv_for(line) == ["relay", *expected]


def test_db_sets_relay_db_before_django_starts() -> None:
    invocation = cli.translate(["--db", "/tmp/x.db", "server"])
    assert invocation.env == {"RELAY_DB": "/tmp/x.db"}
    assert invocation.argv == ["relay", "relay_server"]
    assert cli.translate(["stats"]).env == {}


def test_settings_sets_django_settings_module_before_django_starts() -> None:
    invocation = cli.translate(["--settings", "mysite.settings", "worker", "--tasks"])
    assert invocation.env == {"DJANGO_SETTINGS_MODULE": "mysite.settings"}
    assert invocation.argv == ["relay", "relay_worker", "--tasks"]


@pytest.mark.parametrize(
    ("env", "args", "chosen", "expected"),
    [
        (None, [], False, "relayproject.settings"),
        ("mysite.settings", [], True, "mysite.settings"),
        (None, ["--settings", "mysite.settings"], True, None),  # Django reads it
        (None, ["--settings=mysite.settings"], True, None),
    ],
)
def test_use_settings_falls_back_to_the_standalone_project_only_without_a_choice(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    env: str | None,
    args: list[str],
    chosen: bool,
    expected: str | None,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", str(tmp_path))])
    if env is None:
        monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    else:
        monkeypatch.setenv("DJANGO_SETTINGS_MODULE", env)
    assert cli.use_settings(args) is chosen
    assert os.environ.get("DJANGO_SETTINGS_MODULE") == expected
    # A chosen project's settings import from the current directory, as under manage.py.
    assert (str(tmp_path) in sys.path) is chosen


def test_options_after_the_command_are_not_read_as_global() -> None:
    # "--db" after "submit" is the submit command's business (it has none, so Django errors).
    invocation = cli.translate(["submit", "q", "--payload", "{}", "--db", "x.db"])
    assert invocation.env == {}
    assert invocation.argv[-2:] == ["--db", "x.db"]


def test_main_sets_the_environment_and_runs_django(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []
    seen_db: list[str | None] = []

    def fake_execute(argv: list[str]) -> None:
        ran.append(argv)
        seen_db.append(os.environ.get("RELAY_DB"))

    monkeypatch.setattr(cli, "execute_from_command_line", fake_execute)
    monkeypatch.setenv("RELAY_DB", "before.db")
    cli.main(["--db", "after.db", "--address", "h:1", "stats"])
    assert ran == [["relay", "relay_stats", "--address", "h:1"]]
    assert seen_db == ["after.db"]
    assert os.environ["DJANGO_SETTINGS_MODULE"]


def test_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.translate(["--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    names = ("server", "worker", "submit", "inspect", "stats", "dead", "bench", "pause", "resume")
    for name in (*names, "queue-limits"):
        assert f"  {name} " in out
    assert "--address HOST:PORT" in out


@pytest.mark.parametrize("argv", [[], ["nosuch"], ["--bogus", "stats"], ["--address"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.translate(argv)
    assert caught.value.code == 2
    assert "usage: relay" in capsys.readouterr().err


def test_every_subcommand_but_bench_has_a_management_command() -> None:
    for name, sub in cli.SUBCOMMANDS.items():
        if name == "bench":
            continue  # written separately
        app = "django.core" if name == "migrate" else "queue_core"
        assert load_command_class(app, sub.command)


def parse(command: str, line: str) -> dict[str, Any]:
    """Parse a seed line's arguments with the real management command's parser."""
    argv = argv_for(line)
    parser = load_command_class("queue_core", command).create_parser("relay", command)
    return vars(parser.parse_args(argv[2:]))


def test_seed_worker_line_parses() -> None:
    options = parse(
        "relay_worker",
        "relay worker --queue email --queue notifications --concurrency 16 "
        "--shutdown-timeout-ms 30000",
    )
    assert options["queue"] == ["email", "notifications"]
    assert options["concurrency"] == 16
    assert options["shutdown_timeout_ms"] == 30000


def test_seed_submit_line_parses() -> None:
    options = parse(
        "relay_submit",
        """relay submit email --payload '{"user_id":42}' --priority high --retries 5""",
    )
    assert (options["queue"], options["payload"]) == ("email", '{"user_id":42}')
    assert (options["priority"], options["retries"]) == ("high", 5)
    assert options["jitter"] is None and options["delay_ms"] is None


@pytest.mark.parametrize(
    ("line", "action", "key", "value"),
    [
        ("relay dead list --queue email", "list", "queue", "email"),
        ("relay dead retry job_1", "retry", "job_ids", ["job_1"]),
        ("relay dead purge job_1 job_2", "purge", "job_ids", ["job_1", "job_2"]),
        ("relay --json dead list", "list", "json", True),
        ("relay --address h:1 dead purge job_1", "purge", "address", "h:1"),
    ],
)
def test_seed_dead_lines_parse(line: str, action: str, key: str, value: object) -> None:
    options = parse("relay_dead", line)
    assert options["action"] == action
    assert options[key] == value


def test_seed_stats_and_inspect_lines_parse() -> None:
    assert parse("relay_stats", "relay --json stats")["json"] is True
    assert parse("relay_inspect", "relay inspect job_01J")["job_id"] == "job_01J"


@pytest.mark.parametrize(
    ("command", "argv", "usage"),
    [
        ("relay_stats", [], "usage: relay stats "),
        ("relay_dead", ["purge", "--bogus"], "usage: relay dead purge "),
        ("relay_keys", ["create", "--scope", "bogus"], "usage: relay keys create "),
    ],
)
def test_usage_lines_name_relay_commands_and_their_subcommands(
    command: str, argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A review: the subcommands' usage said "relay relay_dead purge".
    command_class = load_command_class("queue_core", command)
    command_class._called_from_command_line = True  # a usage error prints usage and exits 2
    parser = command_class.create_parser("relay", command)
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--bogus"])
    assert capsys.readouterr().err.startswith(usage)
