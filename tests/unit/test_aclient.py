"""AsyncRelayClient against scripted asyncio servers on 127.0.0.1:0: pipelining, error codes,
connection reuse, reconnect with backoff, timeouts and frame limits.

Each test runs one event loop (``asyncio.run``) holding both the server and the client, and
synchronises on futures and events, never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from queue_core import errors
from queue_core.aclient import AsyncRelayClient, _Connection
from queue_core.client import RelayConnectionError, RelayUnreachable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def ok(request: dict[str, Any], result: Any) -> bytes:
    return orjson.dumps({"id": request.get("id"), "ok": True, "result": result}) + b"\n"


def error(request_id: Any, code: str, message: str = "no", **details: Any) -> bytes:
    body: dict[str, Any] = {"code": code, "message": message, "retryable": False}
    if details:
        body["details"] = details
    return orjson.dumps({"id": request_id, "ok": False, "error": body}) + b"\n"


async def read_request(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    line = await reader.readline()
    if not line:
        return None
    request: dict[str, Any] = orjson.loads(line)
    return request


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """Serve ``handler`` per connection; yield the address and a connection counter."""
    count = [0]

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        count[0] += 1
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}", count
    finally:
        server.close()
        await server.wait_closed()


async def echo_ops(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer every request with ``{"op": op, "args": args}``."""
    while (request := await read_request(reader)) is not None:
        writer.write(ok(request, {"op": request["op"], "args": request.get("args", {})}))
        await writer.drain()


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_methods_send_the_protocol_frames_and_reuse_one_connection() -> None:
    async def main() -> None:
        async with serving(echo_ops) as (address, connections):
            async with AsyncRelayClient(address) as client:
                pong: Any = await client.ping()
                assert pong == {"op": "ping", "args": {}}
                submitted: Any = await client.submit(
                    "emails", {"to": "a"}, priority="high", idempotency_key="k"
                )
                assert submitted["args"] == {
                    "queue": "emails",
                    "payload": {"to": "a"},
                    "priority": "high",
                    "idempotency_key": "k",
                }
                acked: Any = await client.ack("job_1", worker_id="w", lease_token="t")
                assert acked == {
                    "op": "ack",
                    "args": {"job_id": "job_1", "worker_id": "w", "lease_token": "t"},
                }
                failed: Any = await client.fail(
                    "job_1", worker_id="w", lease_token="t", error="x", retryable=False
                )
                assert failed["args"]["retryable"] is False
                stats: Any = await client.stats()
                assert stats["op"] == "stats"
                listed: Any = await client.dead_list(queue="q", limit=5)
                assert listed["args"] == {"queue": "q", "limit": 5}
            assert connections == [1]
            assert client.connects == 1

    asyncio.run(main())


def test_replies_are_matched_by_id_out_of_order() -> None:
    got_lease = asyncio.Event()

    async def out_of_order(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await read_request(reader)  # a long-poll lease
        got_lease.set()
        second = await read_request(reader)  # an ack sent while it waits
        assert first is not None
        assert second is not None
        writer.write(ok(second, {"job_id": "j", "state": "succeeded", "duplicate": False}))
        writer.write(ok(first, {"jobs": [{"job_id": "j2"}]}))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with serving(out_of_order) as (address, connections):
            client = AsyncRelayClient(address)
            lease = asyncio.create_task(client.lease(["q"], worker_id="w", wait_ms=5_000))
            await got_lease.wait()
            acked = await client.ack("j", worker_id="w", lease_token="t")
            assert acked["state"] == "succeeded"
            jobs = await lease
            assert [job["job_id"] for job in jobs] == ["j2"]
            assert connections == [1]
            await client.close()

    asyncio.run(main())


@pytest.mark.parametrize("cls", errors.all_error_classes(), ids=lambda cls: cls.code)
def test_error_replies_raise_the_class_of_their_code(cls: type[errors.RelayError]) -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            writer.write(error(request["id"], cls.code, "explained", job_id="j"))
            await writer.drain()

    async def main() -> None:
        async with serving(refuse) as (address, _), AsyncRelayClient(address) as client:
            with pytest.raises(cls) as caught:
                await client.inspect("j")
            assert caught.value.message == "explained"
            assert caught.value.details == {"job_id": "j"}
            # The connection stays usable after a domain error.
            with pytest.raises(cls):
                await client.inspect("j")
            assert client.connects == 1

    asyncio.run(main())


def test_a_connection_the_server_closed_is_replaced_before_sending() -> None:
    async def one_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        assert request is not None
        writer.write(ok(request, {"pong": True, "server_time_ms": 1}))
        await writer.drain()  # then close, as the idle timeout or a restart does

    async def main() -> None:
        async with serving(one_reply) as (address, connections):
            async with AsyncRelayClient(address) as client:
                await client.ping()
                conn = client._conn
                assert conn is not None
                await conn.reader_task  # the reader sees the EOF
                assert conn.closed
                await client.ping()
            assert connections == [2]

    asyncio.run(main())


def test_a_connection_lost_mid_request_fails_every_outstanding_call() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await read_request(reader)

    async def main() -> None:
        async with serving(hang_up) as (address, _), AsyncRelayClient(address) as client:
            outcomes = await asyncio.gather(
                client.submit("q", {"n": 1}),
                client.submit("q", {"n": 2}),
                return_exceptions=True,
            )
            for outcome in outcomes:
                assert isinstance(outcome, RelayConnectionError)
                assert not isinstance(outcome, RelayUnreachable)  # outcome unknown
                assert "closed by the server" in str(outcome)

    asyncio.run(main())


def test_unreachable_after_bounded_jittered_retries() -> None:
    pauses: list[float] = []

    async def record(seconds: float) -> None:
        pauses.append(seconds)

    async def main() -> None:
        client = AsyncRelayClient(
            f"127.0.0.1:{free_port()}",
            connect_retries=4,
            reconnect_base_ms=100,
            reconnect_cap_ms=300,
            rng=random.Random(7),
            sleep=record,
        )
        with pytest.raises(RelayUnreachable, match="cannot connect"):
            await client.ping()

    asyncio.run(main())
    bounds = [0.1, 0.2, 0.3, 0.3]  # doubling from 100 ms, capped at 300 ms
    assert len(pauses) == len(bounds)
    for pause, bound in zip(pauses, bounds, strict=True):
        assert bound / 2 <= pause <= bound


def test_reconnect_succeeds_once_the_server_is_back() -> None:
    port = free_port()
    servers: list[asyncio.Server] = []

    async def start_on_second_pause(seconds: float) -> None:
        if len(servers) == 0:
            servers.append(await asyncio.start_server(answer, "127.0.0.1", port))

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        assert request is not None
        writer.write(ok(request, {"pong": True, "server_time_ms": 1}))
        await writer.drain()
        await reader.read()
        writer.close()

    async def main() -> None:
        client = AsyncRelayClient(f"127.0.0.1:{port}", sleep=start_on_second_pause)
        assert (await client.ping())["pong"] is True
        await client.close()
        servers[0].close()
        await servers[0].wait_closed()

    asyncio.run(main())


def test_no_reply_in_time_drops_the_connection() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async def main() -> None:
        async with serving(silent) as (address, _):
            client = AsyncRelayClient(address, timeout_s=0.05)
            with pytest.raises(RelayConnectionError, match="no reply within"):
                await client.ping()
            assert client._conn is not None
            assert client._conn.closed
            await client.close()

    asyncio.run(main())


def test_oversize_request_is_refused_before_connecting() -> None:
    async def main() -> None:
        client = AsyncRelayClient(f"127.0.0.1:{free_port()}", max_frame_bytes=100)
        with pytest.raises(errors.FrameTooLarge):
            await client.submit("q", {"blob": "x" * 200})
        with pytest.raises(
            errors.InvalidArgument, match=r"payload\.bad: object is not a JSON type"
        ):
            await client.submit("q", {"bad": object()})
        assert client.connects == 0

    asyncio.run(main())


@pytest.mark.parametrize(("extra", "fits"), [(0, True), (1, False)])
def test_reply_size_limit_is_the_frame_limit(extra: int, fits: bool) -> None:
    limit = 200

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        assert request is not None
        reply = ok(request, {"pad": ""})
        pad = limit + extra - (len(reply) - 1)
        writer.write(ok(request, {"pad": "p" * pad}))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with (
            serving(big) as (address, _),
            AsyncRelayClient(address, max_frame_bytes=limit) as client,
        ):
            if fits:
                assert len((await client.call("ping"))["pad"]) > 0
            else:
                with pytest.raises(RelayConnectionError, match="frame limit"):
                    await client.call("ping")

    asyncio.run(main())


def test_connection_level_error_is_raised_for_waiting_calls() -> None:
    async def full(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(error(None, "TOO_MANY_CONNECTIONS", "full"))
        await writer.drain()

    async def main() -> None:
        async with serving(full) as (address, _), AsyncRelayClient(address) as client:
            with pytest.raises(errors.TooManyConnections, match="full"):
                await client.ping()

    asyncio.run(main())


def test_in_flight_requests_are_bounded() -> None:
    async def main() -> None:
        got_two = asyncio.Event()
        gate = asyncio.Event()

        async def batch_of_two(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            pending: list[dict[str, Any]] = []
            while (request := await read_request(reader)) is not None:
                pending.append(request)
                if len(pending) == 2:
                    got_two.set()
                    await gate.wait()
                    for item in pending:
                        writer.write(ok(item, {}))
                    pending.clear()
                    await writer.drain()

        async with (
            serving(batch_of_two) as (address, _),
            AsyncRelayClient(address, max_in_flight=2) as client,
        ):
            calls = [asyncio.create_task(client.call("ping")) for _ in range(4)]
            await got_two.wait()
            assert client._conn is not None
            assert len(client._conn.pending) == 2  # the other two wait for a slot
            gate.set()
            assert await asyncio.gather(*calls) == [{}, {}, {}, {}]

    asyncio.run(main())


@pytest.mark.parametrize("accepted", [True, False])
def test_api_key_is_sent_in_a_hello_on_each_new_connection(accepted: bool) -> None:
    hellos: list[dict[str, Any]] = []

    async def check_key(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await read_request(reader)
        assert hello is not None
        hellos.append(hello)
        if not accepted:
            writer.write(error(hello["id"], "UNAUTHENTICATED", "bad key"))
            await writer.drain()
            return
        writer.write(ok(hello, {"authenticated": True}))
        await writer.drain()
        await echo_ops(reader, writer)

    async def main() -> None:
        async with (
            serving(check_key) as (address, _),
            AsyncRelayClient(address, api_key="rk_test") as client,
        ):
            if accepted:
                reply: Any = await client.ping()
                assert reply["op"] == "ping"
            else:
                with pytest.raises(errors.Unauthenticated, match="bad key"):
                    await client.ping()

    asyncio.run(main())
    assert hellos == [{"id": "hello", "op": "hello", "args": {"api_key": "rk_test"}}]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        AsyncRelayClient("nowhere")
    with pytest.raises(ValueError, match="max_in_flight"):
        AsyncRelayClient(max_in_flight=0)


def test_calls_waiting_while_a_round_of_connects_fails_fail_with_it() -> None:
    # Each waiting call ran a whole round of its own after the one before: six calls to a
    # host that dropped connections ended 4.5 s, 9.2 s ... 27.5 s in (a review).
    rounds: list[float] = []

    async def record(seconds: float) -> None:
        rounds.append(seconds)

    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"
        client = AsyncRelayClient(address, connect_retries=2, rng=random.Random(7), sleep=record)
        outcomes = await asyncio.gather(*(client.ping() for _ in range(6)), return_exceptions=True)
        assert all(isinstance(o, RelayUnreachable) for o in outcomes), outcomes
        assert len(rounds) == 2  # one round's pauses, for all six calls
        rounds.clear()
        narrow = AsyncRelayClient(  # calls waiting for a request slot fail with the round too
            address, connect_retries=2, max_in_flight=2, rng=random.Random(7), sleep=record
        )
        outcomes = await asyncio.gather(*(narrow.ping() for _ in range(6)), return_exceptions=True)
        assert all(isinstance(o, RelayUnreachable) for o in outcomes), outcomes
        assert len(rounds) == 2
        assert len({str(o) for o in outcomes}) == 1
        rounds.clear()
        with pytest.raises(RelayUnreachable):  # a later call tries again, a round of its own
            await client.ping()
        assert len(rounds) == 2

    asyncio.run(main())


class _ResetWriter:
    """A stream writer whose peer has reset the connection: ``drain`` raises."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        raise ConnectionResetError("reset by peer")

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


def test_a_call_whose_write_fails_leaves_no_exception_unretrieved() -> None:
    # The failed write set an exception on the call's own future (``_Connection.fail``), and
    # the call raised another: asyncio logged "Future exception was never retrieved" (82
    # lines in a 20 s chaos run: a review).
    unretrieved: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, ctx: unretrieved.append(str(ctx["message"])))
        client = AsyncRelayClient("127.0.0.1:1")
        conn = _Connection(
            asyncio.StreamReader(),
            _ResetWriter(),  # type: ignore[arg-type]
            address="127.0.0.1:1",
            max_frame_bytes=1 << 20,
        )
        client._conn = conn
        with pytest.raises(RelayConnectionError, match="reset by peer"):
            await client.ping()
        await conn.aclose()
        gc.collect()  # a future's unretrieved exception is reported when it is collected

    asyncio.run(main())
    assert unretrieved == []


def test_a_reply_whose_id_is_true_answers_no_request() -> None:
    async def true_id(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        assert request is not None and request["id"] == 1
        writer.write(orjson.dumps({"id": True, "ok": True, "result": {"pong": True}}) + b"\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with (
            serving(true_id) as (address, _),
            AsyncRelayClient(address, timeout_s=0.3) as client,
        ):
            with pytest.raises(RelayConnectionError, match="no reply within"):
                await client.ping()

    asyncio.run(main())
