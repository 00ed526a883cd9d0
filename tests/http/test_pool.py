"""The ASGI application keeps its database connections between requests (submit throughput).

Django's own ASGI handler ran each request's sync part in a thread made for it, so every
request opened a new database connection: HTTP submits ran at ~60/s instead of gthread's
~140/s. These tests drive ``relayproject.asgi.application`` in this process with asgiref's
``ApplicationCommunicator`` (real threads, the real test database) and watch Django's
``connection_created`` signal: sequential submits must open at most ``RELAY_HTTP_THREADS``
connections, and a lease (the async view's path) must leave no connection open on a thread
that is gone.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import orjson
import pytest
from asgiref.testing import ApplicationCommunicator
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.test import override_settings

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 2  # RELAY_HTTP_THREADS for these tests
SUBMITS = 30
LEASES = 10
TIMEOUT_S = 30.0  # per request, on a loaded machine


async def exchange(
    method: str, path: str, body: bytes = b"", headers: tuple[tuple[bytes, bytes], ...] = ()
) -> tuple[int, bytes]:
    """Send one request through the project's ASGI application; return its status and body."""
    from relayproject.asgi import application

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    app = ApplicationCommunicator(application, scope)
    await app.send_input({"type": "http.request", "body": body, "more_body": False})
    start = await app.receive_output(TIMEOUT_S)
    assert start["type"] == "http.response.start"
    content = b""
    while True:
        message = await app.receive_output(TIMEOUT_S)
        content += message.get("body", b"")
        if not message.get("more_body", False):
            break
    await app.wait(TIMEOUT_S)
    return int(start["status"]), content


async def call(path: str, body: Any) -> tuple[int, Any]:
    """POST ``body`` as JSON to ``path`` through the project's ASGI application."""
    data = orjson.dumps(body)
    headers = (
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
    )
    status, content = await exchange("POST", path, data, headers)
    return status, orjson.loads(content)


@pytest.fixture
def opened() -> Iterator[list[tuple[str, BaseDatabaseWrapper]]]:
    """Every database connection opened meanwhile, in any thread: (thread name, wrapper)."""
    seen: list[tuple[str, BaseDatabaseWrapper]] = []
    lock = threading.Lock()

    def record(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
        with lock:
            seen.append((threading.current_thread().name, connection))

    connection_created.connect(record, weak=False)
    yield seen
    connection_created.disconnect(record)


@override_settings(RELAY_HTTP_THREADS=THREADS)
def test_sequential_submits_reuse_a_few_long_lived_connections(
    opened: list[tuple[str, BaseDatabaseWrapper]],
) -> None:
    async def submits() -> list[int]:
        out = []
        for i in range(SUBMITS):
            status, body = await call("/api/v1/queues/pool/jobs", {"payload": {"i": i}})
            assert status == 201, body
            out.append(status)
        return out

    assert asyncio.run(submits()) == [201] * SUBMITS
    # Before: one new connection per request (30), each on a thread made for that request.
    assert len(opened) <= THREADS, [name for name, _ in opened]
    assert all(name.startswith("relay-http-db") for name, _ in opened), opened


@override_settings(RELAY_HTTP_THREADS=THREADS)
def test_leases_claim_on_the_pool_and_leave_no_connection_behind(
    opened: list[tuple[str, BaseDatabaseWrapper]],
) -> None:
    async def run() -> list[list[Any]]:
        for i in range(LEASES):
            status, body = await call("/api/v1/queues/pool-lease/jobs", {"payload": {"i": i}})
            assert status == 201, body
        leased = []
        for _ in range(LEASES):
            status, body = await call("/api/v1/leases", {"queues": ["pool-lease"], "wait_ms": 0})
            assert status == 200, body
            leased.append(body["jobs"])
        return leased

    leased = asyncio.run(run())
    assert sorted(jobs[0]["payload"]["i"] for jobs in leased) == list(range(LEASES))
    pooled = [w for name, w in opened if name.startswith("relay-http-db")]
    assert len(pooled) <= THREADS, [name for name, _ in opened]
    # A connection a lease request's own thread opened (its auth may read the key table) is
    # closed with the request: that thread is never used again.
    left_open = [name for name, w in opened if w not in pooled and w.connection is not None]
    assert left_open == []


@override_settings(RELAY_HTTP_THREADS=THREADS)
def test_console_requests_leave_threads_to_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    # Eight console searches that each scanned 200,000 jobs held all eight threads, and
    # /api/v1/health waited 17 s (a review). The console runs on half the threads at most.
    from django.contrib.auth.views import LoginView

    entered = threading.Semaphore(0)
    release = threading.Event()
    original = LoginView.get

    def slow_get(self: LoginView, request: Any, *args: Any, **kwargs: Any) -> Any:
        entered.release()  # a console request holds a pool thread here
        release.wait(TIMEOUT_S)
        return original(self, request, *args, **kwargs)

    monkeypatch.setattr(LoginView, "get", slow_get)
    status, second_in, consoles = two_gated_and_a_submit(
        lambda: exchange("GET", "/admin/login/"), entered, release
    )
    assert status == 201
    assert not second_in, "the second console request took the API's thread"
    assert consoles == [200, 200]


def two_gated_and_a_submit(
    send: Callable[[], Awaitable[tuple[int, Any]]],
    entered: threading.Semaphore,
    release: threading.Event,
) -> tuple[int, bool, list[int]]:
    """Send two requests of a gate one thread wide (each holds its pool thread, ``entered``
    released as it gets there, until ``release``), and while one holds a thread and the other
    waits at the gate, a submit, which is served on the thread left. Return the submit's
    status, whether the second gated request got a thread meanwhile, and their statuses."""

    async def scenario() -> tuple[int, bool, list[int]]:
        gated = [asyncio.create_task(send()) for _ in range(2)]
        assert await asyncio.to_thread(entered.acquire, True, TIMEOUT_S)
        status, _ = await call("/api/v1/queues/gate/jobs", {"payload": 1})
        second_in = entered.acquire(blocking=False)
        release.set()
        return status, second_in, [code for code, _ in await asyncio.gather(*gated)]

    return asyncio.run(scenario())


@pytest.fixture
def held_bulk(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Semaphore, threading.Event]:
    """Bulk requests hold their pool thread inside ``calls.run_each`` until ``release`` is
    set; ``entered`` is released once for each that got there."""
    from queue_api import calls

    entered = threading.Semaphore(0)
    release = threading.Event()
    original = calls.run_each

    def held_run_each(*args: Any, **kwargs: Any) -> Any:
        entered.release()
        release.wait(TIMEOUT_S)
        return original(*args, **kwargs)

    monkeypatch.setattr(calls, "run_each", held_run_each)
    return entered, release


@override_settings(RELAY_HTTP_THREADS=THREADS)
def test_bulk_replays_run_one_at_a_time_and_leave_threads_to_the_api(
    held_bulk: tuple[threading.Semaphore, threading.Event],
) -> None:
    # Eight bulk replays at once held all eight threads, the API's other requests waiting for
    # all of them (a review); their chunks take turns anyway (QueueService.bulk_chunk).
    entered, release = held_bulk
    status, second_in, bulks = two_gated_and_a_submit(
        lambda: call("/api/v1/dead/replay", {"job_ids": ["job_missing"]}), entered, release
    )
    assert status == 201
    assert not second_in, "the second bulk request took the API's thread"
    assert bulks == [200, 200]


@override_settings(RELAY_HTTP_THREADS=THREADS)
def test_a_cancelled_bulk_request_keeps_the_gate_until_its_thread_is_done(
    held_bulk: tuple[threading.Semaphore, threading.Event],
) -> None:
    # Its client gone (gunicorn cancels the request's task) or its time up, a bulk request
    # left the gate while its pool thread went on replaying, and the next one ran beside it
    # on another thread (a hostile review).
    entered, release = held_bulk

    async def scenario() -> tuple[int, bool, tuple[int, Any]]:
        first = asyncio.create_task(call("/api/v1/dead/replay", {"job_ids": ["job_missing"]}))
        assert await asyncio.to_thread(entered.acquire, True, TIMEOUT_S)
        second = asyncio.create_task(call("/api/v1/dead/replay", {"job_ids": ["job_missing"]}))
        first.cancel()  # as gunicorn does when the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await first
        # The first request's thread still replays: the second waits at the gate, and a
        # submit is served on the thread left.
        status, _ = await call("/api/v1/queues/gate/jobs", {"payload": 1})
        second_in = entered.acquire(blocking=False)
        release.set()
        return status, second_in, await second

    status, second_in, (code, _) = asyncio.run(scenario())
    assert status == 201
    assert not second_in, "the second bulk request ran beside the cancelled one"
    assert code == 200
