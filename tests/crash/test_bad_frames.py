"""Bad frames against a real ``relay_server`` process, while a sentinel client keeps working.

One server process serves the whole module (small limits: 64 KiB frames, 24 connections, a
1.5 s idle timeout). During every test a sentinel thread runs submit -> lease -> ack cycles on
its own connection; each test checks that it kept completing cycles, without an error and with
bounded latency, while the abuse went on, and that the server logged no internal error.

Each abuse gets its documented answer: ``BAD_FRAME`` (connection kept, up to
``RELAY_MAX_BAD_FRAMES`` of them; closed when it is the first line, or when the first byte
cannot begin a request: an HTTP request, a TLS hello) for lines that are not UTF-8, not JSON,
nested too deeply, of the wrong shape or types; ``INVALID_ARGUMENT`` for bad
argument types; ``UNKNOWN_OP``; ``FRAME_TOO_LARGE`` and a close for oversize frames;
``TIMEOUT`` and a close for a frame that never completes (however slowly it trickles in);
``TOO_MANY_CONNECTIONS`` and a close past the limit. A frame cut off by the client hanging up
harms nobody, and a slow but complete frame is served. (The in-process versions, with exact
limits, are in tests/integration/test_tcp_server.py.)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from queue_core.client import RelayClient
from tests.hostile.support import Raw, Sentinel
from tests.procs import Proc, spawner

pytestmark = [pytest.mark.slow]

FRAME_LIMIT = 65_536
MAX_CONNECTIONS = 24
IDLE_MS = 1_500
MAX_BAD_FRAMES = 16  # the default
ENV = {
    "RELAY_MAX_FRAME_BYTES": str(FRAME_LIMIT),
    "RELAY_MAX_PAYLOAD_BYTES": "16384",
    "RELAY_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    "RELAY_IDLE_TIMEOUT_MS": str(IDLE_MS),
}


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, int]]:
    db = Path(tmp_path_factory.mktemp("bad-frames")) / "relay.db"
    with spawner(str(db)) as spawn:
        proc, port = spawn.server(**ENV)
        yield proc, port


@pytest.fixture
def port(relay: tuple[Proc, int]) -> Iterator[int]:
    """The server's port, with a sentinel working throughout the test and checked after it."""
    proc, port = relay
    sentinel = Sentinel(port)
    sentinel.wait_cycles(3)
    yield port
    try:
        sentinel.wait_cycles(3)  # still served after the abuse
    finally:
        sentinel.stop()
    assert not sentinel.errors, sentinel.errors
    assert sentinel.worst_s < 5, f"a sentinel cycle took {sentinel.worst_s:.1f}s"
    assert proc.popen.poll() is None, "the server died"
    log = proc.stderr_text()
    assert "internal_error" not in log and "Traceback" not in log, log[-3000:]


@contextlib.contextmanager
def raw(port: int) -> Iterator[Raw]:
    conn = Raw(port)
    try:
        yield conn
    finally:
        conn.close()


NESTED = 5_000  # far deeper than the decoder's 1,024 levels

BAD_FRAMES = {
    "not json": b"{nope\n",
    "truncated json": b'{"op":"submit","args":{"queue":"q","payl\n',
    "empty line": b"\n",
    "not utf-8": b'{"op":"ping","id":"\xff\xfe"}\n',
    "lone surrogate": b'{"op":"ping","id":"\xed\xa0\x80"}\n',
    "nul bytes": b'{"op":"ping"\x00}\n',
    "nan": b'{"op":"ping","args":{"x":NaN}}\n',
    "top-level array": b'[{"op":"ping"}]\n',
    "top-level string": b'"ping"\n',
    "top-level null": b"null\n",
    "op is a number": b'{"op":5}\n',
    "op is missing": b'{"args":{}}\n',
    "op is empty": b'{"op":""}\n',
    "args is a list": b'{"op":"ping","args":[1]}\n',
    "id is an object": b'{"op":"ping","id":{"a":1}}\n',
    "id is a boolean": b'{"op":"ping","id":true}\n',
    "unknown envelope key": b'{"op":"ping","arg":{}}\n',
    "deeply nested args": b'{"op":"ping","args":{"x":' + b"[" * NESTED + b"]" * NESTED + b"}}\n",
    "deeply nested payload": b'{"op":"submit","args":{"queue":"q","payload":'
    + b'{"a":' * NESTED
    + b"1"
    + b"}" * NESTED
    + b"}}\n",
}


@pytest.mark.parametrize("frame", list(BAD_FRAMES.values()), ids=list(BAD_FRAMES))
def test_malformed_frame_gets_bad_frame_and_the_connection_stays(port: int, frame: bytes) -> None:
    with raw(port) as conn:
        assert conn.ping()
        assert conn.code(frame) == "BAD_FRAME"
        assert conn.ping()


@pytest.mark.parametrize("frame", list(BAD_FRAMES.values()), ids=list(BAD_FRAMES))
def test_a_malformed_first_line_closes_the_connection(port: int, frame: bytes) -> None:
    with raw(port) as conn:
        conn.send(frame + b'{"id":"after","op":"submit","args":{"queue":"never","payload":1}}\n')
        assert conn.recv()["error"]["code"] == "BAD_FRAME"
        assert conn.at_eof()


NOT_NDJSON = {
    # A browser's cross-origin form POST: nothing after the request line may run.
    "http post": b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 66\r\n\r\n"
    b'{"id":"after","op":"submit","args":{"queue":"never","payload":1}}\n',
    "tls client hello": bytes.fromhex("160301020001") + b"\x00" * 40,  # no newline at all
    "garbage": b"\x00\x01\x02 hello\n",
}


@pytest.mark.parametrize("data", list(NOT_NDJSON.values()), ids=list(NOT_NDJSON))
def test_a_connection_that_does_not_speak_ndjson_is_closed_at_once(port: int, data: bytes) -> None:
    with raw(port) as conn:
        conn.send(data)
        assert conn.recv()["error"]["code"] == "BAD_FRAME"
        assert conn.at_eof()
    client = RelayClient(f"127.0.0.1:{port}", timeout_s=10)
    try:  # the body after the request line never ran
        assert client.stats()["queues"].get("never") is None
    finally:
        client.close()


def test_too_many_malformed_lines_close_the_connection(port: int) -> None:
    small = [frame for name, frame in BAD_FRAMES.items() if not name.startswith("deeply")]
    with raw(port) as conn:
        assert conn.ping()
        for n in range(MAX_BAD_FRAMES - 1):  # each one answered, the connection kept
            assert conn.code(small[n % len(small)]) == "BAD_FRAME"
        assert conn.ping()  # a valid request does not reset the count
        reply = conn.code(small[0])
        assert reply == "BAD_FRAME"
        assert conn.at_eof()


WRONG_ARGS = {
    "queue is a number": {"op": "submit", "args": {"queue": 5, "payload": 1}},
    "queues is a string": {"op": "lease", "args": {"queues": "q"}},
    "max_jobs is a boolean": {"op": "lease", "args": {"queues": ["q"], "max_jobs": True}},
    "lease_ms is a float": {
        "op": "renew",
        "args": {"job_id": "j", "worker_id": "w", "lease_token": "t", "lease_ms": 1.5},
    },
    "error is a number": {
        "op": "fail",
        "args": {"job_id": "j", "worker_id": "w", "lease_token": "t", "error": 1},
    },
    "nested but valid depth": {
        "op": "submit",
        "args": {"queue": "q", "payload": 1, "delay_ms": [[[[[[1]]]]]]},
    },
    "unknown argument": {"op": "ping", "args": {"x": 1}},
}


@pytest.mark.parametrize("frame", list(WRONG_ARGS.values()), ids=list(WRONG_ARGS))
def test_wrong_argument_types_are_invalid_argument(port: int, frame: dict[str, Any]) -> None:
    with raw(port) as conn:
        assert conn.code(orjson.dumps(frame) + b"\n") == "INVALID_ARGUMENT"
        assert conn.ping()


@pytest.mark.parametrize("op", ["frobnicate", "PING", "__class__", "submit ", "x" * 100])
def test_unknown_op(port: int, op: str) -> None:
    with raw(port) as conn:
        assert conn.code(orjson.dumps({"op": op}) + b"\n") == "UNKNOWN_OP"
        assert conn.ping()


def test_oversize_frames_are_refused_and_closed(port: int) -> None:
    with raw(port) as big:
        big.send(b'{"op":"ping","args":{"pad":"' + b"x" * (4 * FRAME_LIMIT) + b'"}}\n')
        assert big.recv()["error"]["code"] == "FRAME_TOO_LARGE"
        assert big.at_eof()
    with raw(port) as endless:  # no newline ever: refused once the limit is crossed
        endless.send(b"{" + b"x" * (FRAME_LIMIT + 10))
        assert endless.recv()["error"]["code"] == "FRAME_TOO_LARGE"
        assert endless.at_eof()
    with raw(port) as fine:  # a large frame under the limit is served
        payload = "y" * 10_000
        fine.send(orjson.dumps({"op": "submit", "args": {"queue": "big", "payload": payload}}))
        fine.send(b"\n")
        assert fine.recv()["ok"] is True


def test_frames_cut_off_by_the_client_hanging_up_harm_nobody(port: int) -> None:
    frame = orjson.dumps({"op": "submit", "args": {"queue": "cut", "payload": {"n": 1}}})
    for cut in (1, len(frame) // 2, len(frame)):  # part of a frame, or all but its newline
        with raw(port) as conn:
            conn.send(frame[:cut])
        # and with a reset instead of a clean close
        conn = Raw(port)
        conn.send(frame[:cut])
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    with RelayClient(f"127.0.0.1:{port}") as client:
        assert client.stats("cut")["totals"]["ready"] == 0  # no half frame was acted on


def test_slow_frames_are_served_when_complete_and_cut_when_not(port: int) -> None:
    frame = b'{"id":"slow","op":"ping"}\n'
    with raw(port) as slow:
        for i in range(0, len(frame), 4):  # trickles in, but completes within the timeout
            slow.send(frame[i : i + 4])
            time.sleep(0.02)
        assert slow.recv()["id"] == "slow"
    began = time.monotonic()  # the idle clock starts at the connect
    with raw(port) as stuck:
        for byte in b'{"op":"pi':  # never completes, however steadily it trickles
            stuck.send(bytes([byte]))
            time.sleep(0.05)
        reply = stuck.recv()
        assert reply["error"]["code"] == "TIMEOUT" and reply["id"] is None
        assert time.monotonic() - began >= IDLE_MS / 1000 * 0.9
        assert stuck.at_eof()


def test_many_slow_clients_at_once_do_not_hold_up_others(port: int) -> None:
    stalled = [Raw(port) for _ in range(MAX_CONNECTIONS // 2)]
    try:
        for conn in stalled:
            conn.send(b'{"op":"sub')
        with raw(port) as other:
            assert other.ping()
        for conn in stalled:  # each is cut at its idle timeout
            assert conn.recv()["error"]["code"] == "TIMEOUT"
    finally:
        for conn in stalled:
            conn.close()


def test_connections_past_the_limit_are_refused_and_closed(port: int) -> None:
    held: list[Raw] = []
    try:
        refused = None
        for _ in range(MAX_CONNECTIONS + 2):  # the sentinel holds one, maybe two
            conn = Raw(port)
            held.append(conn)
            conn.send(b'{"id":"c","op":"ping"}\n')
            reply = conn.recv()
            if not reply["ok"]:
                refused = conn
                break
        assert refused is not None, "no connection was refused"
        assert reply["error"]["code"] == "TOO_MANY_CONNECTIONS" and reply["error"]["retryable"]
        assert refused.at_eof()
        assert all(c.ping() for c in held if c is not refused)  # the others still work
    finally:
        for conn in held:
            conn.close()
    deadline = time.monotonic() + 10  # once the server has seen them go, new ones are served
    while True:
        with raw(port) as conn:
            conn.send(b'{"id":"c","op":"ping"}\n')
            if conn.recv()["ok"]:
                break
        assert time.monotonic() < deadline


def test_a_flood_of_bad_frames_from_many_clients(port: int) -> None:
    small = [frame for name, frame in BAD_FRAMES.items() if not name.startswith("deeply")]
    junk = b'{"op":"ping"}\n' + b"".join(small[: MAX_BAD_FRAMES - 1])  # pipelined, in one write

    def flood() -> set[str]:
        codes: set[str] = set()
        for _ in range(5):
            with raw(port) as conn:
                conn.send(junk)
                replies = [conn.recv() for _ in range(MAX_BAD_FRAMES)]  # in any order
                assert sum(reply["ok"] for reply in replies) == 1
                codes |= {r["error"]["code"] for r in replies if not r["ok"]}
                assert conn.ping()
        return codes

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = [pool.submit(flood) for _ in range(8)]
        assert all(f.result(timeout=60) == {"BAD_FRAME"} for f in results)
