"""Lost acks against a real ``relay_server`` process, with a fault-injecting TCP proxy between.

* An ack (or fail) that committed but whose reply never reached the worker (the proxy forwards
  it, swallows the reply and cuts the connection) is safe to repeat: the repeat answers success
  with ``duplicate: true``, changes nothing, and the job is never delivered again.
* A real ``relay_worker`` process behind such a proxy retries its acks and every job ends
  SUCCEEDED after one delivery.
* A worker that closes its socket right after sending its ack may or may not have been heard;
  repeating the ack settles it either way, exactly once.
* An ack that never committed (the proxy cuts the connection without forwarding it) leaves the
  lease to expire: the job is delivered once more, and the attempt counter and history show it.

Each test runs on SQLite and on PostgreSQL (``relay_db``).
"""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time
from typing import Any

import orjson
import pytest

from queue_core import errors
from queue_core.client import RelayClient, RelayConnectionError
from tests.chaos.proxy import Action, Proxy
from tests.procs import Spawner
from tests.relay_db import DATABASES, RelayDb

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

SHORT_LEASES = {"RELAY_MIN_LEASE_MS": "100", "RELAY_REAPER_INTERVAL_MS": "50"}


@pytest.fixture
def port(spawn: Spawner, relay_db: RelayDb) -> int:
    _, port = spawn.server(**SHORT_LEASES)
    return port


def first_of(op: str, action: Action) -> Any:
    """A proxy policy: ``action`` for the first ``op`` frame of each job, forward the rest.

    For ``"ack"`` the acks of an ``ack_batch`` count too: ``action`` for a batch holding a
    job's first ack (the worker coalesces its acks)."""
    seen: set[str] = set()
    lock = threading.Lock()

    def policy(frame: dict[str, Any]) -> Action:
        args = frame.get("args") or {}
        if frame.get("op") == op:
            jobs = {str(args.get("job_id"))}
        elif op == "ack" and frame.get("op") == "ack_batch":
            jobs = {str(a.get("job_id")) for a in args.get("acks") or []}
        else:
            return Action.FORWARD
        with lock:
            if jobs <= seen:
                return Action.FORWARD
            seen.update(jobs)
        return action

    return policy


def history(db: RelayDb, job_id: str) -> tuple[Any, ...]:
    (job,) = db.rows(
        "SELECT state, attempt, failures, finished_at_ms FROM relay_job WHERE id = %s", (job_id,)
    )
    attempts = db.rows(
        "SELECT attempt, worker_id, outcome, ended_at_ms FROM relay_attempt"
        " WHERE job_id = %s ORDER BY attempt",
        (job_id,),
    )
    return job, attempts


def wait_past(client: RelayClient, instant_ms: int) -> None:
    """Wait until the server's clock has passed ``instant_ms`` (bounded)."""
    deadline = time.monotonic() + 30
    while client.ping()["server_time_ms"] <= instant_ms:
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("verb", ["ack", "fail"])
def test_settle_whose_reply_is_lost_is_safe_to_repeat(
    port: int, relay_db: RelayDb, verb: str
) -> None:
    direct = RelayClient(f"127.0.0.1:{port}")
    with Proxy(port, first_of(verb, Action.DROP_REPLY)) as proxy, direct:
        worker = RelayClient(proxy.address)
        job = direct.submit(
            "lost", {"n": 1}, max_retries=3, backoff="fixed", backoff_base_ms=60_000
        )["job"]
        lease = worker.lease(["lost"], worker_id="w", lease_ms=500)[0]
        args = {"worker_id": "w", "lease_token": lease["lease_token"]}
        settle = (
            (lambda: worker.ack(job["id"], **args))
            if verb == "ack"
            else (lambda: worker.fail(job["id"], error="transient", **args))
        )
        with pytest.raises(RelayConnectionError):
            settle()  # committed, but the reply was swallowed
        assert len(proxy.dropped_replies) == 1 and proxy.dropped_replies[0]["ok"] is True
        settled = history(relay_db, job["id"])
        want = "succeeded" if verb == "ack" else "retrying"
        assert settled[0][:3] == (want, 1, 0 if verb == "ack" else 1)
        again = settle()  # the worker repeats it with the same token
        assert again["duplicate"] is True and again["state"] == want
        assert history(relay_db, job["id"]) == settled  # the repeat changed nothing
        # Past the moment the lease would have expired: never delivered again.
        wait_past(direct, lease["lease_expires_at_ms"])
        assert direct.lease(["lost"], worker_id="other") == []
        assert history(relay_db, job["id"]) == settled
        worker.close()
    relay_db.audit()


def test_worker_process_retries_acks_whose_replies_are_lost(
    port: int, spawn: Spawner, relay_db: RelayDb
) -> None:
    with Proxy(port, first_of("ack", Action.DROP_REPLY)) as proxy:
        with RelayClient(f"127.0.0.1:{port}") as client:
            ids = [client.submit("lossy", {"i": i})["job"]["id"] for i in range(8)]
        worker = spawn(
            "relay_worker",
            *("--address", proxy.address, "--queue", "lossy", "--concurrency", "4"),
            *("--lease-ms", "3000"),  # jobs leased by a lost ack reply come back soon
            name="relay_worker",
        )
        acked: dict[str, dict[str, Any]] = {}
        while len(acked) < len(ids):
            record = worker.wait_for(
                lambda r: r.get("event") == "acked" and r["job_id"] not in acked, timeout=60
            )
            acked[record["job_id"]] = record
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(30) == 0
        assert set(acked) == set(ids)
        # Every first ack's reply was lost; the worker's retry got "duplicate": the commit was
        # already there.
        assert all(r["duplicate"] is True for r in acked.values())
        # Each job's first ack_batch reply was lost (the worker coalesces the acks of its four
        # handlers), with every ack in it committed.
        lost = [r for reply in proxy.dropped_replies for r in (reply or {})["result"]["results"]]
        assert {r["job_id"] for r in lost} == set(ids)
        assert all(r["ok"] is True for r in lost)
        errors_logged = [r for r in worker.records if r.get("event") == "ack_error"]
        assert {r["job_id"] for r in errors_logged} == set(ids)
    # One delivery each, except the jobs a lost reply had brought (the ack's lease_next): the
    # worker never saw them, so their leases expired and they were delivered again
    # (at-least-once), as jobs leased by a lost lease reply are.
    for job_id in ids:
        state, attempts = history(relay_db, job_id)
        expired = len(attempts) - 1
        assert [a[2] for a in attempts] == ["lease_expired"] * expired + ["succeeded"]
        assert state[:3] == ("succeeded", expired + 1, expired)
        assert acked[job_id]["attempt"] == expired + 1
    relay_db.audit()


def test_ack_cut_off_by_the_client_closing_is_settled_by_repeating_it(
    port: int, relay_db: RelayDb
) -> None:
    with RelayClient(f"127.0.0.1:{port}") as client:
        ids = [client.submit("cut", {"i": i})["job"]["id"] for i in range(20)]
        leases = client.lease(["cut"], worker_id="w", max_jobs=20, lease_ms=60_000)
        assert sorted(x["job_id"] for x in leases) == sorted(ids)
        outcomes = []
        for n, lease in enumerate(leases):
            frame = {
                "id": 1,
                "op": "ack",
                "args": {
                    "job_id": lease["job_id"],
                    "worker_id": "w",
                    "lease_token": lease["lease_token"],
                },
            }
            sock = socket.create_connection(("127.0.0.1", port))
            if n % 2:  # half of them with an abortive close (RST) right after the send
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.sendall(orjson.dumps(frame) + b"\n")
            sock.close()  # the worker dies before reading any reply
            again = client.ack(lease["job_id"], worker_id="w", lease_token=lease["lease_token"])
            assert again["state"] == "succeeded"
            outcomes.append(again["duplicate"])
    for job_id in ids:
        state, attempts = history(relay_db, job_id)
        assert state[:3] == ("succeeded", 1, 0) and [a[2] for a in attempts] == ["succeeded"]
    relay_db.audit()
    assert len(outcomes) == 20  # duplicate or not, depending on whether the server heard it


def test_ack_that_never_committed_leads_to_expiry_and_one_more_delivery(
    port: int, relay_db: RelayDb
) -> None:
    with Proxy(port, first_of("ack", Action.DROP_REQUEST)) as proxy:
        first = RelayClient(proxy.address)
        with RelayClient(f"127.0.0.1:{port}") as second:
            job = second.submit("never", {"n": 1}, max_retries=3)["job"]
            lease = first.lease(["never"], worker_id="w1", lease_ms=300)[0]
            with pytest.raises(RelayConnectionError):
                first.ack(job["id"], worker_id="w1", lease_token=lease["lease_token"])
            assert proxy.frames[-1] == ("ack", Action.DROP_REQUEST)
            assert history(relay_db, job["id"])[0][:3] == ("leased", 1, 0)
            # The lease runs out; the next worker's long-poll gets the job again.
            again = second.lease(["never"], worker_id="w2", lease_ms=60_000, wait_ms=15_000)
            assert [(x["job_id"], x["attempt"]) for x in again] == [(job["id"], 2)]
            second.ack(job["id"], worker_id="w2", lease_token=again[0]["lease_token"])
            # The first worker's retried ack is refused (its lease is long gone).
            with pytest.raises((errors.StaleToken, errors.LeaseExpired)):
                first.ack(job["id"], worker_id="w1", lease_token=lease["lease_token"])
        first.close()
    state, attempts = history(relay_db, job["id"])
    assert state[:3] == ("succeeded", 2, 1)  # one more execution, counted
    assert [(a[0], a[1], a[2]) for a in attempts] == [
        (1, "w1", "lease_expired"),
        (2, "w2", "succeeded"),
    ]
    relay_db.audit()
