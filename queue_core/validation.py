"""Argument checks shared by every surface (they run inside the service layer).

Each function takes an untrusted value and returns it cleaned, or raises ``InvalidArgument``
(``FrameTooLarge`` for an oversized payload) with ``details["field"]`` naming the argument.
"""

from __future__ import annotations

import functools
import math
import re
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


def has_lone_surrogate(value: str) -> bool:
    """Whether ``value`` holds a lone surrogate (U+D800..U+DFFF), which has no UTF-8 form:
    JSON, SQLite and PostgreSQL all refuse it. ASCII text is answered without encoding."""
    if value.isascii():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_SURROGATE = "must not contain lone surrogates (U+D800..U+DFFF): they have no UTF-8 form"


def text(field: str, value: Any, *, max_len: int, min_len: int = 1) -> str:
    """Return ``value`` if it is a string of ``min_len..max_len`` characters without NUL
    (PostgreSQL cannot store NUL in text; refused on every driver alike) and without lone
    surrogates (no UTF-8 form: no store can hold one).

    Raises:
        InvalidArgument: not a string, of the wrong length, or holding NUL or a surrogate.
    """
    if (
        type(value) is str
        and value.isascii()  # no surrogate, without a call (every id and token)
        and min_len <= len(value) <= max_len
        and "\x00" not in value
    ):
        return value
    if not isinstance(value, str):
        raise _bad(field, f"must be a string, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise _bad(field, f"must be {min_len} to {max_len} characters long")
    if "\x00" in value:
        raise _bad(field, "must not contain NUL characters")
    if has_lone_surrogate(value):
        raise _bad(field, _SURROGATE)
    return value


def boolean(field: str, value: Any) -> bool:
    """Return ``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise _bad(field, f"must be true or false, got {type(value).__name__}")
    return value


def queue_name(value: Any, settings: RelaySettings, field: str = "queue") -> str:
    """Return a valid queue name: ``[A-Za-z0-9][A-Za-z0-9_.:-]*``, at most the configured length.

    Args:
        field: the argument's name in an error (``after`` for a cursor that is a queue name).
    """
    if isinstance(value, str) and _known_good(value, settings.max_queue_name_length):
        return value
    name = text(field, value, max_len=settings.max_queue_name_length)
    if not QUEUE_NAME_RE.fullmatch(name):
        raise _bad(
            field, "may contain only letters, digits and _ . : - and must not start with a symbol"
        )
    return name


# The bounds on how many items a list or map argument holds, checked by its length alone,
# before any item: TCP and HTTP (``queue_api.schemas``) refuse an over-long one in these words.


def batch_count(value: Any, settings: RelaySettings) -> None:
    """Refuse a batch submit's ``jobs`` unless it is a list of 1..``max_batch_submit``.

    Raises:
        InvalidArgument: it is not (``details["field"]`` is ``jobs``).
    """
    limit = settings.max_batch_submit
    if not isinstance(value, list) or not 1 <= len(value) <= limit:
        raise _bad("jobs", f"must be a list of 1 to {limit} jobs")


def queue_count(value: list[Any], settings: RelaySettings, field: str = "queues") -> None:
    """Refuse a list of queues unless it holds 1..``max_queues_per_lease`` of them.

    Raises:
        InvalidArgument: it does not (``details["field"]`` is ``field``).
    """
    limit = settings.max_queues_per_lease
    if not 1 <= len(value) <= limit:
        raise _bad(field, f"must name 1 to {limit} queues, got {len(value)}")


def meta_count(value: dict[Any, Any], settings: RelaySettings) -> None:
    """Refuse a ``meta`` map of more than ``max_meta_keys`` keys.

    Raises:
        InvalidArgument: it has more (``details["field"]`` is ``meta``).
    """
    if len(value) > settings.max_meta_keys:
        raise _bad("meta", f"must have at most {settings.max_meta_keys} keys, got {len(value)}")


def queue_list(value: Any, settings: RelaySettings) -> list[str]:
    """Return 1..``max_queues_per_lease`` distinct valid queue names, in the given order."""
    if not isinstance(value, list):
        raise _bad("queues", "must be a non-empty list of queue names")
    queue_count(value, settings)
    return list(dict.fromkeys(queue_name(q, settings) for q in value))


@functools.lru_cache(maxsize=4096)
def _known_good(name: str, max_len: int) -> bool:
    """Whether ``name`` is a valid queue name (cached: a batch names the same queues)."""
    return 1 <= len(name) <= max_len and QUEUE_NAME_RE.fullmatch(name) is not None


MAX_PAYLOAD_DEPTH = 64
"""Deepest nesting of arrays/objects in a payload. Replies wrap a payload in a few more levels,
and the JSON codec stops at 254, so a bound well below that keeps every reply encodable."""


# A JSON string in orjson's output (escapes are a backslash and one more character): what
# nests_deeper drops, so brackets inside strings are not counted.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPENERS_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_A_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")


def nests_deeper(encoded: bytes, limit: int) -> bool:
    """Whether the JSON text ``encoded`` (orjson's output) nests arrays and objects more than
    ``limit`` deep, in C-speed passes over bytes: strings dropped, everything but brackets
    dropped, then each pass removes the innermost ``[]`` pairs, one level a pass.

    The check it replaces counted every bracket in the payload and, past ``limit`` of them,
    walked the decoded value in Python: a valid 25 KB payload of 1,000 empty objects took
    that walk, and a 1 MB batch of 40 of them 170 ms of the writer's time (hostile review).
    This takes about a millisecond a megabyte for such payloads; one built to need every
    pass (2,000 chains 64 deep, 256 KB) takes about 35 ms. ``unfaithful`` still names the
    path of a payload found too deep.
    """
    if encoded.count(b"[") + encoded.count(b"{") <= limit:
        return False  # almost every payload: too few brackets to nest that deep
    if b'"' in encoded:
        encoded = _JSON_STRING.sub(b"", encoded)
    brackets = encoded.translate(_OPENERS_AS_BRACKETS, _NOT_A_BRACKET)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def _path(parent: str, key: object) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def unfaithful(
    value: Any, *, max_depth: int | None = None, root: str = "", encoded: bool = False
) -> tuple[str, str] | None:
    """Find what JSON would not carry faithfully in ``value`` (dicts, lists and tuples walked
    without recursion): a float that is NaN or ±Infinity (orjson writes ``null`` for it), a
    string or key holding a lone surrogate (no UTF-8 form; orjson raises), an integer outside
    -2**63..2**64-1 (orjson's range), a key that is not a string, a value orjson cannot encode
    (a set, ``object()``; a ``datetime`` or ``UUID`` it can), or nesting deeper than
    ``max_depth`` arrays/objects (``WALK_MAX_DEPTH`` when not given: also a value that holds
    itself).

    Args:
        value: a JSON-like value (what is to be encoded, or was decoded).
        max_depth: the deepest nesting allowed (None: not checked).
        root: the name of ``value`` in paths, e.g. ``"payload"`` (``""``: a dict's keys
            name the top level, ``lease_ms``, ``jobs[0].payload``).
        encoded: orjson encoded ``value`` without error, so it holds no surrogate: a quick
            walk that builds no paths looks for the rest first.
    Returns:
        ``(path, problem)`` for the first such part found, e.g. ``("payload.x[2]", "NaN is
        not a JSON number")``; None when there is none. Neither holds a surrogate.
    """
    if encoded and not _suspect(value, max_depth):
        return None
    # Without a max_depth, still no deeper than orjson goes: a value that holds itself
    # (r["self"] = r) made an endless walk that took a process to 6.5 GB (a review).
    deepest = max_depth if max_depth is not None else WALK_MAX_DEPTH
    stack: list[tuple[Any, str, int]] = [(value, root, 1)]
    walked = 0
    while stack:
        item, path, depth = stack.pop()
        walked += 1
        if walked > WALK_MAX_VALUES:  # shared parts are walked once per path to them
            top = re.split(r"[.\[]", path, maxsplit=1)[0] or "value"
            return top, f"holds more than {WALK_MAX_VALUES:,} values to check, or holds itself"
        if isinstance(item, float):
            if not math.isfinite(item):
                name = "NaN" if math.isnan(item) else ("-" if item < 0 else "") + "Infinity"
                return path or "value", f"{name} is not a JSON number"
        elif isinstance(item, str):
            if has_lone_surrogate(item):
                return path or "value", _SURROGATE
        elif isinstance(item, (dict, list, tuple)):
            if depth > deepest:
                if max_depth is not None:
                    return root or "value", f"is nested deeper than {max_depth} levels"
                top = re.split(r"[.\[]", path, maxsplit=1)[0] or "value"  # a cycle's path is long
                return top, f"is nested deeper than {deepest} levels, or holds itself"
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        return path or "value", f"key {key!r} is not a string"
                    if has_lone_surrogate(key):
                        return path or "value", f"key {key!r} {_SURROGATE}"
                    stack.append((child, _path(path, key), depth + 1))
            else:
                stack.extend((child, _path(path, i), depth + 1) for i, child in enumerate(item))
        elif isinstance(item, int):
            if not _INT_MIN <= item <= _INT_MAX:
                return path or "value", "is an integer outside -2**63..2**64-1"
        elif item is not None and not encoded and not _encodes(item):
            return path or "value", f"{type(item).__name__} is not a JSON type"
    return None


_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what orjson encodes
WALK_MAX_DEPTH = 256  # past orjson's own recursion limit (it refuses deeper values)
# Values the walk looks at, at most: a value whose parts share one subtree is walked once per
# path to it, and 20 levels of that took 2.4 s (a review); 200,000 take about 0.1 s.
WALK_MAX_VALUES = 200_000


def _encodes(item: Any) -> bool:
    """Whether orjson encodes ``item`` (a leaf that is no str, number, list or dict)."""
    try:
        orjson.dumps(item)
    except TypeError:
        return False
    return True


def _suspect(value: Any, max_depth: int | None) -> bool:
    """Whether ``value`` holds a float that is NaN or ±Infinity, or nests deeper than
    ``max_depth`` (the hot path: no paths, and no depths when ``max_depth`` is None)."""
    if max_depth is None:
        items = [value]
        pop, extend, isfinite = items.pop, items.extend, math.isfinite
        while items:
            item = pop()
            if isinstance(item, dict):
                extend(item.values())
            elif isinstance(item, (list, tuple)):
                extend(item)
            elif isinstance(item, float) and not isfinite(item):
                return True
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            if isinstance(item, float) and not math.isfinite(item):
                return True
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def payload(value: Any, settings: RelaySettings) -> str:
    """Return the payload as canonical JSON text (sorted keys, compact).

    See ``json_text`` (``field`` ``payload``, limit ``max_payload_bytes``).

    Raises:
        InvalidArgument: None (JSON null, or no payload at all: a job carries a value), or
            as ``json_text``.
    """
    if value is None:
        raise _bad("payload", "is required: any JSON value but null")
    return json_text(value, field="payload", limit=settings.max_payload_bytes)


def result(value: Any, settings: RelaySettings) -> str:
    """Return the result an ack carries as canonical JSON text (sorted keys, compact).

    See ``json_text`` (``field`` ``result``, limit ``result_limit_bytes``).
    """
    return json_text(value, field="result", limit=settings.result_limit_bytes)


def exception_class(value: Any) -> str:
    """Return an exception class name (``module.QualName``, 1..255 characters)."""
    return text("exception_class", value, max_len=255)


def traceback_text(value: Any, settings: RelaySettings) -> str:
    """Return a traceback of at most ``result_limit_bytes`` UTF-8 bytes, NUL characters replaced
    by U+FFFD (as ``error_text``; the worker cuts a longer one, keeping its end).

    Raises:
        InvalidArgument: not a string, over the limit, or holding a lone surrogate.
    """
    if not isinstance(value, str):
        raise _bad("traceback", f"must be a string, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _bad("traceback", _SURROGATE) from None
    limit = settings.result_limit_bytes
    if size > limit:
        raise _bad("traceback", f"is {size} bytes, over the {limit}-byte limit")
    return value.replace("\x00", "\ufffd")


def json_text(value: Any, *, field: str, limit: int) -> str:
    """Return ``value`` as canonical JSON text (sorted keys, compact).

    JSON numbers follow the codec (orjson): integers within 64 bits stay exact; a larger
    integer arriving in a frame has already been read as a double, as JavaScript reads it.

    Raises:
        InvalidArgument: not JSON-serialisable (e.g. a Python int beyond 64 bits, a string or
            key with a lone surrogate), holding a float that is NaN or ±Infinity (orjson
            would store it as ``null``), or nested deeper than ``MAX_PAYLOAD_DEPTH``;
            ``details["field"]`` is ``field`` or the path below it (``payload.a[2]``).
        FrameTooLarge: over ``limit`` bytes once encoded.
    """
    try:
        encoded = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError) as exc:
        # orjson stops at 255 levels: a value that deep is past MAX_PAYLOAD_DEPTH, the limit
        # to name (a value that holds itself is, too).
        found = unfaithful(value, max_depth=MAX_PAYLOAD_DEPTH, root=field)
        if found is not None:
            raise InvalidArgument(": ".join(found), field=found[0]) from exc
        raise _bad(field, f"is not encodable as JSON: {exc}") from exc
    # The size first: what follows then costs at most a limit's worth.
    if len(encoded) > limit:
        raise FrameTooLarge(
            f"{field} is {len(encoded)} bytes, over the {limit}-byte limit",
            field=field,
            limit=limit,
        )
    # Walk the value (in Python: slow) only when the encoding shows it is needed: too deep
    # (nests_deeper, over the bytes), or NaN or ±Infinity, which come out as null, so the
    # value then differs from its decoding (decoded and compared in C, ~20x quicker).
    deep = encoded.count(b"[") + encoded.count(b"{") > MAX_PAYLOAD_DEPTH and nests_deeper(
        encoded, MAX_PAYLOAD_DEPTH
    )
    if deep or (encoded.find(b"null") >= 0 and orjson.loads(encoded) != value):
        depth = MAX_PAYLOAD_DEPTH if deep else None
        found = unfaithful(value, max_depth=depth, root=field, encoded=True)
        if found is not None:
            raise InvalidArgument(": ".join(found), field=found[0])
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
    a character PostgreSQL cannot store).

    Raises:
        InvalidArgument: not a string, over the limit, or holding a lone surrogate (no UTF-8
            form, so no store can hold it; the worker replaces them before it sends a text).
    """
    if not isinstance(value, str):
        raise _bad("error", f"must be a string, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _bad("error", _SURROGATE) from None
    if size > settings.max_error_bytes:
        raise _bad("error", f"is {size} bytes, over the {settings.max_error_bytes}-byte limit")
    return value.replace("\x00", "\ufffd")


JOB_ID_MAX = 40  # the longest job id taken, in characters (Relay's own are 30)


def job_id(value: Any, field: str = "job_id") -> str:
    """Return a plausible job id string (existence is checked by the query); an error names
    ``field`` (a page's ``after`` cursor is a job id too)."""
    return text(field, value, max_len=JOB_ID_MAX)


def plausible_job_id(value: Any) -> str | None:
    """``value`` when ``job_id`` takes it, else None (what a server may echo, or lock)."""
    try:
        return job_id(value)
    except InvalidArgument:
        return None


def worker_id(value: Any) -> str:
    """Return a worker id of 1..128 characters."""
    return text("worker_id", value, max_len=128)


def lease_token(value: Any) -> str:
    """Return a lease token of 1..64 characters."""
    return text("lease_token", value, max_len=64)


def actor(value: Any) -> str | None:
    """Return who asked for an operator action (a username of 1..150 characters), or None."""
    if value is None:
        return None
    return text("actor", value, max_len=150)


def idempotency_key(value: Any) -> str | None:
    """Return an idempotency key of 1..255 characters, or None."""
    if value is None:
        return None
    return text("idempotency_key", value, max_len=255)


UNIQUE_SCOPES = ("window", "active")
"""The values of a submit's ``unique`` option (``QueueService.submit``)."""


def unique_scope(value: Any, key: str | None) -> str | None:
    """Return the stored ``unique_scope`` for a submit's ``unique`` option: ``"active"``, or
    None for ``"window"`` (the default, also when ``value`` is None).

    Args:
        value: ``"window"``, ``"active"`` or None.
        key: the submit's idempotency key (``"active"`` needs one).
    Raises:
        InvalidArgument: another value, or ``"active"`` without an idempotency key
            (``details["field"]`` is ``unique``).
    """
    if value is None or value == "window":
        return None
    if value != "active":
        raise _bad("unique", f"must be 'window' or 'active', got {value!r}")
    if key is None:
        raise _bad("unique", "'active' needs an idempotency_key")
    return "active"


def meta(value: Any, settings: RelaySettings) -> str | None:
    """Return a job's ``meta`` as canonical JSON text (sorted keys, compact), or None when
    ``value`` is None or empty.

    ``meta`` is a flat map of strings carried beside the payload (trace context such as the
    W3C ``traceparent``, a tenant, a request id), bounded so it cannot grow into a second
    payload: at most ``max_meta_keys`` keys of 1..``max_meta_key_bytes`` UTF-8 bytes, string
    values, ``max_meta_bytes`` encoded in all. Neither keys nor values may hold NUL or a lone
    surrogate (as the other text arguments).

    Raises:
        InvalidArgument: not an object, too many keys, a bad key (``details["field"]`` is
            ``meta``), a value that is not a string or holds NUL or a surrogate
            (``meta.<key>``), or over ``max_meta_bytes`` once encoded (``meta``).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("meta", f"must be an object of strings, got {type(value).__name__}")
    if not value:
        return None
    meta_count(value, settings)
    for name, item in value.items():
        if not isinstance(name, str) or not name:
            raise _bad("meta", "keys must be non-empty strings")
        if "\x00" in name or has_lone_surrogate(name):
            raise _bad("meta", "keys must not contain NUL characters or lone surrogates")
        if len(name.encode()) > settings.max_meta_key_bytes:
            raise _bad(
                "meta",
                f"key {name[:20]!r}... is longer than {settings.max_meta_key_bytes} bytes",
            )
        field = f"meta.{name}"
        if not isinstance(item, str):
            raise _bad(field, f"must be a string, got {type(item).__name__}")
        if "\x00" in item:
            raise _bad(field, "must not contain NUL characters")
        if has_lone_surrogate(item):
            raise _bad(field, _SURROGATE)
    encoded = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    if len(encoded) > settings.max_meta_bytes:
        raise _bad(
            "meta",
            f"is {len(encoded)} bytes encoded, more than RELAY_MAX_META_BYTES "
            f"({settings.max_meta_bytes})",
        )
    return encoded.decode()
