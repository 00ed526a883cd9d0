"""``relay bench --database-url postgresql://...``: Relay on PostgreSQL beside a raw psycopg floor.

The run creates a database of its own on that server (``relay_bench_<id>``, dropped at the
end), migrates it, and measures in this order, so each Relay figure has its floor measured
minutes apart on the same machine:

1. the floor for inserts: ``insert_job`` one per transaction, and 100 per transaction;
2. one ``relay_server``: submissions (one job, and batches of 100) by 1 and 16 producers;
   the insert floor again; the claim+ack floor; lease+ack by 1 / 4 / 16 workers; the
   claim+ack floor again; submit-to-start latency with a worker waiting on the same server;
3. a second server on the same database: submit-to-start with the worker waiting on the
   other server (the wake-up crosses servers: LISTEN/NOTIFY), and lease+ack by 16 workers
   split 8 + 8 over the two servers, on one queue;
4. backlog: claim latency through the server with 1,000 and with 1,000,000 READY jobs
   (``--quick``: 100,000), filled by one ``INSERT ... SELECT generate_series``; at each size
   also with queue controls in force (issue 16: a paused queue as full, the claimed queue
   capped and rated; ``scenarios.CONTROLS``). ``--backlog-only`` runs only this step.

The floor is one psycopg connection running the driver's own statements
(``queue_core/storage/postgresql/queries.sql``): ``insert_job``; ``claim`` (the one-statement
claim, one job) then ``ack``, each in its own transaction: two commits per job, as in Relay.
It runs with the database's ``synchronous_commit``, as the server does, and psycopg's
default prepared statements (after five executions), as the server does.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
import psycopg

from relay_bench import load, procs, runs, scenarios
from relay_bench.floor import ack_params, job_row
from relay_bench.runner import Progress, Sizes, Steps, loadavg, machine
from relay_bench.stats import rate, ratio, summarize

Tick = Callable[[int], None]
PRODUCERS = (1, 16)
WORKERS = (1, 4, 16)


def with_database(url: str, name: str) -> str:
    """Return ``url`` naming database ``name`` instead of its own."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def _queries() -> dict[str, str]:
    from queue_core.storage.postgresql.driver import QUERIES  # Django is set up here

    return QUERIES


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def fill(url: str, queue: str, count: int, payload: str) -> None:
    """Insert ``count`` READY jobs of ``queue`` in one statement, then ANALYZE (set-up)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """
            INSERT INTO relay_job (id, queue, state, priority, payload, attempt, failures,
                                   max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter,
                                   created_at_ms, ready_since_ms, updated_at_ms)
            SELECT 'job_' || %(queue)s || lpad(g::text, 12, '0'), %(queue)s, 'ready', 1,
                   %(payload)s, 0, 0, 3, 'exponential', 1000, 300000, true,
                   %(now)s, %(now)s, %(now)s
              FROM generate_series(1, %(n)s) AS g
            """,
            {"queue": queue, "n": count, "now": _now_ms(), "payload": payload},
        )
        conn.execute("ANALYZE relay_job")


def floor_inserts(url: str, one: int, batches: int, payload: str, tick: Tick) -> dict[str, Any]:
    """``insert_job`` one per transaction, then 100 per transaction; jobs/s and latency."""
    sql = _queries()["insert_job"]
    out: dict[str, Any] = {}
    with psycopg.connect(url) as conn:
        for name, per_txn, txns in (("insert_one", 1, one), ("insert_batch100", 100, batches)):
            lat: list[float] = []
            start = time.perf_counter()
            n = 0
            tag = secrets.token_hex(3)
            for _ in range(txns):
                t0 = time.perf_counter()
                now = _now_ms()
                with conn.cursor() as cur:
                    rows = []
                    for _ in range(per_txn):
                        row = job_row(n, now, payload, queue=f"floor-{name}")
                        row["id"] = f"job_{tag}{now:013d}{n:010d}"
                        rows.append(row)
                        n += 1
                    if per_txn == 1:
                        cur.execute(sql, rows[0])
                    else:
                        cur.executemany(sql, rows)
                conn.commit()
                lat.append((time.perf_counter() - t0) * 1000)
                tick(per_txn)
            elapsed = time.perf_counter() - start
            out[name] = {
                "jobs": n,
                "seconds": round(elapsed, 3),
                "per_s": rate(n, elapsed),
                "latency_ms": summarize(lat),
            }
    return out


def floor_claim_ack(url: str, count: int, payload: str, tick: Tick) -> dict[str, Any]:
    """Fill ``count`` jobs, then claim one (a transaction) and ack it (another) until done."""
    queue = f"floor-claim-{secrets.token_hex(3)}"
    fill(url, queue, count, payload)
    q = _queries()
    claim_lat: list[float] = []
    ack_lat: list[float] = []
    done = 0
    with psycopg.connect(url) as conn:
        start = time.perf_counter()
        for _ in range(count):
            t0 = time.perf_counter()
            now = _now_ms()
            token = secrets.token_urlsafe(24)
            params = {
                "guard": True,  # the path of a queue without controls (relay_queue)
                "queues": [queue],
                "limits": [1],
                "limit": 1,
                "now_ms": now,
                "expires_ms": now + 30_000,
                "worker_id": "floor",
                "tokens": [token],
                "room": 1 << 20,
            }
            row = conn.execute(q["claim"], params).fetchone()
            conn.commit()
            if row is None:
                break
            t1 = time.perf_counter()
            ack = ack_params(row[0], token)
            conn.execute(q["ack"], ack).fetchall()
            conn.commit()
            t2 = time.perf_counter()
            claim_lat.append((t1 - t0) * 1000)
            ack_lat.append((t2 - t1) * 1000)
            done += 1
            tick(1)
        elapsed = time.perf_counter() - start
    return {
        "jobs": done,
        "seconds": round(elapsed, 3),
        "per_s": rate(done, elapsed),
        "claim_latency_ms": summarize(claim_lat),
        "ack_latency_ms": summarize(ack_lat),
    }


def claim_latency(
    address: str, queue: str, claims: int, tick: Tick, *, paused: str | None = None
) -> dict[str, Any]:
    """One worker: lease one job of ``queue`` and ack it, ``claims`` times; lease latency.

    With ``paused`` (the controls variant, issue 16) ``scenarios.CONTROLS`` are put in force
    first (``paused`` paused, ``queue`` capped and rated) and the worker names ``paused``
    before ``queue``; the result then has ``controls`` and ``leased_from_paused`` (must be 0).
    """
    lat: list[float] = []
    queues = [paused, queue] if paused else [queue]
    from_paused = 0
    with scenarios._client(address) as client:
        in_force = scenarios.set_controls(client, queue, paused) if paused else None
        for _ in range(claims):
            t0 = time.perf_counter()
            jobs = client.lease(queues, worker_id="bench-backlog")
            lat.append((time.perf_counter() - t0) * 1000)
            for job in jobs:
                from_paused += job["queue"] == paused
                client.ack(job["job_id"], worker_id="bench-backlog", lease_token=job["lease_token"])
            tick(1)
    out: dict[str, Any] = {"claims": len(lat), "lease_latency_ms": summarize(lat)}
    if paused:
        out["controls"] = in_force
        out["leased_from_paused"] = from_paused
    return out


class PgBench(Steps):
    """One benchmark run on PostgreSQL.

    Args:
        url: ``postgresql://user@host:port/dbname``; the run creates and drops a database of
            its own on that server (the user needs CREATEDB).
        sizes: how much work (``runner.FULL``, ``runner.QUICK``, or ``.scaled(...)``).
        progress: the progress hook.
        producers, workers: the concurrency levels of the submit and lease+ack scenarios.
        backlog_enabled: run the backlog scenario (``--no-backlog`` skips it).
        backlog_only: run only the backlog scenario, plain and with queue controls
            (``relay bench --backlog-only``); the document then has ``meta``, ``backlog``,
            ``backlog_controls`` and ``targets`` (``runs.backlog_targets``).
    """

    def __init__(
        self,
        url: str,
        sizes: Sizes,
        *,
        progress: Progress | None = None,
        producers: tuple[int, ...] = PRODUCERS,
        workers: tuple[int, ...] = WORKERS,
        backlog_enabled: bool = True,
        backlog_only: bool = False,
    ) -> None:
        self.admin_url = url
        self.backlog_enabled = backlog_enabled
        self.backlog_only = backlog_only
        self.sizes = sizes
        self.progress = progress or Progress()
        self.producers = producers
        self.workers = workers
        self.run_id = secrets.token_hex(3)
        self.url = with_database(url, f"relay_bench_{self.run_id}")
        self.step_seconds: dict[str, float] = {}

    def run(self) -> dict[str, Any]:
        """Run every scenario and return the result document (``render``/``markdown``).

        Raises:
            RuntimeError: migrate failed or a server would not start.
            psycopg.Error: the database server refused (unreachable, no CREATEDB).
        """
        started = time.time()
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            sync = conn.execute("SHOW synchronous_commit").fetchone()
            conn.execute(f'CREATE DATABASE "relay_bench_{self.run_id}"')
        doc: dict[str, Any] = {
            "meta": {
                "tool": "relay_bench",
                "database": "postgresql",
                "postgresql": version[0] if version else None,
                "synchronous_commit": sync[0] if sync else None,
                "sizes": self.sizes.name,
                "started_at_ms": int(started * 1000),
                "machine": machine(),
                "loadavg_start": loadavg(),
            }
        }
        workdir = Path(tempfile.mkdtemp(prefix="relay-bench-pg-"))
        try:
            with self._step("migrate the bench database"):
                procs.migrate(procs.child_env("", RELAY_DATABASE_URL=self.url))
            env = scenarios.Env(
                workdir=workdir,
                template=workdir / "unused.db",
                synchronous=str(doc["meta"]["synchronous_commit"]),
                run_id=self.run_id,
                deadline_s=self.sizes.deadline_s,
            )
            if self.backlog_only:
                self._backlog_only(doc)
            else:
                self._run_all(doc, env)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            with psycopg.connect(self.admin_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "relay_bench_{self.run_id}" WITH (FORCE)')
        doc["meta"]["loadavg_end"] = loadavg()
        doc["meta"]["duration_s"] = round(time.time() - started, 1)
        doc["meta"]["step_seconds"] = self.step_seconds
        doc["targets"] = runs.backlog_targets(doc) if self.backlog_only else targets(doc)
        return doc

    def _backlog_only(self, doc: dict[str, Any]) -> None:
        body = orjson.dumps(load.payload(0), option=orjson.OPT_SORT_KEYS).decode()
        with self._step("start relay_server"):
            a = self._server()
        try:
            doc.update(self._backlog(a.address, body))
            doc["server"] = {"peak_rss_mb": a.peak_rss_mb()}
        finally:
            a.stop()

    def _server(self) -> procs.ServerProcess:
        return procs.ServerProcess(None, RELAY_DATABASE_URL=self.url)

    def _run_all(self, doc: dict[str, Any], env: scenarios.Env) -> None:
        sz = self.sizes
        body = orjson.dumps(load.payload(0), option=orjson.OPT_SORT_KEYS).decode()
        inserts, claims = [], []
        units = sz.floor_insert_one + sz.floor_batches * 100
        with self._step("floor: inserts", units) as tick:
            inserts.append(
                floor_inserts(self.url, sz.floor_insert_one, sz.floor_batches, body, tick)
            )
        a = self._server()
        b: procs.ServerProcess | None = None
        try:
            rows = doc.setdefault("submit", [])
            for batch in (None, 100):
                total = sz.submit_total if batch is None else sz.batch_total
                for c in self.producers:
                    label = "one job" if batch is None else "batches of 100"
                    with self._step(f"submit, {label}, {c} producers"):
                        rows.append(
                            scenarios.submit(
                                env,
                                a.address,
                                concurrency=c,
                                ops_per_thread=max(1, total // c),
                                batch=batch,
                                server_pid=a.pid,
                            )
                        )
            with self._step("floor: inserts, again", units) as tick:
                inserts.append(
                    floor_inserts(self.url, sz.floor_insert_one, sz.floor_batches, body, tick)
                )
            with self._step("floor: claim+ack", sz.floor_claim_ack) as tick:
                claims.append(floor_claim_ack(self.url, sz.floor_claim_ack, body, tick))
            lease_rows = doc.setdefault("lease_ack", [])
            for c in self.workers:
                jobs = sz.lease_jobs.get(c) or max(2 * c, min(sz.lease_jobs.values()))
                with self._step(f"lease+ack, {c} workers"):
                    lease_rows.append(
                        scenarios.lease_ack(
                            env, a.address, concurrency=c, jobs=jobs, server_pid=a.pid
                        )
                    )
            with self._step("floor: claim+ack, again", sz.floor_claim_ack) as tick:
                claims.append(floor_claim_ack(self.url, sz.floor_claim_ack, body, tick))
            doc["floor"] = {
                "insert_one": scenarios.combine([r["insert_one"] for r in inserts]),
                "insert_batch100": scenarios.combine([r["insert_batch100"] for r in inserts]),
                "claim_ack": scenarios.combine(claims),
            }
            with self._step("submit-to-start, one server", sz.submit_to_start) as tick:
                doc["submit_to_start"] = scenarios.submit_to_start(
                    env, a.address, samples=sz.submit_to_start, tick=tick
                )
            with self._step("start a second server"):
                b = self._server()
            with self._step("submit-to-start, across servers", sz.submit_to_start) as tick:
                doc["submit_to_start_across"] = scenarios.submit_to_start(
                    env, a.address, samples=sz.submit_to_start, tick=tick,
                    consumer_address=b.address,
                )  # fmt: skip
            with self._step("lease+ack, 16 workers over two servers"):
                doc["two_servers"] = self._split_lease_ack(env, a.address, b.address)
            if self.backlog_enabled:
                doc.update(self._backlog(a.address, body))
            else:
                doc["backlog"] = {"status": "skipped: --no-backlog", "sizes": []}
            doc["server"] = {"peak_rss_mb": a.peak_rss_mb()}
        finally:
            a.stop()
            if b is not None:
                b.stop()
        lease16 = next((r for r in doc["lease_ack"] if r["concurrency"] == 16), None)
        fl = doc["floor"]
        for row in doc["submit"]:
            floor = fl["insert_one" if row["mode"] == "single" else "insert_batch100"]["per_s"]
            row["ratio_to_floor"] = ratio(row["per_s"], floor)
        for row in doc["lease_ack"]:
            row["ratio_to_floor"] = ratio(row["per_s"], fl["claim_ack"]["per_s"])
        two = doc["two_servers"]
        two["ratio_to_floor"] = ratio(two["per_s"], fl["claim_ack"]["per_s"])
        two["ratio_to_one_server"] = ratio(two["per_s"], lease16["per_s"]) if lease16 else None

    def _split_lease_ack(self, env: scenarios.Env, a: str, b: str) -> dict[str, Any]:
        """16 workers, 8 on each server, draining one queue; the jobs/s of both together."""
        jobs = self.sizes.lease_jobs.get(16) or 1280
        queue = f"bench-{env.run_id}-two"
        scenarios.prefill(a, queue, jobs)
        results: dict[str, dict[str, Any]] = {}

        def drain(address: str) -> None:
            results[address] = load.run(
                address,
                "lease_ack",
                concurrency=8,
                processes=1,
                ops_per_thread=jobs,
                deadline_s=env.deadline_s,
                queue=queue,
            )

        start = time.perf_counter()
        threads = [threading.Thread(target=drain, args=(addr,)) for addr in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        ops = sum(int(r["ops"]) for r in results.values())
        return {
            "concurrency": 16,
            "servers": 2,
            "jobs": ops,
            "seconds": round(elapsed, 3),
            "per_s": rate(ops, elapsed),
            "per_server_ops": [int(results[addr]["ops"]) for addr in (a, b)],
        }

    def _backlog(self, address: str, body: str) -> dict[str, Any]:
        """At each backlog size: the plain claim, then the claim with queue controls in force
        (a paused queue of as many READY jobs, named first; the claimed queue capped and rated:
        ``scenarios.CONTROLS``) on queues of their own. Returns ``{"backlog", "backlog_controls"}``
        (each ``{"status", "sizes": [row]}``). The jobs a size leaves stay in the table, in
        other queues, while the larger sizes run."""
        sz = self.sizes
        rows, controlled = [], []
        for size in sz.backlog_sizes:
            queue = f"backlog-{size}"
            with self._step(f"backlog: fill {size:,} ready jobs"):
                fill(self.url, queue, size, body)
            with self._step(f"backlog: claims at {size:,} ready", sz.backlog_claims) as tick:
                rows.append(
                    {"ready_jobs": size, **claim_latency(address, queue, sz.backlog_claims, tick)}
                )
            queue, paused = f"backlog-{size}-capped", f"backlog-{size}-paused"
            with self._step(f"backlog with controls: fill 2 x {size:,} ready jobs"):
                fill(self.url, queue, size, body)
                fill(self.url, paused, size, body)
            name = f"backlog with a paused queue, a cap and a rate: claims at {size:,} ready"
            with self._step(name, sz.backlog_claims) as tick:
                controlled.append(
                    {
                        "ready_jobs": size,
                        **claim_latency(address, queue, sz.backlog_claims, tick, paused=paused),
                    }
                )
        return {
            "backlog": {"status": "ran", "sizes": rows},
            "backlog_controls": {
                "status": "ran",
                "controls": dict(scenarios.CONTROLS),
                "sizes": controlled,
            },
        }


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's PostgreSQL targets against one run: ``[{name, target, value, met}]``."""
    out: list[dict[str, Any]] = []

    def add(name: str, target: str, value: float | None, ok: Callable[[float], bool]) -> None:
        out.append(
            {
                "name": name,
                "target": target,
                "value": value,
                "met": None if value is None else ok(value),
            }
        )

    lease16 = next((r for r in doc.get("lease_ack", []) if r.get("concurrency") == 16), None)
    add(
        "lease+ack, 16 workers vs PostgreSQL claim+ack floor",
        ">= 1.0",
        lease16.get("ratio_to_floor") if lease16 else None,
        lambda v: v >= 1.0,
    )
    batch = next(
        (r for r in doc.get("submit", []) if r["mode"] == "batch100" and r["concurrency"] == 1),
        None,
    )
    add(
        "batch submit vs PostgreSQL batch-insert floor",
        ">= 0.50",
        batch.get("ratio_to_floor") if batch else None,
        lambda v: v >= 0.5,
    )
    sizes = doc.get("backlog", {}).get("sizes", [])
    flat = None
    if len(sizes) >= 2:
        small, big = sizes[0], sizes[-1]
        flat = ratio(big["lease_latency_ms"]["p50"], small["lease_latency_ms"]["p50"])
        label = f"claim p50, {big['ready_jobs']:,} vs {small['ready_jobs']:,} ready"
    else:
        label = "claim p50, largest vs smallest backlog"
    add(label, "<= 1.5", flat, lambda v: v <= 1.5)
    controlled = runs.flat_target(
        doc.get("backlog_controls", {}).get("sizes", []), runs.CONTROLS_LABEL
    )
    add(controlled["name"], "<= 1.5", controlled["value"], lambda v: v <= runs.FLAT_CLAIM)
    across = doc.get("submit_to_start_across", {}).get("latency_ms", {}).get("p99")
    add(
        "submit-to-start p99 across servers, idle (ms)",
        "< 50",
        across,
        lambda v: v < 50,
    )
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The run as Markdown tables (docs/benchmarking.md pastes these)."""
    m = doc["meta"]
    lines = [
        f"PostgreSQL {m.get('postgresql')}, synchronous_commit={m.get('synchronous_commit')}, "
        f"{m['machine']['cores']} cores, load {m.get('loadavg_start')} -> {m.get('loadavg_end')}, "
        f"sizes {m['sizes']}, {m.get('duration_s')} s",
        "",
        "| scenario | jobs/s | p50 ms | p99 ms | ratio to floor |",
        "|---|---:|---:|---:|---:|",
    ]
    fl = doc.get("floor", {})
    for name in ("insert_one", "insert_batch100", "claim_ack"):
        row = fl.get(name)
        if row:
            lat: dict[str, Any] = row.get("latency_ms") or row.get("claim_latency_ms") or {}
            lines.append(
                f"| floor {name} (rounds {row.get('rounds_per_s')}) | {row['per_s']:,.0f} | "
                f"{lat.get('p50', '')} | {lat.get('p99', '')} | 1.00 |"
            )
    for row in doc.get("submit", []):
        lat = next(iter(row.get("latency_ms", {}).values()), {})
        lines.append(
            f"| submit {row['mode']}, {row['concurrency']} producers | {row['per_s']:,.0f} | "
            f"{lat.get('p50', '')} | {lat.get('p99', '')} | {row.get('ratio_to_floor')} |"
        )
    for row in doc.get("lease_ack", []):
        lat = row.get("latency_ms", {}).get("lease", {})
        lines.append(
            f"| lease+ack, {row['concurrency']} workers | {row['per_s']:,.0f} | "
            f"{lat.get('p50', '')} | {lat.get('p99', '')} | {row.get('ratio_to_floor')} |"
        )
    two = doc.get("two_servers")
    if two:
        lines.append(
            f"| lease+ack, 16 workers over two servers ({two['per_server_ops']}) | "
            f"{two['per_s']:,.0f} | | | {two.get('ratio_to_floor')} "
            f"({two.get('ratio_to_one_server')}x one server) |"
        )
    for key, label in (("submit_to_start", "one server"), ("submit_to_start_across", "across")):
        lat = doc.get(key, {}).get("latency_ms", {})
        if lat:
            lines.append(f"| submit-to-start, {label} | | {lat.get('p50')} | {lat.get('p99')} | |")
    for row in doc.get("backlog", {}).get("sizes", []):
        lat = row["lease_latency_ms"]
        lines.append(
            f"| lease at {row['ready_jobs']:,} ready | | {lat.get('p50')} | {lat.get('p99')} | |"
        )
    for row in doc.get("backlog_controls", {}).get("sizes", []):
        lat = row["lease_latency_ms"]
        lines.append(
            f"| lease at {row['ready_jobs']:,} ready, paused queue + cap + rate "
            f"({row['leased_from_paused']} from the paused queue) | | {lat.get('p50')} | "
            f"{lat.get('p99')} | |"
        )
    lines += ["", "| target | wanted | measured | met |", "|---|---|---:|---|"]
    for t in doc.get("targets", []):
        lines.append(f"| {t['name']} | {t['target']} | {t['value']} | {t['met']} |")
    return "\n".join(lines) + "\n"
