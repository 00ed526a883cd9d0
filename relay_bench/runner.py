"""Run the whole benchmark: sizes, the order of the scenarios, the progress bar, the targets.

``Bench(sizes, ...).run()`` returns one JSON-ready document (see ``report`` for its keys).
Order, so that every Relay figure has its floor measured minutes apart on the same machine:

1. the raw floor for inserts (fresh files);
2. one ``relay_server`` on a fresh file: TCP submissions (1 / 4 / 16 producers, one job or
   100 per request), the insert floor again, the raw claim+ack floor, lease+ack at 1 / 4 /
   16 / 64 workers, the claim+ack floor again, submit-to-start latency, a real
   ``relay_worker`` process; the server's peak RSS. Each floor is the better of its round
   before and its round after the Relay scenarios it is compared with;
3. HTTP submissions through gunicorn, when the HTTP API is there;
4. backlog scaling: a fresh file per size, filled before its server starts.

With ``address`` (an already running server) only step 2's client-side scenarios run
against it; the floor still runs on local files and RSS and backlog are reported skipped.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import secrets
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import Progress as RichProgress

from relay_bench import http, procs, scenarios
from relay_bench.stats import ratio

SUBMIT_CONCURRENCY = (1, 4, 16)
LEASE_CONCURRENCY = (1, 4, 16, 64)


@dataclasses.dataclass(frozen=True, slots=True)
class Sizes:
    """How much work each scenario does (counts are totals unless named per thread)."""

    name: str
    floor_insert_one: int
    floor_batches: int  # of 100 jobs
    floor_claim_ack: int
    submit_total: int  # single-job submissions per concurrency level
    batch_total: int  # batches of 100 per concurrency level
    lease_jobs: dict[int, int]  # jobs drained per worker concurrency level
    submit_to_start: int
    worker_jobs: int
    backlog_sizes: tuple[int, ...]
    backlog_claims: int
    backlog_worker_jobs: int
    http_total: int
    deadline_s: float

    def scaled(self, factor: float) -> Sizes:
        """Every count times ``factor`` (at least a handful each); backlog sizes too."""

        def s(n: int, low: int = 8) -> int:
            return max(low, int(n * factor))

        return dataclasses.replace(
            self,
            name=f"{self.name}x{factor:g}",
            floor_insert_one=s(self.floor_insert_one),
            floor_batches=s(self.floor_batches, 2),
            floor_claim_ack=s(self.floor_claim_ack),
            submit_total=s(self.submit_total, 16),
            batch_total=s(self.batch_total, 16),
            lease_jobs={c: s(n, 2 * c) for c, n in self.lease_jobs.items()},
            submit_to_start=s(self.submit_to_start, 5),
            worker_jobs=s(self.worker_jobs, 16),
            backlog_sizes=tuple(sorted({s(n, 100) for n in self.backlog_sizes})),
            backlog_claims=s(self.backlog_claims, 10),
            backlog_worker_jobs=s(self.backlog_worker_jobs, 16),
            http_total=s(self.http_total, 16),
        )


FULL = Sizes(
    name="full",
    floor_insert_one=3000,
    floor_batches=300,
    floor_claim_ack=3000,
    submit_total=4800,
    batch_total=320,
    lease_jobs={1: 3000, 4: 4000, 16: 6400, 64: 6400},
    submit_to_start=500,
    worker_jobs=3000,
    backlog_sizes=(1_000, 100_000, 1_000_000),
    backlog_claims=1000,
    backlog_worker_jobs=3000,
    http_total=1600,
    deadline_s=120.0,
)
QUICK = Sizes(
    name="quick",
    floor_insert_one=600,
    floor_batches=40,
    floor_claim_ack=600,
    submit_total=960,
    batch_total=48,
    lease_jobs={1: 500, 4: 800, 16: 1280, 64: 1280},
    submit_to_start=60,
    worker_jobs=600,
    backlog_sizes=(1_000, 100_000),
    backlog_claims=200,
    backlog_worker_jobs=0,
    http_total=640,
    deadline_s=30.0,
)


class Progress:
    """The progress hook: ``step(name, total)`` opens a step, ``tick(n)`` advances it."""

    def step(self, name: str, total: int) -> None:
        """Start a step of ``total`` units."""

    def tick(self, n: int = 1) -> None:
        """Advance the current step."""

    def done(self) -> None:
        """Finish the current step."""


class RichBar(Progress):
    """The progress hook on a rich progress bar (one bar per step)."""

    def __init__(self, progress: RichProgress) -> None:
        self.progress = progress
        self.task: Any = None

    def step(self, name: str, total: int) -> None:
        self.task = self.progress.add_task(name, total=max(1, total))

    def tick(self, n: int = 1) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)

    def done(self) -> None:
        if self.task is not None:
            task = self.progress.tasks[self.task]
            self.progress.update(self.task, completed=task.total)
            self.task = None


def machine() -> dict[str, Any]:
    """The machine's cores, CPU model, load average, Python and SQLite versions."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
    }


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class Steps:
    """Timed, reported steps of a run: ``with self._step(name, total) as tick:`` shows the
    step on ``progress`` and records its seconds in ``step_seconds``."""

    progress: Progress
    step_seconds: dict[str, float]

    @contextmanager
    def _step(self, name: str, total: int = 1) -> Iterator[Callable[[int], None]]:
        self.progress.step(name, total)
        start = time.perf_counter()
        try:
            yield self.progress.tick
        finally:
            self.step_seconds[name] = round(time.perf_counter() - start, 2)
            self.progress.done()


class Bench(Steps):
    """One benchmark run.

    Args:
        sizes: how much work (``FULL``, ``QUICK``, or ``.scaled(...)``).
        address: an already running server to measure instead of spawning one.
        progress: the progress hook.
        http_enabled: try the HTTP scenario (it is still skipped when unavailable).
        backlog_enabled: run the backlog scaling scenario.
        producers: the producer counts of the submission scenarios (default 1, 4, 16).
        workers: the worker counts of the lease+ack scenario (default 1, 4, 16, 64).
    """

    def __init__(
        self,
        sizes: Sizes,
        *,
        address: str | None = None,
        progress: Progress | None = None,
        http_enabled: bool = True,
        backlog_enabled: bool = True,
        producers: tuple[int, ...] = SUBMIT_CONCURRENCY,
        workers: tuple[int, ...] = LEASE_CONCURRENCY,
    ) -> None:
        self.sizes = sizes
        self.address = address
        self.progress = progress or Progress()
        self.http_enabled = http_enabled
        self.backlog_enabled = backlog_enabled
        self.producers = producers
        self.workers = workers
        self.step_seconds: dict[str, float] = {}

    def run(self) -> dict[str, Any]:
        """Run every scenario and return the result document."""
        from queue_core.conf import relay_settings

        started = time.time()
        sz = self.sizes
        doc: dict[str, Any] = {
            "meta": {
                "tool": "relay_bench",
                "sizes": sz.name,
                "started_at_ms": int(started * 1000),
                "machine": machine(),
                "loadavg_start": loadavg(),
                "synchronous": relay_settings().sqlite_synchronous,
                "journal_mode": "wal",
                "external_server": self.address,
            }
        }
        workdir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
        try:
            with self._step("migrate a template database"):
                template = procs.template_db(workdir)
            env = scenarios.Env(
                workdir=workdir,
                template=template,
                synchronous=relay_settings().sqlite_synchronous,
                run_id=secrets.token_hex(3),
                deadline_s=sz.deadline_s,
            )
            self._run_all(doc, env)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        doc["meta"]["loadavg_end"] = loadavg()
        doc["meta"]["duration_s"] = round(time.time() - started, 1)
        doc["meta"]["step_seconds"] = self.step_seconds
        doc["targets"] = targets(doc)
        return doc

    def _run_all(self, doc: dict[str, Any], env: scenarios.Env) -> None:
        sz = self.sizes
        inserts = []
        claims = []
        with self._step("floor: inserts", sz.floor_insert_one + sz.floor_batches * 100) as tick:
            inserts.append(
                scenarios.floor_inserts(env, sz.floor_insert_one, sz.floor_batches, tick)
            )
        server: procs.ServerProcess | None = None
        db_path = procs.fresh_db(env.template, env.workdir, "server")
        if self.address is None:
            with self._step("start relay_server"):
                server = procs.ServerProcess(db_path)
            address = server.address
        else:
            address = self.address
        try:
            pid = server.pid if server is not None else None
            self._tcp(doc, env, address, pid)
            with self._step(
                "floor: inserts, again", sz.floor_insert_one + sz.floor_batches * 100
            ) as tick:
                inserts.append(
                    scenarios.floor_inserts(env, sz.floor_insert_one, sz.floor_batches, tick)
                )
            with self._step("floor: claim+ack", sz.floor_claim_ack) as tick:
                claims.append(scenarios.floor_claim_ack(env, sz.floor_claim_ack, tick))
            self._lease(doc, env, address, pid)
            with self._step("floor: claim+ack, again", sz.floor_claim_ack) as tick:
                claims.append(scenarios.floor_claim_ack(env, sz.floor_claim_ack, tick))
            doc["floor"] = {
                "insert_one": scenarios.combine([r["insert_one"] for r in inserts]),
                "insert_batch100": scenarios.combine([r["insert_batch100"] for r in inserts]),
                "claim_ack": scenarios.combine(claims),
            }
            with self._step("submit-to-start latency", sz.submit_to_start) as tick:
                doc["submit_to_start"] = scenarios.submit_to_start(
                    env, address, samples=sz.submit_to_start, tick=tick
                )
            if server is not None:
                with self._step("relay_worker process"):
                    doc["worker"] = scenarios.worker_drain(
                        env, server, db_path, jobs=sz.worker_jobs, concurrency=16
                    )
                doc["server"] = {"peak_rss_mb": server.peak_rss_mb()}
            else:
                doc["worker"] = {"status": "skipped: --address given"}
                doc["server"] = {"status": "skipped: --address given"}
        finally:
            if server is not None:
                server.stop()
        self._http(doc, env)
        self._backlog(doc, env)
        self._ratios(doc)

    def _tcp(self, doc: dict[str, Any], env: scenarios.Env, address: str, pid: int | None) -> None:
        sz = self.sizes
        rows = doc.setdefault("submit", [])
        for batch in (None, 100):
            total = sz.submit_total if batch is None else sz.batch_total
            for c in self.producers:
                label = "one job" if batch is None else "batches of 100"
                with self._step(f"submit over TCP, {label}, {c} producers"):
                    rows.append(
                        scenarios.submit(
                            env,
                            address,
                            concurrency=c,
                            ops_per_thread=max(1, total // c),
                            batch=batch,
                            server_pid=pid,
                        )
                    )

    def _lease(
        self, doc: dict[str, Any], env: scenarios.Env, address: str, pid: int | None
    ) -> None:
        rows = doc.setdefault("lease_ack", [])
        for c in self.workers:
            jobs = self.sizes.lease_jobs.get(c) or max(2 * c, min(self.sizes.lease_jobs.values()))
            with self._step(f"lease+ack, {c} workers"):
                rows.append(
                    scenarios.lease_ack(env, address, concurrency=c, jobs=jobs, server_pid=pid)
                )

    def _http(self, doc: dict[str, Any], env: scenarios.Env) -> None:
        reason = http.unavailable_reason() if self.http_enabled else "skipped: --no-http"
        if reason is None and self.address is not None:
            reason = "skipped: --address given"
        if reason is not None:
            doc["http"] = {"status": reason}
            return
        total = self.sizes.http_total
        with self._step("submit over HTTP (gunicorn)"):
            try:
                rows = http.submit(
                    procs.fresh_db(env.template, env.workdir, "http"),
                    concurrencies=self.producers,
                    ops_per_thread={c: max(1, total // c) for c in self.producers},
                    deadline_s=env.deadline_s,
                )
            except RuntimeError as exc:
                doc["http"] = {"status": f"failed: {exc}"}
                return
        doc["http"] = {"status": "ran"}
        doc["submit"].extend(rows)

    def _backlog(self, doc: dict[str, Any], env: scenarios.Env) -> None:
        if not self.backlog_enabled or self.address is not None:
            why = "--no-backlog" if not self.backlog_enabled else "--address given"
            doc["backlog"] = {"status": f"skipped: {why}", "sizes": []}
            return
        sz = self.sizes
        rows = []
        biggest = max(sz.backlog_sizes)
        for size in sz.backlog_sizes:
            with self._step(f"backlog: {size:,} ready jobs", size + sz.backlog_claims) as tick:
                rows.append(
                    scenarios.backlog(
                        env,
                        size,
                        claims=sz.backlog_claims,
                        worker_jobs=sz.backlog_worker_jobs if size == biggest else 0,
                        tick=tick,
                    )
                )
        doc["backlog"] = {"status": "ran", "sizes": rows}

    @staticmethod
    def _ratios(doc: dict[str, Any]) -> None:
        fl = doc["floor"]
        one, batch = fl["insert_one"]["per_s"], fl["insert_batch100"]["per_s"]
        for row in doc["submit"]:
            row["floor"] = "insert_one" if row["mode"] == "single" else "insert_batch100"
            row["ratio_to_floor"] = ratio(row["per_s"], one if row["mode"] == "single" else batch)
        claim = fl.get("claim_ack", {}).get("per_s")
        for row in doc["lease_ack"]:
            row["ratio_to_floor"] = ratio(row["per_s"], claim)


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Evaluate the issue's targets against one run: ``[{name, target, value, met}]``.

    ``met`` is None when the run did not measure the figure.
    """
    out: list[dict[str, Any]] = []

    def add(name: str, target: str, value: float | None, met: bool | None) -> None:
        out.append({"name": name, "target": target, "value": value, "met": met})

    submit = doc.get("submit", [])
    batch = _find(submit, transport="tcp", mode="batch100", concurrency=1)
    r = batch.get("ratio_to_floor") if batch else None
    add(
        "batch submit over TCP vs raw batch-insert floor",
        ">= 0.50",
        r,
        None if r is None else r >= 0.5,
    )
    one = _find(submit, transport="tcp", mode="single", concurrency=1)
    sixteen = _find(submit, transport="tcp", mode="single", concurrency=16)
    scale = ratio(sixteen["per_s"], one["per_s"]) if one and sixteen else None
    add(
        "single-job submit, 16 producers vs 1 producer",
        ">= 3.0",
        scale,
        None if scale is None else scale >= 3.0,
    )
    lease16 = _find(doc.get("lease_ack", []), concurrency=16)
    r = lease16.get("ratio_to_floor") if lease16 else None
    add(
        "lease+ack, 16 workers vs raw claim+ack floor",
        ">= 0.40",
        r,
        None if r is None else r >= 0.4,
    )
    s2s = doc.get("submit_to_start", {}).get("latency_ms", {}).get("p99")
    add(
        "submit-to-start p99, idle server, waiting worker (ms)",
        "< 50",
        s2s,
        None if s2s is None else s2s < 50,
    )
    sizes = doc.get("backlog", {}).get("sizes", [])
    big = max(sizes, key=lambda row: row["ready_jobs"], default=None)
    small = min(sizes, key=lambda row: row["ready_jobs"], default=None)
    rss = big["server_peak_rss_mb"] if big and big["ready_jobs"] >= 1_000_000 else None
    add(
        "server peak RSS with 1,000,000 jobs waiting (MiB)",
        "< 150",
        rss,
        None if rss is None else rss < 150,
    )
    flat = None
    if big and small and big is not small:
        flat = ratio(big["lease_latency_ms"]["p50"], small["lease_latency_ms"]["p50"])
    label = (
        f"claim p50, {big['ready_jobs']:,} vs {small['ready_jobs']:,} ready"
        if big and small
        else "claim p50, largest vs smallest backlog"
    )
    add(label, "<= 1.5", flat, None if flat is None else flat <= 1.5)
    return out


def prune_run(
    finished: int, *, deadline_s: float, progress: Progress | None = None
) -> dict[str, Any]:
    """Run only the retention scenario (``scenarios.prune_under_load``): ``relay bench
    --prune-jobs N``. Returns ``{"meta": {...}, "prune": {...}}``."""
    from queue_core.conf import relay_settings

    started = time.time()
    steps = Steps()
    steps.progress = progress or Progress()
    steps.step_seconds = {}
    doc: dict[str, Any] = {
        "meta": {"tool": "relay_bench", "machine": machine(), "loadavg_start": loadavg()}
    }
    workdir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    try:
        with steps._step("migrate a template database"):
            template = procs.template_db(workdir)
        env = scenarios.Env(
            workdir=workdir,
            template=template,
            synchronous=relay_settings().sqlite_synchronous,
            run_id=secrets.token_hex(3),
            deadline_s=deadline_s,
        )
        with steps._step(f"prune {finished:,} finished jobs under lease+ack", finished) as tick:
            doc["prune"] = scenarios.prune_under_load(env, finished, tick=tick)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc["meta"]["loadavg_end"] = loadavg()
    doc["meta"]["duration_s"] = round(time.time() - started, 1)
    return doc
