"""Argument checks shared by every surface (they run inside the service layer).

Each function takes an untrusted value and returns it cleaned, or raises ``InvalidArgument``
(``FrameTooLarge`` for an oversized payload) with ``details["field"]`` naming the argument.
"""

from __future__ import annotations

import functools
from typing import Any

import orjson

from queue_core.conf import QUEUE_NAME_RE, RelaySettings
from queue_core.errors import FrameTooLarge, InvalidArgument
from queue_core.states import Priority


def _bad(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {message}", field=field)


def integer(field: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) within ``[lo, hi]``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(field, f"must be an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise _bad(field, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise _bad(field, f"must be <= {hi}, got {value}")
    return value


def text(field: str, value: Any, *, max_len: int, min_len: int = 1) -> str:
    """Return ``value`` if it is a string of ``min_len..max_len`` characters without NUL
    (PostgreSQL cannot store NUL in text; refused on every driver alike)."""
    if not isinstance(value, str):
        raise _bad(field, f"must be a string, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise _bad(field, f"must be {min_len} to {max_len} characters long")
    if "\x00" in value:
        raise _bad(field, "must not contain NUL characters")
    return value


def boolean(field: str, value: Any) -> bool:
    """Return ``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise _bad(field, f"must be true or false, got {type(value).__name__}")
    return value


def queue_name(value: Any, settings: RelaySettings) -> str:
    """Return a valid queue name: ``[A-Za-z0-9][A-Za-z0-9_.:-]*``, at most the configured length."""
    if isinstance(value, str) and _known_good(value, settings.max_queue_name_length):
        return value
    name = text("queue", value, max_len=settings.max_queue_name_length)
    if not QUEUE_NAME_RE.fullmatch(name):
        raise _bad(
            "queue", "may contain only letters, digits and _ . : - and must not start with a symbol"
        )
    return name


def queue_list(value: Any, settings: RelaySettings) -> list[str]:
    """Return 1..``max_queues_per_lease`` distinct valid queue names, in the given order."""
    if not isinstance(value, list) or not value:
        raise _bad("queues", "must be a non-empty list of queue names")
    if len(value) > settings.max_queues_per_lease:
        raise _bad("queues", f"at most {settings.max_queues_per_lease} queues per lease request")
    return list(dict.fromkeys(queue_name(q, settings) for q in value))


@functools.lru_cache(maxsize=4096)
def _known_good(name: str, max_len: int) -> bool:
    """Whether ``name`` is a valid queue name (cached: a batch names the same queues)."""
    return 1 <= len(name) <= max_len and QUEUE_NAME_RE.fullmatch(name) is not None


MAX_PAYLOAD_DEPTH = 64
"""Deepest nesting of arrays/objects in a payload. Replies wrap a payload in a few more levels,
and the JSON codec stops at 254, so a bound well below that keeps every reply encodable."""


def _depth_ok(value: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def payload(value: Any, settings: RelaySettings) -> str:
    """Return the payload as canonical JSON text (sorted keys, compact).

    JSON numbers follow the codec (orjson): integers within 64 bits stay exact; a larger
    integer arriving in a frame has already been read as a double, as JavaScript reads it.

    Raises:
        InvalidArgument: not JSON-serialisable (e.g. a Python int beyond 64 bits), or nested
            deeper than ``MAX_PAYLOAD_DEPTH``.
        FrameTooLarge: over ``max_payload_bytes`` once encoded.
    """
    try:
        encoded = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise _bad("payload", f"is not encodable as JSON: {exc}") from exc
    # Nesting can't exceed the number of brackets: walk the value only when it could.
    brackets = encoded.count(b"[") + encoded.count(b"{")
    if brackets > MAX_PAYLOAD_DEPTH and not _depth_ok(value, MAX_PAYLOAD_DEPTH):
        raise _bad("payload", f"is nested deeper than {MAX_PAYLOAD_DEPTH} levels")
    if len(encoded) > settings.max_payload_bytes:
        raise FrameTooLarge(
            f"payload is {len(encoded)} bytes, over the {settings.max_payload_bytes}-byte limit",
            field="payload",
            limit=settings.max_payload_bytes,
        )
    return encoded.decode("utf-8")


def priority(value: Any) -> int:
    """Return the priority class number for a name (``low``..``critical``) or number 0-3."""
    try:
        return int(Priority.parse(value))
    except ValueError as exc:
        raise _bad("priority", str(exc)) from exc


def lease_ms(value: Any, settings: RelaySettings) -> int:
    """Return a lease length in ms within ``[min_lease_ms, max_lease_ms]`` (None → default)."""
    if value is None:
        return settings.visibility_timeout_ms
    return integer("lease_ms", value, lo=settings.min_lease_ms, hi=settings.max_lease_ms)


def error_text(value: Any, settings: RelaySettings) -> str:
    """Return a failure text of at most ``max_error_bytes`` UTF-8 bytes, NUL characters
    replaced by U+FFFD (a handler's error message is kept, not refused, even when it holds
    a character PostgreSQL cannot store)."""
    if not isinstance(value, str):
        raise _bad("error", f"must be a string, got {type(value).__name__}")
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > settings.max_error_bytes:
        raise _bad("error", f"is {size} bytes, over the {settings.max_error_bytes}-byte limit")
    return value.replace("\x00", "\ufffd")


def job_id(value: Any) -> str:
    """Return a plausible job id string (existence is checked by the query)."""
    return text("job_id", value, max_len=40)


def worker_id(value: Any) -> str:
    """Return a worker id of 1..128 characters."""
    return text("worker_id", value, max_len=128)


def lease_token(value: Any) -> str:
    """Return a lease token of 1..64 characters."""
    return text("lease_token", value, max_len=64)


def idempotency_key(value: Any) -> str | None:
    """Return an idempotency key of 1..255 characters, or None."""
    if value is None:
        return None
    return text("idempotency_key", value, max_len=255)
