"""The JSON log formatter of ``relayproject.settings`` (``queue_core.logformat``)."""

from __future__ import annotations

import json
import logging
import os

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
