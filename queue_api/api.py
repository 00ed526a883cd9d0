"""The HTTP API: django-ninja, versioned under ``/api/v1``, on the service layer TCP uses.

Every error is an RFC 9457 problem (``queue_api.problems``) with the TCP error code:
``RelayError`` keeps its code and status; ninja's schema errors become ``INVALID_ARGUMENT``
(422); a body that is not JSON becomes ``BAD_FRAME`` (400); anything unexpected becomes a
generic ``INTERNAL`` (500) with the traceback only in the log. The OpenAPI schema is at
``/api/v1/openapi.json`` and its interactive page at ``/api/v1/docs``.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import orjson
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent
from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI, Router
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser
from ninja.renderers import BaseRenderer

from queue_api.problems import problem_response
from queue_api.routers import dead, jobs, maintenance, queues, workers
from queue_api.schemas import HealthOut
from queue_core import errors
from queue_core.conf import relay_settings

log = logging.getLogger("relay.http")


class OrjsonParser(Parser):
    """Parse bodies with orjson, as the TCP codec does (no NaN, no integers past 64 bits)."""

    def parse_body(self, request: HttpRequest) -> Any:
        """Return the decoded JSON body."""
        return orjson.loads(request.body)


class OrjsonRenderer(BaseRenderer):
    """Render responses with orjson."""

    media_type = "application/json"

    def render(self, request: HttpRequest, data: Any, *, response_status: int) -> bytes:
        """Return ``data`` as compact JSON."""
        return orjson.dumps(data)


class RelayAPI(NinjaAPI):
    """``NinjaAPI`` whose OpenAPI document is built once per process.

    ninja builds it on every request of ``/api/v1/openapi.json``, which needs no key: 155-200
    ms of CPU each time (88 KB), so three keyless clients asking in a loop held a sentinel's
    requests up 2.4 s (a hostile review). The routes do not change while the process runs.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._schemas: dict[str, Any] = {}  # by path prefix
        self._schemas_lock = threading.Lock()

    def get_openapi_schema(
        self, *, path_prefix: str | None = None, path_params: dict[str, Any] | None = None
    ) -> Any:
        """ninja's schema for ``path_prefix`` (the API's root path when None), kept after its
        first build."""
        if path_prefix is None:
            path_prefix = self.get_root_path(path_params or {})
        with self._schemas_lock:
            if path_prefix not in self._schemas:
                built = super().get_openapi_schema(path_prefix=path_prefix)
                self._schemas[path_prefix] = built
            return self._schemas[path_prefix]


api = RelayAPI(
    title="Relay HTTP API",
    version="1.0.0",
    description=(
        "Submit, inspect, lease and settle Relay jobs over HTTP, with the semantics of the TCP "
        "protocol (docs/protocol.md). Errors are RFC 9457 problem details carrying Relay's "
        "stable error codes. Authenticate with `Authorization: Bearer <key>` once API keys exist."
    ),
    urls_namespace="relay-api-v1",
    parser=OrjsonParser(),
    renderer=OrjsonRenderer(),
)

health = Router(tags=["health"])


@health.get("/health", response={200: HealthOut}, summary="Liveness and database check")
def health_check(request: HttpRequest) -> dict[str, Any]:
    """Answer when the API runs and can read its database (no key needed)."""
    from queue_api.calls import service

    return {"ok": True, **service().health()}


api.add_router("", health)
api.add_router("", jobs.router)
api.add_router("", workers.router)
api.add_router("", dead.router)
api.add_router("", maintenance.router)
api.add_router("", queues.router)


# ---------------------------------------------------------------------- errors -> problems


@api.exception_handler(errors.RelayError)
def _relay_error(request: HttpRequest, exc: errors.RelayError) -> HttpResponse:
    return problem_response(request, exc)


# The most schema faults one reply lists (``details.errors``); ``details.errors_omitted``
# counts the rest. Unbounded, 60,000 faulty meta values answered 3.6 MB (a hostile review).
MAX_LISTED_ERRORS = 20


@api.exception_handler(ValidationError)
def _validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    problems = [_describe(item) for item in exc.errors[:MAX_LISTED_ERRORS]]
    first = problems[0] if problems else {"field": "", "message": "invalid request"}
    message = f"{first['field']}: {first['message']}" if first["field"] else first["message"]
    details: dict[str, Any] = {"field": first["field"], "errors": problems}
    if batch_entry := _BATCH_ENTRY.match(first["field"]):  # as TCP names the bad spec
        details["index"] = int(batch_entry.group(1))
    if len(exc.errors) > MAX_LISTED_ERRORS:
        details["errors_omitted"] = len(exc.errors) - MAX_LISTED_ERRORS
    return problem_response(request, errors.InvalidArgument(message, **details))


def _describe(item: Any) -> dict[str, str]:
    # Keep the location and the message; never echo the input (it may be a large payload).
    return {"field": field_path(item.get("loc", ())), "message": str(item.get("msg", "invalid"))}


def field_path(loc: Any) -> str:
    """Spell a pydantic error location as TCP names a field: ``jobs[1].queue``.

    The request part (``body``, ``query``, ``path``) is left out, and so is the union member
    pydantic appends for a union field (``priority.literal['low',...]``): no field is named so.
    """
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _REQUEST_PARTS:
            path += f".{part}" if path else part
    return path


_REQUEST_PARTS = frozenset({"body", "query", "path"})
# A batch submit's job: ``details.index`` names it, as ``QueueService.submit_batch`` does.
_BATCH_ENTRY = re.compile(r"jobs\[(\d+)\]")


@api.exception_handler(AuthenticationError)
def _authentication_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return problem_response(request, errors.Unauthenticated())


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    mapped: errors.RelayError
    if exc.status_code == 400:
        mapped = errors.BadFrame("request body is not valid JSON")
    elif exc.status_code == 401:
        mapped = errors.Unauthenticated()
    elif exc.status_code == 403:
        mapped = errors.PermissionDenied()
    elif exc.status_code == 404:
        mapped = errors.JobNotFound(str(exc))
    elif exc.status_code == 413:
        mapped = errors.FrameTooLarge()
    else:
        log.warning("event=http_error status=%s message=%s", exc.status_code, exc)
        mapped = errors.Internal()
    return problem_response(request, mapped)


@api.exception_handler(RequestDataTooBig)
def _too_big(request: HttpRequest, exc: RequestDataTooBig) -> HttpResponse:
    limit = relay_settings().max_frame_bytes
    return problem_response(
        request, errors.FrameTooLarge(f"request body is over the {limit}-byte limit")
    )


@api.exception_handler(TooManyFieldsSent)
def _too_many_fields(request: HttpRequest, exc: TooManyFieldsSent) -> HttpResponse:
    # Django's bound on query parameters (DATA_UPLOAD_MAX_NUMBER_FIELDS): was INTERNAL,
    # retryable, with a traceback logged per request (a hostile review).
    limit = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
    return problem_response(
        request, errors.InvalidArgument(f"more than {limit} query parameters", field="")
    )


@api.exception_handler(Http404)
def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return problem_response(request, errors.JobNotFound("not found"))


@api.exception_handler(Exception)
def _internal(request: HttpRequest, exc: Exception) -> HttpResponse:
    log.exception("event=internal_error path=%s", request.path)
    return problem_response(request, errors.Internal())
