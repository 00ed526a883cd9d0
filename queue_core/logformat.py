"""The JSON log lines of ``relayproject.settings``: python-json-logger's orjson formatter, with
its stdlib-``json`` formatter's encoding for a line orjson refuses."""

from __future__ import annotations

import json
import logging

from pythonjsonlogger import core
from pythonjsonlogger.json import JsonEncoder
from pythonjsonlogger.orjson import OrjsonFormatter


class JsonFormatter(OrjsonFormatter):
    """python-json-logger's ``OrjsonFormatter``: the same fields as its stdlib-``json``
    ``JsonFormatter`` at about a fifth less CPU per line with Relay's settings
    (docs/benchmarking.md, round 6). A line orjson cannot encode (a string holding a lone
    surrogate, as an undecodable file name gives, or an integer beyond 64 bits: orjson raises
    ``TypeError``) is encoded by ``json`` with ``JsonFormatter``'s encoder and escaped to
    ASCII, not lost.

    A line logged as ``event=<name> ...`` with no ``event`` field of its own (an exception's
    line, most failure lines) gets one, ``<name>``, so that every event can be found by its
    field (a review found ``listen_failed`` only in the message text).
    """

    def jsonify_log_record(self, log_data: core.LogData) -> str:
        """``log_data`` as one line of JSON."""
        if "event" not in log_data:
            message = log_data.get("message")
            if isinstance(message, str) and message.startswith("event="):
                log_data["event"] = message[6:].split(" ", 1)[0]
        try:
            return super().jsonify_log_record(log_data)
        except TypeError:
            return json.dumps(log_data, cls=JsonEncoder, ensure_ascii=True)


def not_an_auth_refusal(record: logging.LogRecord) -> bool:
    """A logging filter for ``django.request``: leave out its line for each 401 and 403 of
    the API (``/api/``); the console's stay.

    Relay logs a refused key itself (``event=auth_failed``, at most one line a second per
    reason: ``auth._fail``); Django's own line for every refused request let a flood of bad
    keys flood the log (a review counted 582 lines against Relay's 8).
    """
    if getattr(record, "status_code", None) not in (401, 403):
        return True
    path = getattr(getattr(record, "request", None), "path", "")
    return not (isinstance(path, str) and path.startswith("/api/"))


def one_line_security(record: logging.LogRecord) -> bool:
    """A logging filter for ``django.security``: Django logs each request it refuses there (a
    host not allowed, too many fields, ...) with its traceback and the request, whose text
    holds the whole query string: a review's 8 KB query strings made lines of about 10 KB
    each. Keep one line: no traceback, the request's path cut to 200 characters."""
    record.exc_info = None
    record.exc_text = None
    request = getattr(record, "request", None)
    if request is not None:
        record.request = str(getattr(request, "path", ""))[:200]
    return True
