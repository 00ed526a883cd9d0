"""Concurrent idempotency: many submits with one idempotency key at once create exactly one job.

The submits come from every surface at the same instant (a barrier): threads calling
``QueueService.submit`` directly, threads using ``RelayClient`` and raw pipelining sockets against
a real ``relay_server`` process, child processes calling the service on the same database,
and (in the second test) threads posting to ``POST /api/v1/queues/{queue}/jobs`` through
Django's test client; that test is skipped only if the route is absent. All of them get the
same job, exactly one of them ``deduplicated: false``, and the database holds one job. Once the
window has passed, the same race creates exactly one new job, and the old job no longer holds
the key.

The two races run on SQLite and on PostgreSQL (``relay_db``). With the injected clock the
window's edge is exact: one millisecond before it the key still deduplicates under the race, at
it a new job is created.
"""

from __future__ import annotations

import concurrent.futures
import random
import socket
import threading
import time
from collections.abc import Callable

import orjson
import pytest
from django.db import connections
from django.test import Client, override_settings
from django.urls import Resolver404, resolve

from queue_api import calls
from queue_core.client import RelayClient
from queue_core.clock import FakeClock
from queue_core.models import Job
from queue_core.service import QueueService
from tests.crash.racer import Racer
from tests.procs import Spawner
from tests.relay_db import DATABASES, RelayDb

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

QUEUE = "signup"
KEY = "signup-42"
PAYLOAD = {"key": KEY}  # tests.crash.racer submits this payload too
WINDOW_MS = 5_000
SHORT_WINDOW = {"RELAY_IDEMPOTENCY_WINDOW_MS": str(WINDOW_MS)}
HTTP_ROUTE = f"/api/v1/queues/{QUEUE}/jobs"

Result = tuple[str, str, bool]  # (source, job id, deduplicated)


def http_route_exists() -> bool:
    try:
        resolve(HTTP_ROUTE)
    except Resolver404:
        return False
    return True


@pytest.fixture
def server(spawn: Spawner, relay_db: RelayDb) -> str:
    _, port = spawn.server(**SHORT_WINDOW)
    return f"127.0.0.1:{port}"


def pipelined(address: str, n: int) -> list[Result]:
    """Send ``n`` submits in one write on a raw socket, then read the ``n`` replies."""
    host, port = address.rsplit(":", 1)
    frames = b"".join(
        orjson.dumps(
            {
                "id": i,
                "op": "submit",
                "args": {"queue": QUEUE, "payload": PAYLOAD, "idempotency_key": KEY},
            }
        )
        + b"\n"
        for i in range(n)
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(frames)
        with sock.makefile("rb") as replies:
            out = []
            for _ in range(n):
                reply = orjson.loads(replies.readline())
                assert reply["ok"], reply
                out.append(("raw", reply["result"]["job"]["id"], reply["result"]["deduplicated"]))
    return out


def http_submits(n: int) -> list[Result]:
    client = Client()
    out = []
    try:
        for _ in range(n):
            response = client.post(
                HTTP_ROUTE,
                data=orjson.dumps({"payload": PAYLOAD, "idempotency_key": KEY}),
                content_type="application/json",
            )
            assert response.status_code in (200, 201), response.content
            body = response.json()
            assert (response.status_code == 200) == body["deduplicated"]
            out.append(("http", body["job"]["id"], body["deduplicated"]))
    finally:
        connections.close_all()
    return out


def race(address: str, db: RelayDb, *, http: bool) -> list[Result]:
    """One round: every surface submits KEY at once; return every answer."""
    racers = [
        Racer(
            db.path,
            "submit",
            "--queue",
            QUEUE,
            "--key",
            KEY,
            "--count",
            "3",
            **SHORT_WINDOW,
            **db.env,
        )
        for _ in range(3)
    ]

    def direct() -> list[Result]:
        try:
            service = db.service()
            return [
                ("direct", r["job"]["id"], r["deduplicated"])
                for r in (service.submit(QUEUE, PAYLOAD, idempotency_key=KEY) for _ in range(3))
            ]
        finally:
            connections.close_all()

    def client() -> list[Result]:
        with RelayClient(address) as c:
            return [
                ("client", r["job"]["id"], r["deduplicated"])
                for r in (c.submit(QUEUE, PAYLOAD, idempotency_key=KEY) for _ in range(3))
            ]

    surfaces: list[Callable[[], list[Result]]] = [direct] * 6 + [client] * 4
    surfaces += [lambda: pipelined(address, 5)] * 2
    if http:
        surfaces += [lambda: http_submits(3)] * 4
        # A test client loads the middleware at its first request, and django_prometheus makes
        # its metrics once a process, unguarded: four threads doing that at once registered
        # them twice (DuplicateTimeseries, once in 14 runs). Servers load it once, at start.
        Client().handler.load_middleware()
    barrier = threading.Barrier(len(surfaces) + 1)

    def at_barrier(fn: Callable[[], list[Result]]) -> list[Result]:
        barrier.wait(timeout=60)
        return fn()

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(surfaces)) as pool:
            futures = [pool.submit(at_barrier, fn) for fn in surfaces]
            barrier.wait(timeout=60)
            for racer in racers:
                racer.go()
            results = [r for f in futures for r in f.result(timeout=120)]
        for racer in racers:
            results += [("process", r["job_id"], r["deduplicated"]) for r in racer.results()]
    finally:
        for racer in racers:
            racer.kill()
    return results


def check_one_job(results: list[Result], http: bool) -> str:
    """Every answer names one job, and exactly one answer created it; return its id."""
    ids = {job_id for _, job_id, _ in results}
    assert len(ids) == 1, sorted(ids)
    assert sorted(dedup for _, _, dedup in results).count(False) == 1
    sources = {source for source, _, _ in results}
    assert sources == {"direct", "client", "raw", "process"} | ({"http"} if http else set())
    assert len(results) == 6 * 3 + 4 * 3 + 2 * 5 + 3 * 3 + (4 * 3 if http else 0)
    return ids.pop()


def run_both_rounds(address: str, db: RelayDb, *, http: bool) -> None:
    # The HTTP API's service follows RELAY_DATABASE: the database under test.
    alias = "default" if db.backend == "sqlite" else "postgresql"
    calls.service.cache_clear()  # the API's service is built once per process, from settings
    with override_settings(RELAY_IDEMPOTENCY_WINDOW_MS=WINDOW_MS, RELAY_DATABASE=alias):
        first = check_one_job(race(address, db, http=http), http)
        job = Job.objects.get(id=first)
        assert Job.objects.filter(queue=QUEUE).count() == 1
        assert job.idempotency_expires_at_ms == job.created_at_ms + WINDOW_MS
        # Wait for the window to pass: the condition is the wall clock itself.
        deadline = time.monotonic() + WINDOW_MS / 1000 + 30
        while time.time() * 1000 <= job.idempotency_expires_at_ms:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = check_one_job(race(address, db, http=http), http)
    calls.service.cache_clear()
    assert second != first
    assert Job.objects.filter(queue=QUEUE).count() == 2
    assert Job.objects.get(id=first).idempotency_key is None  # the key moved to the new job
    assert Job.objects.get(id=second).idempotency_key == KEY


def test_concurrent_submits_with_one_key_create_one_job_until_the_window_passes(
    server: str, relay_db: RelayDb
) -> None:
    run_both_rounds(server, relay_db, http=False)


@pytest.mark.skipif(
    not http_route_exists(), reason=f"HTTP API not there yet: no route {HTTP_ROUTE}"
)
def test_concurrent_submits_with_one_key_over_http_tcp_and_processes_create_one_job(
    server: str, relay_db: RelayDb
) -> None:
    """The same race with HTTP submits mixed in (skipped only while the route is absent)."""
    run_both_rounds(server, relay_db, http=True)


@pytest.mark.django_db(transaction=True)
def test_window_edge_under_a_race_with_an_injected_clock(transactional_db: None) -> None:
    clock = FakeClock()

    def burst() -> set[tuple[str, bool]]:
        barrier = threading.Barrier(12)

        def submit(seed: int) -> list[tuple[str, bool]]:
            barrier.wait(timeout=30)
            service = QueueService(clock=clock, rng=random.Random(seed))
            try:
                return [
                    (r["job"]["id"], r["deduplicated"])
                    for r in (service.submit(QUEUE, PAYLOAD, idempotency_key=KEY) for _ in range(4))
                ]
            finally:
                connections.close_all()

        with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
            answers = [a for f in [pool.submit(submit, n) for n in range(12)] for a in f.result()]
        assert len(answers) == 48
        return set(answers)

    created = burst()
    assert len(created) == 2  # one (id, False) and the same id with True
    (first,) = {job_id for job_id, dedup in created if not dedup}
    clock.advance(ms=24 * 3600 * 1000 - 1)  # the default window, less one millisecond
    assert burst() == {(first, True)}
    clock.advance(ms=1)
    fresh = burst()
    (second,) = {job_id for job_id, dedup in fresh if not dedup}
    assert second != first and fresh == {(second, False), (second, True)}
    assert Job.objects.filter(queue=QUEUE).count() == 2
