"""Bytes <-> protocol frames: one UTF-8 JSON object per ``\\n``-terminated line.

No sockets and no Django beyond ``conf``: the server, the client and the tests call these
functions directly. Framing errors raise ``BadFrame`` (the connection stays open) or
``FrameTooLarge`` (the server closes the connection); see ``docs/protocol.md``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from queue_core import errors, validation
from queue_core.conf import relay_settings

RequestId = str | int
MAX_ID_LENGTH = 128
_ENVELOPE_KEYS = frozenset({"id", "op", "args"})


class Request(NamedTuple):
    """One decoded request frame.

    Attributes:
        id: the client's request id (string of at most 128 characters or integer), echoed in
            the reply; ``None`` when the client sent none.
        op: the operation name (not yet checked against the op table).
        args: the operation's arguments (``{}`` when the frame had none).
    """

    id: RequestId | None
    op: str
    args: dict[str, Any]


def _check_size(size: int, max_frame_bytes: int | None) -> None:
    """Refuse a frame of ``size`` bytes (its newline excluded) over the limit."""
    limit = relay_settings().max_frame_bytes if max_frame_bytes is None else max_frame_bytes
    if size > limit:
        raise errors.FrameTooLarge(
            f"frame is {size} bytes, over the {limit}-byte limit", limit_bytes=limit
        )


def _loads(body: bytes) -> Any:
    """The JSON value of ``body`` (a trailing newline is whitespace to the parser); orjson
    checks the UTF-8 itself, so no decoded copy is made. Raises ``BadFrame``."""
    try:
        # orjson rejects nesting deeper than 1024 levels with the same error as bad JSON.
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise errors.BadFrame("frame is not valid UTF-8") from exc
        raise errors.BadFrame(f"frame is not valid JSON: {exc}") from exc


def _valid_id(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, str) and len(value) <= MAX_ID_LENGTH


def decode_request(line: bytes, max_frame_bytes: int | None = None) -> Request:
    """Decode one request line (with or without its trailing ``\\n``).

    Args:
        line: the raw bytes of one frame.
        max_frame_bytes: size limit in bytes, newline excluded (default
            ``RELAY_MAX_FRAME_BYTES``).
    Returns:
        ``Request(id, op, args)``; a missing or ``null`` id or args reads as ``None`` / ``{}``.
    Raises:
        FrameTooLarge: the line without its newline is longer than the limit.
        BadFrame: not UTF-8, not JSON (or nested too deeply), not an object, an unknown
            envelope key, no string ``op``, an id that is neither an integer nor a string of at
            most 128 characters, or ``args`` not an object.
    """
    _check_size(len(line) - line.endswith(b"\n"), max_frame_bytes)
    obj = _loads(line)
    if not isinstance(obj, dict):
        raise errors.BadFrame("frame is not a JSON object")
    if not obj.keys() <= _ENVELOPE_KEYS:
        unknown = sorted(set(obj) - _ENVELOPE_KEYS)
        raise errors.BadFrame(f"unknown frame key {unknown[0]!r}; expected id, op, args")
    req_id = obj.get("id")
    if req_id is not None and type(req_id) is not int and not _valid_id(req_id):
        raise errors.BadFrame(
            f"id must be an integer or a string of at most {MAX_ID_LENGTH} characters"
        )
    op = obj.get("op")
    if not isinstance(op, str) or not op:
        raise errors.BadFrame('frame has no string "op"')
    args = obj.get("args")
    if args is None:
        args = {}
    elif not isinstance(args, dict):
        raise errors.BadFrame('"args" must be a JSON object')
    return Request(id=req_id, op=op, args=args)


def request_id_of(line: bytes) -> RequestId | None:
    """Return the id of a frame that failed to decode, or ``None`` when it cannot be read.

    Lets the server echo the id in a ``BAD_FRAME`` reply when the frame was a JSON object
    with a valid id but something else was wrong.
    """
    try:
        obj = orjson.loads(line)
    except (orjson.JSONDecodeError, UnicodeDecodeError):
        return None
    req_id = obj.get("id") if isinstance(obj, dict) else None
    return req_id if _valid_id(req_id) else None


def encode_request(req_id: RequestId | None, op: str, args: dict[str, Any] | None = None) -> bytes:
    """Encode a request frame ``{"id", "op", "args"}`` ending in ``\\n`` (for clients).

    Raises:
        InvalidArgument: ``args`` hold what JSON cannot carry (``details["field"]`` is its
            path, e.g. ``lease_ms`` or ``payload.items[3]``): a float that is NaN or
            ±Infinity (orjson would send ``null``, which the server reads as "not given": a
            NaN ``delay_ms`` would run the job at once), a string with a lone surrogate, or a
            value of a type JSON does not have.
    """
    frame: dict[str, Any] = {"op": op}
    if req_id is not None:
        frame["id"] = req_id
    if args:
        frame["args"] = args
    try:
        encoded = orjson.dumps(frame, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError as exc:  # orjson.JSONEncodeError
        found = validation.unfaithful(args)
        if found is None:
            raise errors.InvalidArgument(f"{op} args are not JSON-serialisable: {exc}") from exc
        raise _invalid(*found) from exc
    # NaN and ±Infinity come out as null, and the args then differ from their decoding
    # (decoded and compared in C): only then walk them (in Python) to find which one it was.
    if (
        encoded.find(b"null") >= 0
        and orjson.loads(encoded).get("args") != args
        and (found := validation.unfaithful(args, encoded=True))
    ):
        raise _invalid(*found)
    return encoded


def _invalid(path: str, problem: str) -> errors.InvalidArgument:
    """``InvalidArgument`` whose field is the path to the bad value, as the server's is."""
    return errors.InvalidArgument(f"{path}: {problem}", field=path)


def encode_ok(req_id: RequestId | None, result: Any) -> bytes:
    """Encode a success reply ``{"id", "ok": true, "result"}`` ending in ``\\n``.

    Raises:
        TypeError: ``result`` holds something JSON cannot represent (a server bug).
    """
    return orjson.dumps(
        {"id": req_id, "ok": True, "result": result}, option=orjson.OPT_APPEND_NEWLINE
    )


def encode_error(req_id: RequestId | None, exc: BaseException) -> bytes:
    """Encode an error reply ``{"id", "ok": false, "error": {code, message, retryable,
    details?}}`` ending in ``\\n``; a non-``RelayError`` becomes a generic ``INTERNAL``."""
    body = errors.error_body(exc)
    try:
        return orjson.dumps(
            {"id": req_id, "ok": False, "error": body}, option=orjson.OPT_APPEND_NEWLINE
        )
    except TypeError:  # details that JSON cannot hold: keep the code and message
        body.pop("details", None)
        return orjson.dumps(
            {"id": req_id, "ok": False, "error": body}, option=orjson.OPT_APPEND_NEWLINE
        )


def decode_response(line: bytes) -> dict[str, Any]:
    """Decode one reply line for a client.

    Returns:
        The reply object: ``{"id", "ok": true, "result"}`` or ``{"id", "ok": false, "error"}``.
    Raises:
        BadFrame: not UTF-8 JSON, not an object, or no boolean ``ok`` with its ``result`` /
            ``error`` object.
    """
    obj = _loads(line)
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        raise errors.BadFrame('reply is not a JSON object with a boolean "ok"')
    if not obj["ok"] and not isinstance(obj.get("error"), dict):
        raise errors.BadFrame('error reply has no "error" object')
    if obj["ok"] and "result" not in obj:
        raise errors.BadFrame('success reply has no "result"')
    return obj
