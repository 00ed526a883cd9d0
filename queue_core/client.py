"""Synchronous Python client for Relay's NDJSON-over-TCP protocol (``docs/protocol.md``).

``RelayClient`` sends one request at a time per connection and waits for its reply, so it needs
no pipelining; a lock makes one client safe to share between threads (requests queue up behind
each other). Give a long-polling ``lease`` its own client so it does not hold up acks.

Failure semantics, which callers must get right:

* An error reply raises the ``RelayError`` subclass for its code (``errors.error_from_body``):
  the server answered, so the outcome is known (nothing changed), except for
  ``OutcomeUnknown`` (``OUTCOME_UNKNOWN``): the server lost its database connection while
  the database committed, or the database's storage failed the commit's sync, and knows no
  more than a caller whose connection broke (below).
* A connection that cannot be opened raises ``RelayUnreachable``: nothing was sent.
* A broken or timed-out connection raises ``RelayConnectionError`` (a ``ConnectionError``,
  and the base of ``RelayUnreachable``). The request may or may not have been applied: the
  caller cannot know whether a ``submit`` committed (resubmit with an ``idempotency_key`` to be
  safe) or whether a ``lease`` handed out jobs (they come back when their lease expires).
  ``ack`` and ``fail`` are safe to repeat with the same token: a repeat answers success with
  ``"duplicate": true``. The next call reconnects.

Transports: ``TcpTransport`` (the socket, the default), or any ``Transport`` passed as
``transport``, such as ``queue_core.protocol.loopback.LoopbackTransport``, which feeds frames
straight into this process's op table (the contract tests' in-process surface).
"""

from __future__ import annotations

import contextlib
import random
import select
import socket
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol, Self, TypedDict, Unpack

from queue_core import errors
from queue_core.protocol import codec, ops
from queue_core.retry import RetryPolicy, jittered_ms

DEFAULT_ADDRESS = "127.0.0.1:7400"
DEFAULT_MAX_FRAME_BYTES = 1024 * 1024
_RECV_CHUNK = 64 * 1024
RECONNECT_BACKOFF = RetryPolicy(max_retries=0, base_ms=100, cap_ms=2_000, jitter=True)
"""Pauses between connection attempts: 100 ms doubling to 2 s, each jittered to 50-100%."""
_RNG = random.Random()


# A call sends its request only when its deadline leaves at least this long for the reply, s.
MIN_REPLY_S = 0.05


class RelayConnectionError(ConnectionError):
    """The connection to the server failed before a complete reply arrived; outcome unknown.

    Attributes:
        address: the ``HOST:PORT`` the client was talking to.
        reason: what went wrong, without the address.
    """

    def __init__(self, reason: str, *, address: str) -> None:
        super().__init__(f"{reason} ({address})")
        self.address = address
        self.reason = reason


class RelayUnreachable(RelayConnectionError):
    """Nothing was sent (the outcome is known): the TCP connection could not be opened, or a
    call's deadline passed before its turn to send came."""


def parse_address(address: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """Split ``"HOST:PORT"`` (or ``"[IPv6]:PORT"``) into ``(host, port)``.

    Args:
        address: ``"127.0.0.1:7400"``, ``"relay.internal:7400"`` or ``"[::1]:7400"``.
        allow_port_zero: accept port 0 (a server asking the OS for a free port).
    Returns:
        ``(host, port)`` with the brackets of an IPv6 host removed.
    Raises:
        ValueError: with a message naming the problem (no port, bad port, missing host,
            IPv6 without brackets).
    """
    text = address.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"address {address!r}: missing ']' after the IPv6 host")
        host, rest = text[1:end], text[end + 1 :]
        if not rest.startswith(":"):
            raise ValueError(f"address {address!r}: expected ':PORT' after ']'")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:7400")
        if ":" in host:
            raise ValueError(
                f"address {address!r}: write an IPv6 host in brackets, e.g. [::1]:7400"
            )
    if not host:
        raise ValueError(f"address {address!r}: missing host")
    if not port_text.isdigit() or not port_text.isascii():
        raise ValueError(f"address {address!r}: port must be a number, got {port_text!r}")
    port = int(port_text)
    low = 0 if allow_port_zero else 1
    if not low <= port <= 65535:
        raise ValueError(f"address {address!r}: port must be in {low}..65535")
    return host, port


def format_address(host: str, port: int) -> str:
    """Return ``HOST:PORT``, bracketing an IPv6 host (the inverse of ``parse_address``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_addresses(addresses: str) -> list[tuple[str, int]]:
    """Split ``"HOST:PORT[,HOST:PORT...]"`` (``RELAY_ADDRESS``, ``--address``) into servers.

    Several servers of one PostgreSQL database: a client uses the first that answers and
    fails over to the next when its connection breaks (``TcpTransport``).

    Raises:
        ValueError: empty, or an element ``parse_address`` refuses.
    """
    parts = [part.strip() for part in addresses.split(",")]
    if not any(parts):
        raise ValueError("address: expected HOST:PORT[,HOST:PORT...], e.g. 127.0.0.1:7400")
    return [parse_address(part) for part in parts if part]


def format_addresses(servers: Sequence[tuple[str, int]]) -> str:
    """Return ``HOST:PORT,HOST:PORT`` (the inverse of ``parse_addresses``)."""
    return ",".join(format_address(host, port) for host, port in servers)


class Transport(Protocol):
    """Carries one encoded request frame to the server and returns its reply line.

    Implementations need not be thread-safe: ``RelayClient`` serialises calls.
    """

    def roundtrip(self, frame: bytes, *, timeout_s: float, deadline: float | None = None) -> bytes:
        """Send ``frame`` (ending in ``\\n``) and return the reply line without its newline.

        Args:
            frame: one encoded request.
            timeout_s: how long to wait for the reply, in seconds.
            deadline: a ``time.monotonic()`` instant (s) by which the whole call, connecting
                and a ``hello`` included, ends; None for none beyond ``timeout_s``.
        Raises:
            RelayConnectionError: the exchange failed; the transport reconnects next time.
        """
        ...

    def close(self) -> None:
        """Drop the connection; safe from another thread, where it aborts a blocked call."""
        ...


class TcpTransport:
    """One lazily opened TCP connection, reopened after any failure.

    Given several servers (several ``relay server`` processes on one PostgreSQL database), it
    connects to the first that answers, and after a broken connection the next attempt starts
    at the next server: a worker whose server died acks through another with the same lease
    tokens (a lease belongs to the worker, not to the connection).

    Args:
        servers: ``[(host, port), ...]``, tried in turn (``parse_addresses``).
        connect_timeout_s: how long to wait for the TCP handshake, in seconds.
        max_frame_bytes: the longest reply accepted, newline excluded; the read buffer never
            holds more than this plus one byte.
        handshake: a request frame (the ``hello`` op with an API key) sent first on every new
            connection; an error reply to it closes the connection and is raised.
        connect_retries: how many more times to try every server when none can be reached,
            with jittered backoff from 100 ms doubling to 2 s (default 0: fail at once).
    """

    def __init__(
        self,
        servers: Sequence[tuple[str, int]],
        *,
        connect_timeout_s: float,
        max_frame_bytes: int,
        handshake: bytes | None = None,
        connect_retries: int = 0,
    ) -> None:
        if not servers:
            raise ValueError("TcpTransport needs at least one server")
        self.servers = list(servers)
        self._index = 0  # the server in use, or tried next
        self.connect_retries = connect_retries
        self.connect_timeout_s = connect_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.handshake = handshake
        self._sock: socket.socket | None = None
        self._buf = bytearray()

    @property
    def address(self) -> str:
        """``HOST:PORT`` of the server in use (or tried next)."""
        return format_address(*self.servers[self._index])

    def _fail(self, reason: str, cause: BaseException | None = None) -> RelayConnectionError:
        err = RelayConnectionError(reason, address=self.address)
        err.__cause__ = cause
        self.close()
        self._index = (self._index + 1) % len(self.servers)  # fail over next time
        return err

    def _connected(self, deadline: float | None) -> socket.socket:
        sock = self._sock
        if sock is not None and (self._buf or _readable(sock)):
            # Between requests the server has nothing to say: unread bytes or EOF mean it
            # closed the connection (idle TIMEOUT, restart). Reconnect before sending rather
            # than after, so the request is not lost in a dead socket.
            self.close()
            sock = None
        if sock is None:
            sock = self._open(deadline)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            self._buf.clear()
            if self.handshake is not None:
                self._shake(sock, self.handshake, deadline)
        return sock

    def _within(self, deadline: float | None) -> float:
        """``connect_timeout_s``, or less to end by ``deadline``.

        Raises:
            TimeoutError: the deadline has passed.
        """
        if deadline is None:
            return self.connect_timeout_s
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the call's deadline passed")
        return min(self.connect_timeout_s, remaining)

    def _open(self, deadline: float | None) -> socket.socket:
        """Open a TCP connection to the first server that accepts, starting at the current
        one; when none does, retry them all ``connect_retries`` times with jittered backoff
        (safe: nothing was sent), but not past ``deadline``.

        Raises:
            RelayUnreachable: every try failed, or the deadline passed.
        """
        failures = 0
        while True:
            for _ in self.servers:
                try:
                    return socket.create_connection(
                        self.servers[self._index], timeout=self._within(deadline)
                    )
                except OSError as exc:
                    error = exc
                    self._index = (self._index + 1) % len(self.servers)
                    if deadline is not None and time.monotonic() >= deadline:
                        break
            failures += 1
            pause_s = jittered_ms(RECONNECT_BACKOFF, failures, _RNG) / 1000
            if failures > self.connect_retries or (
                deadline is not None and time.monotonic() + pause_s >= deadline
            ):
                raise RelayUnreachable(
                    f"cannot connect: {error}", address=format_addresses(self.servers)
                ) from error
            time.sleep(pause_s)

    def _shake(self, sock: socket.socket, frame: bytes, deadline: float | None) -> None:
        """Send the handshake on a new connection; raise its error reply (nothing else sent).

        Raises:
            RelayError: the server refused it (``UNAUTHENTICATED``); the connection is closed.
            RelayConnectionError: the exchange failed or did not end by ``deadline``.
        """
        try:
            timeout_s = self._within(deadline)
        except TimeoutError as exc:
            raise self._fail("no time left for the hello", exc) from exc
        try:
            sock.settimeout(timeout_s)
            sock.sendall(frame)
            line = self._read_line(sock, time.monotonic() + timeout_s)
        except RelayConnectionError:
            raise
        except TimeoutError as exc:
            raise self._fail(f"no hello reply within {timeout_s:g} s", exc) from exc
        except OSError as exc:
            raise self._fail(f"connection failed during hello: {exc}", exc) from exc
        try:
            reply = codec.decode_response(line)
        except errors.BadFrame as exc:
            raise self._fail(f"malformed hello reply: {exc.message}", exc) from exc
        if not reply["ok"]:
            self.close()
            raise errors.error_from_body(reply["error"])

    def roundtrip(self, frame: bytes, *, timeout_s: float, deadline: float | None = None) -> bytes:
        """Send one frame and read one reply line, each step bounded by ``timeout_s``, and
        everything (connecting and the hello included) by ``deadline`` if given.

        Raises:
            RelayConnectionError: connect failure, send/receive error, no reply in time, the
                server closed the connection, or a reply longer than ``max_frame_bytes``.
        """
        sock = self._connected(deadline)
        began = time.monotonic()
        ends = began + timeout_s if deadline is None else min(began + timeout_s, deadline)
        timeout_s = ends - began
        # Nothing sent, and the connection stays good for the next call: past the deadline,
        # or too near it for a reply (sent 0.5 ms before it, a request was kept and its call
        # raised "no reply within 0.0005 s": outcome unknown for nothing; a review).
        if timeout_s <= 0 or (ends == deadline and timeout_s < MIN_REPLY_S):
            raise RelayUnreachable(
                "the call's deadline passed before it was sent", address=self.address
            )
        try:
            sock.settimeout(timeout_s)
            sock.sendall(frame)
            return self._read_line(sock, ends)
        except RelayConnectionError:
            raise  # already explained (and the socket closed) by _fail
        except TimeoutError as exc:
            raise self._fail(f"no reply within {timeout_s:g} s", exc) from exc
        except OSError as exc:
            raise self._fail(f"connection failed: {exc}", exc) from exc

    def _read_line(self, sock: socket.socket, deadline: float) -> bytes:
        limit = self.max_frame_bytes + 1  # the frame plus its newline
        scanned = 0
        while True:
            newline = self._buf.find(b"\n", scanned)
            if newline >= 0:
                line = bytes(self._buf[:newline])
                del self._buf[: newline + 1]
                return line
            if len(self._buf) >= limit:
                raise self._fail(f"reply is over the {self.max_frame_bytes}-byte frame limit")
            scanned = len(self._buf)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
            chunk = sock.recv(min(_RECV_CHUNK, limit - len(self._buf)))
            if not chunk:
                raise self._fail("connection closed by the server")
            self._buf += chunk

    def stop_sending(self) -> None:
        """Half-close the connection (``shutdown(SHUT_WR)``): the server answers what it
        holds and sees the client is done, so a long-poll waiting for jobs is answered at
        once with none (nothing leased to it), while a reply already on its way still
        arrives. Safe from any thread; the next call reconnects."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Shut the socket down (waking a thread blocked in ``recv``) and forget it."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        with contextlib.suppress(OSError):  # already disconnected
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def request_frame(req_id: int, op: str, args: dict[str, Any] | None, max_frame_bytes: int) -> bytes:
    """Encode one request for sending (both clients).

    Raises:
        FrameTooLarge: over ``max_frame_bytes``, newline excluded.
        InvalidArgument: not JSON-serialisable: NaN or ±Infinity (orjson would send null),
            a lone surrogate, a type JSON does not have.
    """
    frame = codec.encode_request(req_id, op, args)
    if len(frame) - 1 > max_frame_bytes:
        raise errors.FrameTooLarge(
            f"request is {len(frame) - 1} bytes, over the {max_frame_bytes}-byte frame limit",
            limit_bytes=max_frame_bytes,
        )
    return frame


def decode_result[T](call: ops.Call[T], result: Any, address: str) -> T:
    """What the op method returns for the reply's ``result`` (both clients).

    Raises:
        RelayConnectionError: the result is not the op's object (a broken server).
    """
    try:
        return call.decode(result)
    except ValueError as exc:
        raise RelayConnectionError(str(exc), address=address) from None


def _readable(sock: socket.socket) -> bool:
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):  # closed or invalid descriptor
        return True
    return bool(readable)


class ClientOptions(TypedDict, total=False):
    """The keyword options both clients take (``RelayClient``, ``AsyncRelayClient``).

    Attributes:
        timeout_s: how long to wait for a reply, in seconds (30); a ``lease`` waits this much
            longer than its ``wait_ms``.
        connect_timeout_s: how long to wait for each TCP connection attempt, in seconds (5).
        max_frame_bytes: the frame size limit in bytes, newline excluded (the server's
            ``RELAY_MAX_FRAME_BYTES``; 1 MiB); larger requests are refused before sending and
            a larger reply drops the connection.
        api_key: an API key (``rk_...``) sent in a ``hello`` first on every new connection;
            needed once the server has keys. None (the default) sends no hello.
        connect_retries: how many more times to try every server when none can be reached,
            with jittered backoff (>= 0; ``RelayClient`` 0, ``AsyncRelayClient`` 3).
    """

    timeout_s: float
    connect_timeout_s: float
    max_frame_bytes: int
    api_key: str | None
    connect_retries: int


class ClientCore:
    """What both clients share: the servers, the ``ClientOptions`` and the request ids.

    Raises:
        ValueError: ``address`` is malformed, ``timeout_s`` or ``connect_timeout_s`` is not
            above 0, ``max_frame_bytes`` is below 1, or ``connect_retries`` < 0.
    """

    DEFAULT_CONNECT_RETRIES = 0

    def __init__(self, address: str, options: ClientOptions) -> None:
        self.servers = parse_addresses(address)
        self.address = format_addresses(self.servers)
        self.timeout_s = options.get("timeout_s", 30.0)
        self.connect_timeout_s = options.get("connect_timeout_s", 5.0)
        self.max_frame_bytes = options.get("max_frame_bytes", DEFAULT_MAX_FRAME_BYTES)
        self.connect_retries = options.get("connect_retries", self.DEFAULT_CONNECT_RETRIES)
        if self.connect_retries < 0:
            raise ValueError("connect_retries must be >= 0")
        # A structural audit: timeout_s=-1 was taken, though ValueError was documented.
        for option in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, option) > 0:
                raise ValueError(f"{option} must be above 0 seconds")
        if self.max_frame_bytes < 1:
            raise ValueError("max_frame_bytes must be >= 1")
        api_key = options.get("api_key")
        self._hello = (
            codec.encode_request("hello", "hello", {"api_key": api_key}) if api_key else None
        )
        self._next_id = 0


class RelayClient(ClientCore, ops.BlockingClient):
    """Blocking client for a Relay server (or several of one PostgreSQL database, failing
    over); thread-safe, one request in flight at a time.

    Connects on the first call and again on the call after a broken connection. The op
    methods (``submit``, ``lease``, ``ack``, ...) come from the op catalogue
    (``queue_core.protocol.ops.Ops``, which documents each): every one returns the op's
    ``result`` object typed with ``queue_core.types`` (``lease`` returns just its list of
    jobs), as ``AsyncRelayClient``'s do.

    Args:
        address: ``HOST:PORT`` or ``[IPv6]:PORT`` (default ``127.0.0.1:7400``), or several
            separated by commas (servers of one PostgreSQL database): the client fails over to
            the next when a connection breaks (``TcpTransport``, whose connection retries
            pause 100 ms doubling to 2 s).
        transport: carry frames some other way (tests); default a ``TcpTransport``. The
            ``api_key`` hello and ``connect_retries`` are the default transport's.
        **options: ``ClientOptions`` (reply and connect timeouts, frame size, API key,
            connect retries; ``connect_retries`` defaults to 0 here).
    Raises:
        ValueError: ``address`` is malformed or an option is out of range.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        transport: Transport | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(address, options)
        self._transport: Transport = transport or TcpTransport(
            self.servers,
            connect_timeout_s=self.connect_timeout_s,
            max_frame_bytes=self.max_frame_bytes,
            handshake=self._hello,
            connect_retries=self.connect_retries,
        )
        self._lock = threading.Lock()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection. Safe from any thread: a call blocked on it fails with
        ``RelayConnectionError``. The client stays usable and reconnects on the next call."""
        self._transport.close()

    def stop_sending(self) -> None:
        """Tell the server this connection sends nothing more (``TcpTransport.stop_sending``):
        a ``lease`` blocked in its long-poll returns at once, ``[]`` unless jobs were already
        on their way. Safe from any thread; a transport without it does nothing."""
        stop = getattr(self._transport, "stop_sending", None)
        if stop is not None:
            stop()

    def call(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        wait_ms: int = 0,
        deadline: float | None = None,
    ) -> Any:
        """Send one request and return its ``result``.

        Args:
            op: operation name (``"ping"``, ``"submit"``, ...).
            args: its arguments; ``None`` values must already be left out.
            wait_ms: how long the server may hold the request (long-poll) before replying, in
                ms; added to the reply timeout.
            deadline: a ``time.monotonic()`` instant (s) by which the call ends, connecting
                and the ``hello`` included (``RelayConnectionError`` after it); None: the
                reply timeout alone bounds it.
        Returns:
            The reply's ``result`` (a dict for every op in the protocol).
        Raises:
            RelayError: the server answered with an error (the subclass for its code); or,
                with nothing sent, the request is over ``max_frame_bytes`` (``FrameTooLarge``)
                or not JSON-serialisable (``InvalidArgument``: a float that is NaN or
                ±Infinity, a string with a lone surrogate, a type JSON does not have).
            RelayConnectionError: no complete reply (outcome unknown); its subclass
                ``RelayUnreachable`` when nothing was sent (no connection, or the deadline
                passed first, while other threads' calls held the connection, say).
        """
        if deadline is None:
            self._lock.acquire()
        elif not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RelayUnreachable(
                "the call's deadline passed while other calls held the connection",
                address=self.address,
            )
        try:
            self._next_id += 1
            req_id = self._next_id
            frame = request_frame(req_id, op, args, self.max_frame_bytes)
            line = self._transport.roundtrip(
                frame, timeout_s=self.timeout_s + wait_ms / 1000, deadline=deadline
            )
            try:
                reply = codec.decode_response(line)
            except errors.BadFrame as exc:
                self._transport.close()
                raise RelayConnectionError(
                    f"malformed reply from the server: {exc.message}", address=self.address
                ) from exc
            reply_id = reply.get("id")
            if type(reply_id) is not int or reply_id != req_id:  # true == 1 in Python
                # Only connection-level errors (TIMEOUT, TOO_MANY_CONNECTIONS, FRAME_TOO_LARGE)
                # come without an id, and the server closes the connection after them; an
                # error with another id answers no request of ours (a faulty server: it was
                # raised as this call's own, a review).
                self._transport.close()
                if reply_id is None and not reply["ok"]:
                    raise errors.error_from_body(reply["error"])
                raise RelayConnectionError(
                    f"reply id {reply_id!r} does not match request id {req_id}",
                    address=self.address,
                )
        finally:
            self._lock.release()
        if not reply["ok"]:
            raise errors.error_from_body(reply["error"])
        return reply["result"]

    def send[T](self, call: ops.Call[T], *, deadline: float | None = None) -> T:
        """Send one op's ``call`` (what an ``Ops`` method builds: ``RelayClient.submit(...)``
        on the class) and return its result, by ``deadline`` if given (see ``call``).

        Raises:
            as ``call``; RelayConnectionError also when the result is not the op's object.
        """
        result = self.call(call.op, call.args or None, wait_ms=call.wait_ms, deadline=deadline)
        return decode_result(call, result, self.address)
