"""Asyncio client for Relay's NDJSON-over-TCP protocol: the twin of ``client.RelayClient``.

``AsyncRelayClient`` has the same methods, arguments, results and exceptions as the blocking
client, as coroutines. It keeps one connection and **pipelines** requests on it: each request
carries its own id and replies are matched by id (``docs/protocol.md`` allows them out of
order), so a long-polling ``lease`` never holds up an ``ack`` sent from another task. At most
``max_in_flight`` requests are outstanding at once (the server's
``RELAY_MAX_INFLIGHT_PER_CONNECTION`` is 64).

Failure semantics are those of ``RelayClient``:

* An error reply raises the ``RelayError`` subclass for its code (``errors.error_from_body``).
* A connection that cannot be opened raises ``RelayUnreachable`` (nothing was sent), but only
  after ``connect_retries`` more tries, ``reconnect_base_ms`` doubling up to ``reconnect_cap_ms``
  and jittered to 50-100% (Relay's own backoff, ``retry.jittered_ms``). Retrying a connect is
  always safe because nothing was sent.
* A connection that breaks, or a reply that does not arrive within ``timeout_s`` (plus the
  request's ``wait_ms``), raises ``RelayConnectionError`` for every request then outstanding
  on it: their outcome is unknown, and the client does **not** resend them (a ``submit``
  without an idempotency key could run twice). ``ack`` and ``fail`` are safe to repeat with the
  same token. The next call opens a new connection.
* Cancelling a call abandons its reply; a cancelled ``lease`` may have leased jobs, which come
  back when their leases expire.

A client belongs to the event loop that first used it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import socket
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Self, Unpack

from queue_core import errors
from queue_core.client import (
    DEFAULT_ADDRESS,
    ClientCore,
    ClientOptions,
    RelayConnectionError,
    RelayUnreachable,
    decode_result,
    format_address,
    request_frame,
)
from queue_core.protocol import codec, ops
from queue_core.retry import RetryPolicy, jittered_ms

__all__ = ["AsyncRelayClient"]

Sleep = Callable[[float], Awaitable[object]]


class _Connection:
    """One TCP connection: a reader task matches replies to the futures of their requests."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        address: str,
        max_frame_bytes: int,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.address = address
        self.max_frame_bytes = max_frame_bytes
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.closed = False
        self._write_lock = asyncio.Lock()
        self.reader_task = asyncio.create_task(self._read_loop(), name=f"relay-reader-{address}")

    async def send(self, frame: bytes) -> None:
        """Write one frame whole (the lock keeps frames from interleaving) and drain.

        Raises:
            RelayConnectionError: the write failed; the connection is closed.
        """
        async with self._write_lock:
            if self.closed:
                raise RelayConnectionError("connection closed", address=self.address)
            try:
                self.writer.write(frame)
                await self.writer.drain()
            except OSError as exc:  # ConnectionResetError, BrokenPipeError, ...
                reason = f"connection failed: {exc}"
                self.fail(lambda: RelayConnectionError(reason, address=self.address))
                raise RelayConnectionError(reason, address=self.address) from exc

    async def _read_loop(self) -> None:
        reason = "connection closed by the server"
        try:
            while True:
                try:
                    line = await self.reader.readuntil(b"\n")
                except asyncio.LimitOverrunError:
                    reason = f"reply is over the {self.max_frame_bytes}-byte frame limit"
                    return
                except asyncio.IncompleteReadError:
                    return
                except OSError as exc:
                    reason = f"connection failed: {exc}"
                    return
                try:
                    reply = codec.decode_response(line)
                except errors.BadFrame as exc:
                    reason = f"malformed reply from the server: {exc.message}"
                    return
                req_id = reply.get("id")
                # type(): true is 1 to a dict, and answered request 1 (a review).
                future = self.pending.pop(req_id, None) if type(req_id) is int else None
                if future is not None:
                    if not future.done():
                        future.set_result(reply)
                elif not reply["ok"] and req_id is None:
                    # A connection-level error (TOO_MANY_CONNECTIONS, UNAVAILABLE, TIMEOUT,
                    # FRAME_TOO_LARGE): the server closes the connection after it, and it
                    # applied none of the requests still waiting here.
                    self.fail(functools.partial(errors.error_from_body, reply["error"]))
                    return
                # Anything else answers a request that was cancelled or timed out: dropped.
        finally:
            self.fail(lambda: RelayConnectionError(reason, address=self.address))

    def fail(self, make_error: Callable[[], BaseException]) -> None:
        """Close the connection and fail every outstanding request with a fresh error."""
        self.closed = True
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(make_error())
        self.writer.close()

    async def aclose(self) -> None:
        """Close, fail outstanding requests, and wait for the reader task to end."""
        self.fail(lambda: RelayConnectionError("client closed", address=self.address))
        self.reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.reader_task
        with contextlib.suppress(Exception):  # already reset by the peer, for example
            await self.writer.wait_closed()


class AsyncRelayClient(ClientCore, ops.Ops, ops.Asynchronous):
    """Asyncio client for a Relay server (or several of one PostgreSQL database, failing
    over); many tasks may share it (requests are pipelined).

    Connects on the first call and again on the call after a broken connection. The op
    methods are ``RelayClient``'s (``queue_core.protocol.ops.Ops``), as coroutines returning
    the same typed results.

    Args:
        address: ``HOST:PORT`` or ``[IPv6]:PORT`` (default ``127.0.0.1:7400``), or several
            separated by commas: the client connects to the first that answers and, after a
            broken connection, starts at the next (failover, as ``RelayClient``).
        max_in_flight: most requests outstanding on the connection at once (>= 1); further
            calls wait for a free slot.
        reconnect_base_ms, reconnect_cap_ms: the pause before the first retry and the cap of
            the doubling pauses, in ms; each is jittered to 50-100%.
        rng: randomness for the jitter (default a fresh ``random.Random``).
        sleep: the coroutine that pauses between connection attempts (default
            ``asyncio.sleep``; tests record the pauses).
        **options: ``ClientOptions`` (reply and connect timeouts, frame size, API key,
            connect retries; ``connect_retries`` defaults to 3 here). An error reply to the
            API key's hello (``UNAUTHENTICATED``) is raised and not retried.
    Raises:
        ValueError: ``address`` is malformed or a number is out of range.
    """

    DEFAULT_CONNECT_RETRIES = 3

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        max_in_flight: int = 64,
        reconnect_base_ms: int = 100,
        reconnect_cap_ms: int = 2_000,
        rng: random.Random | None = None,
        sleep: Sleep | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(address, options)
        self._index = 0  # the server in use, or tried next
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self._backoff = RetryPolicy(
            max_retries=0,
            base_ms=reconnect_base_ms,
            cap_ms=max(reconnect_cap_ms, reconnect_base_ms),
            jitter=True,
        )
        self._rng = rng or random.Random()
        self._sleep: Sleep = sleep or asyncio.sleep
        self._conn: _Connection | None = None
        self._connect_lock: asyncio.Lock | None = None
        # Connect cycles that ended in RelayUnreachable, and the last one's error: a call that
        # waited for the lock while one failed fails with it (``_connection``).
        self._connect_failures = 0
        self._connect_error: RelayUnreachable | None = None
        self._slots: asyncio.Semaphore | None = None
        self.connects = 0
        """How many connections this client has opened (a reconnect adds one)."""

    @property
    def server_index(self) -> int:
        """The position in ``servers`` of the server in use, or tried next."""
        return self._index

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; outstanding calls fail with ``RelayConnectionError``.

        The client stays usable and reconnects on the next call.
        """
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()

    async def _connection(self, failures: int | None = None) -> _Connection:
        """The open connection, or a new one: each server in turn, ``connect_retries`` rounds
        with jittered backoff.

        Calls waiting while another call's round of tries failed fail with its error, at
        once: each ran a whole round of its own after the one before it, and six calls to an
        unreachable host took 4.5 s, 9.2 s, ... 27.5 s (with the defaults each waiter added
        about 21 s: a review).

        Args:
            failures: ``_connect_failures`` when the call began (before it waited for a
                request slot too); default: now.
        Raises:
            RelayUnreachable: no server could be reached (nothing was sent).
            RelayError, RelayConnectionError: the ``hello`` was refused or failed.
        """
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        if failures is None:
            failures = self._connect_failures
        async with self._connect_lock:
            conn = self._conn
            if conn is not None and not conn.closed:
                return conn
            if self._connect_failures != failures and self._connect_error is not None:
                raise RelayUnreachable(
                    self._connect_error.reason, address=self.address
                ) from self._connect_error
            try:
                return await self._connect(conn)
            except RelayUnreachable as exc:
                self._connect_failures += 1
                self._connect_error = exc
                raise

    async def _connect(self, conn: _Connection | None) -> _Connection:
        """``_connection``'s tries, under its lock (``conn``: the broken connection, if any)."""
        if conn is not None:
            await conn.aclose()
            self._conn = None
            self._index = (self._index + 1) % len(self.servers)  # it broke: fail over
        failures = tried = 0
        while True:
            host, port = self.servers[self._index]
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port, limit=self.max_frame_bytes),
                    self.connect_timeout_s,
                )
            except (OSError, TimeoutError) as exc:
                self._index = (self._index + 1) % len(self.servers)
                tried += 1
                if tried < len(self.servers):
                    continue  # the next server, at once
                failures, tried = failures + 1, 0
                if failures > self.connect_retries:
                    reason = str(exc) or type(exc).__name__
                    raise RelayUnreachable(
                        f"cannot connect: {reason}", address=self.address
                    ) from exc
                await self._sleep(jittered_ms(self._backoff, failures, self._rng) / 1000)
                continue
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connects += 1
            if self._hello is not None:
                try:
                    await self._shake(reader, writer, self._hello)
                except RelayConnectionError:
                    # The next try starts at the next server, as after a broken
                    # connection (a review: each repeat went back to a stopped server).
                    self._index = (self._index + 1) % len(self.servers)
                    raise
            self._conn = _Connection(
                reader,
                writer,
                address=format_address(host, port),
                max_frame_bytes=self.max_frame_bytes,
            )
            return self._conn

    async def _shake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frame: bytes
    ) -> None:
        """Send the ``hello`` on a new connection before anything else; raise its error.

        Raises:
            RelayError: the server refused it (``UNAUTHENTICATED``); the connection is closed.
            RelayConnectionError: the exchange failed.
        """
        reason = ""
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                writer.write(frame)
                await writer.drain()
                line = await reader.readuntil(b"\n")
            reply = codec.decode_response(line)
        except TimeoutError:
            reason = f"no hello reply within {self.connect_timeout_s:g} s"
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            reason = f"connection failed during hello: {exc!r}"
        except errors.BadFrame as exc:
            reason = f"malformed hello reply: {exc.message}"
        if reason:
            writer.close()
            raise RelayConnectionError(reason, address=self.address)
        if not reply["ok"]:
            writer.close()
            raise errors.error_from_body(reply["error"])

    async def call(self, op: str, args: dict[str, Any] | None = None, *, wait_ms: int = 0) -> Any:
        """Send one request and return its ``result``: ``RelayClient.call`` as a coroutine.

        Raises:
            as ``RelayClient.call``, and RelayUnreachable: no connection could be opened
            (nothing was sent).
        """
        self._next_id += 1
        req_id = self._next_id
        frame = request_frame(req_id, op, args, self.max_frame_bytes)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        failures = self._connect_failures  # calls waiting for a slot fail with a round too
        async with self._slots:
            conn = await self._connection(failures)
            future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            conn.pending[req_id] = future
            timeout_s = self.timeout_s + wait_ms / 1000
            try:
                async with asyncio.timeout(timeout_s):
                    await conn.send(frame)
                    reply = await future
            except TimeoutError as exc:
                # A reply this late means a hung server or a dead link: drop the connection.
                reason = f"no reply within {timeout_s:g} s"
                conn.fail(lambda: RelayConnectionError(reason, address=self.address))
                raise RelayConnectionError(reason, address=self.address) from exc
            finally:
                conn.pending.pop(req_id, None)
                if future.done() and not future.cancelled():
                    # Failed by conn.fail while this call raised its own error: retrieved
                    # here, or asyncio logs "Future exception was never retrieved" (82 lines
                    # in a 20 s chaos run: a review).
                    future.exception()
        if not reply["ok"]:
            raise errors.error_from_body(reply["error"])
        return reply["result"]

    async def send[T](self, call: ops.Call[T]) -> T:
        """Send one op's ``call`` (what an ``Ops`` method builds) and return its result.

        Raises:
            as ``call``; RelayConnectionError also when the result is not the op's object.
        """
        result = await self.call(call.op, call.args or None, wait_ms=call.wait_ms)
        return decode_result(call, result, self.address)
