"""A ``Worker`` holding many leases over a slow link, against a real server through a proxy
that holds every renew reply (a real TCP server, real sockets, a real worker).

Renewed one request per lease, a worker's leases were bounded by the lease length over one
renew's round trip: 16 leases of 6 s with replies 400 ms late lost 7 (docs/failure-model.md,
"A fifth attack"). The worker now renews every lease due at once in one ``renew_batch``.

Waiting is on the worker's counters and job states, never on fixed sleeps; the proxy's hold
on each renew reply is the link latency under test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from queue_core.client import RelayClient
from queue_core.models import Job
from queue_core.worker import Worker
from tests.chaos.proxy import Action, Proxy
from tests.integration.test_tcp_server import Running, wait_for

JOBS = 16
LEASE_MS = 3_000  # renewed every second
DELAY_S = 0.25  # each renew reply: 16 in a row would take 4 s, past a 3 s lease
ROUNDS = 3  # renewals of each lease before the handlers may finish


def _slow_renews(frame: dict[str, Any]) -> Action:
    return Action.DELAY_REPLY if frame.get("op") in ("renew", "renew_batch") else Action.FORWARD


def test_a_worker_keeps_its_leases_over_a_slow_link(start: Callable[..., Running]) -> None:
    running = start()
    with RelayClient(f"127.0.0.1:{running.port}") as producer:
        producer.submit_batch([{"queue": "slow", "payload": n} for n in range(JOBS)])
    release = threading.Event()
    with Proxy(running.port, _slow_renews, reply_delay_s=DELAY_S) as proxy:
        worker = Worker(
            lambda: RelayClient(proxy.address),
            ["slow"],
            handler=lambda payload, ctx: release.wait(60),
            concurrency=JOBS,
            lease_ms=LEASE_MS,
        )
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: worker.counters()["leased"] == JOBS)
            # Every lease renewed ROUNDS times, or one lost (the old serial renewals).
            wait_for(
                lambda: worker.renewed >= JOBS * ROUNDS or worker.lost > 0,
                timeout_s=30,
            )
            lost = worker.lost
            release.set()
            wait_for(lambda: worker.counters()["acked"] == JOBS or worker.lost > lost)
        finally:
            release.set()
            worker.stop()
            thread.join(30)
    assert not thread.is_alive()
    assert worker.lost == 0, f"{worker.lost} of {JOBS} leases lost over the slow link"
    renews = [op for op, _ in proxy.frames if op in ("renew", "renew_batch")]
    assert set(renews) == {"renew_batch"}
    # About a request a round: leases that came in different lease calls may fall due apart.
    assert len(renews) * 4 <= worker.renewed, (len(renews), worker.renewed)
    jobs = Job.objects.filter(queue="slow")
    assert sorted((job.state, job.attempt) for job in jobs) == [("succeeded", 1)] * JOBS
