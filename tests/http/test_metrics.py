"""Relay's metrics: counters after commit, expiries reported by the service's observer,
gauges from the DB, and text every Prometheus parser accepts."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from typing import Any

import pytest
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from queue_api import calls
from queue_core import metrics
from queue_core.clock import FakeClock
from queue_core.service import QueueService
from tests.http.conftest import Api, metric
from tests.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def families(text: str) -> dict[str, Any]:
    """Parse exposition text (raises on anything a Prometheus scraper would reject)."""
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_http_requests_move_the_counters(api: Api) -> None:
    before = {
        name: metric(name, queue="m1")
        for name in (
            "relay_jobs_submitted_total",
            "relay_jobs_deduplicated_total",
            "relay_jobs_leased_total",
            "relay_jobs_acked_total",
            "relay_jobs_failed_total",
            "relay_jobs_dead_total",
            "relay_jobs_replayed_total",
        )
    }
    stale_before = metric("relay_stale_token_rejections_total", op="ack")
    claims_before = metric("relay_claim_duration_seconds_count")
    jobs = "/api/v1/queues/m1/jobs"
    api.post(jobs, {"payload": 1, "idempotency_key": "k"})
    api.post(jobs, {"payload": 1, "idempotency_key": "k"})
    api.post(jobs, {"payload": 2, "max_retries": 0})
    leases = api.post("/api/v1/leases", {"queues": ["m1"], "worker_id": "w", "max_jobs": 2})
    first, second = leases.json()["jobs"]
    api.post(f"/api/v1/jobs/{first['job_id']}/ack", {"worker_id": "w", "lease_token": "x" * 32})
    api.post(
        f"/api/v1/jobs/{first['job_id']}/ack",
        {"worker_id": "w", "lease_token": first["lease_token"]},
    )
    api.post(
        f"/api/v1/jobs/{second['job_id']}/fail",
        {"worker_id": "w", "lease_token": second["lease_token"], "error": "boom"},
    )
    api.post(f"/api/v1/dead/{second['job_id']}/replay")

    def delta(name: str) -> float:
        return metric(name, queue="m1") - before[name]

    assert delta("relay_jobs_submitted_total") == 2
    assert delta("relay_jobs_deduplicated_total") == 1
    assert delta("relay_jobs_leased_total") == 2
    assert delta("relay_jobs_acked_total") == 1
    assert delta("relay_jobs_failed_total") == 1
    assert delta("relay_jobs_dead_total") == 1
    assert delta("relay_jobs_replayed_total") == 1
    assert metric("relay_stale_token_rejections_total", op="ack") - stale_before == 1
    assert metric("relay_claim_duration_seconds_count") - claims_before >= 1
    assert metric("relay_job_submit_to_start_seconds_count", queue="m1") >= 2


def test_metrics_endpoint_parses_and_has_gauges_from_the_database(api: Api) -> None:
    api.post("/api/v1/queues/g1/jobs", {"payload": 1})
    api.post("/api/v1/queues/g1/jobs", {"payload": 2, "delay_ms": 60_000})
    response = api.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    text = response.content.decode()
    found = families(text)
    for name in (
        "relay_jobs_submitted",
        "relay_queue_jobs",
        "relay_queue_oldest_ready_age_seconds",
        "relay_database_up",
        "relay_claim_duration_seconds",
        "django_http_requests_total_by_method",
    ):
        assert name in found, name
    depth = samples(text, "relay_queue_jobs")
    assert depth[(("queue", "g1"), ("state", "ready"))] == 1
    assert depth[(("queue", "g1"), ("state", "pending"))] == 1
    assert samples(text, "relay_database_up") == {(): 1.0}


def test_queue_labels_are_bounded(
    transactional_db: None, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With 10,000 queues /metrics had 80,041 series (12.7 MB): past the bound, queues fold
    # into queue="_other", in the counters (first come) and in the gauges (deepest kept).
    monkeypatch.setattr(metrics, "_labelled", set())
    service = QueueService(clock=clock)
    with override_settings(RELAY_METRICS_MAX_QUEUES=3):
        for i, name in enumerate(["b1", "b2", "b3", "b4", "b5", "b6"]):
            for n in range(i + 1):  # b6 is the deepest
                service.submit(name, n)
            metrics.record([metrics.Event("submitted", name, i + 1)])
        text = metrics.exposition().decode()
    submitted = {
        dict(labels)["queue"]: value
        for labels, value in samples(text, "relay_jobs_submitted_total").items()
        if dict(labels)["queue"] in {"b1", "b2", "b3", "b4", "b5", "b6", "_other"}
    }
    assert submitted == {"b1": 1, "b2": 2, "b3": 3, "_other": 4 + 5 + 6}
    ready = {
        dict(labels)["queue"]: value
        for labels, value in samples(text, "relay_queue_jobs").items()
        if dict(labels)["state"] == "ready"
    }
    assert ready == {"b4": 4, "b5": 5, "b6": 6, "_other": 1 + 2 + 3}
    ages = samples(text, "relay_queue_oldest_ready_age_seconds")
    assert len(ages) == 4 and (("queue", "_other"),) in ages


def test_labels_never_carry_job_ids_or_error_texts(api: Api) -> None:
    job = api.post("/api/v1/queues/l1/jobs", {"payload": 1, "max_retries": 0}).json()["job"]
    held = api.post("/api/v1/leases", {"queues": ["l1"], "worker_id": "w"}).json()["jobs"][0]
    api.post(
        f"/api/v1/jobs/{job['id']}/fail",
        {"worker_id": "w", "lease_token": held["lease_token"], "error": "secret error text"},
    )
    text = api.get("/metrics").content.decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for value in sample.labels.values():
                assert not value.startswith("job_"), sample
                assert "secret error text" not in value, sample


def test_lease_expiries_are_counted_when_they_commit(transactional_db: None) -> None:
    clock = FakeClock()
    svc = QueueService(observer=metrics.observe, clock=clock)
    svc.submit("x1", {"n": 1}, max_retries=1)
    svc.submit("x1", {"n": 2}, max_retries=0)
    svc.claim(["x1"], worker_id="w", max_jobs=2, lease_ms=1_000)
    expired = metric("relay_lease_expirations_total", queue="x1")
    dead = metric("relay_jobs_dead_total", queue="x1")
    clock.advance(seconds=2)
    assert svc.expire_leases() == ["x1"]
    assert metric("relay_lease_expirations_total", queue="x1") - expired == 2
    assert metric("relay_jobs_dead_total", queue="x1") - dead == 1


def test_rolled_back_expiries_are_not_counted(transactional_db: None) -> None:
    clock = FakeClock()
    svc = QueueService(observer=metrics.observe, clock=clock)
    svc.submit("x2", {"n": 1})
    svc.claim(["x2"], worker_id="w", lease_ms=1_000)
    clock.advance(seconds=2)
    before = metric("relay_lease_expirations_total", queue="x2")

    def expire_then_fail() -> None:
        with svc.transaction():
            svc.expire_leases()  # a savepoint inside the outer transaction
            raise RuntimeError("roll the outer transaction back")

    with pytest.raises(RuntimeError):
        expire_then_fail()
    assert metric("relay_lease_expirations_total", queue="x2") == before
    svc.expire_leases()
    assert metric("relay_lease_expirations_total", queue="x2") - before == 1


def test_http_claim_sweep_counts_expiries(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    svc = QueueService(observer=metrics.observe, clock=clock)
    monkeypatch.setattr(calls, "service", lambda: svc)
    api.post("/api/v1/queues/x3/jobs", {"payload": 1})
    api.post("/api/v1/leases", {"queues": ["x3"], "worker_id": "w", "lease_ms": 1_000})
    before = metric("relay_lease_expirations_total", queue="x3")
    clock.advance(seconds=2)
    again = api.post("/api/v1/leases", {"queues": ["x3"], "worker_id": "w2"}).json()["jobs"]
    assert again[0]["attempt"] == 2
    assert metric("relay_lease_expirations_total", queue="x3") - before == 1


def test_metrics_server_serves_the_same_text(transactional_db: None) -> None:
    QueueService().submit("s1", {"n": 1})
    server = metrics.MetricsServer("127.0.0.1", 0).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            assert r.status == 200
            text = r.read().decode()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=10)
    finally:
        server.stop()
    assert samples(text, "relay_queue_jobs")[(("queue", "s1"), ("state", "ready"))] == 1
    assert "relay_jobs_submitted" in families(text)


def handlers() -> int:
    """Threads alive now, less the exporter's connection timers (one per served one)."""
    return sum(1 for t in threading.enumerate() if not isinstance(t, threading.Timer))


def test_the_metrics_server_bounds_its_connections_and_closes_silent_ones(
    transactional_db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A thread and a descriptor a connection, with no timeout: 230 idle connections took every
    # descriptor of a server whose limit was 250 (a review).
    monkeypatch.setattr(metrics._QuietHandler, "timeout", 2.0)
    server = metrics.MetricsServer("127.0.0.1", 0).start()
    before = handlers()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    try:
        for sock in idle:
            sock.sendall(b"GET /metr")  # half a request line, then silence
        wait_until(lambda: handlers() >= before + 8, what="a thread each", timeout_s=10)
        for sock in idle:  # each closed by the server after its timeout (EOF, not ours)
            sock.settimeout(10)
            assert sock.makefile("rb").read(1) in (b"", b"H")  # an error reply, or none
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            assert r.status == 200  # the slots came back
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_the_metrics_server_answers_503_when_every_slot_is_serving_a_scrape(
    transactional_db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    entered = threading.Semaphore(0)

    def held() -> bytes:  # a scrape that takes as long as the test says
        entered.release()
        assert release.wait(30)
        return b"# held\n"

    monkeypatch.setattr(metrics, "exposition", held)
    server = metrics.MetricsServer("127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{server.port}/metrics"
    scrapes = [
        threading.Thread(target=lambda: urllib.request.urlopen(url, timeout=30).read())
        for _ in range(8)
    ]
    try:
        for scrape in scrapes:
            scrape.start()
        for _ in scrapes:
            assert entered.acquire(timeout=10)  # all 8 are being served
        threads = handlers()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as refused:
            refused.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = refused.makefile("rb").read()  # until the server closes it
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer
        assert handlers() == threads  # no thread for it
    finally:
        release.set()
        for scrape in scrapes:
            scrape.join(10)
        server.stop()


def test_a_scrape_takes_the_slot_of_the_oldest_connection_without_a_request(
    transactional_db: None,
) -> None:
    # Eight connections that send nothing (or half a line), reopened as fast as they are cut,
    # kept 43 of 44 scrapes out (a review): a newcomer now evicts the oldest of them.
    server = metrics.MetricsServer("127.0.0.1", 0).start()
    before = handlers()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    try:
        idle[0].sendall(b"GET /metr")
        full = lambda: handlers() >= before + 8  # noqa: E731 - each holds its slot
        wait_until(full, what="every slot held", timeout_s=10)
        for victim in range(3):  # each scrape takes the oldest idle one's slot
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
                assert r.status == 200
            idle[victim].settimeout(10)
            assert idle[victim].makefile("rb").read().startswith(b"HTTP/1.1 503 ")
            wait_until(  # the victim's and the scrape's threads ended
                lambda: handlers() <= before + 7, what="a slot free", timeout_s=10
            )
            # As the review's client did: open another at once, filling the slots again.
            idle.append(socket.create_connection(("127.0.0.1", server.port)))
            wait_until(full, what="every slot held again", timeout_s=10)
        for sock in idle[3:]:  # the others still wait for their request
            sock.settimeout(0)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_the_metrics_server_cuts_a_connection_that_trickles_past_its_time(
    transactional_db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A byte every 7 s from 8 connections kept every scrape out for good: each read came
    # within the silence timeout (a second review).
    monkeypatch.setattr(metrics._ThreadingWSGIServer, "connection_s", 1.0, raising=False)
    server = metrics.MetricsServer("127.0.0.1", 0).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            began = time.monotonic()
            closed = False
            for byte in b"GET /metrics HTTP/1.1\r\n" * 10:  # a byte a 0.2 s: never silent
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    closed = True
                    break
                sock.settimeout(0.2)
                try:
                    if sock.recv(1) == b"":  # the server closed it
                        closed = True
                        break
                except TimeoutError:
                    pass
            assert closed and time.monotonic() - began < 5
    finally:
        server.stop()


def test_cancels_and_timeouts_are_counted(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    svc = QueueService(observer=metrics.observe, clock=clock)
    monkeypatch.setattr(calls, "service", lambda: svc)
    names = (
        "relay_jobs_cancelled_total",
        "relay_jobs_timed_out_total",
        "relay_jobs_failed_total",
        "relay_jobs_dead_total",
        "relay_jobs_released_total",
    )
    before = {name: metric(name, queue="m2") for name in names}

    def delta(name: str) -> float:
        return metric(name, queue="m2") - before[name]

    jobs = "/api/v1/queues/m2/jobs"
    waiting = api.post(jobs, {"payload": 1}).json()["job"]["id"]
    assert api.post(f"/api/v1/jobs/{waiting}/cancel", {}).json()["cancelled"] is True
    assert delta("relay_jobs_cancelled_total") == 1
    # A leased job: the cancel only marks it; its worker's release ends it (counted then).
    running = api.post(jobs, {"payload": 2}).json()["job"]["id"]
    [lease] = api.post("/api/v1/leases", {"queues": ["m2"], "worker_id": "w"}).json()["jobs"]
    assert api.post(f"/api/v1/jobs/{running}/cancel", {}).json()["cancelled"] is False
    assert delta("relay_jobs_cancelled_total") == 1
    ids = {"worker_id": "w", "lease_token": lease["lease_token"]}
    assert api.post(f"/api/v1/jobs/{running}/release", ids).json()["state"] == "cancelled"
    assert delta("relay_jobs_cancelled_total") == 2 and delta("relay_jobs_released_total") == 0
    # A renew at the time limit: a timeout, a failed attempt and (no retries left) a dead job.
    api.post(jobs, {"payload": 3, "time_limit_ms": 1_000, "max_retries": 0})
    [lease] = api.post("/api/v1/leases", {"queues": ["m2"], "worker_id": "w"}).json()["jobs"]
    clock.advance(ms=1_000)
    ids = {"worker_id": "w", "lease_token": lease["lease_token"]}
    assert api.post(f"/api/v1/jobs/{lease['job_id']}/renew", ids).json()["stop"] == "timeout"
    assert delta("relay_jobs_timed_out_total") == 1
    assert delta("relay_jobs_failed_total") == 1 and delta("relay_jobs_dead_total") == 1
    # A lease that ran out past its limit (a hung worker): counted by the sweep's observer.
    api.post(jobs, {"payload": 4, "time_limit_ms": 1_000, "max_retries": 1})
    svc.claim(["m2"], worker_id="w", lease_ms=1_000)
    clock.advance(ms=1_000)
    assert svc.expire_leases() == ["m2"]
    assert delta("relay_jobs_timed_out_total") == 2
