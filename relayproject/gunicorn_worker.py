"""gunicorn's ``asgi`` worker with its connection limit enforced (``RELAY_HTTP_CONNECTIONS``).

gunicorn 27's ``asgi`` worker counts its open connections (``nr_conns``) but never compares
the count with ``worker_connections``: a hostile review held 4,000 slow-body connections on a
worker set to 1,000, each a file descriptor the worker's database connections need too.
``BoundedWorker`` answers a connection accepted past the limit ``503`` with the problem code
``TOO_MANY_CONNECTIONS`` and ``Retry-After: 1`` (as Relay's TCP server refuses one, and as
uvicorn's ``--limit-concurrency`` answers 503), without reading its request, then closes it.

The seam is the worker's event loop: the worker makes its listening servers with
``loop.create_server(factory, ...)``, and asyncio calls the factory once per accepted
connection. ``BoundedWorker`` wraps that factory. The worker counts a connection
(``nr_conns``) in ``ASGIProtocol.connection_made``, which asyncio runs one loop iteration
after the factory; one accept burst runs every factory of the burst first (asyncio accepts
up to the listen backlog, 2,048, at once), so the wrapper also counts the connections whose
factory ran in this iteration (``_pending``), until theirs has. A TLS connection is counted
only once its handshake is over. ``tests/http/test_capacity.py`` checks the limit holds
against the gunicorn version in the lock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

import orjson
from gunicorn.workers.gasgi import ASGIWorker

from queue_core.errors import TooManyConnections
from queue_core.protocol.limits import ACCEPT_LOG_EVERY_S, Every

log = logging.getLogger("relay.http")

LINGER_S = 1.0  # how long a refused connection is read (and dropped) before it is closed


def refusal_response() -> bytes:
    """The whole HTTP/1.1 response to a connection past the limit: 503, ``Retry-After: 1``,
    ``Connection: close`` and the problem body of ``TOO_MANY_CONNECTIONS``."""
    from queue_api.problems import CONTENT_TYPE, RETRY_AFTER_S, problem_body

    exc = TooManyConnections("this HTTP worker is at its connection limit (RELAY_HTTP_CONNECTIONS)")
    body = orjson.dumps(problem_body(exc, ""))
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        f"Content-Type: {CONTENT_TYPE}\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Retry-After: {RETRY_AFTER_S}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class Refusal(asyncio.Protocol):
    """A connection past the limit: send ``response``, shut the write side, and drop what
    the client sends until it closes, or for ``LINGER_S`` at most. Closing at once with the
    client's request unread would make the kernel reset the connection, and the client could
    lose the answer (nginx's ``lingering_close`` reads on for the same reason); what arrives
    after ``LINGER_S`` may still get a reset."""

    def __init__(self, response: bytes) -> None:
        self._response = response
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self._response)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        """Drop it: the request is not read."""

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class BoundedWorker(ASGIWorker):  # type: ignore[misc]  # gunicorn has no type hints
    """gunicorn's ``asgi`` worker that holds at most ``worker_connections`` connections
    (``RELAY_HTTP_CONNECTIONS``) and answers the rest 503 (``Refusal``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused = 0  # connections answered 503, since the worker started
        self._pending = 0  # factories run whose connection_made has not yet
        self._every = Every(ACCEPT_LOG_EVERY_S)
        self._response = b""

    def _setup_event_loop(self) -> None:
        super()._setup_event_loop()
        self._response = refusal_response()
        loop = self.loop
        create = loop.create_server

        async def create_server(factory: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
            return await create(functools.partial(self._protocol, factory), *args, **kwargs)

        loop.create_server = create_server

    def _protocol(self, factory: Callable[[], asyncio.BaseProtocol]) -> asyncio.BaseProtocol:
        if self.nr_conns + self._pending < self.worker_connections:
            # The transport schedules connection_made (which counts the connection) right
            # after this, for the next loop iteration; _counted runs just before it there.
            self._pending += 1
            self.loop.call_soon(self._counted)
            return factory()
        self.refused += 1
        held = self._every.due("http_connection_refused")
        if held is not None:
            log.warning(
                "event=http_connection_refused limit=%d refused=%d",
                self.worker_connections,
                self.refused,
                extra={
                    "event": "http_connection_refused",
                    "limit": self.worker_connections,
                    "refused": self.refused,
                },
            )
        return Refusal(self._response)

    def _counted(self) -> None:
        self._pending -= 1
