"""RelayClient against a tiny in-test socket server on 127.0.0.1 that sends canned replies.

No Relay server and no database: each test scripts what the server does with each request
(answer, answer with an error, close, send junk), then checks what the client raises.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

from queue_core import errors
from queue_core.aclient import AsyncRelayClient
from queue_core.client import (
    MIN_REPLY_S,
    RelayClient,
    RelayConnectionError,
    RelayUnreachable,
    format_address,
    parse_address,
)
from tests.unit.canned_server import CannedServer, Script, error, ok


@pytest.fixture
def serve() -> Iterator[Callable[..., CannedServer]]:
    servers: list[CannedServer] = []

    def start(script: Script, **kwargs: Any) -> CannedServer:
        server = CannedServer(script, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def pong(request: dict[str, Any], conn: int) -> bytes:
    return ok(request, {"pong": True, "server_time_ms": 1, "conn": conn})


def test_sends_one_ndjson_line_per_request_and_returns_the_result(serve: Any) -> None:
    server = serve(pong)
    with RelayClient(server.address) as client:
        assert client.ping() == {"pong": True, "server_time_ms": 1, "conn": 0}
        client.submit("email", {"user_id": 42}, priority="high", max_retries=5)
    first, second = server.raw
    assert first.endswith(b"\n") and first.count(b"\n") == 1
    assert orjson.loads(first) == {"id": 1, "op": "ping"}
    assert orjson.loads(second) == {
        "id": 2,
        "op": "submit",
        "args": {
            "queue": "email",
            "payload": {"user_id": 42},
            "priority": "high",
            "max_retries": 5,
        },
    }


def test_a_null_payload_is_sent_but_unset_options_are_not(serve: Any) -> None:
    server = serve(lambda req, conn: ok(req, {"job": {"id": "job_1"}, "deduplicated": False}))
    with RelayClient(server.address) as client:
        client.submit("q", None)
    assert server.requests[0]["args"] == {"queue": "q", "payload": None}


def test_lease_returns_the_jobs_list(serve: Any) -> None:
    server = serve(lambda req, conn: ok(req, {"jobs": [{"job_id": "job_1"}]}))
    with RelayClient(server.address) as client:
        jobs = client.lease(["a", "b"], worker_id="w:1", max_jobs=4, lease_ms=5000, wait_ms=10)
    assert jobs == [{"job_id": "job_1"}]
    assert server.requests[0]["args"] == {
        "queues": ["a", "b"],
        "worker_id": "w:1",
        "max_jobs": 4,
        "lease_ms": 5000,
        "wait_ms": 10,
    }


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("NOT_FOUND", errors.JobNotFound),
        ("STALE_TOKEN", errors.StaleToken),
        ("LEASE_EXPIRED", errors.LeaseExpired),
        ("INVALID_ARGUMENT", errors.InvalidArgument),
        ("BUSY", errors.StoreBusy),
        ("UNAVAILABLE", errors.Unavailable),
    ],
)
def test_error_replies_raise_the_matching_error(
    serve: Any, code: str, cls: type[errors.RelayError]
) -> None:
    server = serve(lambda req, conn: error(req, code, "it went wrong", job_id="job_1"))
    with RelayClient(server.address) as client, pytest.raises(cls) as caught:
        client.ack("job_1", worker_id="w", lease_token="t")
    assert caught.value.message == "it went wrong"
    assert caught.value.details == {"job_id": "job_1"}
    assert type(caught.value).code == code


def test_an_unknown_error_code_raises_the_base_error(serve: Any) -> None:
    server = serve(lambda req, conn: error(req, "SOMETHING_NEW", "future"))
    with RelayClient(server.address) as client, pytest.raises(errors.RelayError) as caught:
        client.ping()
    assert type(caught.value) is errors.RelayError
    assert caught.value.message == "future"


def test_an_error_reply_keeps_the_connection(serve: Any) -> None:
    def script(req: dict[str, Any], conn: int) -> bytes:
        return error(req, "NOT_FOUND") if req["op"] == "inspect" else pong(req, conn)

    server = serve(script)
    with RelayClient(server.address) as client:
        with pytest.raises(errors.JobNotFound):
            client.inspect("job_x")
        assert client.ping()["conn"] == 0
    assert server.connections == 1


@pytest.mark.parametrize("reply_id", [1001, True, "1"], ids=["another", "true", "string"])
def test_an_error_for_another_request_is_not_this_calls_own(serve: Any, reply_id: Any) -> None:
    # A faulty server's error with another id was raised as the call's own (INVALID_ARGUMENT
    # "answer to request 1001" for request 1), and stopped a worker (a review); true is 1.
    def script(req: dict[str, Any], conn: int) -> bytes:
        return error({"id": reply_id}, "INVALID_ARGUMENT", f"answer to request {reply_id}")

    server = serve(script)
    with (
        RelayClient(server.address) as client,
        pytest.raises(RelayConnectionError, match="does not match request id 1"),
    ):
        client.ping()


def test_an_error_without_an_id_is_the_connections(serve: Any) -> None:
    # TOO_MANY_CONNECTIONS, TIMEOUT, FRAME_TOO_LARGE: raised as their own codes.
    server = serve(lambda req, conn: error({}, "TOO_MANY_CONNECTIONS"))
    with RelayClient(server.address) as client, pytest.raises(errors.TooManyConnections):
        client.ping()


def test_reconnects_after_the_server_closes_an_idle_connection(serve: Any) -> None:
    server = serve(pong)
    with RelayClient(server.address) as client:
        assert client.ping()["conn"] == 0
        server.drop_connections()  # as after an idle timeout or a server restart
        _wait_readable(client)
        # The dead connection is noticed before sending: no error, a new connection.
        assert client.ping()["conn"] == 1
    assert server.connections == 2


def test_reconnects_after_an_unsolicited_timeout_frame(serve: Any) -> None:
    timeout_frame = (
        b'{"id":null,"ok":false,"error":{"code":"TIMEOUT","message":"idle","retryable":true}}\n'
    )

    def script(req: dict[str, Any], conn: int) -> bytes:
        # After its reply the first connection also sends the idle TIMEOUT the server sends
        # before closing; the client must not mistake it for the next reply.
        return pong(req, conn) + (timeout_frame if conn == 0 else b"")

    server = serve(script)
    with RelayClient(server.address) as client:
        assert client.ping()["conn"] == 0
        _wait_readable(client)
        assert client.ping()["conn"] == 1


def test_a_dropped_request_raises_connection_error_then_the_next_call_reconnects(
    serve: Any,
) -> None:
    server = serve(lambda req, conn: None if conn == 0 else pong(req, conn))
    with RelayClient(server.address) as client:
        with pytest.raises(RelayConnectionError) as caught:
            client.ack("job_1", worker_id="w", lease_token="t")
        assert not isinstance(caught.value, RelayUnreachable)  # it was sent: outcome unknown
        assert "closed by the server" in str(caught.value)
        assert caught.value.address == server.address
        assert client.ping()["conn"] == 1


def test_connection_level_error_without_our_id_is_raised_and_drops_the_connection(
    serve: Any,
) -> None:
    busy = (
        b'{"id":null,"ok":false,"error":{"code":"TOO_MANY_CONNECTIONS",'
        b'"message":"full","retryable":true}}\n'
    )
    server = serve(pong, greeting=busy)
    with RelayClient(server.address) as client, pytest.raises(errors.TooManyConnections):
        client.ping()


def test_a_reply_over_the_frame_limit_drops_the_connection(serve: Any) -> None:
    big = {"pong": True, "blob": "x" * 5000}
    server = serve(lambda req, conn: ok(req, big) if conn == 0 else pong(req, conn))
    with RelayClient(server.address, max_frame_bytes=1000) as client:
        with pytest.raises(RelayConnectionError, match="over the 1000-byte frame limit"):
            client.ping()
        assert len(client._transport._buf) <= 1001  # type: ignore[attr-defined]
        assert client.ping()["conn"] == 1


def test_a_reply_of_exactly_the_frame_limit_is_accepted(serve: Any) -> None:
    def script(req: dict[str, Any], conn: int) -> bytes:
        frame = ok(req, {"pad": ""})
        pad = 1000 - (len(frame) - 1)
        return ok(req, {"pad": "x" * pad})

    server = serve(script)
    with RelayClient(server.address, max_frame_bytes=1000) as client:
        assert len(client.ping()["pad"]) > 900


def test_a_request_over_the_frame_limit_is_not_sent(serve: Any) -> None:
    server = serve(pong)
    with RelayClient(server.address, max_frame_bytes=100) as client:
        with pytest.raises(errors.FrameTooLarge):
            client.submit("q", {"blob": "x" * 200})
        client.ping()
    assert [r["op"] for r in server.requests] == ["ping"]


def test_a_payload_json_cannot_hold_is_invalid(serve: Any) -> None:
    server = serve(pong)
    with RelayClient(server.address) as client, pytest.raises(errors.InvalidArgument):
        client.submit("q", {"when": object()})
    assert server.requests == []


def test_a_malformed_reply_is_a_connection_error(serve: Any) -> None:
    server = serve(lambda req, conn: b"not json\n" if conn == 0 else pong(req, conn))
    with RelayClient(server.address) as client:
        with pytest.raises(RelayConnectionError, match="malformed reply"):
            client.ping()
        assert client.ping()["conn"] == 1


def test_a_reply_with_another_id_is_a_connection_error(serve: Any) -> None:
    server = serve(lambda req, conn: ok({"id": 999}, {}) if conn == 0 else pong(req, conn))
    with RelayClient(server.address) as client:
        with pytest.raises(RelayConnectionError, match="does not match"):
            client.ping()
        assert client.ping()["conn"] == 1


def test_no_reply_in_time_is_a_connection_error(serve: Any) -> None:
    silent = threading.Event()
    server = serve(lambda req, conn: b"" if silent.wait(5) else None)
    try:
        with (
            RelayClient(server.address, timeout_s=0.05) as client,
            pytest.raises(RelayConnectionError, match="no reply within"),
        ):
            client.ping()
    finally:
        silent.set()


def test_a_deadline_bounds_the_hello_and_the_reply_together(serve: Any) -> None:
    # The django.tasks backend's repeats end by one deadline; before it, a hello took up to
    # connect_timeout_s and then the reply its whole timeout_s.
    silent = threading.Event()
    server = serve(lambda req, conn: b"" if silent.wait(5) else None)
    try:
        with RelayClient(
            server.address, timeout_s=5, connect_timeout_s=5, api_key="rk_x"
        ) as client:
            began = time.monotonic()
            with pytest.raises(RelayConnectionError, match="no hello reply"):
                client.send(RelayClient.ping(), deadline=began + 0.2)
            took = time.monotonic() - began
            with pytest.raises(RelayConnectionError, match="deadline passed"):
                client.send(RelayClient.ping(), deadline=time.monotonic() - 1)
    finally:
        silent.set()
    assert 0.15 <= took < 1.0, took


def test_a_deadline_bounds_the_wait_for_another_threads_call(serve: Any) -> None:
    # One client shared by threads: a call waits for the one before it, and with a deadline
    # no longer than that (a review: a thread with a 1 s deadline waited on the lock first).
    arrived, release = threading.Event(), threading.Event()

    def answer_when_released(req: dict[str, Any], conn: Any) -> Any:
        arrived.set()
        return ok(req, {"pong": True}) if release.wait(5) else None

    server = serve(answer_when_released)
    try:
        with RelayClient(server.address, timeout_s=5) as client:
            first = threading.Thread(target=client.ping)
            first.start()
            assert arrived.wait(5), "the first call never arrived"  # it holds the connection
            began = time.monotonic()
            with pytest.raises(RelayUnreachable, match="while other calls held"):
                client.send(RelayClient.ping(), deadline=began + 0.2)
            took = time.monotonic() - began
            release.set()
            first.join(5)
            assert client.ping()["pong"] is True  # the connection is still good
    finally:
        release.set()
    assert 0.15 <= took < 1.0, took


def test_a_deadline_already_past_sends_nothing_and_keeps_the_connection(serve: Any) -> None:
    # A second review: it sent nothing, yet said "no reply within 0 s" (outcome unknown) and
    # closed a healthy connection.
    connections: list[int] = []

    def script(request: dict[str, Any], conn: int) -> bytes:
        connections.append(conn)
        return ok(request, {"pong": True})

    server = serve(script)
    with RelayClient(server.address) as client:
        client.ping()
        with pytest.raises(RelayUnreachable, match="passed before it was sent"):  # nothing sent
            client.send(RelayClient.ping(), deadline=time.monotonic() - 0.001)
        client.ping()
    assert len(connections) == 2 and len(set(connections)) == 1


def test_a_refused_connection_is_unreachable() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        address = format_address("127.0.0.1", probe.getsockname()[1])
    with RelayClient(address) as client, pytest.raises(RelayUnreachable) as caught:
        client.ping()
    assert isinstance(caught.value, ConnectionError)
    assert caught.value.address == address
    assert "cannot connect" in caught.value.reason


def test_the_lease_timeout_covers_its_wait() -> None:
    seen: list[float] = []

    class Recording:
        def roundtrip(
            self, frame: bytes, *, timeout_s: float, deadline: float | None = None
        ) -> bytes:
            seen.append(timeout_s)
            request = orjson.loads(frame)
            return ok(request, {"jobs": []})[:-1]

        def close(self) -> None:
            pass

    client = RelayClient(timeout_s=2.0, transport=Recording())
    client.lease(["q"], worker_id="w", wait_ms=20_000)
    client.ping()
    assert seen == [22.0, 2.0]


def test_one_client_is_safe_to_share_between_threads(serve: Any) -> None:
    server = serve(pong)
    client = RelayClient(server.address)
    failures: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(50):
                assert client.ping()["pong"] is True
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    client.close()
    assert failures == []
    assert len(server.requests) == 400
    assert len({r["id"] for r in server.requests}) == 400
    assert server.connections == 1


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:7400", ("127.0.0.1", 7400)),
        ("relay.internal:80", ("relay.internal", 80)),
        ("[::1]:7400", ("::1", 7400)),
        (" localhost:1 ", ("localhost", 1)),
    ],
)
def test_parse_address(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected
    assert parse_address(format_address(*expected)) == expected


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1", "expected HOST:PORT"),
        ("127.0.0.1:", "port must be a number"),
        ("127.0.0.1:http", "port must be a number"),
        ("127.0.0.1:0", r"port must be in 1\.\.65535"),
        ("127.0.0.1:65536", r"port must be in 1\.\.65535"),
        (":7400", "missing host"),
        ("::1:7400", "IPv6 host in brackets"),
        ("[::1]7400", "expected ':PORT'"),
        ("[::1:7400", "missing ']'"),
        ("127.0.0.1:-1", "port must be a number"),
    ],
)
def test_parse_address_rejects(address: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_address(address)


def test_parse_address_may_allow_port_zero() -> None:
    assert parse_address("127.0.0.1:0", allow_port_zero=True) == ("127.0.0.1", 0)


def test_a_bad_address_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        RelayClient("nohost")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"timeout_s": -1}, "timeout_s must be above 0"),
        ({"timeout_s": 0}, "timeout_s must be above 0"),
        ({"connect_timeout_s": 0.0}, "connect_timeout_s must be above 0"),
        ({"max_frame_bytes": 0}, "max_frame_bytes must be >= 1"),
        ({"connect_retries": -1}, "connect_retries must be >= 0"),
    ],
)
def test_an_option_out_of_range_fails_at_construction(
    options: dict[str, Any], message: str
) -> None:
    # A structural audit: timeout_s=-1 was taken, though its docstring promised ValueError.
    with pytest.raises(ValueError, match=message):
        RelayClient("127.0.0.1:7400", **options)
    with pytest.raises(ValueError, match=message):
        AsyncRelayClient("127.0.0.1:7400", **options)


def _wait_readable(client: RelayClient) -> None:
    """Block until the client's idle socket has unread bytes (the server's unsolicited frame)."""
    import select

    transport: Any = client._transport
    if transport._buf:  # already read along with the previous reply
        return
    sock = transport._sock
    assert sock is not None
    readable, _, _ = select.select([sock], [], [], 5)
    assert readable


def test_a_deadline_too_near_for_a_reply_sends_nothing(serve: Any) -> None:
    # Sent 0.5 ms before its deadline, a submit was kept and its call raised "no reply within
    # 0.0005 s": outcome unknown for nothing (a review).
    server = serve(pong)
    with RelayClient(server.address) as client:
        assert client.ping()["conn"] == 0
        with pytest.raises(RelayUnreachable, match="deadline passed before it was sent"):
            client.call("ping", deadline=time.monotonic() + MIN_REPLY_S / 2)
        assert client.ping()["conn"] == 0  # the connection stays good
    assert len(server.raw) == 2
