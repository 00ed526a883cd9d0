"""Guards in front of the views: body size, JSON-only bodies, and the ASGI body bound.

``BodyLimitMiddleware``: refuse request bodies over ``RELAY_MAX_FRAME_BYTES`` before Django
reads them.

A declared ``Content-Length`` over the limit gets ``413 FRAME_TOO_LARGE`` at once, without a
byte of the body being read. A chunked body (no length; gunicorn de-chunks ``wsgi.input``) is
read up to the limit plus one byte: over it, 413; within it, the bytes are handed on as the
body with their length, since Django otherwise reads a body without ``Content-Length`` as
empty. ``DATA_UPLOAD_MAX_MEMORY_SIZE`` is set to the same limit as a second fence.

``JsonOnlyMiddleware``: under ``/api/``, a request with a body must say ``Content-Type:
application/json``; anything else (``text/plain``, a form, none) gets ``415
UNSUPPORTED_MEDIA_TYPE`` before a view runs. A web page of another origin can send those
without a CORS preflight, and with API keys off it would otherwise create jobs. A POST, PUT or
PATCH without a body passes only without a Content-Type and without a cross-origin ``Origin``
(``curl -X POST .../replay`` does; a page elsewhere cannot).

``MethodProblemMiddleware``: a method a path under ``/api/`` does not serve gets a ``405``
problem (code ``UNKNOWN_OP``) with ``Allow``, not django-ninja's plain-text 405; ``HEAD`` is
served wherever ``GET`` is.

``AsgiBodyLimit``: under ASGI Django reads the whole body before any middleware runs, so this
ASGI wrapper (``relayproject.asgi``) applies the same bound first: 413 for a declared length
over the limit without reading it, and a body without a length (chunked) is collected up to the
limit plus one byte.

Both Django middlewares run in sync and in async mode: under ASGI, requests to sync views run
the sync chain on ``queue_api.pool``'s threads, and requests to an async view (the lease
long-poll) the async chain, so they hold no thread while they wait.
"""

from __future__ import annotations

import io
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import DisallowedHost
from django.core.handlers.asgi import ASGIRequest
from django.core.handlers.wsgi import LimitedStream
from django.http import HttpRequest, HttpResponse

from queue_api.problems import CONTENT_TYPE, problem_body, problem_response
from queue_core import errors
from queue_core.conf import relay_settings


def _too_large(limit: int, size: int | None) -> errors.FrameTooLarge:
    said = f"{size} bytes, " if size is not None else ""
    return errors.FrameTooLarge(
        f"request body is {said}over the {limit}-byte limit (RELAY_MAX_FRAME_BYTES)",
        limit_bytes=limit,
    )


class _Middleware:
    """A middleware that runs in sync or async mode, as the chain around it does (so the
    async lease long-poll holds no thread: a middleware without ``async_capable`` would make
    Django run the chain below it on one)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        """Handle ``request`` (a coroutine in async mode); subclasses say how."""
        raise NotImplementedError


class _Guard(_Middleware):
    """A middleware that may answer instead of the view, in sync or async mode."""

    def __call__(self, request: HttpRequest) -> Any:
        """Answer with ``refuse``'s response, or pass the request on."""
        if self.async_mode:
            return self._acall(request)
        # Sync mode serves WSGI requests and, under ASGI, queue_api.pool's (body already read).
        streaming = not isinstance(request, ASGIRequest)
        return self.refuse(request, streaming=streaming) or self.get_response(request)

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        refused = self.refuse(request, streaming=False)
        if refused is not None:
            return refused
        response: HttpResponse = await self.get_response(request)
        return response

    def refuse(self, request: HttpRequest, *, streaming: bool) -> HttpResponse | None:
        """The response that stops ``request``, or None to pass it on.

        Args:
            streaming: whether the body is still unread (WSGI); False under ASGI (async
                mode, or sync mode on ``queue_api.pool``), where ``AsgiBodyLimit`` has
                already bounded it.
        """
        raise NotImplementedError


class BodyLimitMiddleware(_Guard):
    """Bound every request body by ``RELAY_MAX_FRAME_BYTES`` (see the module docstring)."""

    def refuse(self, request: HttpRequest, *, streaming: bool) -> HttpResponse | None:
        """Refuse an oversized body with 413 (None: within the limit)."""
        limit = relay_settings().max_frame_bytes
        declared = request.META.get("CONTENT_LENGTH") or ""
        if declared:
            try:
                size = int(declared)
            except ValueError:
                return problem_response(request, errors.BadFrame("Content-Length is not a number"))
            if size > limit:
                return problem_response(request, _too_large(limit, size))
        elif streaming and "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower():
            stream = request.META.get("wsgi.input")
            data = stream.read(limit + 1) if stream is not None else b""
            if len(data) > limit:
                return problem_response(request, _too_large(limit, None))
            request.META["CONTENT_LENGTH"] = str(len(data))
            # Django built its body stream with length 0; give it the bytes read here.
            request._stream = LimitedStream(io.BytesIO(data), len(data))  # type: ignore[assignment]
        return None


BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json(content_type: str) -> bool:
    """Whether a Content-Type header names ``application/json`` (parameters allowed)."""
    return content_type.partition(";")[0].strip().lower() == "application/json"


class HostProblemMiddleware(_Guard):
    """400 ``BAD_FRAME`` problem details for a request under ``/api/`` whose ``Host`` is not in
    ``ALLOWED_HOSTS`` (``RELAY_ALLOWED_HOSTS``). Django's ``CommonMiddleware`` raised
    ``DisallowedHost`` there, answered with its HTML "Bad Request (400)" page and a logged
    traceback, so an API client behind a proxy with another host name got HTML (hostile
    review)."""

    def refuse(self, request: HttpRequest, *, streaming: bool) -> HttpResponse | None:
        """Refuse an API request whose Host is not allowed (None: allowed, or not the API)."""
        if not request.path.startswith("/api/"):
            return None
        try:
            request.get_host()
        except DisallowedHost:
            sent = request.META.get("HTTP_HOST", "")[:100]
            return problem_response(
                request,
                errors.BadFrame(
                    f"Host {sent!r} is not one this server answers to (RELAY_ALLOWED_HOSTS)"
                ),
            )
        return None


class JsonOnlyMiddleware(_Guard):
    """415 for a request under ``/api/`` with a body that is not ``application/json``."""

    def refuse(self, request: HttpRequest, *, streaming: bool) -> HttpResponse | None:
        """Refuse a non-JSON body with 415 (None: JSON, or no body on GET/DELETE/...)."""
        if not request.path.startswith("/api/"):
            return None
        declared = request.META.get("CONTENT_LENGTH") or ""
        has_body = (declared not in ("", "0")) or bool(request.META.get("HTTP_TRANSFER_ENCODING"))
        content_type = request.META.get("CONTENT_TYPE", "")
        if is_json(content_type):
            return None
        # No body: fine for GET/DELETE/..., and for a POST without a Content-Type unless a
        # page of another origin sends it (a browser names it in Origin).
        if not has_body and (
            request.method not in BODY_METHODS or (not content_type and not _cross_origin(request))
        ):
            return None
        return problem_response(
            request,
            errors.UnsupportedMediaType(
                "request bodies must be JSON with 'Content-Type: application/json' "
                f"(got {content_type or 'none'!r})",
                content_type=content_type,
            ),
        )


def _cross_origin(request: HttpRequest) -> bool:
    """Whether a browser sent ``request`` from a page of another origin (``Origin`` header
    naming another host than ``Host``); clients other than browsers send no ``Origin``."""
    origin = request.headers.get("Origin")
    if origin is None:
        return False
    try:
        host = request.get_host()
    except DisallowedHost:
        return True
    return origin.partition("://")[2].rstrip("/").lower() != host.lower()


class MethodProblemMiddleware(_Middleware):
    """Under ``/api/``, a method a path does not serve as a problem: ``405`` with its
    ``Allow`` header, code ``UNKNOWN_OP`` (on TCP, the op no handler serves). django-ninja
    answers it in plain text, outside the API's exception handlers (hostile review). And
    ``HEAD`` is answered wherever ``GET`` is, without the body (RFC 9110, section 9.3.2):
    django-ninja routes ``GET`` only, and a load balancer's ``HEAD /api/v1/health`` got 405."""

    def __call__(self, request: HttpRequest) -> Any:
        """Pass the request on (a ``HEAD`` as ``GET``); mend the response (``mend``)."""
        if self.async_mode:
            return self._acall(request)
        head = _head_as_get(request)
        return mend(request, self.get_response(request), head=head)

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        head = _head_as_get(request)
        return mend(request, await self.get_response(request), head=head)


def _head_as_get(request: HttpRequest) -> bool:
    """Turn a ``HEAD`` under ``/api/`` into a ``GET``; return whether it was one."""
    if request.method != "HEAD" or not request.path.startswith("/api/"):
        return False
    request.method = "GET"
    return True


def mend(request: HttpRequest, response: HttpResponse, *, head: bool = False) -> HttpResponse:
    """``response``, or for a plain ``405`` under ``/api/`` the same refusal as a problem;
    for a ``HEAD`` served as ``GET`` (``head``), without its body (its headers kept)."""
    if head:
        request.method = "HEAD"
        if not response.streaming:
            response.content = b""
    if (
        response.status_code != 405
        or not request.path.startswith("/api/")
        or response.get("Content-Type", "").startswith(CONTENT_TYPE)
    ):
        return response
    methods = [m.strip() for m in response.get("Allow", "").split(",") if m.strip()]
    if "GET" in methods and "HEAD" not in methods:
        methods.append("HEAD")  # served wherever GET is (above)
    allow = ", ".join(methods)
    body = problem_body(
        errors.UnknownOp(
            f"{request.method} is not served at {request.path} (allowed: {allow or 'none'})",
            method=request.method,
            allowed=methods,
        ),
        request.path,
    )
    mended = HttpResponse(orjson.dumps(body), status=body["status"], content_type=CONTENT_TYPE)
    mended["Allow"] = allow
    return mended


# ---------------------------------------------------------------------- ASGI

Scope = dict[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


class AsgiAbsoluteForm:
    """Serve a request whose target is a whole URL (``GET http://host/api/v1/health``, the
    absolute form, RFC 9112 §3.2.2, which a server must accept) as its path: gunicorn hands
    the URL on as the path, which matched no route (a review: Django's HTML 404 for every
    ``/api/`` route). As the RFC says, the URL's host stands for the ``Host`` header (Django
    still checks it against ``ALLOWED_HOSTS``).

    Args:
        app: the ASGI application.
    """

    def __init__(self, app: Asgi) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Call the app, with an absolute-form target made its path first."""
        raw = (scope.get("raw_path") or b"") if scope["type"] == "http" else b""
        if raw[:8].lower().startswith((b"http://", b"https://")):
            # The target as sent (``path`` is decoded: a %3F or %2F in it would split it).
            try:
                url = urllib.parse.urlsplit(raw.decode("latin-1"))
            except ValueError:  # ``http://[::1/``: gunicorn's plain-text 500 before
                await _answer(send, scope, errors.BadFrame("the request target is not a URL"))
                return
            path = url.path or "/"
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"host"]
            scope = {
                **scope,
                "path": urllib.parse.unquote(path, errors="replace"),
                "raw_path": path.encode("latin-1"),
                "headers": [(b"host", url.netloc.encode("latin-1")), *headers],
            }
        await self.app(scope, receive, send)


class AsgiBodyLimit:
    """Bound HTTP request bodies by ``RELAY_MAX_FRAME_BYTES`` before an ASGI app reads them.

    Args:
        app: the ASGI application to protect (Django's ``ASGIHandler``).
    """

    def __init__(self, app: Asgi) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer 413 for an oversized body, else call the app (a chunked body pre-read)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = relay_settings().max_frame_bytes
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _answer(send, scope, errors.BadFrame("Content-Length is not a number"))
                return
            if size > limit:
                await _answer(send, scope, _too_large(limit, size))
                return
            await self.app(scope, receive, send)
            return
        # No length (chunked, or no body): collect up to the limit, then replay it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _answer(send, scope, _too_large(limit, None))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _answer(send: Send, scope: Scope, exc: errors.RelayError) -> None:
    """Send ``exc`` as a problem response straight over ASGI (the body is not read)."""
    body = orjson.dumps(problem_body(exc, str(scope.get("path", ""))), default=str)
    await send(
        {
            "type": "http.response.start",
            "status": exc.http_status,
            "headers": [
                (b"content-type", CONTENT_TYPE.encode()),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
