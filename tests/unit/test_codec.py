"""The NDJSON codec: round trips and every framing error, without sockets or a database."""

from __future__ import annotations

import datetime as dt
import math
import uuid
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_core import errors
from queue_core.protocol import codec


def test_request_round_trip() -> None:
    line = codec.encode_request("c-17", "lease", {"queues": ["emails"], "max_jobs": 2})
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    req = codec.decode_request(line)
    assert req == codec.Request(id="c-17", op="lease", args={"queues": ["emails"], "max_jobs": 2})


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (b'{"op":"ping"}', codec.Request(None, "ping", {})),
        (b'{"id":null,"op":"ping","args":null}', codec.Request(None, "ping", {})),
        (
            b'{"id":7,"op":"stats","args":{"queue":"q"}}\n',
            codec.Request(7, "stats", {"queue": "q"}),
        ),
        (b'  {"id":"x","op":"ping"}  \n', codec.Request("x", "ping", {})),
        ('{"id":"é","op":"ping"}'.encode(), codec.Request("é", "ping", {})),
    ],
)
def test_decode_request_accepts(frame: bytes, expected: codec.Request) -> None:
    assert codec.decode_request(frame) == expected


@pytest.mark.parametrize(
    "frame",
    [
        b"\xff\xfe{}",  # not UTF-8
        b'{"op":"ping"',  # truncated JSON
        b"",  # empty line
        b"[1,2]",  # not an object
        b'"ping"',
        b"{}",  # no op
        b'{"op":5}',  # op not a string
        b'{"op":""}',
        b'{"op":"ping","args":[1]}',  # args not an object
        b'{"op":"ping","args":"x"}',
        b'{"id":true,"op":"ping"}',  # bool is not an id
        b'{"id":1.5,"op":"ping"}',
        b'{"id":{"a":1},"op":"ping"}',
        b'{"op":"ping","arg":{}}',  # unknown envelope key (typo of args)
        ('{"id":"' + "x" * 129 + '","op":"ping"}').encode(),  # id too long
        b'{"op":"ping","args":{"v":NaN}}',
    ],
)
def test_decode_request_rejects_bad_frames(frame: bytes) -> None:
    with pytest.raises(errors.BadFrame) as info:
        codec.decode_request(frame)
    assert info.value.code == "BAD_FRAME"


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b'{"op":"ping","id":"\xff"}\n', "frame is not valid UTF-8"),
        (b'{"op":"ping","id":"\xed\xa0\x80"}', "frame is not valid UTF-8"),  # a surrogate
        (b'{"op":"ping","id":"\xc0\xaf"}', "frame is not valid UTF-8"),  # overlong
        (b'{"op":"ping",}\n', "frame is not valid JSON"),
        (b"\n", "frame is not valid JSON"),
    ],
)
def test_undecodable_bytes_and_bad_json_are_told_apart(frame: bytes, message: str) -> None:
    """orjson reads the bytes (no decoded copy); the message still says which fault it was,
    as Python's strict UTF-8 decoder judges it."""
    with pytest.raises(errors.BadFrame) as info:
        codec.decode_request(frame)
    assert info.value.message.startswith(message)


def test_deep_nesting_is_a_bad_frame_not_a_crash() -> None:
    deep = b'{"op":"submit","args":{"payload":' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    with pytest.raises(errors.BadFrame):
        codec.decode_request(deep, max_frame_bytes=len(deep))


def test_id_of_128_characters_is_accepted() -> None:
    frame = ('{"id":"' + "x" * 128 + '","op":"ping"}').encode()
    assert codec.decode_request(frame).id == "x" * 128


def test_frame_limit_counts_bytes_without_the_newline() -> None:
    frame = b'{"op":"ping","args":{"pad":"' + b"a" * 50 + b'"}}'
    limit = len(frame)
    assert codec.decode_request(frame + b"\n", max_frame_bytes=limit).op == "ping"
    with pytest.raises(errors.FrameTooLarge) as info:
        codec.decode_request(frame + b"\n", max_frame_bytes=limit - 1)
    assert info.value.code == "FRAME_TOO_LARGE"


def test_frame_limit_counts_bytes_not_characters() -> None:
    frame = '{"op":"ping","args":{"s":"ééé"}}'.encode()
    assert len(frame) == len('{"op":"ping","args":{"s":"ééé"}}') + 3
    with pytest.raises(errors.FrameTooLarge):
        codec.decode_request(frame, max_frame_bytes=len(frame) - 1)


def test_frame_limit_defaults_to_the_setting() -> None:
    from django.test import override_settings

    with override_settings(RELAY_MAX_FRAME_BYTES=20):
        with pytest.raises(errors.FrameTooLarge):
            codec.decode_request(b'{"op":"ping","id":"0123456789"}')
        assert codec.decode_request(b'{"op":"ping"}').op == "ping"


def test_oversize_is_checked_before_parsing() -> None:
    with pytest.raises(errors.FrameTooLarge):
        codec.decode_request(b"\xff" * 11, max_frame_bytes=10)


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (b'{"id":"a","op":5}', "a"),
        (b'{"id":3,"args":1}', 3),
        (b"[1]", None),
        (b"\xff", None),
        (b'{"id":true,"op":"x"}', None),
        (b"{", None),
    ],
)
def test_request_id_of_salvages_the_id(frame: bytes, expected: object) -> None:
    assert codec.request_id_of(frame) == expected


def test_ok_reply_round_trip() -> None:
    line = codec.encode_ok(5, {"jobs": [], "n": 1})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert codec.decode_response(line) == {"id": 5, "ok": True, "result": {"jobs": [], "n": 1}}


def test_error_reply_shape() -> None:
    line = codec.encode_error("c-18", errors.StaleToken())
    reply = codec.decode_response(line)
    assert reply["id"] == "c-18"
    assert reply["ok"] is False
    assert reply["error"]["code"] == "STALE_TOKEN"
    assert reply["error"]["retryable"] is False
    assert "details" not in reply["error"]
    err = errors.error_from_body(reply["error"])
    assert isinstance(err, errors.StaleToken)


def test_error_reply_carries_details() -> None:
    reply = codec.decode_response(codec.encode_error(1, errors.InvalidArgument("bad", field="q")))
    assert reply["error"]["details"] == {"field": "q"}


def test_unknown_exception_becomes_generic_internal() -> None:
    reply = codec.decode_response(codec.encode_error(None, KeyError("secret detail")))
    assert reply["id"] is None
    assert reply["error"]["code"] == "INTERNAL"
    assert "secret" not in reply["error"]["message"]


def test_unserialisable_details_are_dropped_not_raised() -> None:
    reply = codec.decode_response(codec.encode_error(1, errors.InvalidArgument("x", v=object())))
    assert reply["error"]["code"] == "INVALID_ARGUMENT"
    assert "details" not in reply["error"]


@pytest.mark.parametrize(
    "line",
    [b"\xff", b"nope", b"[]", b'{"id":1}', b'{"ok":"yes"}', b'{"ok":false}', b'{"ok":true}'],
)
def test_decode_response_rejects_malformed_replies(line: bytes) -> None:
    with pytest.raises(errors.BadFrame):
        codec.decode_response(line)


def test_replies_are_compact_single_lines() -> None:
    line = codec.encode_ok("x", {"text": "a\nb"})
    assert line.count(b"\n") == 1
    assert orjson.loads(line)["result"]["text"] == "a\nb"


NAN, INF = math.nan, math.inf
LONE = "\ud800"  # a high surrogate with no low one after it
TRAIL = "\udcff"  # what os.fsdecode makes of a stray 0xFF byte


# ----------------------------- what JSON cannot carry: NaN, ±Infinity, lone surrogates (#11, #12)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"queue": "q", "payload": {"x": NAN}}, "payload.x"),
        ({"queue": "q", "payload": 1, "delay_ms": NAN}, "delay_ms"),
        ({"queue": "q", "payload": 1, "max_retries": INF}, "max_retries"),
        ({"queues": ["q"], "worker_id": "w", "lease_ms": NAN}, "lease_ms"),
        ({"jobs": [{"queue": "q", "payload": 1}, {"queue": "q", "payload": [-INF]}]}, None),
        ({"queues": ["q"], "worker_id": f"w{LONE}"}, "worker_id"),
        ({"job_id": "j", "error": f"boom {TRAIL}"}, "error"),
    ],
)
def test_encode_request_refuses_nan_infinity_and_surrogates(
    args: dict[str, Any], field: str | None
) -> None:
    # orjson sent NaN as null, which the server reads as "not given" (a NaN delay_ms made a
    # READY job); lone surrogates made orjson raise TypeError.
    with pytest.raises(errors.InvalidArgument) as info:
        codec.encode_request(1, "op", args)
    expected = "jobs[1].payload[0]" if field is None else field
    assert info.value.details == {"field": expected}


@pytest.mark.parametrize(
    ("value", "field", "problem"),
    [
        (object(), "result", "object is not a JSON type"),
        ({"a": [1, {"b": {3}}]}, "result.a[1].b", "set is not a JSON type"),
        ({(1, 2): 3}, "result", "key (1, 2) is not a string"),
        (2**64, "result", "outside -2**63..2**64-1"),
        (-(2**63) - 1, "result", "outside -2**63..2**64-1"),
    ],
)
def test_encode_request_names_what_orjson_cannot_encode(
    value: Any, field: str, problem: str
) -> None:
    # These raised with no field: the worker could not tell a result it cannot store from
    # any other refused ack, held the lease until it expired and ran the job again (review).
    with pytest.raises(errors.InvalidArgument) as info:
        codec.encode_request(1, "ack", {"job_id": "j", "result": value})
    assert info.value.details == {"field": field} and problem in info.value.message
    edges = [2**64 - 1, -(2**63), dt.datetime(2026, 1, 1), uuid.UUID(int=0)]
    assert orjson.loads(codec.encode_request(1, "ack", {"result": edges}))["args"]["result"][
        :2
    ] == [
        2**64 - 1,
        -(2**63),
    ]


def test_encode_request_refuses_a_value_that_holds_itself_at_once() -> None:
    # The walk that names the bad part had no bound: a value holding itself took a process
    # to 6.5 GB and never returned, and froze an async client's loop (a review).
    looped: dict[str, Any] = {"a": 1}
    looped["self"] = looped
    pair: list[Any] = []
    pair += [pair, pair]
    for value in (looped, pair):
        with pytest.raises(errors.InvalidArgument) as info:
            codec.encode_request(1, "ack", {"job_id": "j", "result": value})
        assert info.value.details == {"field": "result"}
        assert "holds itself" in info.value.message


def test_encode_request_still_sends_nulls_and_finite_floats() -> None:
    frame = codec.encode_request(7, "submit", {"queue": "q", "payload": {"a": None, "b": 0.5}})
    assert frame == b'{"op":"submit","id":7,"args":{"queue":"q","payload":{"a":null,"b":0.5}}}\n'


def test_args_that_decode_differently_but_hold_nothing_bad_are_sent() -> None:
    # A tuple decodes as a list: the args differ from their decoding, the walk finds nothing.
    frame = codec.encode_request(1, "lease", {"queues": ("q",), "note": None})
    assert orjson.loads(frame)["args"] == {"queues": ["q"], "note": None}
    with pytest.raises(errors.InvalidArgument):
        codec.encode_request(1, "lease", {"queues": ("q",), "note": None, "lease_ms": NAN})


_DEEP_TUPLES = """
import os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relayproject.settings")
from queue_core import errors, validation
from queue_core.conf import RelaySettings
from queue_core.protocol import codec
value = 1
for _ in range(100_000):
    value = (value,)
for name, call in [
    ("encode_request", lambda: codec.encode_request(1, "submit", {"queue": "q", "payload": value})),
    ("payload", lambda: validation.payload(value, RelaySettings())),
]:
    try:
        call()
    except errors.InvalidArgument as exc:
        print(name, exc.code, exc.details.get("field"))
"""


def test_a_deep_chain_of_tuples_is_refused_not_a_crash() -> None:
    """orjson 3.12 and 3.13 count no depth through a tuple inside a tuple: 3,000 of them
    corrupted the heap ("free(): invalid next size") and 100,000 killed the process with
    SIGSEGV, in a client's encode_request and in the service's payload check alike (a job
    function's result is a tuple as easily as a payload). pyproject keeps orjson below 3.12,
    whose 3.11 refuses them ("Recursion limit reached"); this test stops a version that does
    not. In a child process: a crash fails the test instead of ending the test run."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _DEEP_TUPLES], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n") == [
        "encode_request INVALID_ARGUMENT payload",
        "payload INVALID_ARGUMENT payload",
        "",
    ]


def _reference_loads(line: bytes) -> object:
    """The decoding before orjson read bytes: a strict UTF-8 decode, then the text."""
    body = line[:-1] if line.endswith(b"\n") else line
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "BAD_UTF8"
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return "BAD_JSON"


@settings(max_examples=3000, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=40),
        st.builds(
            lambda head, junk, tail: head + junk + tail,
            st.sampled_from([b'{"op":"', b'{"id":"', b"[", b'"']),
            st.binary(max_size=8),
            st.sampled_from([b'"}', b'"}\n', b"]", b'"', b""]),
        ),
        st.recursive(
            st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.text(max_size=4), inner, max_size=3)
            ),
            max_leaves=6,
        ).map(lambda v: orjson.dumps(v) + b"\n"),
    )
)
def test_bytes_decode_as_the_text_did(line: bytes) -> None:
    """Every line: the same value, or the same kind of fault, as decoding it to text first."""
    expected = _reference_loads(line)
    try:
        got: object = codec._loads(line)
    except errors.BadFrame as exc:
        got = "BAD_UTF8" if exc.message == "frame is not valid UTF-8" else "BAD_JSON"
    assert got == expected
