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
    # Past orjson's own depth (255) the refusal named the walk's bound, 256, not the limit.
    for _ in range(300):
        deep = [deep]
    with pytest.raises(errors.InvalidArgument, match=r"nested deeper than 64 levels$"):
        v.payload(deep, relay_settings())


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


# ------------------------------------------------------------------ nesting depth, fast


def _nest(depth: int, leaf: object, kind: str) -> object:
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


@pytest.mark.parametrize("kind", ["list", "dict"])
@pytest.mark.parametrize("leaf", [1, "s", [], {}])
def test_nests_deeper_agrees_with_the_walk_at_the_boundary(kind: str, leaf: object) -> None:
    for depth in range(v.MAX_PAYLOAD_DEPTH - 3, v.MAX_PAYLOAD_DEPTH + 4):
        value = _nest(depth, leaf, kind)
        walked = v.unfaithful(value, max_depth=v.MAX_PAYLOAD_DEPTH) is not None
        assert v.nests_deeper(orjson.dumps(value), v.MAX_PAYLOAD_DEPTH) is walked, depth


def test_brackets_inside_strings_are_not_nesting() -> None:
    value = {"a": "[[[[{{{{" * 100, "b": '\\"[[[' * 100, "c": ["]]]]" * 50, '"{{"']}
    assert not v.nests_deeper(orjson.dumps(value), v.MAX_PAYLOAD_DEPTH)
    assert v.nests_deeper(orjson.dumps({"s": "]]]]", "deep": _nest(70, "[", "list")}), 64)


def test_many_shallow_objects_are_not_walked_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid payload of 1,000 empty objects has more brackets than the depth limit: the old
    check walked it in Python (170 ms for a 1 MB batch of 40 such; a hostile review)."""

    def walked(*args: object, **kwargs: object) -> None:
        raise AssertionError("the payload was walked in Python")

    monkeypatch.setattr(v, "unfaithful", walked)
    shallow = [{} for _ in range(1000)]
    assert v.json_text(shallow, field="payload", limit=1 << 20) == orjson.dumps(shallow).decode()
    # Over the size limit: refused before anything else looks at it.
    with pytest.raises(errors.FrameTooLarge):
        v.json_text(_nest(100, shallow, "list"), field="payload", limit=1000)


def test_the_walk_stops_after_a_bounded_number_of_values() -> None:
    # Parts that share one subtree are walked once per path to it: a set after 2**24 such
    # paths kept a worker's slot at 100% CPU, its job leased, for as long as it ran (a review).
    from queue_core.validation import WALK_MAX_VALUES, unfaithful

    shared: list[Any] = [1]
    for _ in range(24):
        shared = [shared, shared]
    found = unfaithful({"result": [[{1}], shared]})
    assert found == (
        "result",
        f"holds more than {WALK_MAX_VALUES:,} values to check, or holds itself",
    )
