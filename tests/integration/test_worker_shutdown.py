"""A ``Worker`` stopped while its lease call waits in a long-poll, against a real server:
it stops at once (not when the long-poll runs out), and nothing is leased to the lease call
it abandons."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from queue_core.client import RelayClient
from queue_core.worker import Worker
from tests.integration.test_tcp_server import Running, wait_for

LONG_POLL_MS = 20_000  # the most a lease may wait (RELAY_MAX_WAIT_MS)


def test_an_idle_worker_stops_without_waiting_out_its_long_poll(
    start: Callable[..., Running],
) -> None:
    running = start()
    address = f"127.0.0.1:{running.port}"
    worker = Worker(lambda: RelayClient(address), ["q"], concurrency=2, wait_ms=LONG_POLL_MS)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.ready.wait(10)
    # Its lease call is parked on the server, waiting for a job on "q".
    wait_for(lambda: any(c.waiting for c in list(running.server._conns)))
    stopped_at = time.monotonic()
    worker.stop()
    thread.join(LONG_POLL_MS / 1000 / 2)
    assert not thread.is_alive(), "the worker waited out its long-poll"
    assert time.monotonic() - stopped_at < LONG_POLL_MS / 1000 / 4
    # The abandoned long-poll leases nothing: a job submitted now stays READY.
    with RelayClient(address) as client:
        client.submit("q", {"n": 1})
        wait_for(lambda: not any(c.waiting for c in list(running.server._conns)))
        assert client.stats()["totals"]["ready"] == 1
    assert worker.counters()["leased"] == 0


def test_an_idle_worker_stops_soon_though_its_server_never_answers() -> None:
    # A server that accepts and answers nothing kept an idle worker's stop for its whole
    # shutdown timeout (30 s): the lease call waited for an answer (a review).
    from tests.unit.canned_server import CannedServer, ok

    asked, release = threading.Event(), threading.Event()

    def mute(req: dict[str, Any], conn: Any) -> bytes:
        if req.get("op") == "lease":
            asked.set()
            release.wait(60)
        return ok(req, {"jobs": []})

    server = CannedServer(mute)
    try:
        worker = Worker(
            lambda: RelayClient(server.address, timeout_s=60),
            ["q"],
            concurrency=2,
            wait_ms=LONG_POLL_MS,
            shutdown_timeout_ms=30_000,
        )
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        assert asked.wait(10)
        stopped_at = time.monotonic()
        worker.stop()
        thread.join(20)
        assert not thread.is_alive()
        assert time.monotonic() - stopped_at < 10, "it waited for an answer"
    finally:
        release.set()
        server.close()
