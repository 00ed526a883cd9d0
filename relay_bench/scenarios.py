"""The measurements. Each function runs one scenario and returns a JSON-ready dict.

Throughputs are jobs per second over the window from the first client's start to the last
one's end; latencies are per request, measured by the client (so they include the loopback
round trip, the server's queueing and the fsync of the group commit that carried them).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_core import errors
from queue_core.client import RelayClient
from relay_bench import floor, load, procs
from relay_bench.stats import rate, summarize

Tick = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Env:
    """What every scenario needs.

    Attributes:
        workdir: a temporary directory for database files (removed by the runner).
        template: a migrated empty database to copy.
        synchronous: the ``synchronous`` pragma of this part of the run (``FULL``,
            ``NORMAL``...): the servers the scenarios start get it as
            ``RELAY_SQLITE_SYNCHRONOUS``, and the floors use it.
        run_id: a short id that makes queue names unique to this run.
        deadline_s: the most any one load phase may take.
    """

    workdir: Path
    template: Path
    synchronous: str
    run_id: str
    deadline_s: float


def _client(address: str) -> RelayClient:
    return RelayClient(address, timeout_s=60.0, max_frame_bytes=load.MAX_FRAME_BYTES)


def _processes(concurrency: int) -> int:
    """Client processes for a concurrency level: 1 up to 4 clients, then one per 8 (min 2)."""
    if concurrency <= 4:
        return 1
    return max(2, min(8, concurrency // 8))


def _load_result(result: dict[str, Any]) -> dict[str, Any]:
    """Replace the raw latency lists of ``load.run`` by their summaries."""
    out = {k: v for k, v in result.items() if k != "latency_ms"}
    out["latency_ms"] = {name: summarize(v) for name, v in result["latency_ms"].items()}
    return out


def _measured(server_pid: int | None, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a load and add the server's CPU time per job (``server_cpu_us_per_job``).

    CPU per job barely moves when other processes compete for the cores, so it shows a change
    in the server's own work more reliably than a rate does on a busy machine.
    """
    before = procs.cpu_s(server_pid)
    result = _load_result(run())
    after = procs.cpu_s(server_pid)
    per_job = None
    if before is not None and after is not None and result["ops"]:
        per_job = round((after - before) / result["ops"] * 1e6, 1)
    result["server_cpu_us_per_job"] = per_job
    return result


# ------------------------------------------------------------------------------ the floor


def _floor_db(env: Env, kind: floor.Kind, name: str) -> str:
    """A fresh file for one floor loop: a copy of the migrated template (``schema``) or a new
    ``floor.LEAN_SCHEMA`` file (``lean``)."""
    if kind == "schema":
        return str(procs.fresh_db(env.template, env.workdir, name))
    path = env.workdir / f"{name}.db"
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            Path(f"{path}{suffix}").unlink()
    return floor.create_lean(str(path))


def lean_db(env: Env, name: str) -> str:
    """A new, empty lean floor file (``floor.LEAN_SCHEMA``) named ``name`` in ``env.workdir``."""
    return _floor_db(env, "lean", name)


def floor_inserts(
    env: Env, one: int, batches: int, tick: Tick, *, kind: floor.Kind = "schema"
) -> dict[str, Any]:
    """A floor for inserts at ``env.synchronous``: one per transaction, and 100 per
    transaction (one ``executemany``); ``kind`` is ``lean`` or ``schema`` (see ``floor``)."""
    body = _payload_text()
    single = floor.insert_one(
        _floor_db(env, kind, f"floor-{kind}-one"), one, body, env.synchronous, tick, kind=kind
    )
    batch = floor.insert_batches(
        _floor_db(env, kind, f"floor-{kind}-batch"),
        batches,
        100,
        body,
        env.synchronous,
        tick,
        kind=kind,
    )
    return {"insert_one": single, "insert_batch100": batch}


def floor_claim_ack(
    env: Env, count: int, tick: Tick, *, kind: floor.Kind = "schema"
) -> dict[str, Any]:
    """A floor for claim (one transaction) + ack (one transaction) at ``env.synchronous``."""
    path = _floor_db(env, kind, f"floor-{kind}-claim")
    return floor.claim_ack(path, count, _payload_text(), env.synchronous, tick, kind=kind)


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge floor rounds: the best round (its rate and latencies) plus every round's rate.

    The floor is measured before and after the Relay scenarios it is compared with. The
    better round is the one the machine disturbed least; a disturbed floor would flatter
    every Relay ratio, so the ratios are taken against the better one.
    """
    best = max(rounds, key=lambda r: r["per_s"])
    out = dict(best)
    out["rounds_per_s"] = [r["per_s"] for r in rounds]
    return out


def _payload_text() -> str:
    import orjson

    return orjson.dumps(load.payload(0), option=orjson.OPT_SORT_KEYS).decode()


# ------------------------------------------------------------------------------ TCP


def submit(
    env: Env,
    address: str,
    *,
    concurrency: int,
    ops_per_thread: int,
    batch: int | None,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """Producers submitting one job per request (``batch`` None) or ``batch`` per request."""
    kind = "submit" if batch is None else "submit_batch"
    out = _measured(
        server_pid,
        lambda: load.run(
            address,
            kind,
            concurrency=concurrency,
            processes=_processes(concurrency),
            ops_per_thread=ops_per_thread,
            deadline_s=env.deadline_s,
            queue=f"bench-{env.run_id}-submit",
            batch=batch or 1,
        ),
    )
    out.update(transport="tcp", mode="single" if batch is None else f"batch{batch}")
    return out


def prefill(address: str, queue: str, count: int) -> None:
    """Submit ``count`` jobs to ``queue`` in batches of 100 (set-up, not measured)."""
    with _client(address) as client:
        for lo in range(0, count, 100):
            n = min(100, count - lo)
            client.submit_batch(
                [{"queue": queue, "payload": load.payload(lo + i)} for i in range(n)]
            )


def lease_ack(
    env: Env,
    address: str,
    *,
    concurrency: int,
    jobs: int,
    server_pid: int | None = None,
    processes: int | None = None,
    lease_next: bool = False,
) -> dict[str, Any]:
    """``concurrency`` workers doing lease(max_jobs=1) -> ack until ``jobs`` are drained, in
    ``processes`` client processes (default ``_processes(concurrency)``).

    With ``lease_next`` each ack asks for the worker's next job in the same request (one
    request per job, as ``relay worker`` leases); the row then has ``mode: "lease_next"``,
    else no ``mode`` (two requests per job)."""
    queue = f"bench-{env.run_id}-lease{concurrency}{'n' if lease_next else ''}"
    prefill(address, queue, jobs)
    out = _measured(
        server_pid,
        lambda: load.run(
            address,
            "lease_next" if lease_next else "lease_ack",
            concurrency=concurrency,
            processes=processes or _processes(concurrency),
            ops_per_thread=jobs,
            deadline_s=env.deadline_s,
            queue=queue,
        ),
    )
    if lease_next:
        out["mode"] = "lease_next"
    ops = out["per_thread_ops"]
    # Fairness: the least-served worker's share relative to an even split.
    out["least_served_share"] = round(min(ops) * len(ops) / max(1, sum(ops)), 3)
    return out


def submit_to_start(
    env: Env, address: str, *, samples: int, tick: Tick, consumer_address: str | None = None
) -> dict[str, Any]:
    """Idle server, one worker waiting in a long-poll: time from ``submit`` to the lease reply.

    A producer submits one job at a time; a consumer thread long-polls ``lease`` (wait 5 s),
    notes when the lease arrives, acks, and long-polls again. The producer waits until the
    consumer is back in its long-poll (plus 2 ms for the request to reach the server) before
    the next submit, so every sample starts on an idle server with a waiting worker. With
    ``consumer_address`` (another server of the same PostgreSQL database) the worker waits
    there: the wake-up crosses servers.
    """
    queue = f"bench-{env.run_id}-s2s"
    arrived: list[float] = []
    sent: list[float] = []
    waiting = threading.Event()
    got = threading.Event()
    stop = threading.Event()
    problems: list[str] = []

    def consume() -> None:
        with _client(consumer_address or address) as client:
            while not stop.is_set():
                waiting.set()
                try:
                    jobs = client.lease([queue], worker_id="bench-s2s", wait_ms=5000)
                except (errors.RelayError, ConnectionError) as exc:
                    problems.append(repr(exc))
                    return
                now = time.perf_counter()
                waiting.clear()
                for job in jobs:
                    arrived.append(now)
                    client.ack(job["job_id"], worker_id="bench-s2s", lease_token=job["lease_token"])
                if jobs:
                    got.set()

    consumer = threading.Thread(target=consume, name="bench-s2s-consumer", daemon=True)
    consumer.start()
    submit_lat: list[float] = []
    with _client(address) as producer:
        try:
            for n in range(samples):
                if not waiting.wait(10) or problems:
                    break
                time.sleep(0.002)
                got.clear()
                t0 = time.perf_counter()
                sent.append(t0)
                producer.submit(queue, load.payload(n))
                submit_lat.append((time.perf_counter() - t0) * 1000)
                if not got.wait(10):
                    problems.append(f"job {n} not leased within 10 s")
                    break
                tick(1)
        finally:
            stop.set()
            with contextlib.suppress(errors.RelayError, ConnectionError):
                producer.submit(queue, {"stop": True})  # ends the consumer's last long-poll
    consumer.join(15)
    pairs = min(len(sent), len(arrived))
    lat = [(arrived[i] - sent[i]) * 1000 for i in range(pairs)]
    return {
        "samples": pairs,
        "latency_ms": summarize(lat),
        "submit_latency_ms": summarize(submit_lat),
        "problems": problems[:3],
    }


def worker_drain(
    env: Env,
    server: procs.ServerProcess,
    db_path: Path,
    *,
    jobs: int,
    concurrency: int,
    prefill_jobs: bool = True,
) -> dict[str, Any]:
    """Run a real ``relay_worker`` process until it has acked ``jobs`` jobs; its peak RSS and rate.

    With ``prefill_jobs`` the queue is filled first over TCP; otherwise it drains the backlog
    already in the file (queue ``bench``).
    """
    queue = f"bench-{env.run_id}-worker" if prefill_jobs else "bench"
    if prefill_jobs:
        prefill(server.address, queue, jobs)
    before = procs.count_state(db_path, "succeeded", queue)
    worker = procs.WorkerProcess(server.address, queue, concurrency, db_path)
    start = time.perf_counter()
    done = 0
    try:
        deadline = time.monotonic() + env.deadline_s
        while time.monotonic() < deadline:
            done = procs.count_state(db_path, "succeeded", queue) - before
            if done >= jobs or worker.popen.poll() is not None:
                break
            time.sleep(0.05)
        elapsed = time.perf_counter() - start
        peak = worker.peak_rss_mb()
    finally:
        worker.stop()
    return {
        "concurrency": concurrency,
        "jobs": done,
        "seconds": round(elapsed, 3),
        "per_s": rate(done, elapsed),
        "worker_peak_rss_mb": peak,
    }


# ------------------------------------------------------------------------------ backlog


# The queue controls in force in the controls variant of the backlog scenario: a paused queue
# holding as many READY jobs as the claimed one, named first in the worker's list, and a cap and
# a rate on the claimed queue high enough never to hold back one worker (one job leased at a
# time, about a thousand claims a second), so the claim runs their code paths on every call.
CONTROLS: dict[str, Any] = {
    "paused_queue": "bench-paused",
    "max_leased": 1000,
    "rate_per_s": 1_000_000.0,
    "burst": 1000,
}


def set_controls(client: RelayClient, queue: str, paused_queue: str) -> dict[str, Any]:
    """Put ``CONTROLS`` in force: pause ``paused_queue``, cap and rate ``queue`` (set-up).

    Returns:
        ``{"paused": QueueControls, "limited": QueueControls}``: the server's replies, so the
        report shows the controls the claims ran under, not the ones asked for.
    """
    paused = client.pause(paused_queue)
    limited = client.set_queue_limits(
        queue,
        max_leased=CONTROLS["max_leased"],
        rate_per_s=CONTROLS["rate_per_s"],
        burst=CONTROLS["burst"],
    )
    return {"paused": dict(paused), "limited": dict(limited)}


def backlog(
    env: Env,
    size: int,
    *,
    claims: int,
    worker_jobs: int,
    tick: Tick,
    controls: bool = False,
) -> dict[str, Any]:
    """Claim latency and server memory with ``size`` READY jobs waiting.

    The file is filled directly (``procs.fill_backlog``) before its server starts; then one
    worker does ``claims`` x lease(max_jobs=1) + ack, and, when ``worker_jobs`` > 0, a real
    ``relay_worker`` drains that many more.

    With ``controls`` (issue 16) the file also holds ``size`` READY jobs of a second queue,
    which is paused (``pause``) before the first claim, and the claimed queue gets a cap and
    a token-bucket rate (``set_queue_limits``; values in ``CONTROLS``); the worker names the
    paused queue first, so every claim skips it and passes the cap and the rate. The row
    then has ``controls`` (the server's replies to ``pause`` and ``set_queue_limits``:
    ``set_controls``) and ``leased_from_paused`` (must be 0).
    """
    name = f"backlog-{size}" + ("-controls" if controls else "")
    db_path = procs.fresh_db(env.template, env.workdir, name)
    fill_s = procs.fill_backlog(db_path, size, tick=tick)
    paused = CONTROLS["paused_queue"]
    if controls:
        fill_s = round(fill_s + procs.fill_backlog(db_path, size, queue=paused, first=size), 2)
    queues = [paused, "bench"] if controls else ["bench"]
    t0 = time.perf_counter()
    server = procs.ServerProcess(db_path, RELAY_SQLITE_SYNCHRONOUS=env.synchronous)
    startup_s = time.perf_counter() - t0
    from_paused = 0
    try:
        rss_idle = server.peak_rss_mb()
        lease_lat: list[float] = []
        ack_lat: list[float] = []
        with _client(server.address) as client:
            client.ping()
            in_force = set_controls(client, "bench", paused) if controls else None
            start = time.perf_counter()
            for _ in range(claims):
                a = time.perf_counter()
                jobs = client.lease(queues, worker_id="bench-backlog", max_jobs=1)
                b = time.perf_counter()
                if not jobs:
                    break
                from_paused += jobs[0]["queue"] == paused
                client.ack(
                    jobs[0]["job_id"], worker_id="bench-backlog", lease_token=jobs[0]["lease_token"]
                )
                c = time.perf_counter()
                lease_lat.append((b - a) * 1000)
                ack_lat.append((c - b) * 1000)
            elapsed = time.perf_counter() - start
        worker = (
            worker_drain(env, server, db_path, jobs=worker_jobs, concurrency=16, prefill_jobs=False)
            if worker_jobs
            else None
        )
        peak = server.peak_rss_mb()
    finally:
        server.stop()
    both = [x + y for x, y in zip(lease_lat, ack_lat, strict=True)]
    row: dict[str, Any] = {
        "ready_jobs": size,
        "fill_s": fill_s,
        "server_startup_s": round(startup_s, 2),
        "claims": len(lease_lat),
        "lease_ack_per_s": rate(len(lease_lat), elapsed),
        "lease_latency_ms": summarize(lease_lat),
        "ack_latency_ms": summarize(ack_lat),
        "lease_ack_latency_ms": summarize(both),
        "server_rss_after_start_mb": rss_idle,
        "server_peak_rss_mb": peak,
        "worker": worker,
    }
    if controls:
        row["controls"] = in_force
        row["leased_from_paused"] = from_paused
    return row


# ------------------------------------------------------------------------------ retention


def prune_under_load(
    env: Env, finished: int, *, claims_after: int = 2000, tick: Tick
) -> dict[str, Any]:
    """Claim latency while the server's retention deletes ``finished`` old SUCCEEDED jobs.

    ``finished`` jobs that finished two days ago (each with its attempt) and a READY backlog
    are written into a fresh file; a server with ``RELAY_RETENTION_SUCCEEDED=1d`` starts on
    it and prunes them in its bounded batches while one worker does lease(max_jobs=1) + ack
    without pause. Latencies are split into those taken while old jobs remained and the
    ``claims_after`` taken after the last one went. Bounded by ``env.deadline_s``.
    """
    db_path = procs.fresh_db(env.template, env.workdir, f"prune-{finished}")
    day_ms = 86_400_000
    fill_s = procs.fill_finished(db_path, finished, finished_at_ms=_now_ms() - 2 * day_ms)
    ready = finished // 2 + claims_after + 10_000  # more than the worker can drain meanwhile
    fill_s += procs.fill_backlog(db_path, ready)
    server = procs.ServerProcess(
        db_path, RELAY_RETENTION_SUCCEEDED="1d", RELAY_SQLITE_SYNCHRONOUS=env.synchronous
    )
    cutoff = _now_ms() - day_ms
    left = [finished]
    stop = threading.Event()

    def watch() -> None:  # counts old jobs from another connection, once a second
        with contextlib.closing(sqlite3.connect(db_path, timeout=30)) as conn:
            while not stop.is_set():
                (n,) = conn.execute(
                    "SELECT COUNT(*) FROM relay_job WHERE state = 'succeeded' "
                    "AND finished_at_ms < ?",
                    (cutoff,),
                ).fetchone()
                tick(left[0] - int(n))
                left[0] = int(n)
                if not n:
                    return
                stop.wait(1.0)

    during: list[float] = []
    after: list[float] = []
    watcher = threading.Thread(target=watch, name="prune-watch")
    try:
        start = time.perf_counter()
        watcher.start()
        done_s: float | None = None
        with _client(server.address) as client:
            while time.perf_counter() - start < env.deadline_s:
                a = time.perf_counter()
                jobs = client.lease(["bench"], worker_id="bench-prune", max_jobs=1)
                b = time.perf_counter()
                if not jobs:
                    break
                client.ack(
                    jobs[0]["job_id"], worker_id="bench-prune", lease_token=jobs[0]["lease_token"]
                )
                if left[0]:
                    during.append((b - a) * 1000)
                    continue
                if done_s is None:
                    done_s = time.perf_counter() - start
                after.append((b - a) * 1000)
                if len(after) >= claims_after:
                    break
    finally:
        stop.set()
        watcher.join(timeout=30)
        server.stop()
    return {
        "finished_jobs": finished,
        "fill_s": round(fill_s, 2),
        "pruned": finished - left[0],
        "prune_s": round(done_s, 1) if done_s is not None else None,
        "pruned_per_s": rate(finished - left[0], done_s) if done_s else None,
        "lease_latency_ms_while_pruning": summarize(during),
        "lease_latency_ms_after": summarize(after),
        "lease_acks_while_pruning": len(during),
    }


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
