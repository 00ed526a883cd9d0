"""How the console shows instants, durations, errors and lease tokens (pure functions).

Relay stores instants as epoch milliseconds; the console shows them as ISO 8601 UTC and
durations as short spans ("3m 12s"). A lease token is a fencing secret: only its last four
characters are ever rendered.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import orjson

DASH = "—"
TOKEN_TAIL_CHARS = 4


def iso_ms(ms: int | None) -> str:
    """Render epoch ms as ``2026-01-01 00:00:00Z`` (UTC), or a dash for None."""
    if ms is None:
        return DASH
    moment = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def span_ms(ms: int | None) -> str:
    """Render a duration in ms in its two largest units: ``850ms``, ``42s``, ``3m 12s``."""
    if ms is None:
        return DASH
    ms = max(0, int(ms))
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms // 1000
    parts: list[str] = []
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)):
        value, seconds = divmod(seconds, size)
        if value or parts:
            parts.append(f"{value}{unit}")
        if len(parts) == 2:
            break
    # Drop a trailing zero unit ("3m 0s" -> "3m").
    if len(parts) == 2 and parts[1].startswith("0"):
        parts.pop()
    return " ".join(parts)


def relative_ms(at_ms: int | None, now_ms: int) -> str:
    """Render an instant relative to now: ``3m 12s ago`` or ``in 20s``."""
    if at_ms is None:
        return DASH
    delta = now_ms - at_ms
    return f"{span_ms(delta)} ago" if delta >= 0 else f"in {span_ms(-delta)}"


# The most characters of an error a list's hover title repeats; the job's page shows it all.
# Whole, 100 errors of 4 KiB full of "<" made a dead-letter page of 2.16 MB (a review); 0.27 MB
# with this.
HOVER_CHARS = 300


def shorten(text: str | None, limit: int = 80) -> str:
    """One line of at most ``limit`` characters, with an ellipsis when cut."""
    if not text:
        return DASH
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def token_tail(token: str | None) -> str:
    """The last characters of a lease token, never the whole token: ``…xY3Q``."""
    if not token:
        return DASH
    return "…" + token[-TOKEN_TAIL_CHARS:]


def token_status(state: str, token: str | None, expires_at_ms: int | None, now_ms: int) -> str:
    """Describe a job's lease token without revealing it.

    Returns e.g. ``live, ends …xY3Q, expires in 12s`` or ``expired 3s ago, ends …xY3Q (the
    reaper reclaims it)`` or ``none``.
    """
    if state != "leased" or not token:
        return "none (no live lease)"
    if expires_at_ms is not None and expires_at_ms > now_ms:
        return f"live, ends {token_tail(token)}, expires {relative_ms(expires_at_ms, now_ms)}"
    return (
        f"expired {relative_ms(expires_at_ms, now_ms)}, ends {token_tail(token)} "
        "(the reaper will reclaim it)"
    )


# Indented JSON is shown when it is at most this many times the stored text, plus
# ``PRETTY_SLACK`` bytes; else the stored (compact) text is. Indentation grows with
# depth: a 256 KiB payload of a list 63 levels deep indented to a 16.9 MB page that took
# Chromium 20 s (a review), where the compact text is 256 KiB.
PRETTY_GROWTH = 4
PRETTY_SLACK = 64 * 1024


def pretty_json(raw: str | None) -> str:
    """Indent a stored canonical-JSON payload for reading: the stored text itself if it is
    not JSON, or if indented it would be over ``PRETTY_GROWTH`` times its UTF-8 length plus
    ``PRETTY_SLACK`` bytes."""
    if raw is None:
        return ""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    pretty = orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    if len(pretty) > PRETTY_GROWTH * len(raw.encode()) + PRETTY_SLACK:
        return raw
    return pretty.decode()


# A job's state as a task result reads it: django.tasks' TaskResultStatus names for a Django
# task (queue_core.tasks_backend.STATUS_OF_STATE), the job state for any other job.
_TASK_STATUS = {
    "pending": "READY",
    "ready": "READY",
    "retrying": "READY",
    "leased": "RUNNING",
    "succeeded": "SUCCESSFUL",
    "dead": "FAILED",
}


def result_status(state: str, django_task: bool) -> str:
    """``"SUCCESSFUL (succeeded)"`` for a Django task's job, else the state itself."""
    if django_task and state in _TASK_STATUS:
        return f"{_TASK_STATUS[state]} ({state})"
    return state


def result_errors(raw: str | None) -> list[dict[str, Any]]:
    """The stored errors (``relay_result.errors``) as rows to show, newest attempt first:
    ``{"attempt", "exception_class", "traceback"}``; [] for none or unreadable text."""
    if not raw:
        return []
    try:
        entries = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return []
    if not isinstance(entries, list):
        return []
    rows = [
        {
            "attempt": entry.get("attempt"),
            "exception_class": entry.get("exception_class", ""),
            "traceback": entry.get("traceback", ""),
        }
        for entry in entries
        if isinstance(entry, dict)
    ]
    rows.reverse()
    return rows
