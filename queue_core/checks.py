"""System checks for Relay settings (ids ``relay.E001``...), after Django's tasks ``checks.py``."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

from queue_core.conf import RelaySettings, parse_duration_ms


@checks.register()
def check_relay_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Validate the RELAY_* settings: positive limits, consistent lease bounds, known backoff."""
    errors: list[checks.CheckMessage] = []
    try:
        s = RelaySettings.from_django()
    except TypeError as exc:  # pragma: no cover - a setting of the wrong kind
        return [checks.Error(f"RELAY settings are malformed: {exc}", id="relay.E001")]
    positive = [
        "max_frame_bytes",
        "max_payload_bytes",
        "max_error_bytes",
        "max_result_bytes",
        "max_queue_name_length",
        "min_lease_ms",
        "max_queues_per_lease",
        "max_jobs_per_lease",
        "max_batch_submit",
        "max_connections",
        "max_inflight_per_connection",
        "idle_timeout_ms",
        "reaper_interval_ms",
        "server_heartbeat_ms",
        "max_clock_skew_ms",
        "sqlite_wal_limit_bytes",
        "sqlite_checkpoint_wait_ms",
        "max_unsent_bytes_per_connection",
        "max_unsent_bytes",
        "max_buffered_request_bytes",
        "max_bad_frames",
        "auth_timeout_ms",
        "metrics_max_queues",
        "max_queues",
        "clock_step_tolerance_ms",
        "http_threads",
        "max_meta_keys",
        "max_meta_key_bytes",
        "max_meta_bytes",
    ]
    for name in positive:
        if getattr(s, name) <= 0:
            errors.append(checks.Error(f"RELAY_{name.upper()} must be > 0", id="relay.E002"))
    for name in ("max_connections_per_address", "max_connections_per_key"):  # 0: no cap
        if getattr(s, name) < 0:
            errors.append(checks.Error(f"RELAY_{name.upper()} must be >= 0", id="relay.E014"))
    if not s.min_lease_ms <= s.visibility_timeout_ms <= s.max_lease_ms:
        errors.append(
            checks.Error(
                "RELAY_VISIBILITY_TIMEOUT_MS must lie within "
                "[RELAY_MIN_LEASE_MS, RELAY_MAX_LEASE_MS]",
                id="relay.E003",
            )
        )
    from queue_core.service import MAX_BATCH_ACKS

    if s.max_jobs_per_lease > MAX_BATCH_ACKS:
        # A structural audit: with 200, a lease of 150 jobs could not be acked in one batch.
        errors.append(
            checks.Error(
                f"RELAY_MAX_JOBS_PER_LEASE must be at most {MAX_BATCH_ACKS}, the most acks one "
                "ack_batch takes (and the most jobs relay worker asks for at once)",
                id="relay.E013",
            )
        )
    if s.default_backoff not in ("fixed", "exponential"):
        errors.append(
            checks.Error("RELAY_DEFAULT_BACKOFF must be 'fixed' or 'exponential'", id="relay.E004")
        )
    if s.max_payload_bytes >= s.max_frame_bytes:
        errors.append(
            checks.Error(
                "RELAY_MAX_PAYLOAD_BYTES must be below RELAY_MAX_FRAME_BYTES", id="relay.E005"
            )
        )
    if s.sqlite_synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        errors.append(
            checks.Error(
                "RELAY_SQLITE_SYNCHRONOUS must be OFF, NORMAL, FULL or EXTRA", id="relay.E006"
            )
        )
    if s.startup_check not in ("integrity", "quick"):
        errors.append(
            checks.Error("RELAY_STARTUP_CHECK must be 'integrity' or 'quick'", id="relay.E007")
        )
    if s.event_loop not in ("auto", "uvloop", "asyncio"):
        errors.append(
            checks.Error("RELAY_EVENT_LOOP must be 'auto', 'uvloop' or 'asyncio'", id="relay.E012")
        )
    for name in ("retention_succeeded", "retention_dead"):
        try:
            parse_duration_ms(getattr(s, name))
        except ValueError as exc:
            errors.append(checks.Error(f"RELAY_{name.upper()}: {exc}", id="relay.E010"))
    try:
        s.time_limits_ms()
    except ValueError as exc:
        errors.append(checks.Error(f"RELAY_QUEUE_TIME_LIMITS: {exc}", id="relay.E011"))
    engine = settings.DATABASES.get(s.database, {}).get("ENGINE")
    if engine is None:
        errors.append(
            checks.Error(f"RELAY_DATABASE: no database alias {s.database!r}", id="relay.E008")
        )
    elif engine not in ("django.db.backends.sqlite3", "django.db.backends.postgresql"):
        errors.append(
            checks.Error(
                f"RELAY_DATABASE {s.database!r} uses {engine}; Relay stores jobs in SQLite or "
                "PostgreSQL",
                id="relay.E009",
            )
        )
    return errors
