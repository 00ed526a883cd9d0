"""Two ``relay server`` processes on one PostgreSQL database: wake-ups cross servers, a claim
is exclusive across them, an idempotency key raced through both makes one job, their sweeps
never expire a lease twice, a restart releases nothing, and when one is killed with SIGKILL
its workers fail over and ack through the other with the same lease tokens."""

from __future__ import annotations

import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connections

from queue_core import errors
from queue_core.client import RelayClient, RelayConnectionError
from queue_core.models import Job, JobAttempt
from queue_core.service import QueueService
from queue_core.storage import driver_for
from queue_core.storage.postgresql.driver import PostgresDriver
from tests.audit import audit
from tests.postgresql.conftest import DATABASES, Server
from tests.procs import Spawner
from tests.storage.conftest import database_url
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

Start = Callable[..., list[Server]]


def audit_postgresql() -> None:
    audit(connections["postgresql"], quick_check=False)


def test_both_servers_register_and_a_killed_one_ages_out(servers: Start) -> None:
    a, b = servers(2, RELAY_SERVER_HEARTBEAT_MS="200")
    with RelayClient(b.address) as client:
        live = {s["address"] for s in client.stats()["servers"]}
        assert live == {a.address, b.address}
        a.proc.kill()
        wait_until(
            lambda: [s["address"] for s in client.stats()["servers"]] == [b.address],
            what="the killed server to leave the live list",
        )


def test_a_job_submitted_on_one_server_wakes_a_long_poll_on_the_other(servers: Start) -> None:
    # The fallback poll (each reaper pass) is 5 s here, so a wake-up within 1 s came through
    # LISTEN/NOTIFY. docs/benchmarking.md has the latency measured on an idle machine.
    a, b = servers(2, RELAY_REAPER_INTERVAL_MS="5000")
    latencies: list[float] = []
    with RelayClient(a.address) as producer, RelayClient(b.address, timeout_s=10) as worker:
        for i in range(30):
            got: list[Any] = []
            waiter = threading.Thread(
                target=lambda got=got: got.extend(
                    worker.lease(["wake"], worker_id="w", wait_ms=4000)
                )
            )
            waiter.start()
            job_id = producer.submit("wake", i)["job"]["id"]
            submitted = time.monotonic()
            waiter.join(10)
            latencies.append(time.monotonic() - submitted)
            assert [lease["job_id"] for lease in got] == [job_id]
            worker.ack(job_id, worker_id="w", lease_token=got[0]["lease_token"])
    p99 = sorted(latencies)[int(0.99 * len(latencies))]
    assert max(latencies) < 1.0, f"median {statistics.median(latencies):.4f}s, p99 {p99:.4f}s"


def test_an_idempotency_key_raced_through_two_servers_makes_one_job(servers: Start) -> None:
    a, b = servers(2)
    per_key = 8
    for key in (f"race-{n}" for n in range(10)):
        barrier = threading.Barrier(per_key)
        results: list[dict[str, Any]] = []
        failures: list[BaseException] = []

        def submit(
            address: str,
            key: str = key,
            barrier: threading.Barrier = barrier,
            results: list[dict[str, Any]] = results,
            failures: list[BaseException] = failures,
        ) -> None:
            try:
                with RelayClient(address) as client:
                    client.ping()  # connected before the barrier: the submits start together
                    barrier.wait(10)
                    results.append(client.submit("idem", {"k": key}, idempotency_key=key))
            except BaseException as exc:
                failures.append(exc)

        threads = [
            threading.Thread(target=submit, args=(a.address if i % 2 else b.address,))
            for i in range(per_key)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert failures == []
        assert len({r["job"]["id"] for r in results}) == 1, results
        assert sorted(r["deduplicated"] for r in results) == [False] + [True] * (per_key - 1)
    assert Job.objects.filter(queue="idem").count() == 10


def test_a_claim_is_exclusive_across_servers_threads_and_processes(
    servers: Start, pg_spawn: Spawner
) -> None:
    a, b = servers(2)
    total = 600
    workers = [
        pg_spawn(
            "relay_worker",
            "--address",
            f"{first.address},{second.address}",
            "--queue",
            "excl",
            "--concurrency",
            "4",
            name=f"worker-{n}",
            **database_url("postgresql"),
        )
        for n, (first, second) in enumerate([(a, b), (b, a)])
    ]
    # The workers wait, long-polling, before any job exists: on a loaded machine the threads
    # below once drained all 600 jobs before a worker process had started.
    for worker in workers:
        worker.wait_event("worker_ready")
    with RelayClient(a.address) as producer:
        for start in range(0, total, 200):
            producer.submit_batch(
                [{"queue": "excl", "payload": i} for i in range(start, start + 200)]
            )
    leased: list[str] = []
    errors_seen: list[BaseException] = []
    lock = threading.Lock()

    def drain(address: str, worker_id: str) -> None:
        try:
            with RelayClient(address) as client:
                while Job.objects.filter(queue="excl").exclude(state="succeeded").exists():
                    for lease in client.lease(["excl"], worker_id=worker_id, max_jobs=3):
                        client.ack(
                            lease["job_id"], worker_id=worker_id, lease_token=lease["lease_token"]
                        )
                        with lock:
                            leased.append(lease["job_id"])
        except BaseException as exc:
            errors_seen.append(exc)
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=drain, args=(server.address, f"t{n}"))
        for n, server in enumerate([a, b, a, b])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors_seen == []
    for worker in workers:
        worker.signal(signal.SIGTERM)  # ready (above): its SIGTERM handler is in place
        assert worker.wait_exit(30) == 0
    assert Job.objects.filter(queue="excl", state="succeeded").count() == total
    # Every job was delivered once: one attempt each, by a thread or by a worker process.
    assert set(Job.objects.filter(queue="excl").values_list("attempt", flat=True)) == {1}
    assert JobAttempt.objects.filter(job__queue="excl").count() == total
    assert len(leased) == len(set(leased))
    by_process = total - len(leased)
    assert 0 < len(leased) < total and by_process > 0  # both kinds took part
    audit_postgresql()


def test_sweeps_racing_on_two_servers_expire_each_lease_once(servers: Start) -> None:
    a, _ = servers(2, RELAY_REAPER_INTERVAL_MS="20")  # both sweep every 20 ms
    n = 200
    with RelayClient(a.address) as client:
        client.submit_batch([{"queue": "sweep", "payload": i, "max_retries": 5} for i in range(n)])
        client.submit_batch([{"queue": "later", "payload": i, "delay_ms": 300} for i in range(n)])
        leased = []
        while len(leased) < n:
            leased += client.lease(["sweep"], worker_id="gone", max_jobs=100, lease_ms=1000)
    # Nobody acks: both servers' reapers race to expire the leases and promote the due jobs.
    wait_until(
        lambda: (
            Job.objects.filter(queue="sweep", state="ready").count() == n
            and Job.objects.filter(queue="later", state="ready").count() == n
        ),
        what="every lease to expire and every delayed job to be promoted",
    )
    expired = Counter(
        JobAttempt.objects.filter(job__queue="sweep").values_list("outcome", flat=True)
    )
    assert expired == {"lease_expired": n}  # one expiry per lease, never two
    assert set(Job.objects.filter(queue="sweep").values_list("failures", flat=True)) == {1}
    audit_postgresql()


def test_a_server_restart_releases_nothing(servers: Start, pg_spawn: Spawner) -> None:
    a, b = servers(2)
    with RelayClient(a.address) as client:
        job_id = client.submit("hold", 1)["job"]["id"]
        lease = client.lease(["hold"], worker_id="w")[0]
    b.proc.signal(signal.SIGTERM)
    assert b.proc.wait_exit(30) == 0
    (b2,) = servers(1)  # a new server starts on the shared database: no recovery
    job = Job.objects.get(id=job_id)
    assert (job.state, job.lease_token) == ("leased", lease["lease_token"])
    with RelayClient(b2.address) as client:  # the worker acks through another server
        result = client.ack(job_id, worker_id="w", lease_token=lease["lease_token"])
    assert result["state"] == "succeeded"


def test_kill_one_of_two_servers_mid_run_workers_fail_over(
    servers: Start, pg_spawn: Spawner
) -> None:
    """The issue's "done when": 2,000 jobs, two servers, a worker per server given both
    addresses, SIGKILL of one server mid-run; every job SUCCEEDED, none under two leases, and
    the dead server's worker finished through the other."""
    a, b = servers(2, RELAY_SERVER_HEARTBEAT_MS="500")
    total, concurrency = 2000, 8
    with RelayClient(b.address) as producer:
        for start in range(0, total, 500):
            producer.submit_batch(
                [
                    {"queue": "kill", "payload": {"i": i, "sleep_ms": i % 7}}
                    for i in range(start, start + 500)
                ]
            )
    worker_a, worker_b = (
        pg_spawn(
            "relay_worker",
            "--address",
            addresses,
            "--queue",
            "kill",
            "--concurrency",
            str(concurrency),
            "--lease-ms",
            "3000",
            "--worker-id",
            name,
            name=name,
            **database_url("postgresql"),
        )
        for name, addresses in [
            ("worker-a", f"{a.address},{b.address}"),
            ("worker-b", f"{b.address},{a.address}"),
        ]
    )
    wait_until(
        lambda: sum(1 for r in list(worker_a.records) if r.get("event") == "acked") >= 300,
        what="worker-a to ack 300 jobs through server a",
    )
    a.proc.kill()  # SIGKILL: no drain, its connections just break
    with RelayClient(b.address) as client:
        wait_until(
            lambda: client.stats("kill")["totals"]["succeeded"] == total,
            timeout_s=120,
            what="every job to succeed",
        )
    records = list(worker_a.records)
    broken = next(
        i for i, r in enumerate(records) if r.get("event") in ("ack_error", "lease_error")
    )  # worker-a's first call that met the dead server
    assert [r for r in records[:broken] if r.get("event") == "acked"], "a: nothing before"
    assert [r for r in records[broken:] if r.get("event") == "acked"], "a: nothing through b"
    for worker in (worker_a, worker_b):
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(30) == 0
    assert Job.objects.filter(queue="kill").count() == total
    assert Job.objects.filter(queue="kill", state="succeeded").count() == total
    # Re-deliveries only for leases in flight when the server died (a claim that committed
    # but whose reply was lost comes back by expiry): at most one per worker slot.
    redelivered = Job.objects.filter(queue="kill", attempt__gt=1).count()
    assert redelivered <= 2 * concurrency
    audit_postgresql()  # among others: no job succeeded under two leases


def test_servers_recover_when_their_database_connections_are_terminated(servers: Start) -> None:
    a, b = servers(2)
    with RelayClient(a.address) as ca, RelayClient(b.address, timeout_s=15) as cb:
        for client in (ca, cb):  # every reader and writer connection in use
            for _ in range(8):
                client.stats()
                client.submit("warm", 1)
        with connections["postgresql"].cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            (killed,) = cursor.fetchone()
        assert killed >= 4

        def served(client: RelayClient) -> bool:
            try:
                client.stats()
                client.submit("after", 1)
            except (errors.Unavailable, errors.StoreBusy, RelayConnectionError):
                return False  # while the connections are replaced: retryable, never INTERNAL
            return True

        for client in (ca, cb):
            # Each thread replaces its connection on its next call: a few UNAVAILABLE at most.
            wait_until(lambda client=client: all(served(client) for _ in range(8)), timeout_s=30)
        # Long-polls still cross servers: b's listener reconnected.
        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.extend(cb.lease(["cross"], worker_id="w", wait_ms=10_000))
        )
        waiter.start()
        job_id = ca.submit("cross", 1)["job"]["id"]
        waiter.join(15)
        assert [lease["job_id"] for lease in got] == [job_id]


def test_a_row_lock_held_elsewhere_gets_busy_not_a_stalled_server(servers: Start) -> None:
    (a,) = servers(1, RELAY_LOCK_TIMEOUT_MS="500")
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    with psycopg.connect(url) as holder, RelayClient(a.address, timeout_s=10) as client:
        # Another transaction binds the key and stays open: the insert must wait for it.
        holder.execute(
            "INSERT INTO relay_job (id, queue, state, priority, payload, idempotency_key, "
            "idempotency_expires_at_ms, attempt, failures, max_retries, backoff, "
            "backoff_base_ms, backoff_cap_ms, jitter, created_at_ms, ready_since_ms, "
            "updated_at_ms) VALUES ('job_held', 'locked', 'ready', 1, '1', 'k', "
            "9999999999999, 0, 0, 3, 'fixed', 1000, 1000, false, 1, 1, 1)"
        )
        started = time.monotonic()
        with pytest.raises(errors.StoreBusy):
            client.submit("locked", 1, idempotency_key="k")
        assert time.monotonic() - started < 5
        assert client.submit("other", 1)["job"]["state"] == "ready"  # others are served
        holder.rollback()
        assert client.submit("locked", 1, idempotency_key="k")["deduplicated"] is False


class Heard:
    """The queues named by the notifications this process's change feed hears, in order
    (subscribed, and connected, once made)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: list[str | None] = []
        feed = driver_for("postgresql").changes()
        feed.subscribe(self._hear)
        wait_until(lambda: feed.connected.is_set(), what="the listener to connect")  # type: ignore[attr-defined]

    def _hear(self, queue: str | None) -> None:
        with self._lock:
            self._queues.append(queue)

    def queues(self) -> list[str | None]:
        """What was heard so far."""
        with self._lock:
            return list(self._queues)

    def clear(self) -> None:
        """Forget what was heard so far."""
        with self._lock:
            self._queues.clear()


def test_a_commit_elsewhere_names_the_queues_it_made_ready() -> None:
    # A server wakes only the long-polls of the queues another server made jobs READY in
    # (RelayServer._foreign_commit): the notification carries the queue.
    heard = Heard()
    heard.clear()  # the reconnect's own "look again" (None)
    other = QueueService(driver=PostgresDriver("postgresql"))  # another origin: another server
    other.submit("busy", 1)
    other.submit_batch([{"queue": "idle", "payload": 1}, {"queue": "busy", "payload": 2}])
    other.submit("later", 1, delay_ms=60_000)  # nothing READY: no notification
    wait_until(lambda: len(heard.queues()) >= 3, what="three notifications")
    assert sorted(map(str, heard.queues())) == ["busy", "busy", "idle"], heard.queues()


def test_a_lost_wake_up_is_caught_by_the_fallback_poll(servers: Start) -> None:
    # A READY job that arrives without a notification (here: a row written by hand) still
    # reaches a waiting long-poll, within a reaper pass or so.
    (a,) = servers(1, RELAY_REAPER_INTERVAL_MS="200")
    got: list[Any] = []
    with RelayClient(a.address, timeout_s=20) as worker:
        worker.ping()
        waiter = threading.Thread(
            target=lambda: got.extend(worker.lease(["quiet"], worker_id="w", wait_ms=10_000))
        )
        waiter.start()
        with connections["postgresql"].cursor() as cursor:
            cursor.execute(
                "INSERT INTO relay_job (id, queue, state, priority, payload, attempt, failures, "
                "max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter, created_at_ms, "
                "ready_since_ms, updated_at_ms) VALUES ('job_quiet', 'quiet', 'ready', 1, '1', "
                "0, 0, 3, 'fixed', 1000, 1000, false, 1, 1, 1)"
            )
        started = time.monotonic()
        waiter.join(15)
        assert [lease["job_id"] for lease in got] == ["job_quiet"]
        assert time.monotonic() - started < 5  # the long-poll's own timeout is 10 s


def test_an_ack_that_frees_a_capped_slot_notifies_other_servers() -> None:
    # A lease that ends in a queue a claim here found capped (max_leased) may let a long-poll
    # elsewhere claim: the ack's commit names the queue (QueueService._slot_freed).
    heard = Heard()
    other = QueueService(driver=PostgresDriver("postgresql"))  # another origin: another server
    other.set_queue_limits("capped", max_leased=1)
    other.submit_batch([{"queue": "capped", "payload": i} for i in range(3)])
    wait_until(lambda: "capped" in heard.queues(), what="the submit's notification")
    heard.clear()
    leases = other.claim(["capped"], worker_id="w", max_jobs=3)
    assert len(leases) == 1  # the cap
    other.ack(leases[0]["job_id"], worker_id="w", lease_token=leases[0]["lease_token"])
    (lease,) = other.claim(["capped"], worker_id="w")
    other.fail(lease["job_id"], worker_id="w", lease_token=lease["lease_token"], error="x")
    other.submit("marker", 1)  # notifications of one session come in commit order
    wait_until(lambda: "marker" in heard.queues(), what="the marker's notification")
    assert heard.queues() == ["capped", "capped", "marker"], heard.queues()


def test_an_ack_on_one_server_wakes_a_long_poll_held_by_the_cap_on_the_other(
    servers: Start,
) -> None:
    # The fallback poll is 60 s and the long-poll waits 20 s: only the ack's notification
    # wakes it within seconds.
    a, b = servers(2, RELAY_REAPER_INTERVAL_MS="60000")
    url = database_url("postgresql")["RELAY_DATABASE_URL"]
    got: list[Any] = []
    with (
        RelayClient(a.address) as producer,
        RelayClient(a.address) as first,
        RelayClient(b.address, timeout_s=30) as second,
        psycopg.connect(url) as locker,
    ):
        producer.set_queue_limits("capped", max_leased=1)
        producer.submit("capped", 1)
        producer.submit("capped", 2)
        (held,) = first.lease(["capped"], worker_id="first", max_jobs=2)
        # Hold the queue's controls row, so the long-poll's claim waits on it where we can
        # see it (pg_stat_activity); once that claim is over, the long-poll waits.
        locker.execute("SELECT 1 FROM relay_queue WHERE name = 'capped' FOR UPDATE")
        waiter = threading.Thread(
            target=lambda: got.extend(second.lease(["capped"], worker_id="second", wait_ms=20_000))
        )
        waiter.start()
        with psycopg.connect(url, autocommit=True) as watcher:

            def blocked() -> int | None:
                row = watcher.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE '%%relay_queue%%'"
                ).fetchone()
                return int(row[0]) if row else None

            pid = wait_until(blocked, what="the long-poll's claim to wait on the row lock")
            locker.rollback()

            def claim_over() -> bool:
                row = watcher.execute(
                    "SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
                return row is None or row[0] == "idle"

            wait_until(claim_over, what="the long-poll's first claim to end")
        assert not got and waiter.is_alive()  # held back by the cap
        first.ack(held["job_id"], worker_id="first", lease_token=held["lease_token"])
        acked = time.monotonic()
        waiter.join(30)
        assert [lease["payload"] for lease in got] == [2]
        assert time.monotonic() - acked < 5, "woken by the fallback poll or the deadline"
