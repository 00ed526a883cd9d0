"""Error codes: one class per code, and docs/protocol.md lists every one of them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from queue_core import errors

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def documented_codes() -> dict[str, tuple[str, str]]:
    rows = re.findall(r"^\| `([A-Z_]+)` \| (\d+|–) \| (yes|no) \|", DOC.read_text(), re.M)
    return {code: (status, retry) for code, status, retry in rows}


def test_docs_list_every_code_with_its_status_and_retryability() -> None:
    documented = documented_codes()
    classes = {cls.code: cls for cls in errors.all_error_classes()}
    assert set(documented) == set(classes)
    for code, cls in classes.items():
        assert documented[code] == (str(cls.http_status), "yes" if cls.retryable else "no"), code


def test_codes_are_unique() -> None:
    codes = [cls.code for cls in errors.all_error_classes()]
    assert len(codes) == len(set(codes))


def test_error_body_hides_internal_details() -> None:
    body = errors.error_body(KeyError("secret path /etc/x"))
    assert body == {
        "code": "INTERNAL",
        "message": "Internal error; see the server log.",
        "retryable": True,
    }


def test_error_round_trip_through_body() -> None:
    exc = errors.StaleToken("nope", job_id="job_1")
    back = errors.error_from_body(exc.to_dict())
    assert type(back) is errors.StaleToken
    assert (back.message, back.details) == ("nope", {"job_id": "job_1"})


@pytest.mark.parametrize(
    ("details", "kept"),
    [
        ("a string", {}),
        ([1, 2], {}),
        ({"message": "m", "field": "x"}, {"message": "m", "field": "x"}),
        ({1: "one"}, {"1": "one"}),
        (None, {}),
    ],
)
def test_an_error_body_of_any_shape_makes_a_relay_error(details: Any, kept: dict[str, Any]) -> None:
    # A faulty server's details raised TypeError out of both clients, and killed the worker's
    # renewer thread (a review).
    back = errors.error_from_body({"code": "BUSY", "message": "busy", "details": details})
    assert type(back) is errors.StoreBusy
    assert (back.message, back.details) == ("busy", kept)


def test_an_error_body_cuts_long_messages_and_detail_strings() -> None:
    # An unknown argument's name is echoed in the message and in details.field: a name of
    # 1,000,000 characters made a 2 MB error reply, past the frame a client reads (a review).
    name = "x" * 1_000_000
    body = errors.InvalidArgument(f"{name}: unknown argument", field=name, index=3).to_dict()
    assert len(body["message"]) == errors.MAX_MESSAGE_CHARS and body["message"].endswith("…")
    assert len(body["details"]["field"]) == errors.MAX_DETAIL_CHARS
    assert body["details"]["index"] == 3
    short = errors.InvalidArgument("queue: too long", field="queue").to_dict()
    assert short == {
        "code": "INVALID_ARGUMENT",
        "message": "queue: too long",
        "retryable": False,
        "details": {"field": "queue"},
    }
