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
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self, cast

from queue_core import errors, types
from queue_core.client import (
    DEFAULT_ADDRESS,
    DEFAULT_MAX_FRAME_BYTES,
    RelayConnectionError,
    RelayUnreachable,
    _compact,
    format_address,
    format_addresses,
    parse_addresses,
)
from queue_core.protocol import codec
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
                future = self.pending.pop(req_id, None) if isinstance(req_id, int) else None
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


class AsyncRelayClient:
    """Asyncio client for one Relay server; many tasks may share it (requests are pipelined).

    Connects on the first call and again on the call after a broken connection. Every method
    returns the op's ``result`` object as ``docs/protocol.md`` describes it, typed with
    ``queue_core.types`` (``lease`` returns just its list of jobs).

    Args:
        address: ``HOST:PORT`` or ``[IPv6]:PORT`` (default ``127.0.0.1:7400``), or several
            separated by commas: the client connects to the first that answers and, after a
            broken connection, starts at the next (failover, as ``RelayClient``).
        timeout_s: how long to wait for a reply, in seconds; a ``lease`` waits this much longer
            than its ``wait_ms``.
        connect_timeout_s: how long to wait for each TCP connection attempt, in seconds.
        max_frame_bytes: the frame size limit in bytes, newline excluded (the server's
            ``RELAY_MAX_FRAME_BYTES``; 1 MiB); larger requests are refused before sending and
            a larger reply drops the connection.
        max_in_flight: most requests outstanding on the connection at once (>= 1); further
            calls wait for a free slot.
        connect_retries: how many more times to try every server when none can be reached
            (>= 0).
        reconnect_base_ms, reconnect_cap_ms: the pause before the first retry and the cap of
            the doubling pauses, in ms; each is jittered to 50-100%.
        api_key: an API key (``rk_...``) sent in a ``hello`` first on every new connection, as
            ``RelayClient`` does; an error reply to it (``UNAUTHENTICATED``) is raised and not
            retried. None sends no hello.
        rng: randomness for the jitter (default a fresh ``random.Random``).
        sleep: the coroutine that pauses between connection attempts (default
            ``asyncio.sleep``; tests record the pauses).
    Raises:
        ValueError: ``address`` is malformed or a number is out of range.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_in_flight: int = 64,
        connect_retries: int = 3,
        reconnect_base_ms: int = 100,
        reconnect_cap_ms: int = 2_000,
        api_key: str | None = None,
        rng: random.Random | None = None,
        sleep: Sleep | None = None,
    ) -> None:
        self.servers = parse_addresses(address)
        self.address = format_addresses(self.servers)
        self._index = 0  # the server in use, or tried next
        if max_in_flight < 1 or connect_retries < 0:
            raise ValueError("max_in_flight must be >= 1 and connect_retries >= 0")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.max_in_flight = max_in_flight
        self.connect_retries = connect_retries
        self._backoff = RetryPolicy(
            max_retries=0,
            base_ms=reconnect_base_ms,
            cap_ms=max(reconnect_cap_ms, reconnect_base_ms),
            jitter=True,
        )
        self._hello = (
            codec.encode_request("hello", "hello", {"api_key": api_key}) if api_key else None
        )
        self._rng = rng or random.Random()
        self._sleep: Sleep = sleep or asyncio.sleep
        self._conn: _Connection | None = None
        self._connect_lock: asyncio.Lock | None = None
        self._slots: asyncio.Semaphore | None = None
        self._next_id = 0
        self.connects = 0
        """How many connections this client has opened (a reconnect adds one)."""

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

    async def _connection(self) -> _Connection:
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            conn = self._conn
            if conn is not None and not conn.closed:
                return conn
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
                    await self._shake(reader, writer, self._hello)
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
        """Send one request and return its ``result``.

        Args:
            op: operation name (``"ping"``, ``"submit"``, ...).
            args: its arguments; ``None`` values must already be left out.
            wait_ms: how long the server may hold the request (long-poll) before replying, in
                ms; added to the reply timeout.
        Returns:
            The reply's ``result`` (a dict for every op in the protocol).
        Raises:
            RelayError: the server answered with an error (the subclass for its code); or,
                with nothing sent, the request is over ``max_frame_bytes`` (``FrameTooLarge``)
                or not JSON-serialisable (``InvalidArgument``: a float that is NaN or
                ±Infinity, a string with a lone surrogate, a type JSON does not have).
            RelayUnreachable: no connection could be opened (nothing was sent).
            RelayConnectionError: no complete reply (outcome unknown).
        """
        self._next_id += 1
        req_id = self._next_id
        # Refuses NaN/Infinity (orjson would send null) and lone surrogates: InvalidArgument.
        frame = codec.encode_request(req_id, op, args)
        if len(frame) - 1 > self.max_frame_bytes:
            raise errors.FrameTooLarge(
                f"request is {len(frame) - 1} bytes, over the {self.max_frame_bytes}-byte "
                "frame limit",
                limit_bytes=self.max_frame_bytes,
            )
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        async with self._slots:
            conn = await self._connection()
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
        if not reply["ok"]:
            raise errors.error_from_body(reply["error"])
        return reply["result"]

    async def _call_dict(
        self, op: str, args: dict[str, Any] | None = None, *, wait_ms: int = 0
    ) -> dict[str, Any]:
        result = await self.call(op, args or None, wait_ms=wait_ms)
        if not isinstance(result, dict):
            raise RelayConnectionError(f"{op} reply has no result object", address=self.address)
        return result

    async def ping(self) -> types.PingResult:
        """Check the server is up. See ``RelayClient.ping``."""
        return cast(types.PingResult, await self._call_dict("ping"))

    async def submit(
        self,
        queue: str,
        payload: Any,
        *,
        priority: str | int | None = None,
        max_retries: int | None = None,
        backoff: str | None = None,
        backoff_base_ms: int | None = None,
        backoff_cap_ms: int | None = None,
        jitter: bool | None = None,
        delay_ms: int | None = None,
        run_at_ms: int | None = None,
        idempotency_key: str | None = None,
    ) -> types.SubmitResult:
        """Enqueue one job (none -> ready, or -> pending when delayed).

        Arguments, result and errors as ``RelayClient.submit``.
        """
        args = {
            "queue": queue,
            "payload": payload,
            **_compact(
                {
                    "priority": priority,
                    "max_retries": max_retries,
                    "backoff": backoff,
                    "backoff_base_ms": backoff_base_ms,
                    "backoff_cap_ms": backoff_cap_ms,
                    "jitter": jitter,
                    "delay_ms": delay_ms,
                    "run_at_ms": run_at_ms,
                    "idempotency_key": idempotency_key,
                }
            ),
        }
        return cast(types.SubmitResult, await self._call_dict("submit", args))

    async def submit_batch(self, jobs: Sequence[dict[str, Any]]) -> types.SubmitBatchResult:
        """Enqueue several jobs in one transaction (all or none). See ``RelayClient``."""
        result = await self._call_dict("submit_batch", {"jobs": [dict(job) for job in jobs]})
        return cast(types.SubmitBatchResult, result)

    async def lease(
        self,
        queues: Sequence[str],
        *,
        worker_id: str,
        max_jobs: int = 1,
        lease_ms: int | None = None,
        wait_ms: int = 0,
    ) -> list[types.Lease]:
        """Lease up to ``max_jobs`` ready jobs (ready -> leased), waiting up to ``wait_ms``.

        Arguments and errors as ``RelayClient.lease``. Other calls on this client go on while
        a lease waits.
        """
        args = _compact(
            {
                "queues": list(queues),
                "worker_id": worker_id,
                "max_jobs": max_jobs,
                "lease_ms": lease_ms,
                "wait_ms": wait_ms,
            }
        )
        result = await self._call_dict("lease", args, wait_ms=wait_ms)
        jobs = result.get("jobs")
        if not isinstance(jobs, list):
            raise RelayConnectionError("lease reply has no jobs list", address=self.address)
        return cast(list[types.Lease], jobs)

    async def renew(
        self, job_id: str, *, worker_id: str, lease_token: str, lease_ms: int | None = None
    ) -> types.RenewResult:
        """Extend a live lease (leased -> leased). See ``RelayClient.renew``."""
        args = _compact(
            {
                "job_id": job_id,
                "worker_id": worker_id,
                "lease_token": lease_token,
                "lease_ms": lease_ms,
            }
        )
        return cast(types.RenewResult, await self._call_dict("renew", args))

    async def ack(self, job_id: str, *, worker_id: str, lease_token: str) -> types.AckResult:
        """Mark a leased job as done (leased -> succeeded). Safe to repeat."""
        args = {"job_id": job_id, "worker_id": worker_id, "lease_token": lease_token}
        return cast(types.AckResult, await self._call_dict("ack", args))

    async def fail(
        self,
        job_id: str,
        *,
        worker_id: str,
        lease_token: str,
        error: str,
        retryable: bool = True,
    ) -> types.FailResult:
        """Record a failed attempt (leased -> retrying, or -> dead). Safe to repeat."""
        args = {
            "job_id": job_id,
            "worker_id": worker_id,
            "lease_token": lease_token,
            "error": error,
            "retryable": retryable,
        }
        return cast(types.FailResult, await self._call_dict("fail", args))

    async def release(
        self, job_id: str, *, worker_id: str, lease_token: str
    ) -> types.ReleaseResult:
        """Give a leased job back without counting a failure (leased -> ready)."""
        args = {"job_id": job_id, "worker_id": worker_id, "lease_token": lease_token}
        return cast(types.ReleaseResult, await self._call_dict("release", args))

    async def inspect(self, job_id: str) -> types.JobResult:
        """Read one job with its attempt history and events."""
        return cast(types.JobResult, await self._call_dict("inspect", {"job_id": job_id}))

    async def stats(
        self, queue: str | None = None, *, limit: int | None = None, after: str | None = None
    ) -> types.StatsResult:
        """Count jobs by state, per queue, a page of queues at a time (as ``RelayClient``)."""
        args = _compact({"queue": queue, "limit": limit, "after": after})
        return cast(types.StatsResult, await self._call_dict("stats", args))

    async def dead_list(
        self, queue: str | None = None, limit: int = 100, after: str | None = None
    ) -> types.DeadListResult:
        """List dead-lettered jobs, oldest id first, a page at a time."""
        args = _compact({"queue": queue, "limit": limit, "after": after})
        return cast(types.DeadListResult, await self._call_dict("dead_list", args))

    async def dead_retry(self, job_id: str) -> types.JobResult:
        """Replay a dead job (dead -> ready); its history is kept."""
        return cast(types.JobResult, await self._call_dict("dead_retry", {"job_id": job_id}))

    async def dead_purge(self, job_id: str) -> types.DeadPurgeResult:
        """Delete a dead job for good."""
        result = await self._call_dict("dead_purge", {"job_id": job_id})
        return cast(types.DeadPurgeResult, result)
