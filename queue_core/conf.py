"""Typed, frozen view of the flat ``RELAY_*`` Django settings.

After procrastinate's ``PROCRASTINATE_*`` settings class and django-ninja's ``NINJA_*`` model:
one dataclass, rebuilt when a test overrides a setting, validated by system checks
(``queue_core.checks``, ids ``relay.E001``...). Values are read in ``relayproject/settings.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

QUEUE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")  # use with fullmatch


@dataclasses.dataclass(frozen=True, slots=True)
class RelaySettings:
    """Every Relay setting, its default and its unit.

    Attributes:
        address: TCP listen/connect address ``HOST:PORT`` (default ``127.0.0.1:7400``).
        metrics_address: ``HOST:PORT`` for the server's /metrics, empty for none.
        max_frame_bytes: largest NDJSON frame in bytes, newline excluded (1 MiB).
        max_payload_bytes: largest job payload, as compact JSON bytes (256 KiB, as SQS).
        max_error_bytes: longest failure text in UTF-8 bytes (4096).
        max_result_bytes: largest result a worker sends with an ack (compact JSON), and
            largest traceback it sends with a fail (UTF-8), in bytes (64 KiB); a job's stored
            errors keep the newest that fit this too. The limit applied is
            ``result_limit_bytes``: never more than an eighth of ``max_frame_bytes``, so a
            ``result`` reply fits one frame.
        max_queue_name_length: longest queue name in characters (128).
        visibility_timeout_ms: default lease length in ms (30 000).
        min_lease_ms / max_lease_ms: bounds for a requested lease in ms (1 000 / 12 h, as SQS).
        max_wait_ms: longest long-poll wait of a lease request in ms (20 000, as SQS).
        max_queues_per_lease: queues one lease request may subscribe to (16).
        max_jobs_per_lease: jobs one lease request may take (100; at most 100, the acks one
            ``ack_batch`` takes: ``relay.E013``).
        max_batch_submit: jobs in one batch submit (1 000).
        max_connections: concurrent TCP connections (1 024).
        max_inflight_per_connection: requests one connection may have in progress (64).
        idle_timeout_ms: a connection silent for this long (no complete frame) is closed (120 000).
        shutdown_grace_ms: after SIGTERM, how long renew/ack/fail are still served (5 000).
        reaper_interval_ms: how often the server expires leases and promotes due jobs (1 000).
        max_delay_ms: the furthest a job may be scheduled into the future, in ms (30 days).
        max_retries: the largest per-job retry budget a producer may ask for (100).
        default_max_retries: retry budget when the producer gives none (3).
        default_backoff: ``"exponential"`` or ``"fixed"``.
        default_backoff_base_ms / default_backoff_cap_ms: backoff base and cap in ms (1 s / 300 s).
        default_jitter: whether retry delays are jittered to 50-100% by default (True).
        idempotency_window_ms: how long an idempotency key stays bound to its job (24 h).
        busy_retry_budget_ms: how long the store retries "database is locked" before BUSY (10 s).
        sqlite_synchronous: SQLite ``synchronous`` pragma (``FULL``).
        durable_leases: commit leases durably too (False: a transaction of lease
            bookkeeping only, a claim or a sweep, does not wait for the disk; an OS crash
            or power loss may then take back the leases made since the last durable commit,
            and with them their attempt numbers: docs/design-decisions.md, "Leases without
            their own fsync"). True for handlers that rely on ``attempt`` as a fencing
            epoch through a power loss.
        event_loop: the event loop ``relay server`` runs on: ``"auto"`` (the default: uvloop
            when it is installed, as it is with Relay on Linux and macOS, else asyncio's
            own), ``"uvloop"`` (refuse to start without it) or ``"asyncio"``. uvloop
            (libuv, in Cython) runs the loop, its sockets and its timers outside the
            interpreter: 7-14% fewer instructions per request (docs/benchmarking.md,
            round 8).
        startup_check: what the server checks before serving: ``"integrity"`` (``PRAGMA
            integrity_check``, the default: 2.7 s for 1M jobs on the benchmark machine) or
            ``"quick"`` (``PRAGMA quick_check``, 0.9 s there, blind to index entries out of
            step with their rows).
        database: the Django database alias Relay's tables live in (``"default"``); its
            engine picks the storage driver (SQLite or PostgreSQL, ``queue_core.storage``).
        pg_prepared_statements: on PostgreSQL, run Relay's own statements as prepared
            statements, prepared on first use on each connection (True). Django turns
            psycopg's prepared statements off by default for connection poolers; without them
            PostgreSQL parses and plans every statement, which here cost about half of its
            CPU per lease+ack (docs/benchmarking.md). Set False behind a pooler in transaction
            mode that cannot keep them (PgBouncer before 1.21).
        lock_timeout_ms: on PostgreSQL, the longest a relay server's statement waits for a
            row or table lock another transaction holds, in ms (2 000; PostgreSQL's
            ``lock_timeout``); the call then gets ``BUSY`` (retryable) instead of holding its
            whole group commit, and every other client's calls in it. 0: no limit.
        pg_idle_in_transaction_timeout_ms: on PostgreSQL, how long a relay server's
            connection may sit idle inside a transaction before PostgreSQL ends its session,
            in ms (5 000; ``idle_in_transaction_session_timeout``). A server frozen mid-batch
            (stopped, its VM paused, cut off from the database) otherwise holds the batch's
            row locks and the sweep's advisory lock until it resumes, and no other server
            expires a lease or makes a retry ready meanwhile. 0: no limit.
        pg_stuck_transaction_ms: on PostgreSQL, a relay server ends another relay server's
            session that has waited this long for its server in the middle of a transaction
            (no statement since), in ms (15 000, three heartbeats; ``pg_terminate_backend``,
            looked for every third of it): a server frozen in the middle of a command, which
            the idle limit does not see (PostgreSQL waits for the rest of the command). A
            server waiting for locks is not ended. 0: never.
        server_heartbeat_ms: how often a server renews its row in the server registry, in
            ms (5 000); it counts as live for three of these.
        max_clock_skew_ms: past this many ms (1 000) between a server's clock and the
            database's, the server logs it: ``event=clock_skew`` when its own time (the
            database's, ``AnchoredClock``, read again every ``server_heartbeat_ms``) was
            found that far off, ``event=host_clock_off`` when its machine's wall clock is
            (Relay does not use it).

        SQLite write-ahead log bound (docs/failure-model.md, item 6):

        sqlite_wal_limit_bytes: the size the ``-wal`` file is kept under, in bytes (16 MiB).
            Every SQLite connection Relay opens gets it as ``PRAGMA journal_size_limit`` (a
            log that restarts is cut back to it), and the server's reaper checkpoints with
            ``wal_checkpoint(RESTART)`` when the file has grown past it.
        sqlite_checkpoint_wait_ms: how long that checkpoint waits for readers of older
            snapshots to finish, in ms (200); the writer waits with it. A checkpoint that
            could not finish is tried again after 1 s, then after twice as long each time it
            fails again, up to 2 s (``MAX_CHECKPOINT_BACKOFF_S``).
        clock_step_tolerance_ms: wall-clock steps (item 13): the most, in ms, the wall clock
            may advance more or less than the monotonic clock between two readings before it
            counts as a step (1 000; NTP slewing moves it 0.5 ms/s at most). Leases set before
            a forward step are then judged by the time before it (``queue_core.clock.StepGuard``).
        clock: the dotted path of the ``Clock`` class the service reads time from
            (``"queue_core.clock.SystemClock"``). A test hook: end-to-end tests step a real
            server's clock with ``tests.stepclock.FileStepClock``; never set it in production.

        Hostile clients (hardening items 1, 4, 14):

        max_unsent_bytes_per_connection: reply bytes one connection may hold reserved or
            unsent before its reads wait and its next frame is not read (2 MiB;
            ``queue_core.protocol.budget``).
        max_unsent_bytes: reply bytes all connections may hold before one that drained
            nothing for a second is cut off (64 MiB).
        max_buffered_request_bytes: request bytes all connections may have buffered in the
            server (lines read ahead, lines still arriving) before those whose unfinished
            line began over a second ago are cut off; with the lines of the requests in
            progress, past it a connection with a request in progress reads no further line
            until there is room (64 MiB; ``queue_core.protocol.reading``).
        max_bad_frames: malformed lines a connection may send before it is closed (16); a
            first line that is not a request closes it at once.
        auth_timeout_ms: with API keys on, how long a connection may go without a successful
            ``hello`` before it is closed, in ms (10 000).
        max_connections_per_address: TCP connections one client IP address may hold; 0 for
            no cap (the default: loopback clients share one address).
        max_connections_per_key: TCP connections one API key may hold at once (a ``hello``
            past it is refused ``TOO_MANY_CONNECTIONS``); 0 for no cap (the default: one
            key may serve a whole fleet of workers).
        metrics_max_queues: queue names with their own metric series (100); the others
            are summed under ``queue="_other"`` (``queue_core.metrics``).
        max_queues: queues that may hold jobs at once (10 000): a submit that would start
            another is refused ``TOO_MANY_QUEUES``. Queue names come from producers, and
            ``stats``, the console's overview and the metrics gauges read every queue's
            counts, so this bounds what one producer key can make them cost.

        Exposure (hardening item 3):

        allow_public_without_keys: let ``relay server`` and the HTTP side listen on an address
            that is not loopback while no API key exists (False: they refuse to start, exit
            code 5). Only for a network that is private by other means.

        Job metadata (issue 16, item 7): a job's optional ``meta`` map of strings.

        max_meta_keys: keys one job's ``meta`` may have (16).
        max_meta_key_bytes: longest ``meta`` key, in UTF-8 bytes (64).
        max_meta_bytes: largest ``meta`` map, as compact JSON bytes (1 024).

        HTTP threads (ASGI submit throughput):

        http_threads: threads per HTTP worker process that run requests' sync work (views,
            middleware, the lease claims) and keep their database connections between
            requests (8, as the gthread worker had; ``queue_api.pool``). Requests beyond
            them wait on the event loop, holding no thread.

        Backups:

        backup_dir: the folder the console's "Back up now" writes SQLite copies to, as
            ``relay-YYYYmmddTHHMMSSZ.db`` (empty, the default: the console offers none;
            ``relay backup PATH`` takes any path).
        Time limits (issue 16, item 4):

        queue_time_limits: each queue's default maximum run time of one attempt
            (``time_limits_ms``); a job's own ``time_limit_ms`` wins. Empty: no limits.
    """

    address: str = "127.0.0.1:7400"
    metrics_address: str = ""
    max_frame_bytes: int = 1024 * 1024
    max_payload_bytes: int = 256 * 1024
    max_error_bytes: int = 4096
    max_result_bytes: int = 64 * 1024
    max_queue_name_length: int = 128
    visibility_timeout_ms: int = 30_000
    min_lease_ms: int = 1_000
    max_lease_ms: int = 43_200_000
    max_wait_ms: int = 20_000
    max_queues_per_lease: int = 16
    max_jobs_per_lease: int = 100
    max_batch_submit: int = 1000
    max_connections: int = 1024
    max_inflight_per_connection: int = 64
    idle_timeout_ms: int = 120_000
    shutdown_grace_ms: int = 5_000
    reaper_interval_ms: int = 1_000
    max_delay_ms: int = 30 * 24 * 3600 * 1000
    max_retries: int = 100
    default_max_retries: int = 3
    default_backoff: str = "exponential"
    default_backoff_base_ms: int = 1_000
    default_backoff_cap_ms: int = 300_000
    default_jitter: bool = True
    idempotency_window_ms: int = 24 * 3600 * 1000
    busy_retry_budget_ms: int = 10_000
    sqlite_synchronous: str = "FULL"
    durable_leases: bool = False
    startup_check: str = "integrity"
    event_loop: str = "auto"
    database: str = "default"
    pg_prepared_statements: bool = True
    lock_timeout_ms: int = 2_000
    pg_idle_in_transaction_timeout_ms: int = 5_000
    pg_stuck_transaction_ms: int = 15_000
    server_heartbeat_ms: int = 5_000
    max_clock_skew_ms: int = 1_000
    # SQLite write-ahead log bound.
    sqlite_wal_limit_bytes: int = 16 * 1024 * 1024
    sqlite_checkpoint_wait_ms: int = 200
    # Hostile clients (issue 13).
    max_unsent_bytes_per_connection: int = 2 * 1024 * 1024
    max_unsent_bytes: int = 64 * 1024 * 1024
    max_buffered_request_bytes: int = 64 * 1024 * 1024
    max_bad_frames: int = 16
    auth_timeout_ms: int = 10_000
    max_connections_per_address: int = 0
    max_connections_per_key: int = 0
    metrics_max_queues: int = 100
    max_queues: int = 10_000
    # Wall-clock steps (item 13).
    clock_step_tolerance_ms: int = 1_000
    clock: str = "queue_core.clock.SystemClock"
    # Exposure (hardening item 3).
    allow_public_without_keys: bool = False
    # HTTP threads (ASGI submit throughput).
    http_threads: int = 8
    # Retention (issue 16, item 1).
    retention_succeeded: str = "7d"
    retention_dead: str = "30d"
    # Console backups (issue 16, item 8).
    backup_dir: str = ""
    # Job metadata (issue 16, item 7).
    max_meta_keys: int = 16
    max_meta_key_bytes: int = 64
    max_meta_bytes: int = 1024

    @property
    def result_limit_bytes(self) -> int:
        """The result bound in force, in bytes: ``max_result_bytes``, capped at an eighth of
        ``max_frame_bytes`` (a ``result`` reply holds the job, up to half a frame, its return
        value and its errors)."""
        return min(self.max_result_bytes, self.max_frame_bytes // 8)

    # Time limits (issue 16, item 4): {queue: duration}, or "queue=5m,other=2h".
    queue_time_limits: Any = ""

    def retention_ms(self) -> dict[str, int]:
        """The retention of each finished state in ms, ``{"succeeded": ms, "dead": ms,
        "cancelled": ms}``; 0 keeps that state forever. Cancelled jobs are kept as long as
        dead ones (``RELAY_RETENTION_DEAD``): both are jobs that did not succeed, which an
        operator may still want to replay.

        Raises:
            ValueError: a retention setting is not a duration (the system check
                ``relay.E010`` reports it at start).
        """
        dead = parse_duration_ms(self.retention_dead)
        return {
            "succeeded": parse_duration_ms(self.retention_succeeded),
            "dead": dead,
            "cancelled": dead,
        }

    def time_limits_ms(self) -> dict[str, int]:
        """The per-queue default time limits (``RELAY_QUEUE_TIME_LIMITS``) in ms.

        The setting is a mapping ``{"reports": "2h", "emails": "30s"}`` or, as the environment
        gives it, the text ``"reports=2h,emails=30s"``; each duration as ``parse_duration_ms``
        reads it, and 0 means "no limit" for that queue.

        Returns:
            ``{queue: ms}`` (queues with 0 left out).
        Raises:
            ValueError: not a mapping or such a text, a duration that is not one, or one
                over ``RELAY_MAX_DELAY_MS`` as a job's own ``time_limit_ms`` would be (the
                system check ``relay.E011`` reports it at start).
        """
        raw = self.queue_time_limits
        items: list[tuple[Any, Any]]
        if isinstance(raw, dict):
            items = list(raw.items())
        elif isinstance(raw, str):
            items = []
            for part in raw.split(","):
                if not part.strip():
                    continue
                name, sep, value = part.partition("=")
                if not sep:
                    raise ValueError(f"{part.strip()!r} is not queue=duration")
                items.append((name.strip(), value.strip()))
        else:
            raise ValueError("must be a mapping of queue names to durations")
        limits: dict[str, int] = {}
        for name, value in items:
            if not isinstance(name, str) or not QUEUE_NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a queue name")
            ms = parse_duration_ms(value)
            if ms > self.max_delay_ms:
                # As a job's own time_limit_ms: at most RELAY_MAX_DELAY_MS.
                raise ValueError(f"{name}: {value} is over RELAY_MAX_DELAY_MS")
            if ms:
                limits[name] = ms
        return limits

    @classmethod
    def from_django(cls) -> RelaySettings:
        """Build from ``settings.RELAY_<FIELD>``; a missing setting keeps its default, but
        for those in ``FROM_ENVIRONMENT``, which the environment variable of the same name
        gives when it is set."""
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            name = f"RELAY_{field.name.upper()}"
            if hasattr(settings, name):
                values[field.name] = getattr(settings, name)
            elif field.name in FROM_ENVIRONMENT and os.environ.get(name):
                values[field.name] = os.environ[name]
        return cls(**values)


# Settings a project that does not set them takes from the environment: where a process
# finds the server is the deployment's to say, per process (docs/django.md tells workers
# `RELAY_ADDRESS=a:7400,b:7400`), as `RELAY_API_KEY` is (``auth.client_api_key``).
FROM_ENVIRONMENT = frozenset({"address"})


_DURATION_RE = re.compile(r"(\d+)(ms|s|m|h|d)")
_UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_duration_ms(text: str) -> int:
    """Parse a duration such as ``"7d"``, ``"12h"``, ``"30m"``, ``"45s"`` or ``"500ms"``.

    Args:
        text: a whole number and one unit (``ms``, ``s``, ``m``, ``h``, ``d``), no spaces;
            or ``"0"`` (no unit needed).
    Returns:
        The duration in ms (>= 0).
    Raises:
        ValueError: anything else (a bare number other than 0, a fraction, a sign).
    """
    text = str(text).strip()
    if text == "0":
        return 0
    match = _DURATION_RE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration: a whole number and a unit (ms, s, m, h, d), "
            "such as 7d or 12h, or 0"
        )
    return int(match.group(1)) * _UNIT_MS[match.group(2)]


@functools.cache
def relay_settings() -> RelaySettings:
    """Return the current Relay settings (cached; rebuilt when a setting changes)."""
    return RelaySettings.from_django()


@receiver(setting_changed)
def _reset(*, setting: str, **kwargs: object) -> None:
    if setting.startswith("RELAY_"):
        relay_settings.cache_clear()
