"""``relay submit QUEUE (--payload JSON | --payload-file PATH) [options]``: enqueue one job and
print its id."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from typing import Any

import orjson
from django.core.management.base import CommandParser

from queue_core.client import RelayClient
from queue_core.conf import relay_settings
from queue_core.management.relay_command import RelayClientCommand, invalid_argument
from queue_core.states import class_name


def parse_run_at(text: str) -> int:
    """Parse an ISO 8601 instant (UTC when it has no offset) to epoch ms.

    Raises:
        CommandError: not ISO 8601 (``INVALID_ARGUMENT``).
    """
    try:
        instant = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise invalid_argument(
            f"--run-at {text!r} is not an ISO 8601 instant (e.g. 2026-01-01T09:30:00Z)"
        ) from exc
    if instant.tzinfo is None:
        instant = instant.replace(tzinfo=dt.UTC)
    return round(instant.timestamp() * 1000)


def parse_meta(items: list[str] | None) -> dict[str, str] | None:
    """Turn repeated ``--meta KEY=VALUE`` options into the job's ``meta`` map.

    The value is everything after the first ``=`` (it may hold ``=`` itself, or be empty);
    the server checks the bounds (``RELAY_MAX_META_*``).

    Raises:
        CommandError: an item without ``=``, or a key given twice (``INVALID_ARGUMENT``).
    """
    if not items:
        return None
    meta: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise invalid_argument(f"--meta {item!r} is not KEY=VALUE")
        if key in meta:
            raise invalid_argument(f"--meta {key!r} is given twice")
        meta[key] = value
    return meta


class Command(RelayClientCommand):
    """Submit one job; print its id, with ``(duplicate)`` when an idempotency key matched."""

    help = (
        "Submit a job to QUEUE. Prints the job id, followed by '(duplicate)' when the "
        "idempotency key matched an existing job. Options left out take the server's "
        "RELAY_DEFAULT_* settings."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Define QUEUE, --payload and the job options."""
        parser.add_argument("queue", metavar="QUEUE", help="Queue name.")
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument(
            "--payload",
            metavar="JSON",
            help="Job payload as JSON, e.g. '{\"a\":1}'.",
        )
        source.add_argument(
            "--payload-file",
            metavar="PATH",
            help="Read the payload's JSON from PATH ('-': standard input): a payload past "
            "about 128 KiB does not fit one command-line argument.",
        )
        parser.add_argument(
            "--priority",
            type=class_name,  # any ASCII case, as TCP and HTTP take it
            choices=["low", "normal", "high", "critical"],
            help="Priority class, any case (default normal).",
        )
        parser.add_argument(
            "--retries",
            type=int,
            metavar="N",
            help="Failures retried before the job goes dead (default RELAY_DEFAULT_MAX_RETRIES).",
        )
        parser.add_argument(
            "--backoff",
            choices=["fixed", "exponential"],
            help="Retry delay shape (default RELAY_DEFAULT_BACKOFF).",
        )
        parser.add_argument(
            "--backoff-base-ms",
            type=int,
            metavar="MS",
            help="Fixed delay or first exponential delay (default RELAY_DEFAULT_BACKOFF_BASE_MS).",
        )
        parser.add_argument(
            "--backoff-cap-ms",
            type=int,
            metavar="MS",
            help="Largest retry delay (default RELAY_DEFAULT_BACKOFF_CAP_MS).",
        )
        parser.add_argument(
            "--jitter",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="Scale retry delays into 50-100%% (default RELAY_DEFAULT_JITTER).",
        )
        when = parser.add_mutually_exclusive_group()
        when.add_argument(
            "--delay-ms", type=int, metavar="MS", help="Run no sooner than MS from now."
        )
        when.add_argument(
            "--run-at",
            metavar="ISO8601",
            help="Run no sooner than this instant (UTC unless it has an offset).",
        )
        parser.add_argument(
            "--idempotency-key",
            metavar="KEY",
            help="Deduplicate resubmits of the same payload with this key.",
        )
        parser.add_argument(
            "--unique",
            choices=["window", "active"],
            help="When the idempotency key is freed: 'window' (default) after "
            "RELAY_IDEMPOTENCY_WINDOW_MS, 'active' also as soon as the job succeeds, goes "
            "dead or is cancelled (unique while active).",
        )
        parser.add_argument(
            "--meta",
            action="append",
            metavar="KEY=VALUE",
            help="Metadata stored with the job and handed to its handler (repeatable), "
            "e.g. --meta traceparent=00-...-01.",
        )
        parser.add_argument(
            "--time-limit-ms",
            type=int,
            metavar="MS",
            help="The most one attempt may run, in ms (default: the queue's, else none).",
        )
        super().add_arguments(parser)

    def run(self, client: RelayClient, **options: Any) -> None:
        """Submit and print the id (or the whole result with --json)."""
        option, text = "--payload", options["payload"]
        if text is None:
            option, text = "--payload-file", _read_payload(options["payload_file"])
        try:
            payload = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise invalid_argument(f"{option} is not valid JSON: {exc}") from exc
        run_at_ms = parse_run_at(options["run_at"]) if options["run_at"] else None
        result = client.submit(
            options["queue"],
            payload,
            priority=options["priority"],
            max_retries=options["retries"],
            backoff=options["backoff"],
            backoff_base_ms=options["backoff_base_ms"],
            backoff_cap_ms=options["backoff_cap_ms"],
            jitter=options["jitter"],
            delay_ms=options["delay_ms"],
            run_at_ms=run_at_ms,
            idempotency_key=options["idempotency_key"],
            unique=options["unique"],
            meta=parse_meta(options["meta"]),
            time_limit_ms=options["time_limit_ms"],
        )
        if options["json"]:
            self.print_json(result)
            return
        job_id = result["job"]["id"]
        self.stdout.write(f"{job_id} (duplicate)" if result.get("deduplicated") else job_id)


def _read_payload(path: str) -> bytes:
    """The bytes of ``path`` (``-``: standard input), at most a frame's worth.

    Raises:
        CommandError: ``INVALID_ARGUMENT`` when it cannot be read or holds more than
            ``RELAY_MAX_FRAME_BYTES`` (no request could carry it).
    """
    limit = relay_settings().max_frame_bytes
    try:
        if path == "-":
            if sys.stdin is None:  # started with standard input closed (<&-)
                raise invalid_argument("--payload-file -: standard input is closed")
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with open(path, "rb") as file:
                data = file.read(limit + 1)
    except OSError as exc:
        raise invalid_argument(f"--payload-file: {exc.strerror or exc}: {path}") from None
    if len(data) > limit:
        raise invalid_argument(f"--payload-file: {path} holds more than {limit} bytes")
    return data
