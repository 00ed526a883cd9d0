"""The argument checks of ``queue_core.validation`` on values JSON cannot carry faithfully:
floats that are NaN or ±Infinity (orjson writes them as ``null``) and lone surrogates (no
UTF-8 form: orjson, SQLite and PostgreSQL refuse them)."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from queue_core import errors
from queue_core import validation as v
from queue_core.conf import relay_settings

NAN, INF = math.nan, math.inf
LONE = "\ud800"  # a high surrogate with no low one after it
TRAIL = "\udcff"  # what os.fsdecode makes of a stray 0xFF byte


@pytest.mark.parametrize(
    ("value", "field", "problem"),
    [
        ({"x": NAN}, "payload.x", "NaN is not a JSON number"),
        ([1, [2.5, INF]], "payload[1][1]", "Infinity is not a JSON number"),
        ({"a": {"b": (0, -INF)}}, "payload.a.b[1]", "-Infinity is not a JSON number"),
        (NAN, "payload", "NaN is not a JSON number"),
        ({"a": ["ok", f"x{LONE}y"]}, "payload.a[1]", "lone surrogates"),
        ({"a": {TRAIL: 1}}, "payload.a", "key '\\udcff' must not contain lone surrogates"),
        (LONE, "payload", "lone surrogates"),
    ],
)
def test_payload_refuses_what_json_would_not_carry(value: Any, field: str, problem: str) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        v.payload(value, relay_settings())
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.details == {"field": field}
    assert problem in info.value.message and info.value.message.startswith(f"{field}: ")
    info.value.message.encode("utf-8")  # the error itself can be sent


@pytest.mark.parametrize(
    "value",
    [{"x": None}, [None, 1.5, -0.0, 1e308, "null", "é😀"], {"é": {"ü": [None]}}, ("t", None)],
)
def test_payload_keeps_nulls_finite_floats_and_real_characters(value: Any) -> None:
    expected = list(value) if isinstance(value, tuple) else value  # JSON has arrays only
    assert orjson.loads(v.payload(value, relay_settings())) == expected


def test_payload_depth_is_still_bounded_by_the_same_walk() -> None:
    deep: Any = 1
    for _ in range(v.MAX_PAYLOAD_DEPTH):
        deep = [deep]
    assert v.payload(deep, relay_settings())
    with pytest.raises(errors.InvalidArgument, match="nested deeper than 64 levels"):
        v.payload([deep], relay_settings())
    with pytest.raises(errors.InvalidArgument, match="NaN"):  # NaN below the limit is found too
        v.payload([deep, NAN], relay_settings())


@pytest.mark.parametrize(
    ("check", "field"),
    [
        (v.worker_id, "worker_id"),
        (v.idempotency_key, "idempotency_key"),
        (v.job_id, "job_id"),
        (v.lease_token, "lease_token"),
        (v.actor, "actor"),
        (lambda value: v.queue_name(value, relay_settings()), "queue"),
        (lambda value: v.error_text(value, relay_settings()), "error"),
    ],
)
@pytest.mark.parametrize("text", [LONE, f"w-{TRAIL}", f"é{LONE}"])
def test_strings_with_lone_surrogates_are_refused(check: Any, field: str, text: str) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        check(text)
    assert info.value.details == {"field": field}


def test_well_formed_text_passes() -> None:
    assert v.worker_id("hôte-😀:1") == "hôte-😀:1"
    assert v.error_text("boom é😀\x00", relay_settings()) == "boom é😀\ufffd"
    assert v.actor(None) is None and v.actor("admin") == "admin"


@pytest.mark.parametrize("value", [NAN, INF, -INF, 1.0, 30_000.0, True, "30000", None], ids=repr)
def test_integer_arguments_refuse_every_float(value: Any) -> None:
    with pytest.raises(errors.InvalidArgument, match="must be an integer"):
        v.integer("lease_ms", value, lo=0)


def test_has_lone_surrogate() -> None:
    assert not v.has_lone_surrogate("")
    assert not v.has_lone_surrogate("ascii")
    assert not v.has_lone_surrogate("é😀")
    assert v.has_lone_surrogate(LONE) and v.has_lone_surrogate(f"é{TRAIL}")
