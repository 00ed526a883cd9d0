"""RELAY_* settings: typed view, override_settings, system checks."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.core import checks
from django.test.utils import override_settings

from queue_core.conf import RelaySettings, parse_duration_ms, relay_settings


def test_defaults() -> None:
    s = relay_settings()
    assert s.max_frame_bytes == 1024 * 1024
    assert s.visibility_timeout_ms == 30_000
    assert s.sqlite_synchronous == "FULL"


def test_override_settings_rebuilds_the_view() -> None:
    with override_settings(RELAY_MAX_FRAME_BYTES=10):
        assert relay_settings().max_frame_bytes == 10
    assert relay_settings().max_frame_bytes == 1024 * 1024


def ids() -> set[str]:
    return {m.id for m in checks.run_checks() if m.id and m.id.startswith("relay.")}


def test_checks_pass_on_defaults() -> None:
    assert ids() == set()


def test_checks_catch_bad_settings() -> None:
    with override_settings(RELAY_VISIBILITY_TIMEOUT_MS=10):
        assert "relay.E003" in ids()
    with override_settings(RELAY_MAX_CONNECTIONS=0):
        assert "relay.E002" in ids()
    with override_settings(RELAY_DEFAULT_BACKOFF="linear"):
        assert "relay.E004" in ids()
    with override_settings(RELAY_MAX_PAYLOAD_BYTES=2 * 1024 * 1024):
        assert "relay.E005" in ids()
    with override_settings(RELAY_SQLITE_SYNCHRONOUS="SOMETIMES"):
        assert "relay.E006" in ids()
    with override_settings(RELAY_STARTUP_CHECK="none"):
        assert "relay.E007" in ids()
    with override_settings(RELAY_CLOCK_STEP_TOLERANCE_MS=0):
        assert "relay.E002" in ids()
    with override_settings(RELAY_EVENT_LOOP="trio"):
        assert "relay.E012" in ids()
    with override_settings(RELAY_MAX_JOBS_PER_LEASE=101):  # one ack_batch takes 100 acks
        assert "relay.E013" in ids()
    with override_settings(RELAY_MAX_JOBS_PER_LEASE=100):
        assert ids() == set()
    # A negative cap refused every connection (the address's) or every hello (the key's).
    for name in ("RELAY_MAX_CONNECTIONS_PER_ADDRESS", "RELAY_MAX_CONNECTIONS_PER_KEY"):
        with override_settings(**{name: -1}):
            assert ids() == {"relay.E014"}
        with override_settings(**{name: 0}):  # no cap
            assert ids() == set()


def test_the_event_loop_setting_picks_the_servers_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import sys

    import uvloop

    from queue_core.protocol.loops import loop_factory, loop_name

    assert relay_settings().event_loop == "auto"
    assert loop_factory("auto") is uvloop.new_event_loop  # installed with Relay
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    for factory, name in ((uvloop.new_event_loop, "uvloop"), (asyncio.new_event_loop, "asyncio")):
        loop = factory()
        try:
            assert loop_name(loop) == name
        finally:
            loop.close()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: import fails
    assert loop_factory("auto") is None
    with pytest.raises(ImportError):
        loop_factory("uvloop")


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("0", 0),
        ("500ms", 500),
        ("45s", 45_000),
        ("30m", 1_800_000),
        ("12h", 43_200_000),
        ("7d", 604_800_000),
        (" 1d ", 86_400_000),
    ],
)
def test_durations_parse(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "7", "1.5h", "-1d", "7 d", "1w", "d", "0s0"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration_ms(text)


def test_retention_defaults_and_zero() -> None:
    assert relay_settings().retention_ms() == {
        "succeeded": 7 * 86_400_000,
        "dead": 30 * 86_400_000,
        "cancelled": 30 * 86_400_000,
    }
    with override_settings(RELAY_RETENTION_SUCCEEDED="0", RELAY_RETENTION_DEAD="12h"):
        assert relay_settings().retention_ms() == {
            "succeeded": 0,
            "dead": 43_200_000,
            "cancelled": 43_200_000,
        }


def test_checks_catch_bad_retention() -> None:
    with override_settings(RELAY_RETENTION_SUCCEEDED="7"):
        assert "relay.E010" in ids()
    with override_settings(RELAY_RETENTION_DEAD="forever"):
        assert "relay.E010" in ids()


def test_the_result_limit_is_capped_at_an_eighth_of_a_frame() -> None:
    assert RelaySettings().result_limit_bytes == 64 * 1024
    assert RelaySettings(max_frame_bytes=4096).result_limit_bytes == 512
    assert RelaySettings(max_frame_bytes=4096, max_result_bytes=100).result_limit_bytes == 100


def test_queue_time_limits_from_text_or_a_mapping() -> None:
    assert relay_settings().time_limits_ms() == {}
    with override_settings(RELAY_QUEUE_TIME_LIMITS=" reports=2h, emails=30s,idle=0 ,"):
        assert relay_settings().time_limits_ms() == {"reports": 7_200_000, "emails": 30_000}
        assert "relay.E011" not in ids()
    with override_settings(RELAY_QUEUE_TIME_LIMITS={"reports": "1m"}):
        assert relay_settings().time_limits_ms() == {"reports": 60_000}


@pytest.mark.parametrize(
    "value",
    [
        "reports",
        "reports=2 h",
        "bad queue=1m",
        "=1m",
        "reports=-1s",
        5,
        {"q": "x"},
        "big=999999999d",  # over RELAY_MAX_DELAY_MS, as a job's own time_limit_ms would be
        "huge=99999999999999999d",
    ],
)
def test_checks_catch_bad_queue_time_limits(value: object) -> None:
    with override_settings(RELAY_QUEUE_TIME_LIMITS=value):
        with pytest.raises(ValueError, match=r"duration|queue|RELAY_MAX_DELAY_MS"):
            relay_settings().time_limits_ms()
        assert "relay.E011" in ids()


def test_the_standalone_project_reads_every_number_from_the_environment() -> None:
    # A docs audit: RELAY_MAX_BUFFERED_REQUEST_BYTES was documented as a setting and read
    # nowhere in relayproject/settings.py, so the service kept 64 MiB whatever was set.
    # RELAY_DATABASE is the one field left out: the service's alias is fixed there.
    import dataclasses
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    numbers = {
        f.name: f.default + 7
        for f in dataclasses.fields(RelaySettings)
        if f.type in (int, "int") and isinstance(f.default, int)
    }
    assert "max_buffered_request_bytes" in numbers and len(numbers) > 40
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env |= {f"RELAY_{name.upper()}": str(value) for name, value in numbers.items()}
    env |= {"DJANGO_SETTINGS_MODULE": "relayproject.settings", "RELAY_SECRET_KEY": "x" * 50}
    script = (
        "import dataclasses, json, django; django.setup()\n"
        "from queue_core.conf import relay_settings\n"
        "print(json.dumps(dataclasses.asdict(relay_settings()), default=str))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    read = json.loads(out.stdout)
    assert {name: read[name] for name in numbers} == numbers


def test_a_project_without_the_settings_takes_address_and_key_from_the_environment(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/django.md gives workers `RELAY_API_KEY` (and `RELAY_ADDRESS`) in their environment;
    # only the standalone project read them there, so a worker in a user's project was
    # UNAUTHENTICATED with the key exported (a Django review).
    from queue_core.auth import client_api_key

    monkeypatch.setenv("RELAY_ADDRESS", "relay-1:7400,relay-2:7400")
    monkeypatch.setenv("RELAY_API_KEY", "rk_from_env")
    del settings.RELAY_ADDRESS
    del settings.RELAY_API_KEY
    relay_settings.cache_clear()
    assert relay_settings().address == "relay-1:7400,relay-2:7400"
    assert client_api_key() == "rk_from_env"
    # A project that sets them keeps its own.
    settings.RELAY_ADDRESS = "127.0.0.1:7401"
    settings.RELAY_API_KEY = "rk_from_settings"
    assert relay_settings().address == "127.0.0.1:7401"
    assert client_api_key() == "rk_from_settings"
    monkeypatch.delenv("RELAY_ADDRESS")
    del settings.RELAY_ADDRESS
    relay_settings.cache_clear()
    assert relay_settings().address == RelaySettings().address


def test_the_project_passes_its_system_checks_without_a_warning() -> None:
    # A URL pattern for '//api/...' began with '/' (urls.W002): every command printed the
    # warning before its one line (CI's one-line tests caught it).
    from django.core.management import call_command

    call_command("check", fail_level="WARNING", stdout=io.StringIO())
