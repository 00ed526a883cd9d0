"""The HTTP side stays up behind many slow or long-polling clients (hardening item 5).

A real gunicorn with gunicorn.conf.py on a loopback port; 64 clients that send part of a
request and stall, 64 lease long-polls that wait, then /health and a submit must be answered
within a few seconds. Everything is bounded: 128 sockets, one probe each, deadlines throughout.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import time

import orjson
import pytest

from tests.http.conftest import Gunicorn, start_gunicorn
from tests.procs import Spawner

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SLOW = 64  # clients that send part of a request and stall
POLLS = 64  # lease long-polls that wait for a job
PROBE_S = 5.0  # how long /health and a submit may take behind them
POLL_WAIT_MS = 15_000  # longer than the probes take, so every long-poll is still waiting


def read_response(sock: socket.socket, deadline: float) -> tuple[int, bytes]:
    """Read one HTTP/1.1 response with a Content-Length from ``sock`` before ``deadline``."""
    data = b""
    while b"\r\n\r\n" not in data:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        part = sock.recv(65536)
        if not part:
            raise ConnectionError(f"closed after {data[:200]!r}")
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(body) < length:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        part = sock.recv(65536)
        if not part:
            raise ConnectionError("closed mid-body")
        body += part
    return status, body


def timed(server: Gunicorn, method: str, path: str, body: object = None) -> tuple[int, float]:
    """Send one request with a ``PROBE_S`` timeout; return its status (0: none) and seconds."""
    started = time.monotonic()
    try:
        status, _, _ = server.request(method, path, body, timeout=PROBE_S)
    except (OSError, http.client.HTTPException):
        status = 0
    return status, time.monotonic() - started


def test_health_and_submit_answer_behind_64_slow_and_64_long_polling_clients(
    spawn: Spawner,
) -> None:
    server = start_gunicorn(spawn)
    port = server.port
    sockets: list[socket.socket] = []
    polls: list[socket.socket] = []
    try:
        # Slow clients: half stop inside the request line, half inside the headers.
        for i in range(SLOW):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            partial = (
                b"GET /api/v1/hea"
                if i % 2
                else b"POST /api/v1/leases HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            )
            sock.sendall(partial)
            sockets.append(sock)
        # Long-polls on a queue with no job: each waits up to POLL_WAIT_MS.
        body = orjson.dumps({"queues": ["capacity"], "wait_ms": POLL_WAIT_MS})
        head = (
            "POST /api/v1/leases HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        for _ in range(POLLS):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(head + body)
            polls.append(sock)

        health = [timed(server, "GET", "/api/v1/health") for _ in range(3)]
        submit = timed(server, "POST", "/api/v1/queues/other/jobs", {"payload": {"n": 1}})
        print(
            f"\nbehind {SLOW} slow + {POLLS} long-polling clients: health "
            + ", ".join(f"{status} in {s * 1000:.0f} ms" for status, s in health)
            + f"; submit {submit[0]} in {submit[1] * 1000:.0f} ms"
        )
        assert [status for status, _ in health] == [200, 200, 200], health
        assert submit[0] == 201, submit

        # The long-polls were really waiting: one job each wakes every one of them.
        jobs = [{"queue": "capacity", "payload": {"n": i}} for i in range(POLLS)]
        status, _, _ = server.request("POST", "/api/v1/jobs/batch", {"jobs": jobs}, timeout=10)
        assert status == 201
        deadline = time.monotonic() + 10
        leased = []
        for sock in polls:
            status, raw = read_response(sock, deadline)
            assert status == 200, raw
            leased += [job["job_id"] for job in orjson.loads(raw)["jobs"]]
        assert len(leased) == len(set(leased)) == POLLS
    finally:
        for sock in sockets + polls:
            with contextlib.suppress(OSError):
                sock.close()


LIMIT = 8  # RELAY_HTTP_CONNECTIONS in the next test
ARRIVALS = 40
HEALTH = b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
KEEPALIVE = "60"  # RELAY_HTTP_KEEPALIVE_S: served connections stay open through a test


def _problem(answer: tuple[int, bytes]) -> tuple[int, str, bool]:
    status, body = answer
    problem = orjson.loads(body)
    return status, problem["code"], problem["retryable"]


def _served(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that each had one request answered 200 and stay open (kept alive)."""
    served = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        served.append(sock)
        try:
            sock.sendall(HEALTH)
            assert read_response(sock, time.monotonic() + 10)[0] == 200
        except BaseException:
            for opened in served:
                opened.close()
            raise
    return served


def _admitted(port: int) -> socket.socket:
    """A connection whose request was answered 200, kept open, past the limit.

    A newcomer may arrive in the worker's accept burst with the connections it would evict,
    before they count as connected: then it is refused (503) and evicts nobody, and it
    connects again, as a client does after a ``Retry-After``. Within 10 s.
    """
    deadline = time.monotonic() + 10
    while True:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            sock.sendall(HEALTH)
            status, raw = read_response(sock, deadline)
        except BaseException:
            sock.close()
            raise
        if status == 200:
            return sock
        sock.close()
        assert status == 503, raw
        assert time.monotonic() < deadline, "no connection without a head was evicted"


def _held(port: int, n: int, partial: bytes = b"GET /api/v1/hea") -> list[socket.socket]:
    """``n`` connections that send ``partial`` (half a request line) and stall."""
    held = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(partial)
        held.append(sock)
    return held


def _polling(port: int, n: int, wait_ms: int = 15_000) -> list[socket.socket]:
    """``n`` lease long-polls on a queue with no job, sent whole: each waits ``wait_ms``."""
    body = orjson.dumps({"queues": ["nothing-here"], "wait_ms": wait_ms})
    head = (
        "POST /api/v1/leases HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    polls = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(head + body)
        polls.append(sock)
    return polls


def _refused(port: int, n: int) -> None:
    """``n`` newcomers, one after another, are each answered 503 ``TOO_MANY_CONNECTIONS``."""
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as late:
            late.sendall(HEALTH)
            answer = read_response(late, time.monotonic() + 10)
            assert _problem(answer) == (503, "TOO_MANY_CONNECTIONS", True), answer


def _still_open(socks: list[socket.socket]) -> None:
    """Nothing has come on ``socks``, not even their end: the server still holds them."""
    for sock in socks:
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(100)
        sock.setblocking(True)


def test_connections_past_the_limit_are_answered_503_and_the_held_ones_are_served(
    spawn: Spawner,
) -> None:
    # gunicorn's asgi worker never enforced worker_connections (a review held 4,000 on a
    # worker set to 1,000): relayproject.gunicorn_worker.BoundedWorker does. All 40 connect
    # before any sends, so the listen backlog hands the worker a burst of them at once: which
    # of them are refused and which evicted (none has sent a head) is the loop's timing, but
    # never more than the limit are served.
    server = start_gunicorn(
        spawn, RELAY_HTTP_CONNECTIONS=str(LIMIT), RELAY_HTTP_KEEPALIVE_S=KEEPALIVE
    )
    sockets = [
        socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(ARRIVALS)
    ]
    try:
        for sock in sockets:
            sock.sendall(HEALTH)
        deadline = time.monotonic() + 10
        answers = [read_response(sock, deadline) for sock in sockets]
        statuses = sorted(status for status, _ in answers)
        assert statuses == [200] * LIMIT + [503] * (ARRIVALS - LIMIT), statuses
        refusals = {_problem(answer) for answer in answers if answer[0] == 503}
        assert refusals == {(503, "TOO_MANY_CONNECTIONS", True)}, refusals
    finally:
        for sock in sockets:
            sock.close()
    # The held connections, once closed, leave room: a new client is served.
    deadline = time.monotonic() + 10
    while (answer := server.request("GET", "/api/v1/health", timeout=5))[0] != 200:
        assert answer[0] == 503 and answer[1]["retry-after"] == "1", answer
        assert time.monotonic() < deadline, "the closed connections were never given back"


def test_requests_in_progress_are_never_given_up_for_a_newcomer(spawn: Spawner) -> None:
    # Every slot holds a long-poll whose request was sent whole: a newcomer is refused, and
    # each long-poll is answered at the end of its wait.
    server = start_gunicorn(spawn, RELAY_HTTP_CONNECTIONS="3", RELAY_HTTP_KEEPALIVE_S=KEEPALIVE)
    polls = _polling(server.port, 3, wait_ms=3000)
    try:
        _refused(server.port, 5)
        deadline = time.monotonic() + 15
        for sock in polls:
            status, raw = read_response(sock, deadline)
            assert status == 200 and orjson.loads(raw)["jobs"] == [], raw
    finally:
        for sock in polls:
            sock.close()


def test_a_newcomer_at_the_limit_takes_the_slot_of_the_oldest_connection_without_a_head(
    spawn: Spawner,
) -> None:
    # A client that reconnected as fast as it was cut held every slot with connections that
    # never sent a head, each for the 15 s header timeout: every other client was refused. At
    # the limit a newcomer now takes the slot of the oldest such connection, which is answered
    # 503 as a refused one is. The header timeout is 60 s here: only eviction frees a slot.
    server = start_gunicorn(
        spawn,
        RELAY_HTTP_CONNECTIONS="3",
        RELAY_HTTP_KEEPALIVE_S=KEEPALIVE,
        RELAY_HTTP_HEADER_TIMEOUT_S="60",
    )
    # Silent: a byte the worker has not read yet would pass a connection over, and which of
    # them the loop has read when a newcomer comes is its timing.
    held = _held(server.port, 3, partial=b"")
    newcomers: list[socket.socket] = []
    try:
        newcomers.append(_admitted(server.port))
        # Oldest first: each held connection is answered 503 and closed in turn.
        for i, victim in enumerate(held):
            if i:  # the rest are connected now: the next newcomer is served at once
                newcomers += _served(server.port, 1)
            answer = read_response(victim, time.monotonic() + 10)
            assert _problem(answer) == (503, "TOO_MANY_CONNECTIONS", True), answer
            victim.settimeout(10)
            assert victim.recv(100) == b"", "the evicted connection was not closed"
            _still_open(held[i + 1 :])
    finally:
        for sock in held + newcomers:
            sock.close()
    log = server.proc.stderr_text()
    assert "Traceback" not in log and "Exception in callback" not in log, log[-3000:]
    assert "event=http_connection_evicted" in log, log[-3000:]


def test_connections_kept_alive_between_requests_keep_their_slots(spawn: Spawner) -> None:
    # A pooled client's connection, idle between its requests, is not given up for a
    # newcomer: closing it raced the client's next request (a review: a client reusing one
    # connection under a flood lost 4-33% of its requests when the oldest idle one was closed).
    server = start_gunicorn(spawn, RELAY_HTTP_CONNECTIONS="3", RELAY_HTTP_KEEPALIVE_S=KEEPALIVE)
    idle = _served(server.port, 3)
    try:
        _refused(server.port, 5)
        _still_open(idle)
        for sock in idle:
            sock.sendall(HEALTH)
            assert read_response(sock, time.monotonic() + 10)[0] == 200
    finally:
        for sock in idle:
            sock.close()


def test_refused_clients_that_reset_at_once_cost_no_traceback(spawn: Spawner) -> None:
    # A refused client that read part of the 503 and closed (a reset: its request unread)
    # made the refusal's shutdown() raise ENOTCONN, and asyncio logged a 13-line traceback
    # for each: 476 for 500 refusals (a review). Here long-polls hold the slots.
    server = start_gunicorn(spawn, RELAY_HTTP_CONNECTIONS="2")
    polls = _polling(server.port, 2)
    try:
        for _ in range(100):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                sock.sendall(HEALTH)
                sock.recv(12)
        # The accept queue is first in, first out: this one is answered after those.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as probe:
            probe.sendall(HEALTH)
            assert read_response(probe, time.monotonic() + 10)[0] == 503
    finally:
        for sock in polls:
            sock.close()
    log = server.proc.stderr_text()
    assert "Traceback" not in log and "Exception in callback" not in log, log[-3000:]


def test_evicted_clients_that_reset_at_once_cost_no_traceback(spawn: Spawner) -> None:
    # The same with every slot held by connections without a head: each newcomer evicts the
    # oldest of them, newcomers included, and resets after reading part of an answer.
    server = start_gunicorn(spawn, RELAY_HTTP_CONNECTIONS="2", RELAY_HTTP_KEEPALIVE_S=KEEPALIVE)
    held = _held(server.port, 2)
    try:
        for _ in range(100):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            held.append(sock)
            if len(held) > 4:  # reset the oldest, whatever it was answered
                held.pop(0).close()
        _admitted(server.port).close()
    finally:
        for sock in held:
            sock.close()
    log = server.proc.stderr_text()
    assert "Traceback" not in log and "Exception in callback" not in log, log[-3000:]


def test_a_connection_that_never_finishes_its_headers_gives_its_slot_back(
    spawn: Spawner,
) -> None:
    # gunicorn waits for a first request's headers for ever: 50 silent connections held a
    # limit of 50 for good (a review). The header timeout is 1 s here (15 s by default). No
    # newcomer arrives until they are closed (a newcomer would evict one).
    server = start_gunicorn(spawn, RELAY_HTTP_CONNECTIONS="3", RELAY_HTTP_HEADER_TIMEOUT_S="1")
    # A long-poll's request was read: it runs past the header timeout, to its own deadline.
    body = orjson.dumps({"queues": ["nothing"], "wait_ms": 3000})
    poll = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    poll.sendall(
        b"POST /api/v1/leases HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    held = _held(server.port, 2)
    try:
        deadline = time.monotonic() + 10
        for sock in held:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            assert sock.recv(100) == b"", "the stalled connection was not closed"
        assert timed(server, "GET", "/api/v1/health")[0] == 200
        started = time.monotonic()
        status, raw = read_response(poll, time.monotonic() + 10)
        assert status == 200, raw
        assert orjson.loads(raw)["jobs"] == [], raw
        assert time.monotonic() - started > 0.5  # it was still waiting
    finally:
        for sock in [poll, *held]:
            sock.close()


def test_a_request_whose_body_trickles_or_whose_response_is_unread_gives_its_slot_back(
    spawn: Spawner,
) -> None:
    # gunicorn waits 60 s per body chunk with no end, and its drain has no timeout: ten
    # connections that sent a byte of body every 30 s, or pipelined requests they never
    # read, held a limit of ten for good (a review). The request timeout is 2 s here.
    server = start_gunicorn(spawn, RELAY_HTTP_CONNECTIONS="2", RELAY_HTTP_REQUEST_TIMEOUT_S="2")
    trickle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    trickle.sendall(
        b"POST /api/v1/queues/q/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    unread = socket.socket()
    unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    unread.connect(("127.0.0.1", server.port))
    unread.settimeout(10)
    docs = b"GET /api/v1/openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    unread.sendall(docs * 50)  # about 8 MB of answers it never reads
    try:
        # Both heads are in before the probe (else it would evict one): an answer has begun
        # to arrive on ``unread``, and ``trickle``'s bytes were in the kernel before it connected.
        assert unread.recv(1, socket.MSG_PEEK) == b"H"
        assert timed(server, "GET", "/api/v1/health")[0] == 503  # both slots held
        # Neither is read from: only the server's timeout can give their slots back.
        started = time.monotonic()
        while (status := timed(server, "GET", "/api/v1/health")[0]) != 200:
            assert status == 503, status
            assert time.monotonic() - started < 15, "the held slots never came back"
            time.sleep(0.2)  # a client's retry pace, not a synchronisation
        trickle.settimeout(5)
        with contextlib.suppress(ConnectionResetError):  # closed: reset, or an end
            assert trickle.recv(100) == b""
    finally:
        trickle.close()
        unread.close()
