"""The JSON log formatter of ``relayproject.settings`` (``queue_core.logformat``)."""

from __future__ import annotations

import json
import logging
import os
import sys

import orjson

from queue_core import logformat


def test_a_json_line_orjson_refuses_is_written_escaped_not_lost() -> None:
    formatter = logformat.JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "ts", "levelname": "level", "name": "logger"},
    )
    name = os.fsdecode(b"\xff.csv")  # an undecodable file name: a lone surrogate
    record = logging.LogRecord(
        "relay.worker", logging.WARNING, __file__, 1, "bad %s", (name,), None
    )
    record.event, record.big = "handler_failed", 1 << 70  # type: ignore[attr-defined]
    line = formatter.format(record)
    assert "\\udcff.csv" in line and "\n" not in line
    assert json.loads(line)["big"] == 1 << 70 and json.loads(line)["level"] == "WARNING"
    plain = logging.LogRecord("relay.worker", logging.INFO, __file__, 1, "ok", (), None)
    assert orjson.loads(formatter.format(plain))["message"] == "ok"  # orjson's own line


def test_a_line_logged_as_an_event_with_no_event_field_gets_one() -> None:
    formatter = logformat.JsonFormatter("%(levelname)s %(name)s %(message)s")
    record = logging.LogRecord(
        "relay.store", logging.WARNING, __file__, 1, "event=listen_failed error=%r", ("x",), None
    )
    assert orjson.loads(formatter.format(record))["event"] == "listen_failed"
    record.event = "given"  # type: ignore[attr-defined]
    assert orjson.loads(formatter.format(record))["event"] == "given"
    plain = logging.LogRecord("relay.store", logging.INFO, __file__, 1, "events=1", (), None)
    assert "event" not in orjson.loads(formatter.format(plain))


def test_a_refused_request_is_one_short_line_in_the_configured_log() -> None:
    # Django logs each refused request (django.security.<Error>) with its traceback and the
    # request, whose text holds the whole query string: lines of about 10 KB (a review).
    from django.test import RequestFactory

    from relayproject import settings

    config = settings.LOGGING
    (handler,) = config["loggers"]["django.security"]["handlers"]
    (name,) = config["handlers"][handler]["filters"]
    assert config["filters"][name]["callback"] == "ext://queue_core.logformat.one_line_security"
    formatter = logformat.JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "ts", "levelname": "level", "name": "logger"},
    )
    request = RequestFactory().get("/admin/queue_core/job/", {f"f{i}": "x" * 8 for i in range(900)})
    try:
        raise ValueError("too many fields")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "django.security.TooManyFieldsSent", logging.ERROR, __file__, 1, "refused", (), exc_info
    )
    record.request, record.status_code = request, 400  # type: ignore[attr-defined]
    assert len(formatter.format(record)) > 8000  # Django's line, unfiltered
    record.exc_text = None
    assert logformat.one_line_security(record)
    line = formatter.format(record)
    assert "Traceback" not in line and len(line) < 500, line
    assert orjson.loads(line)["request"] == "/admin/queue_core/job/"
