"""Fewer round trips per job (issue 15, item 3) through a real TCP server: the next jobs an
ack leased (``lease_next``) go back at once when its reply cannot be sent (the client is gone,
or reads nothing until it is cut off), a draining server
leases none while the ack itself still works, and ``relay_worker --concurrency 4`` drains a
queue with most jobs coming in its acks' replies (real processes, both drivers).

Waiting is on events, replies, log lines and job states, never on fixed sleeps.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from django.test import override_settings

from queue_core.client import RelayClient
from queue_core.models import Job
from queue_core.protocol import connection, writer
from queue_core.service import QueueService
from tests.integration.test_tcp_server import (
    Client,
    Running,
    spy_write_now,
    squeeze,
    wait_for,
)
from tests.procs import Spawner
from tests.relay_db import DATABASES, RelayDb

WAIT_S = 60.0


def ack_args(lease: dict[str, Any], worker_id: str, **more: Any) -> dict[str, Any]:
    return {
        "job_id": lease["job_id"],
        "worker_id": worker_id,
        "lease_token": lease["lease_token"],
        **more,
    }


def test_next_jobs_of_an_ack_whose_reply_cannot_be_sent_go_back(
    start: Callable[..., Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A write outlives its connection only on a writer thread (PostgreSQL, or SQLite while
    # another connection holds the write lock); inline, the loop reads no EOF mid-commit.
    monkeypatch.setattr(writer, "INLINE_WRITES", False)
    running = start()
    producer = Client(running.port)
    for i in range(4):
        producer.ok("submit", queue="nx", payload={"i": i}, max_retries=0)
    ghost = Client(running.port)
    (first,) = ghost.ok("lease", queues=["nx"], worker_id="ghost")["jobs"]
    claiming, go_on = threading.Event(), threading.Event()
    claim = QueueService._claim_in  # the claim an ack with lease_next runs on its transaction

    def held_claim(self: QueueService, *args: Any, **kwargs: Any) -> Any:
        leases = claim(self, *args, **kwargs)
        if leases:
            claiming.set()
            assert go_on.wait(15)
        return leases

    monkeypatch.setattr(QueueService, "_claim_in", held_claim)
    spec = {"queues": ["nx"], "max_jobs": 3}
    ghost.send("ack", **ack_args(first, "ghost", lease_next=spec))
    assert claiming.wait(15)
    ghost.close()  # the client is gone before the reply with its 3 next jobs
    wait_for(lambda: any(conn.gone for conn in running.server._conns))
    go_on.set()
    wait_for(lambda: len(running.server._conns) == 1)
    wait_for(lambda: Job.objects.filter(state="ready").count() == 3)
    assert Job.objects.get(pk=first["job_id"]).state == "succeeded"  # the ack itself stands
    assert producer.ok("stats")["totals"]["leased"] == 0
    producer.close()


@pytest.mark.parametrize("via", ["ack", "lease"])
def test_jobs_a_reply_hands_out_go_back_when_it_is_never_read(
    via: str, start: Callable[..., Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reply is written at once (no task) when nothing is queued before it: an ack's with
    # its next jobs, and a lease's that does not wait (``Requests.start_lease``). A reply the
    # kernel only partly takes waits for the rest, and a reader silent past SEND_TIMEOUT_S is
    # cut off: the jobs in it go back at once, not when their leases expire.
    monkeypatch.setattr(connection, "SEND_TIMEOUT_S", 0.5)
    written = spy_write_now(monkeypatch)
    running = start()
    producer = Client(running.port)
    for i in range(4):
        producer.ok("submit", queue="nb", payload={"i": i, "blob": "x" * 200_000})
    ghost = Client(running.port)
    if via == "ack":
        (first,) = ghost.ok("lease", queues=["nb"], worker_id="ghost")["jobs"]
        squeeze(running, ghost)  # so the ~600 KB reply cannot all go in
        spec = {"queues": ["nb"], "max_jobs": 3}
        ghost.send("ack", **ack_args(first, "ghost", lease_next=spec))
    else:
        assert ghost.ok("ping")["pong"] is True
        squeeze(running, ghost)
        ghost.send("lease", queues=["nb"], worker_id="ghost", max_jobs=3)
    wait_for(lambda: len(running.server._conns) == 1)  # the silent reader was cut off
    assert "buffered" in written
    ready = 3 if via == "ack" else 4
    wait_for(lambda: Job.objects.filter(state="ready").count() == ready)
    if via == "ack":
        assert Job.objects.get(pk=first["job_id"]).state == "succeeded"  # the ack stands
    assert producer.ok("stats")["totals"]["leased"] == 0
    ghost.close()
    producer.close()


@override_settings(RELAY_MAX_FRAME_BYTES=4096, RELAY_MAX_PAYLOAD_BYTES=2048)
def test_an_ack_before_an_oversize_frame_is_answered_and_its_next_jobs_not_stranded(
    start: Callable[..., Running],
) -> None:
    # The connection is closing (FRAME_TOO_LARGE) when the ack's commit lands: the ack is
    # answered as every request before the oversize frame is, and the next jobs it leased
    # either reach the client in that reply or are given back, never leased to nobody. (Its
    # reply was dropped before: the connection was already marked gone.)
    running = start()
    producer = Client(running.port)
    for i in range(3):
        producer.ok("submit", queue="ov", payload={"i": i})
    client = Client(running.port, timeout=30)
    (first,) = client.ok("lease", queues=["ov"], worker_id="w")["jobs"]
    ack = {"id": 7, "op": "ack", "args": ack_args(first, "w", lease_next={"queues": ["ov"]})}
    client.send_raw(orjson.dumps(ack) + b"\n" + b"x" * 8192 + b"\n")
    replies: dict[Any, dict[str, Any]] = {}
    while line := client.file.readline():
        reply = orjson.loads(line)
        replies[reply["id"]] = reply
    client.close()
    assert set(replies) == {7, None}
    assert replies[None]["error"]["code"] == "FRAME_TOO_LARGE"
    assert replies[7]["ok"] and replies[7]["result"]["state"] == "succeeded"
    sent = {job["job_id"] for job in replies[7]["result"]["next"]}
    wait_for(lambda: len(running.server._conns) == 1)
    assert set(Job.objects.filter(state="leased").values_list("id", flat=True)) == sent
    assert Job.objects.filter(state="ready").count() == 2 - len(sent)
    producer.close()


def test_a_draining_server_acks_but_leases_no_next_job(start: Callable[..., Running]) -> None:
    running = start(shutdown_grace_ms=30_000)
    worker, producer = Client(running.port), Client(running.port)
    try:
        for i in range(3):
            producer.ok("submit", queue="dr", payload=i)
        first, second = worker.ok("lease", queues=["dr"], worker_id="w", max_jobs=2)["jobs"]
        running.server.request_shutdown()
        wait_for(lambda: running.server._requests.draining)
        out = worker.ok("ack", **ack_args(first, "w", lease_next={"queues": ["dr"]}))
        assert out == {
            "job_id": first["job_id"],
            "state": "succeeded",
            "duplicate": False,
            "next": [],
        }
        out = worker.ok(
            "ack_batch", acks=[ack_args(second, "w")], lease_next={"queues": ["dr"], "max_jobs": 5}
        )
        assert out["next"] == [] and out["results"][0]["ok"] is True
        running.thread.join(10)  # nothing leased any more: the grace ends early
        assert not running.thread.is_alive()
        assert Job.objects.filter(state="ready").count() == 1
    finally:
        worker.close()
        producer.close()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=DATABASES)
def test_relay_worker_drains_a_queue_mostly_through_its_acks(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    jobs = 60
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    with RelayClient(address) as client:
        client.submit_batch([{"queue": "busy", "payload": {"n": n}} for n in range(jobs)])
    worker = spawn(
        "relay_worker",
        "--address",
        address,
        "--queue",
        "busy",
        "--concurrency",
        "4",
        "--wait-ms",
        "1000",
        name="relay_worker",
    )
    worker.wait_event("worker_ready", timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    with RelayClient(address) as client:
        while client.stats("busy")["queues"]["busy"]["succeeded"] < jobs:
            assert time.monotonic() < deadline, "the worker did not drain the queue"
            time.sleep(0.05)
    worker.signal(signal.SIGTERM)
    stopped = worker.wait_event("worker_stopped", timeout=WAIT_S)
    assert stopped["acked"] == jobs and stopped["leased"] == jobs
    # Many jobs came with an ack's reply (one round trip for them); the others from the lease
    # thread, which takes the slots freed while an ack's lease_next was in flight in one claim.
    leased = [r for r in worker.records if r.get("event") == "leased"]
    via_lease = sum(r.get("via") == "lease" for r in leased)
    assert stopped["leased_next"] == jobs - via_lease
    assert stopped["leased_next"] >= jobs // 5, stopped
    assert relay_db.rows("SELECT count(*) FROM relay_job WHERE state = 'succeeded'") == [(jobs,)]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=DATABASES)
def test_ack_batch_and_lease_next_in_the_servers_group_commit(
    spawn: Spawner, relay_db: RelayDb
) -> None:
    """On PostgreSQL the group commit runs flat (no SAVEPOINT per call): a refused ack in a
    batch is set apart without undoing the others there too."""
    _, port = spawn.server()
    with RelayClient(f"127.0.0.1:{port}") as client:
        client.submit_batch([{"queue": "gc", "payload": n} for n in range(6)])
        a, b, c = client.lease(["gc"], worker_id="w", max_jobs=3)
        out = client.ack_batch(
            [
                ack_args(a, "w"),
                {**ack_args(b, "w"), "lease_token": "stale"},
                ack_args(c, "w", result={"c": 1}),
                {**ack_args(b, "w"), "worker_id": "other"},
            ],
            lease_next={"queues": ["gc"], "max_jobs": 2},
        )
        assert [r["ok"] for r in out["results"]] == [True, False, True, False]
        assert [r["error"]["code"] for r in out["results"] if r["error"]] == ["STALE_TOKEN"] * 2
        assert len(out["next"]) == 2
        d, e = out["next"]
        acked = client.ack(**ack_args(d, "w"), lease_next={"queues": ["gc"], "max_jobs": 5})
        assert len(acked["next"]) == 1  # the last ready one
        failed = client.fail(**ack_args(e, "w"), error="boom", lease_next={"queues": ["gc"]})
        assert failed["state"] == "retrying" and failed["next"] == []
        assert client.result(c["job_id"])["return_value"] == {"c": 1}
    states = dict(relay_db.rows("SELECT state, count(*) FROM relay_job GROUP BY state"))
    assert states == {"succeeded": 3, "leased": 2, "retrying": 1}
