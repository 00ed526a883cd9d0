"""Refuse request bodies over ``RELAY_MAX_FRAME_BYTES`` before Django reads them.

A declared ``Content-Length`` over the limit gets ``413 FRAME_TOO_LARGE`` at once, without a
byte of the body being read. A chunked body (no length; gunicorn de-chunks ``wsgi.input``) is
read up to the limit plus one byte: over it, 413; within it, the bytes are handed on as the
body with their length, since Django otherwise reads a body without ``Content-Length`` as
empty. ``DATA_UPLOAD_MAX_MEMORY_SIZE`` is set to the same limit as a second fence.
"""

from __future__ import annotations

import io
from collections.abc import Callable

from django.core.handlers.wsgi import LimitedStream
from django.http import HttpRequest, HttpResponse

from queue_api.problems import problem_response
from queue_core import errors
from queue_core.conf import relay_settings


def _too_large(limit: int, size: int | None) -> errors.FrameTooLarge:
    said = f"{size} bytes, " if size is not None else ""
    return errors.FrameTooLarge(
        f"request body is {said}over the {limit}-byte limit (RELAY_MAX_FRAME_BYTES)",
        limit_bytes=limit,
    )


class BodyLimitMiddleware:
    """Bound every request body by ``RELAY_MAX_FRAME_BYTES`` (see the module docstring)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        """Refuse an oversized body with 413, or pass the request on."""
        limit = relay_settings().max_frame_bytes
        declared = request.META.get("CONTENT_LENGTH") or ""
        if declared:
            try:
                size = int(declared)
            except ValueError:
                return problem_response(request, errors.BadFrame("Content-Length is not a number"))
            if size > limit:
                return problem_response(request, _too_large(limit, size))
        elif "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower():
            stream = request.META.get("wsgi.input")
            data = stream.read(limit + 1) if stream is not None else b""
            if len(data) > limit:
                return problem_response(request, _too_large(limit, None))
            request.META["CONTENT_LENGTH"] = str(len(data))
            # Django built its body stream with length 0; give it the bytes read here.
            request._stream = LimitedStream(io.BytesIO(data), len(data))  # type: ignore[assignment]
        return self.get_response(request)
