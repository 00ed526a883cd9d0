"""Through real processes: gunicorn with gunicorn.conf.py, beside relay_server and relay_worker
on one SQLite file; the done-when scenario of the HTTP issue."""

from __future__ import annotations

import socket
import time
import urllib.request
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from queue_core import auth
from tests.http.conftest import Gunicorn, start_gunicorn
from tests.procs import Spawner

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Fetch /metrics and parse it with prometheus_client's parser."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def raw_exchange(port: int, head: bytes, body_chunks: list[bytes] | None = None) -> bytes:
    """Send a raw request (head, then optional chunks) and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        for chunk in body_chunks or []:
            sock.sendall(chunk)
        data = b""
        while b"\r\n\r\n" not in data:
            part = sock.recv(65536)
            if not part:
                break
            data += part
        return data


def test_gunicorn_serves_the_api_docs_admin_and_metrics(gunicorn: Gunicorn) -> None:
    status, body = gunicorn.json("POST", "/api/v1/queues/g/jobs", {"payload": {"a": 1}})
    assert status == 201, body
    assert body["job"]["state"] == "ready"
    status, schema = gunicorn.json("GET", "/api/v1/openapi.json")
    assert status == 200 and "/api/v1/leases" in schema["paths"]
    status, headers, html = gunicorn.request("GET", "/api/v1/docs")
    assert status == 200 and b"swagger-ui-bundle.js" in html
    status, headers, _ = gunicorn.request("GET", "/static/ninja/swagger-ui-bundle.js")
    assert status == 200 and "javascript" in headers["content-type"]
    status, _, _ = gunicorn.request("GET", "/admin/login/")
    assert status == 200
    values = scrape(f"http://127.0.0.1:{gunicorn.port}/metrics")
    assert values[("relay_queue_jobs", (("queue", "g"), ("state", "ready")))] == 1
    assert values[("relay_jobs_submitted_total", (("queue", "g"),))] == 1


def test_gunicorn_serves_a_request_whose_target_is_a_whole_url(gunicorn: Gunicorn) -> None:
    # RFC 9112 §3.2.2: a server must accept the absolute form. gunicorn passed the URL on as
    # the path: Django's HTML 404 for every /api/ route (a review).
    origin = f"127.0.0.1:{gunicorn.port}".encode()
    head = b"GET http://" + origin + b"/api/v1/health?x=1 HTTP/1.1\r\nHost: elsewhere\r\n"
    reply = raw_exchange(gunicorn.port, head + b"Connection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    missing = b"GET http://" + origin + b"/api/v1/nope HTTP/1.1\r\nConnection: close\r\n\r\n"
    reply = raw_exchange(gunicorn.port, missing)
    assert reply.startswith(b"HTTP/1.1 404") and b"application/problem+json" in reply, reply[:300]
    foreign = b"GET http://evil.example/api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    reply = raw_exchange(gunicorn.port, foreign + b"Connection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400"), reply[:300]  # its host, not Host:, is checked
    # Split as sent, then decoded: an encoded ? or / is part of a name, not a delimiter
    # (a second review: the decoded path was split, "capq%3Fx" read as "capq").
    for target, origin_form in (
        (b"/api/v1/queues/capq%3Fx/controls", True),
        (b"%2Fapi%2Fv1%2Fhealth", False),
    ):
        line = b"GET http://" + origin + target + b" HTTP/1.1\r\nConnection: close\r\n\r\n"
        absolute = raw_exchange(gunicorn.port, line)
        if origin_form:
            same = b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            assert absolute.split(b"\r\n")[0] == raw_exchange(gunicorn.port, same).split(b"\r\n")[0]
            assert absolute.startswith(b"HTTP/1.1 422"), absolute[:300]  # the name "capq?x"
        else:
            assert absolute.startswith(b"HTTP/1.1 400"), absolute[:300]  # a host of "...%2F..."
    # A URL that does not parse (a third review: gunicorn's plain-text 500 and a traceback).
    broken = b"GET http://[::1/api/v1/health HTTP/1.1\r\nConnection: close\r\n\r\n"
    reply = raw_exchange(gunicorn.port, broken)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:300]
    assert b"application/problem+json" in reply and b'"BAD_FRAME"' in reply, reply[:300]


def test_gunicorn_refuses_oversized_bodies_with_413(gunicorn: Gunicorn) -> None:
    # Only the head is sent: the 413 comes from Content-Length, before any body byte.
    head = (
        b"POST /api/v1/queues/g/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n"
    )
    reply = raw_exchange(gunicorn.port, head)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"application/problem+json" in reply
    # A chunked body without a length is bounded as it is read.
    chunked_head = (
        b"POST /api/v1/queues/g/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n"
    )
    big = b"x" * (1024 * 1024 + 10)
    chunk = f"{len(big):x}\r\n".encode() + big + b"\r\n0\r\n\r\n"
    reply = raw_exchange(gunicorn.port, chunked_head, [chunk])
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    small = orjson.dumps({"payload": {"chunked": True}})
    ok = f"{len(small):x}\r\n".encode() + small + b"\r\n0\r\n\r\n"
    reply = raw_exchange(gunicorn.port, chunked_head, [ok])
    assert reply.startswith(b"HTTP/1.1 201"), reply[:300]


def wait_for(predicate: Any, timeout_s: float = 60.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value (a condition wait with a deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_done_when_http_producer_tcp_worker_and_both_metrics(spawn: Spawner) -> None:
    """Submit over HTTP with a producer key, consume with relay_worker over TCP with a worker
    key, and watch counters and gauges move on both processes' /metrics."""
    producer = auth.create_key("producer", ["producer"]).key
    worker = auth.create_key("worker", ["worker"]).key
    server, port = spawn.server("--metrics-address", "127.0.0.1:0")
    tcp_metrics = server.wait_event("metrics_ready")["port"]
    http = start_gunicorn(spawn)

    status, body = http.json("POST", "/api/v1/queues/e2e/jobs", {"payload": {"n": 0}})
    assert (status, body["code"]) == (401, "UNAUTHENTICATED")
    started = time.monotonic()
    n = 20
    for i in range(n):
        status, body = http.json(
            "POST", "/api/v1/queues/e2e/jobs", {"payload": {"n": i}}, key=producer
        )
        assert status == 201, body
    submit_s = time.monotonic() - started
    http_url = f"http://127.0.0.1:{http.port}/metrics"
    tcp_url = f"http://127.0.0.1:{tcp_metrics}/metrics"
    before = scrape(http_url)
    assert before[("relay_queue_jobs", (("queue", "e2e"), ("state", "ready")))] == n
    assert before[("relay_jobs_submitted_total", (("queue", "e2e"),))] == n

    # Without a key the worker is refused; with RELAY_API_KEY it consumes.
    refused = spawn.run("relay_worker", "--queue", "e2e", "--address", f"127.0.0.1:{port}")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    spawn(
        "relay_worker", "--queue", "e2e", "--address", f"127.0.0.1:{port}", "--concurrency", "4",
        RELAY_API_KEY=worker,
    )  # fmt: skip
    consumed_from = time.monotonic()

    def settled() -> dict[Any, float] | None:
        # The gauges count live jobs only: settled once none is ready or leased, and the
        # server's counter says every one was acked.
        values = scrape(http_url)
        live = sum(
            values.get(("relay_queue_jobs", (("queue", "e2e"), ("state", state))), 0)
            for state in ("ready", "leased")
        )
        acked = scrape(tcp_url).get(("relay_jobs_acked_total", (("queue", "e2e"),)), 0)
        return values if live == 0 and acked == n else None

    after = wait_for(settled, what="jobs to succeed")
    consume_s = time.monotonic() - consumed_from
    tcp_values = scrape(tcp_url)
    assert tcp_values[("relay_jobs_acked_total", (("queue", "e2e"),))] == n
    assert tcp_values[("relay_jobs_leased_total", (("queue", "e2e"),))] == n
    assert ("relay_queue_jobs", (("queue", "e2e"), ("state", "succeeded"))) not in tcp_values
    assert tcp_values[("relay_claim_duration_seconds_count", ())] >= 1
    assert tcp_values[("relay_job_submit_to_start_seconds_count", (("queue", "e2e"),))] == n
    assert (
        tcp_values[("relay_auth_failures_total", (("code", "UNAUTHENTICATED"), ("surface", "tcp")))]
        >= 1
    )
    # A queue with no live job has no series left (finished jobs are not counted).
    assert not [key for key in after if key[0] == "relay_queue_jobs" and ("queue", "e2e") in key[1]]
    print(
        f"\ndone-when: {n} HTTP submits in {submit_s:.3f}s, consumed over TCP in {consume_s:.3f}s"
    )
