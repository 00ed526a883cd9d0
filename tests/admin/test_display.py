"""How the console renders instants, spans, errors and lease tokens (no database)."""

from __future__ import annotations

import pytest

from queue_admin import display

NOW = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def test_iso_ms_is_utc() -> None:
    assert display.iso_ms(NOW) == "2026-01-01 00:00:00Z"
    assert display.iso_ms(None) == "—"


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0ms"),
        (850, "850ms"),
        (42_000, "42s"),
        (192_000, "3m 12s"),
        (180_000, "3m"),
        (3_600_000 * 2 + 60_000 * 5 + 7_000, "2h 5m"),
        (86_400_000 * 4 + 3_600_000 * 3, "4d 3h"),
        (-5, "0ms"),
    ],
)
def test_span_ms_keeps_the_two_largest_units(ms: int, text: str) -> None:
    assert display.span_ms(ms) == text


def test_relative_ms() -> None:
    assert display.relative_ms(NOW - 90_000, NOW) == "1m 30s ago"
    assert display.relative_ms(NOW + 20_000, NOW) == "in 20s"


def test_shorten_makes_one_line() -> None:
    assert display.shorten("Traceback\n  File 'x'\nValueError: boom", 80) == (
        "Traceback File 'x' ValueError: boom"
    )
    assert display.shorten("x" * 100, 10) == "x" * 9 + "…"
    assert display.shorten(None) == "—"


def test_token_status_never_shows_the_token() -> None:
    token = "q3ZxSECRETSECRETSECRETxY3Q"
    live = display.token_status("leased", token, NOW + 12_000, NOW)
    assert live == "live, ends …xY3Q, expires in 12s"
    expired = display.token_status("leased", token, NOW - 3_000, NOW)
    assert expired.startswith("expired 3s ago, ends …xY3Q")
    assert display.token_status("dead", None, None, NOW) == "none (no live lease)"
    for text in (live, expired, display.token_tail(token)):
        assert "SECRET" not in text


def test_pretty_json_indents_and_sorts() -> None:
    assert (
        display.pretty_json('{"b":1,"a":[1,2]}') == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}'
    )
    assert display.pretty_json("not json") == "not json"
