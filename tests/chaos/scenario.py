"""The crash/restart scenario: real server and worker processes killed with SIGKILL, restarted.

``run_chaos(ChaosConfig(...))`` submits jobs whose payloads dictate their end (succeed after a
short sleep, fail until the retry budget is spent, fail non-retryably), starts a ``relay_server``
and several ``relay_worker`` processes, and then, ``cycles`` times, waits until a random amount
of progress has been made (a bounded poll of the database, never a fixed sleep) and SIGKILLs the
server, one worker, or everything. Workers reach the server through a ``Proxy`` with a stable
address, so a killed server is restarted on a fresh port (port 0) behind the same address and
workers from before the kill keep running: their old tokens must be fenced out.

After each kill and after each restart ``tests.audit.audit`` checks the database invariants.
At the end every job must be terminal in the state its payload dictates, none lost, no lease
acked twice, and the extra deliveries (beyond what the payload alone causes) bounded by the
leases in flight at the kills: per job by its interrupted attempts, and in total by the leases
the restarted servers recovered, the leases of killed workers that expired, and the leases a
server gave back because their lease reply could not be sent (a worker killed while its claim
ran): attempts the history closes as ``released`` that no worker's own log shows it received.

Used by ``tests/crash/test_crash_recovery.py`` (short, in CI) and ``python -m tests.chaos.run``
(long, opt-in). No Django in this process: the database is read with ``sqlite3``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from queue_core.client import RelayClient
from tests.audit import audit, counts
from tests.chaos.proxy import Proxy
from tests.procs import Proc, Spawner, spawner

QUEUE = "chaos"


@dataclasses.dataclass(frozen=True)
class ChaosConfig:
    """One chaos run.

    Attributes:
        db: SQLite file to use (created and migrated by the server).
        cycles: how many kill/restart cycles.
        jobs: how many jobs.
        workers: how many ``relay_worker`` processes.
        concurrency: jobs each worker runs at once.
        lease_ms: the workers' lease length (a killed worker's jobs wait this long).
        seed: seeds the job mix and the kill points and kinds.
        settle_timeout_s: how long the jobs may take to finish after the last cycle.
        kinds: what each cycle kills (``server``, ``worker`` or ``all``), cycled through;
            empty: a random choice each cycle.
    """

    db: Path
    cycles: int = 4
    jobs: int = 1000
    workers: int = 2
    concurrency: int = 8
    lease_ms: int = 2000
    seed: int = 20261129
    settle_timeout_s: float = 180.0
    kinds: tuple[str, ...] = ()


@dataclasses.dataclass
class ChaosResult:
    """What happened, and every violation found (``ok`` when there is none)."""

    jobs: int = 0
    kills: list[str] = dataclasses.field(default_factory=list)
    recovered_leases: int = 0
    expired_leases_of_killed_workers: int = 0
    expired_leases_of_live_workers: int = 0
    released_unsent: int = 0
    released_by_workers: int = 0
    deliveries: int = 0
    executions_logged: int = 0
    duplicates: int = 0
    lost: int = 0
    audits: int = 0
    final_states: dict[str, int] = dataclasses.field(default_factory=dict)
    violations: list[str] = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def in_flight_at_kills(self) -> int:
        """Leases interrupted by the kills: recovered at restart, or expired after a kill."""
        return self.recovered_leases + self.expired_leases_of_killed_workers

    @property
    def allowed_duplicates(self) -> int:
        """Deliveries a kill (or, rarely, a renewal stalled past its lease) may repeat, and
        deliveries given back without running: by the server when it could not send the lease
        reply, or by a worker that stopped."""
        return (
            self.in_flight_at_kills
            + self.expired_leases_of_live_workers
            + self.released_unsent
            + self.released_by_workers
        )

    @property
    def ok(self) -> bool:
        """True when no invariant was violated."""
        return not self.violations

    def summary(self) -> str:
        """One line per figure, for people."""
        kinds = collections.Counter(self.kills)
        return "\n".join(
            [
                f"jobs={self.jobs} final={self.final_states}",
                f"kills={len(self.kills)} ({', '.join(f'{k}={n}' for k, n in kinds.items())})",
                f"in_flight_at_kills={self.in_flight_at_kills} (recovered at restart="
                f"{self.recovered_leases}, expired from killed workers="
                f"{self.expired_leases_of_killed_workers})",
                f"expired_leases_of_live_workers={self.expired_leases_of_live_workers}"
                " (a stalled renewal, not a kill; normally 0)",
                f"released_unsent={self.released_unsent} (leases the server gave back: their"
                f" reply could not be sent) released_by_workers={self.released_by_workers}",
                f"deliveries={self.deliveries} executions_logged={self.executions_logged}",
                f"duplicates={self.duplicates} (allowed <= {self.allowed_duplicates})",
                f"lost={self.lost} audits={self.audits} elapsed={self.elapsed_s:.1f}s",
                "result=" + ("OK" if self.ok else f"{len(self.violations)} VIOLATION(S)"),
                *(f"  violation: {v}" for v in self.violations),
            ]
        )


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a job's payload dictates: its end state and its deliveries without faults."""

    state: str
    deliveries: int


def make_jobs(rng: random.Random, n: int) -> tuple[list[dict[str, Any]], list[Expected]]:
    """Job specs (submit args) and what each must end as."""
    specs: list[dict[str, Any]] = []
    expected: list[Expected] = []
    for i in range(n):
        roll = rng.random()
        spec: dict[str, Any] = {
            "queue": QUEUE,
            "backoff": "fixed",
            "backoff_base_ms": 20,
            "jitter": False,
            "idempotency_key": f"chaos-{i}",
        }
        if roll < 0.65:
            # A lost lease counts as a failure: a generous budget so kills never kill the job.
            # One in twenty runs for seconds, so a worker from before a server restart is often
            # still running one and then acks it with its old token: that ack must be refused.
            sleep_ms = rng.randint(1_500, 2_500) if roll < 0.03 else rng.randint(5, 120)
            spec |= {"payload": {"i": i, "sleep_ms": sleep_ms}, "max_retries": 100}
            spec["priority"] = rng.choice(["low", "normal", "high"])
            expected.append(Expected("succeeded", 1))
        elif roll < 0.85:
            retries = rng.randint(0, 2)
            spec |= {"payload": {"i": i, "fail": True, "error": f"e{i}"}, "max_retries": retries}
            expected.append(Expected("dead", retries + 1))
        else:
            spec |= {
                "payload": {"i": i, "fail": True, "error": "bad", "retryable": False},
                "max_retries": 5,
            }
            expected.append(Expected("dead", 1))
        specs.append(spec)
    return specs, expected


class _Cluster:
    """The server, the workers and the proxy in front of the server."""

    def __init__(self, spawn: Spawner, config: ChaosConfig, log: Callable[[str], None]) -> None:
        self.spawn = spawn
        self.config = config
        self.log = log
        self.proxy = Proxy(None)
        self.server: Proc | None = None
        self.servers: list[Proc] = []
        self.workers: dict[int, Proc] = {}
        self.worker_ids: dict[int, str] = {}
        self.killed_worker_ids: set[str] = set()
        self.generation = 0

    def start_server(self) -> None:
        server, port = self.spawn.server(RELAY_REAPER_INTERVAL_MS="200")
        self.server = server
        self.servers.append(server)
        self.proxy.retarget(port)

    def start_worker(self, slot: int) -> None:
        self.generation += 1
        worker_id = f"chaos-w{slot}-g{self.generation}"
        proc = self.spawn(
            "relay_worker",
            "--address",
            self.proxy.address,
            "--queue",
            QUEUE,
            "--concurrency",
            str(self.config.concurrency),
            "--lease-ms",
            str(self.config.lease_ms),
            "--wait-ms",
            "1000",
            "--shutdown-timeout-ms",
            "2000",
            "--worker-id",
            worker_id,
            name=worker_id,
        )
        proc.wait_event("worker_ready", timeout=60)
        self.workers[slot] = proc
        self.worker_ids[slot] = worker_id

    def kill_server(self) -> None:
        assert self.server is not None
        self.server.kill()
        self.proxy.retarget(None)  # clients see their connections close, new ones refused

    def kill_worker(self, slot: int) -> None:
        self.workers[slot].kill()
        self.killed_worker_ids.add(self.worker_ids[slot])

    def all_procs(self) -> list[Proc]:
        return list(self.spawn.procs)

    def close(self) -> None:
        self.proxy.close()


def _terminal(db: Path) -> int:
    c = counts(db)
    return c["succeeded"] + c["dead"]


def _wait_for(
    condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05
) -> None:
    """Poll ``condition`` until true; raise TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def _audit(db: Path, result: ChaosResult, when: str) -> None:
    result.audits += 1
    try:
        audit(db)
    except AssertionError as exc:
        result.violations.append(f"audit {when}: {exc}")


def run_chaos(config: ChaosConfig, log: Callable[[str], None] = print) -> ChaosResult:
    """Run the scenario; return what happened, with every violation in ``violations``."""
    began = time.monotonic()
    rng = random.Random(config.seed)
    result = ChaosResult(jobs=config.jobs)
    specs, expected = make_jobs(rng, config.jobs)
    with spawner(str(config.db)) as spawn:
        cluster = _Cluster(spawn, config, log)
        try:
            _run(cluster, config, rng, specs, expected, result)
        except (TimeoutError, AssertionError) as exc:
            result.violations.append(f"scenario: {exc}")
        finally:
            cluster.close()
    result.elapsed_s = time.monotonic() - began
    return result


def _submit_all(address: str, specs: list[dict[str, Any]]) -> list[str]:
    ids: list[str] = []
    with RelayClient(address, timeout_s=60) as client:
        for start in range(0, len(specs), 200):
            results = client.submit_batch(specs[start : start + 200])["results"]
            ids.extend(r["job_id"] for r in results)
    return ids


def _run(
    cluster: _Cluster,
    config: ChaosConfig,
    rng: random.Random,
    specs: list[dict[str, Any]],
    expected: list[Expected],
    result: ChaosResult,
) -> None:
    db = config.db
    cluster.start_server()
    ids = _submit_all(cluster.proxy.address, specs)
    if len(set(ids)) != len(specs):
        result.violations.append(f"submit returned {len(set(ids))} ids for {len(specs)} jobs")
    for slot in range(config.workers):
        cluster.start_worker(slot)

    # Kill points: amounts of progress (terminal jobs), one in each stretch of the first 90%
    # of the run; the first may be 0, a kill during the first claim burst.
    stretch = config.jobs * 0.9 / max(1, config.cycles)
    marks = [int(stretch * (c + rng.random())) for c in range(config.cycles)]
    for cycle, mark in enumerate(marks, 1):
        _wait_for(lambda m=mark: _terminal(db) >= m, 120, f"{mark} terminal jobs")
        if config.kinds:
            kind = config.kinds[(cycle - 1) % len(config.kinds)]
        else:
            kind = rng.choice(["server", "worker", "worker", "all"])
        slot = rng.randrange(config.workers)
        done = _terminal(db)
        if kind in ("server", "all"):
            cluster.kill_server()
        if kind == "worker":
            cluster.kill_worker(slot)
        if kind == "all":
            for s in list(cluster.workers):
                cluster.kill_worker(s)
        result.kills.append(kind)
        leased = counts(db)["leased"]
        cluster.log(f"cycle {cycle}: SIGKILL {kind} at {done} terminal jobs ({leased} leased)")
        _audit(db, result, f"after kill {cycle} ({kind})")
        if kind in ("server", "all"):
            cluster.start_server()
            _audit(db, result, f"after server restart {cycle}")
        if kind == "worker":
            cluster.start_worker(slot)
        if kind == "all":
            for s in range(config.workers):
                cluster.start_worker(s)
        _audit(db, result, f"after restart {cycle}")

    _wait_for(
        lambda: _terminal(db) == config.jobs,
        config.settle_timeout_s,
        f"all {config.jobs} jobs to finish (now {counts(db)})",
        poll_s=0.1,
    )
    for proc in cluster.workers.values():
        proc.signal(signal.SIGTERM)
    for proc in cluster.workers.values():
        proc.wait_exit(30)
    assert cluster.server is not None
    cluster.server.signal(signal.SIGTERM)
    cluster.server.wait_exit(30)
    _audit(db, result, "at the end")
    _check_outcome(cluster, db, ids, expected, result)


def _check_outcome(
    cluster: _Cluster,
    db: Path,
    ids: list[str],
    expected: list[Expected],
    result: ChaosResult,
) -> None:
    v = result.violations
    with contextlib.closing(sqlite3.connect(db)) as conn:
        jobs = {
            row[0]: row[1:]
            for row in conn.execute("SELECT id, state, attempt, failures FROM relay_job")
        }
        attempts = conn.execute(
            "SELECT job_id, attempt, worker_id, outcome FROM relay_attempt"
        ).fetchall()
    result.final_states = dict(collections.Counter(state for state, _, _ in jobs.values()))
    result.lost = sum(1 for job_id in ids if job_id not in jobs)
    if result.lost:
        v.append(f"{result.lost} job(s) lost")
    if len(jobs) != len(ids):
        v.append(f"{len(jobs)} jobs in the database, {len(ids)} submitted")

    # The workers' own logs, which the server cannot write: the deliveries each worker
    # received, acked, and gave back itself.
    leased: collections.Counter[tuple[str, int]] = collections.Counter()
    acked: collections.Counter[str] = collections.Counter()
    acked_attempt: dict[str, int] = {}
    worker_released: set[tuple[str, int]] = set()
    for proc in cluster.all_procs():
        if not proc.name.startswith("chaos-w"):
            continue
        for r in proc.records:
            if r.get("event") == "leased":
                leased[(r["job_id"], int(r["attempt"]))] += 1
            elif r.get("event") == "acked" and not r.get("duplicate"):
                acked[r["job_id"]] += 1
                acked_attempt[r["job_id"]] = int(r["attempt"])
            elif r.get("event") == "released":
                worker_released.add((r["job_id"], int(r["attempt"])))

    # Interrupted attempts: leases a kill cut short (recovered at a restart, or expired), and
    # leases given back unrun. The server gives back a lease whose reply it could not send (the
    # worker was killed while its claim ran): the history says "released", and the workers'
    # logs must agree that no worker received that delivery.
    interrupted: collections.Counter[str] = collections.Counter()
    for job_id, attempt, worker_id, outcome in attempts:
        if outcome == "recovered":
            interrupted[job_id] += 1
            result.recovered_leases += 1
        elif outcome == "lease_expired":
            interrupted[job_id] += 1
            if worker_id in cluster.killed_worker_ids:
                result.expired_leases_of_killed_workers += 1
            else:
                result.expired_leases_of_live_workers += 1
        elif outcome == "released":
            interrupted[job_id] += 1
            if (job_id, attempt) in worker_released:
                result.released_by_workers += 1
            elif leased[(job_id, attempt)]:
                v.append(
                    f"{job_id} attempt {attempt}: released, but {worker_id} received it and "
                    "did not release it"
                )
            else:
                result.released_unsent += 1
    logged_recovered = sum(
        int(r.get("leases", 0))
        for proc in cluster.servers
        for r in proc.records
        if r.get("event") == "recovered"
    )
    if logged_recovered != result.recovered_leases:
        v.append(
            f"servers logged {logged_recovered} recovered leases, history shows "
            f"{result.recovered_leases}"
        )

    for job_id, want in zip(ids, expected, strict=True):
        if job_id not in jobs:
            continue
        state, attempt, _ = jobs[job_id]
        result.deliveries += attempt
        if state != want.state:
            v.append(f"{job_id} ended {state}, its payload dictates {want.state}")
        extra = attempt - want.deliveries
        result.duplicates += max(0, extra)
        if extra > interrupted[job_id]:
            v.append(
                f"{job_id}: {attempt} deliveries, {want.deliveries} expected plus "
                f"{interrupted[job_id]} interrupted"
            )
    if result.duplicates > result.allowed_duplicates:
        v.append(f"{result.duplicates} duplicates > {result.allowed_duplicates} interrupted")

    # Each delivery handed to one worker; no lease acked twice.
    result.executions_logged = sum(leased.values())
    twice = [key for key, n in leased.items() if n > 1]
    if twice:
        v.append(f"deliveries handed to two workers: {twice[:5]}")
    if result.executions_logged > result.deliveries:
        v.append(f"{result.executions_logged} leases logged, {result.deliveries} in the history")
    double = [job_id for job_id, n in acked.items() if n > 1]
    if double:
        v.append(f"jobs acked twice (not as duplicates): {double[:5]}")
    succeeded_attempt = {
        job_id: attempt for job_id, attempt, _, outcome in attempts if outcome == "succeeded"
    }
    wrong = [
        job_id
        for job_id, attempt in acked_attempt.items()
        if succeeded_attempt.get(job_id) != attempt
    ]
    if wrong:
        v.append(f"accepted acks that are not the succeeded attempt: {wrong[:5]}")
