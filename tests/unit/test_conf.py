"""RELAY_* settings: typed view, override_settings, system checks."""

from __future__ import annotations

from django.core import checks
from django.test.utils import override_settings

from queue_core.conf import relay_settings


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
