"""The HTTP side's database threads: a small pool of long-lived threads per process.

Django's own ASGI handler runs each request's sync work (middleware, views) in a thread made
for that request (asgiref's ``ThreadSensitiveContext``). Django's connections are per thread,
so every request opened a new database connection and closed it again: HTTP submits fell from
~141/s under gunicorn's gthread worker to ~59/s. ``PooledAsgiHandler`` instead runs the whole
sync request of a sync view (signals, middleware, view, ``response.close()``) as one call on
``executor()``, a pool of ``RELAY_HTTP_THREADS`` threads that keep their connections between
requests as gthread's threads did (``CONN_MAX_AGE``, with Django's health checks and its
``close_old_connections`` at each request's start and end, all on that thread).

Only the parsing and the sending stay on the event loop, so a slow client still holds no
thread. The operator console's requests take at most ``CONSOLE_SHARE`` of the threads at once,
and the API's bulk replay and purge one (the rest wait on the event loop), so heavy console pages
and bulk actions leave threads to the API. A
request to an async view (the lease long-poll) goes through Django's async path:
its middleware and auth run in a thread made for it, whose connections are closed when it
ends; its claims run on the pool (``run``), so a waiting long-poll holds no pool thread.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext, iscoroutinefunction, sync_to_async
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.db import close_old_connections, connections
from django.http import HttpRequest, HttpResponseBase
from django.urls import Resolver404, ResolverMatch, resolve, set_script_prefix

from queue_core.conf import relay_settings

THREAD_NAME = "relay-http-db"
SHUTDOWN_TIMEOUT_S = 10.0  # how long shutdown() waits for each pool thread
# The operator console (the admin site's URLs) runs at most this share of the pool's threads
# at once; its other requests wait on the event loop, holding none. Eight console searches
# that each scanned 200,000 jobs for 2 s held all eight threads, and /api/v1/health waited
# 17 s behind them (a review).
CONSOLE_SHARE = 0.5
# The API's bulk operator routes (replay and purge of many dead letters) run one request at a
# time per process: their chunks take turns anyway (``QueueService.bulk_chunk``), and eight at
# once held all eight threads, so the API's other requests waited for all of them (a review).
BULK_ROUTES = frozenset({"replay_many", "purge_many"})


@functools.cache
def executor() -> ThreadPoolExecutor:
    """The process's pool: ``RELAY_HTTP_THREADS`` threads, started on first use (so after
    gunicorn forks its worker), named ``relay-http-db_N``."""
    return ThreadPoolExecutor(relay_settings().http_threads, thread_name_prefix=THREAD_NAME)


def shutdown() -> None:
    """Close every pool thread's database connections and stop the threads; the next use
    starts a new pool (tests, between test cases).

    Raises:
        threading.BrokenBarrierError: a pool thread stayed busy for ``SHUTDOWN_TIMEOUT_S``.
    """
    if executor.cache_info().currsize == 0:
        return
    pool = executor()
    executor.cache_clear()
    # One call per thread: each waits at the barrier until all threads hold one, so every
    # thread (started now if it was not yet) closes its own connections.
    count = pool._max_workers  # the size it was made with (settings may have changed since)
    barrier = threading.Barrier(count)

    def close() -> None:
        barrier.wait(SHUTDOWN_TIMEOUT_S)
        connections.close_all()

    for future in [pool.submit(close) for _ in range(count)]:
        future.result(SHUTDOWN_TIMEOUT_S)
    pool.shutdown(wait=True)


def _upkept[T](fn: Callable[..., T], *args: Any) -> T:
    # What Django does at a request's start and end, for this pool thread's connection:
    # close it when it is too old or broken; the next use then checks its health.
    close_old_connections()
    try:
        return fn(*args)
    finally:
        close_old_connections()


async def run[T](fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on a pool thread (its connection kept, checked as per request) and
    return what it returns; raises what it raises."""
    call = sync_to_async(_upkept, thread_sensitive=False, executor=executor())
    result: T = await call(fn, *args)
    return result


class PooledAsgiHandler(ASGIHandler):
    """Django's ASGI handler with each sync request served whole on ``executor()``.

    Requests whose URL resolves to an async view keep Django's async path (see the module
    docstring); all others, including 404s, run Django's sync middleware chain on a pool
    thread, like a WSGI request. The body is read on the event loop first (it is bounded by
    ``queue_api.middleware.AsgiBodyLimit`` in front).
    """

    def __init__(self) -> None:
        super().__init__()
        self._sync = _SyncHandler()
        self._sync.load_middleware(is_async=False)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Serve one ASGI connection scope (HTTP only, as Django's handler)."""
        if scope["type"] == "http":
            path, match = _match(scope)
            if match is None or not iscoroutinefunction(match.func):
                await self._handle_pooled(scope, receive, send, (path, match))
                return
        # A thread of this request's own for its sync parts, as Django's handler makes, but
        # whose connections are closed when the request ends (the thread is not reused).
        own = ThreadPoolExecutor(1, thread_name_prefix="relay-http-request")
        try:
            async with ThreadSensitiveContext(executor=own):
                await self.handle(scope, receive, send)
        finally:
            await asyncio.get_running_loop().run_in_executor(own, connections.close_all)
            own.shutdown(wait=False)

    async def _handle_pooled(
        self, scope: dict[str, Any], receive: Any, send: Any, matched: _Matched
    ) -> None:
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        gate = _gate(matched)
        if gate is not None:
            await gate.acquire()  # left when the pool thread is done with the request
        await self._pooled(scope, send, body_file, matched, gate)

    async def _pooled(
        self,
        scope: dict[str, Any],
        send: Any,
        body_file: Any,
        matched: _Matched,
        gate: asyncio.Semaphore | None,
    ) -> None:
        """Serve the request on a pool thread, then send its response. The request's body is
        closed, and its gate left, when the thread is done with it, even if this task is
        cancelled first (its client gone, its time up): the thread goes on to the end. Closed
        at the cancel, the body failed a view still to read it (a 500), and a bulk request
        waiting at the gate ran beside the one still replaying (a hostile review)."""
        set_script_prefix(get_script_prefix(scope))
        serve = sync_to_async(self._serve, thread_sensitive=False, executor=executor())
        served = asyncio.ensure_future(serve(scope, body_file, matched))
        served.add_done_callback(functools.partial(_served, body_file, gate))
        response = await asyncio.shield(served)
        await self.send_response(response, send)
        if response.streaming:
            await sync_to_async(response.close, thread_sensitive=False, executor=executor())()

    def _serve(self, scope: dict[str, Any], body_file: Any, matched: _Matched) -> HttpResponseBase:
        """On a pool thread: the request's whole sync life, as Django's WSGI handler runs it.

        A response that is not streamed is closed here (``request_finished``: this thread's
        connection upkeep) before the loop sends its bytes; a streamed one after sending.
        """
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, error = self.create_request(scope, body_file)
        if request is not None:
            request._relay_matched = matched  # type: ignore[attr-defined]
        response = self._sync.get_response(request) if request is not None else error
        assert response is not None  # create_request gives a request or an error response
        response._handler_class = self.__class__  # type: ignore[attr-defined]
        if not response.streaming:
            response.close()
        return response


_Matched = tuple[str, ResolverMatch | None]  # (path_info, its URL match; None: no route)


def _served(body_file: Any, gate: asyncio.Semaphore | None, served: asyncio.Future[Any]) -> None:
    """A pool thread is done with a request: close its body, leave its gate, and mark an
    error no one waits for any more as seen (its task was cancelled)."""
    body_file.close()
    if gate is not None:
        gate.release()
    if not served.cancelled():
        served.exception()


_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


def _gate(matched: _Matched) -> asyncio.Semaphore | None:
    """This event loop's gate for the request, or None: the operator console's requests (a
    URL of the admin site) share ``CONSOLE_SHARE`` of the pool's threads (at least one), the
    API's ``BULK_ROUTES`` one thread."""
    match = matched[1]
    if match is None:
        return None
    if "admin" in match.namespaces:
        kind, slots = "console", max(1, int(relay_settings().http_threads * CONSOLE_SHARE))
    elif match.url_name in BULK_ROUTES:
        kind, slots = "bulk", 1
    else:
        return None
    gates = _GATES.setdefault(asyncio.get_running_loop(), {})
    gate = gates.get(kind)
    if gate is None:
        gate = gates[kind] = asyncio.Semaphore(slots)
    return gate


def _match(scope: dict[str, Any]) -> _Matched:
    """The request's path_info (as ``ASGIRequest`` makes it) and its URL match, or None."""
    path = str(scope["path"]).removeprefix(get_script_prefix(scope))
    try:
        return path, resolve(path)
    except Resolver404:
        return path, None


class _SyncHandler(BaseHandler):
    """Django's sync handler, reusing the URL match ``PooledAsgiHandler`` made to pick the
    path (one ``resolve`` a request instead of two, ~4% of a submit's CPU)."""

    def resolve_request(self, request: HttpRequest) -> ResolverMatch:
        """The match made on the loop when it is for this request's path, else a fresh one."""
        matched: _Matched = getattr(request, "_relay_matched", ("", None))
        path, match = matched
        if match is None or path != request.path_info or hasattr(request, "urlconf"):
            return super().resolve_request(request)
        request.resolver_match = match
        return match
