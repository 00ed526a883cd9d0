"""gunicorn's ``asgi`` worker with its connection limit enforced (``RELAY_HTTP_CONNECTIONS``).

gunicorn 27's ``asgi`` worker counts its open connections (``nr_conns``) but never compares
the count with ``worker_connections``: a hostile review held 4,000 slow-body connections on a
worker set to 1,000, each a file descriptor the worker's database connections need too.
``BoundedWorker``:

* at the limit, makes room for a newcomer (``_evict``): it closes the oldest connection that
  has not sent its first request's whole head, answered as a refused one is (as Relay's TCP
  server evicts its oldest connection without a key); never one whose first bytes wait in
  the kernel unread. A client that reconnects as fast as it is cut holds slots only for the
  moments before its heads arrive;
* answers a connection accepted past the limit, when every connection has sent a head,
  ``503`` with the problem code ``TOO_MANY_CONNECTIONS`` and ``Retry-After: 1`` (as
  Relay's TCP server refuses one, and as uvicorn's ``--limit-concurrency`` answers 503),
  without reading its request (``Refusal``);
* caps the limit to what the process's file-descriptor limit holds, raising the soft limit
  first (``queue_core.protocol.limits.connection_cap``, as the TCP server does);
* closes a connection whose request has been in progress for over ``request_timeout_s``
  (``RELAY_HTTP_REQUEST_TIMEOUT_S``, 60 s): a body that trickles in, or a response the client
  does not read, held a slot for good (``_sweep``);
* closes a connection whose first request's headers have not all arrived
  ``header_timeout_s`` after it was accepted (``RELAY_HTTP_HEADER_TIMEOUT_S``, 15 s; nginx's
  ``client_header_timeout``): gunicorn waits for them for ever, and 50 silent connections
  held a limit of 50 for good, every new client refused (a review). Later requests on a
  kept-alive connection wait at most gunicorn's ``keepalive``.

The seam is the worker's event loop: the worker makes its listening servers with
``loop.create_server(factory, ...)``, and asyncio calls the factory once per accepted
connection. ``BoundedWorker`` wraps that factory. The worker counts a connection
(``nr_conns``) in ``ASGIProtocol.connection_made``, which asyncio runs one loop iteration
after the factory; one accept burst runs every factory of the burst first (asyncio accepts
up to the listen backlog, 2,048, at once), so the wrapper also counts the connections whose
factory ran in this iteration (``_pending``), until theirs has. A TLS connection is counted
only once its handshake is over. The two timeouts read two attributes of gunicorn's
``ASGIProtocol`` (``req_count``, ``_current_request``). ``tests/http/test_capacity.py`` checks
all of it against the gunicorn version in the lock (pyproject.toml allows 27.x only).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import termios
import weakref
from collections.abc import Callable
from typing import Any

import orjson
from gunicorn.asgi.protocol import ASGIProtocol
from gunicorn.workers.gasgi import ASGIWorker

from queue_core.errors import TooManyConnections
from queue_core.protocol.limits import ACCEPT_LOG_EVERY_S, Every, connection_cap, kernel_queue

log = logging.getLogger("relay.http")

LINGER_S = 1.0  # how long a refused connection is read (and dropped) before it is closed
# Refused connections lingering at once, at most: past it a refusal closes as soon as its
# answer is written. 3,000 connects in one burst at a limit of 50 held 2,036 descriptors for
# a second when every refusal lingered (a review); 420 with this cap (58 at rest), what
# asyncio's accept batches of 100 hold until their refusals close.
MAX_LINGERING = 64
HEADER_TIMEOUT_S = 15.0  # default of RELAY_HTTP_HEADER_TIMEOUT_S
# Default of RELAY_HTTP_REQUEST_TIMEOUT_S: past a long-poll's longest wait (20 s), the 1 MiB
# body at 17 KiB/s, and gunicorn's own 60 s worker timeout.
REQUEST_TIMEOUT_S = 60.0
SWEEP_S = 1.0  # how often the connections are looked at for their timeouts


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


# What a served connection is doing, as ``_evict`` sees it (``state``).
CONNECTING = "connecting"  # connection_made has not run (same accept burst, or a TLS handshake)
GONE = "gone"  # closing or lost
UNHEARD = "unheard"  # its first request's whole head has not been read
HEARD = "heard"  # past it: a request in progress, or kept alive between requests
MAX_LOOKED = 64  # connections passed over for one newcomer, at most


def state(protocol: asyncio.BaseProtocol) -> str:
    """What gunicorn's ``protocol`` (an ``ASGIProtocol``) is doing: ``CONNECTING``, ``GONE``,
    ``UNHEARD`` or ``HEARD``, read from its attributes (gunicorn 27: ``transport``,
    ``_conn_lost_handled``, ``_current_request``, ``req_count``).

    Between ``_current_request`` cleared after a request and ``req_count`` raised for the
    next, gunicorn's loop does not yield, so ``req_count <= 1`` with no request is the
    first one's head still to come."""
    transport = getattr(protocol, "transport", None)
    if transport is None:
        return CONNECTING
    if transport.is_closing() or getattr(protocol, "_conn_lost_handled", True):
        return GONE
    if getattr(protocol, "_current_request", None) is not None:
        return HEARD
    if getattr(protocol, "req_count", 2) <= 1:
        return UNHEARD
    return HEARD


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """How many bytes the kernel holds for ``transport``'s socket that the worker has not read
    (``FIONREAD``); 0 without a socket or when the kernel does not say."""
    return kernel_queue(transport.get_extra_info("socket"), termios.FIONREAD) or 0


def _oldest_unheard(
    table: weakref.WeakKeyDictionary[asyncio.BaseProtocol, None],
) -> asyncio.BaseProtocol | None:
    """The oldest protocol of ``table`` (in insertion order) still ``UNHEARD``, unless nothing
    of what its client sent has been read yet while bytes wait in the kernel
    (``ReadNoting.read_any``, ``unread_bytes``); it is taken out of ``table``. Those past
    their first head, or gone, are taken out on the way; those with bytes arriving are passed
    over, at most ``MAX_LOOKED``. The search stops at a ``CONNECTING`` one (the rest are
    newer)."""
    found: asyncio.BaseProtocol | None = None
    dropped: list[asyncio.BaseProtocol] = []
    looked = 0
    for protocol in table:
        now = state(protocol)
        if now == CONNECTING:
            break
        if now != UNHEARD:
            dropped.append(protocol)
            continue
        transport = getattr(protocol, "transport")  # noqa: B009
        if getattr(protocol, "read_any", True) or not unread_bytes(transport):
            found = protocol
            break
        looked += 1
        if looked >= MAX_LOOKED:
            break
    for protocol in dropped:
        table.pop(protocol, None)
    if found is not None:
        table.pop(found, None)
    return found


class ReadNoting(ASGIProtocol):  # type: ignore[misc]  # gunicorn has no type hints
    """gunicorn's ``ASGIProtocol``, noting whether anything its client sent has been read
    (``read_any``): ``_evict`` spares a connection whose first bytes wait in the kernel unread
    (its request is arriving), not one that has been read from and is still short of a head
    (a review: sparing every connection with unread bytes let hogs that sent a byte of a head
    every 0.2 ms keep the worker behind on reading, and their slots)."""

    read_any = False

    def data_received(self, data: bytes) -> None:
        self.read_any = True
        super().data_received(data)


class Refusal(asyncio.Protocol):
    """A connection past the limit: send ``response``, shut the write side, and drop what
    the client sends until it closes, or for ``LINGER_S`` at most. Closing at once with the
    client's request unread would make the kernel reset the connection, and the client could
    lose the answer (nginx's ``lingering_close`` reads on for the same reason); what arrives
    after ``LINGER_S`` may still get a reset. Without ``linger`` (too many linger already) it
    closes as soon as the answer is written.

    Args:
        response: the whole answer (``refusal_response``).
        linger: whether to linger; ``done`` is called once the connection is gone.
    """

    def __init__(self, response: bytes, linger: bool, done: Callable[[], None]) -> None:
        self._response = response
        self._linger = linger
        self._done = done
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        try:
            transport.write(self._response)
            if not self._linger:
                transport.close()
                return
            if transport.can_write_eof():
                transport.write_eof()
        except OSError:  # the client reset the connection already
            transport.abort()
            return
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        """Drop it: the request is not read."""

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._done()


class BoundedWorker(ASGIWorker):  # type: ignore[misc]  # gunicorn has no type hints
    """gunicorn's ``asgi`` worker that holds at most ``worker_connections`` connections
    (``RELAY_HTTP_CONNECTIONS``, capped by the fd limit), makes room for a newcomer by
    closing the oldest connection without a request head (``_evict``),
    answers the rest 503 (``Refusal``) and, once a ``SWEEP_S``, closes the connections past
    their header or request timeout (``header_timeout_s``, ``request_timeout_s``: set by
    ``relayproject/gunicorn_conf.py``'s ``post_fork`` hook)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker_connections: int = self.cfg.worker_connections
        self.header_timeout_s = HEADER_TIMEOUT_S
        self.request_timeout_s = REQUEST_TIMEOUT_S
        self.refused = 0  # connections answered 503, since the worker started
        self.evicted = 0  # of those, connections served until a newcomer took their slot
        self.timed_out = 0  # connections closed by the header or the request timeout
        # The connections served, each with when it was accepted (loop time), and since when
        # each one's request in progress, keyed by that request, has been (``_sweep``).
        self._served: weakref.WeakKeyDictionary[asyncio.BaseProtocol, float] = (
            weakref.WeakKeyDictionary()
        )
        # The connections served that had not sent their first request's whole head when last
        # looked at, oldest first (``_evict``).
        self._unheard: weakref.WeakKeyDictionary[asyncio.BaseProtocol, None] = (
            weakref.WeakKeyDictionary()
        )
        self._since: weakref.WeakKeyDictionary[
            asyncio.BaseProtocol, tuple[tuple[int, int], float]
        ] = weakref.WeakKeyDictionary()
        self._sweeping = False
        self._pending = 0  # factories run whose connection_made has not yet
        self._lingering = 0  # refused connections not yet closed
        self._every = Every(ACCEPT_LOG_EVERY_S)
        self._response = b""

    def _setup_event_loop(self) -> None:
        super()._setup_event_loop()
        self.worker_connections = connection_cap(self.worker_connections)
        self._response = refusal_response()
        loop = self.loop
        create = loop.create_server

        async def create_server(factory: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
            return await create(functools.partial(self._protocol, factory), *args, **kwargs)

        loop.create_server = create_server

    def _protocol(self, factory: Callable[[], asyncio.BaseProtocol]) -> asyncio.BaseProtocol:
        if self.nr_conns + self._pending >= self.worker_connections:
            self._evict()
        if self.nr_conns + self._pending < self.worker_connections:
            # The transport schedules connection_made (which counts the connection) right
            # after this, for the next loop iteration; _counted runs just before it there.
            self._pending += 1
            self.loop.call_soon(self._counted)
            protocol = factory()
            if type(protocol) is ASGIProtocol:
                protocol.__class__ = ReadNoting
            self._served[protocol] = self.loop.time()
            self._unheard[protocol] = None
            timeouts = self.header_timeout_s > 0 or self.request_timeout_s > 0
            if timeouts and not self._sweeping:
                self._sweeping = True
                self.loop.call_later(SWEEP_S, self._sweep)
            return protocol
        self.refused += 1
        self._log("http_connection_refused", self.refused)
        linger = self._lingering < MAX_LINGERING
        self._lingering += 1
        return Refusal(self._response, linger, self._lingered)

    def _evict(self) -> None:
        """Make room for a newcomer at the limit: the oldest connection that has not sent its
        first request's whole head (``UNHEARD``) gives its slot. Its gunicorn protocol is told
        the connection is lost, which gives back its count (``nr_conns``) at once, and a
        ``Refusal`` takes over its transport, answering 503 and reading what the client sends
        for ``LINGER_S``, as a refused newcomer's does. Without such a connection nothing
        happens (the newcomer is refused).

        A connection nothing has been read from yet while its bytes wait in the kernel
        (``ReadNoting``, ``unread_bytes``) is passed over: its request is arriving, and the next
        loop turn reads it (a review: under a flood, 43 of 45 long-polls evicted had their
        whole request waiting, 4-42 ms after accept). One read from and still short of a head
        is trickling it, and may go.
        Connections kept alive between requests are not taken either: closing the oldest idle
        one (as nginx drains them) was tried and not kept, since the oldest is a pooled
        client's, and a review's client reusing one connection under a flood then lost 4-33%
        of its requests to the close racing its next request (none at the last stop's head).

        ``_unheard`` keeps connections in the order they were accepted, until found past
        their first head (or gone), so each is looked at past it once. At most
        ``MAX_LOOKED`` connections are passed over for one newcomer. A connection whose
        ``connection_made`` has not run yet (same accept burst) has no transport: it and every
        newer one are left alone. (With TLS, which Relay's deployments end at a proxy, a
        connection still in its handshake has none either, and stops the search while it
        lasts: the newcomer is refused.)
        """
        protocol = _oldest_unheard(self._unheard)
        if protocol is not None:
            transport = self._lost(protocol)
            self.refused += 1
            self.evicted += 1
            self._log("http_connection_evicted", self.evicted)
            linger = self._lingering < MAX_LINGERING
            self._lingering += 1
            refusal = Refusal(self._response, linger, self._lingered)
            transport.set_protocol(refusal)
            refusal.connection_made(transport)

    @staticmethod
    def _lost(protocol: asyncio.BaseProtocol) -> asyncio.WriteTransport:
        """Tell gunicorn's ``protocol`` its connection is lost (``nr_conns -= 1``) and return
        its transport. Without the grace period gunicorn gives a running task to see the
        disconnect (``asgi_disconnect_grace_period``, 3 s): the task waits for a request and
        runs no app call, and the grace timer held each evicted protocol for 3 s (8,243 alive
        at once in a count, the worker at 270 MB, under a flood of about 4,000 connects a
        second)."""
        transport: asyncio.WriteTransport = getattr(protocol, "transport")  # noqa: B009
        task = getattr(protocol, "_task", None)
        setattr(protocol, "_task", None)  # noqa: B010  # gunicorn has no type hints
        protocol.connection_lost(None)
        if task is not None:
            task.cancel()
        return transport

    def _counted(self) -> None:
        self._pending -= 1

    def _lingered(self) -> None:
        self._lingering -= 1

    def _sweep(self) -> None:
        """Close each connection past a timeout, while connections are served:

        * the header timeout: its first request's headers not all in ``header_timeout_s``
          after it was accepted (gunicorn waits for them for ever; later requests on a
          kept-alive connection wait at most its ``keepalive``);
        * the request timeout: a request in progress for over ``request_timeout_s``, a body
          that trickles in (gunicorn waits its 60 s timeout per chunk, with no end) or a
          response the client does not read (gunicorn's drain has no timeout). Ten of either
          held a limit of ten for good (a review); nginx bounds both (``client_body_timeout``,
          ``send_timeout``). Its connection is aborted: its buffered response is dropped.
        """
        now = self.loop.time()
        for protocol, accepted in list(self._served.items()):
            transport = getattr(protocol, "transport", None)
            if transport is None or transport.is_closing():
                continue
            request = getattr(protocol, "_current_request", None)
            if request is None:  # between requests, or before the first one's headers
                self._since.pop(protocol, None)
                first = getattr(protocol, "req_count", 2) <= 1
                if first and 0 < self.header_timeout_s < now - accepted:
                    self.timed_out += 1
                    self._log("http_header_timeout", self.timed_out)
                    transport.close()
                continue
            key = (getattr(protocol, "req_count", 0), id(request))
            seen = self._since.get(protocol)
            if seen is None or seen[0] != key:
                self._since[protocol] = (key, now)
            elif 0 < self.request_timeout_s < now - seen[1]:
                self.timed_out += 1
                self._log("http_request_timeout", self.timed_out)
                transport.abort()
        if self._served:
            self.loop.call_later(SWEEP_S, self._sweep)
        else:
            self._sweeping = False

    def _log(self, event: str, count: int) -> None:
        """One warning line per ``event`` every ``ACCEPT_LOG_EVERY_S``, with the count so far."""
        if self._every.due(event) is None:
            return
        log.warning(
            "event=%s limit=%d count=%d",
            event,
            self.worker_connections,
            count,
            extra={"event": event, "limit": self.worker_connections, "count": count},
        )
