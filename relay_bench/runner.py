"""Run the whole benchmark: sizes, the order of the scenarios, the progress bar.

``Bench(sizes, ...).run()`` returns one JSON-ready document (see ``report`` for its keys).
Each of ``runs`` repetitions does, at every ``synchronous`` level (``FULL`` and ``NORMAL``
for the floors; the Relay scenarios at the levels asked for, by default the configured one),
so that every Relay figure has its floors measured minutes apart on the same machine:

1. the lean and the schema floors for inserts (fresh files; ``relay_bench.floor``);
2. one ``relay_server`` on a fresh file with ``RELAY_SQLITE_SYNCHRONOUS`` set to the level:
   TCP submissions (1 / 4 / 16 producers, one job or 100 per request), the lean and schema
   claim+ack floors, lease+ack at 1 / 4 / 16 / 64 workers (16 in 4 client processes), and
   at 1 and 16 workers again with each ack leasing the next job (``lease_next``, one request
   per job), submit-to-start latency, a real ``relay_worker`` process; the server's peak RSS. (At a
   level without Relay scenarios, only the claim+ack floors.)
2b. with ``with_ceiling``: the same TCP scenarios (no worker process) against
   ``relay_bench.ceiling``, the least a CPython server must do for them, on a fresh lean file,
   with ratios to the same floors: a target the ceiling misses is out of reach for any server
   written this way on this machine (``part["ceiling"]``; each target gets its ``ceiling``).

Then ``relay_bench.runs`` merges the repetitions into medians with their min-max spread,
each ratio taken within its own run and level first; and, once, not repeated:

3. HTTP submissions through gunicorn, when the HTTP API is there;
4. backlog scaling: a fresh file per size, filled before its server starts; then the same
   with queue controls in force (a paused queue as full as the claimed one, a cap and a rate
   on the claimed queue: ``scenarios.backlog(controls=True)``, issue 16).

``backlog_run`` (``relay bench --backlog-only``) runs only step 4, plain and controls
alternating size by size, ``--runs`` times.

With ``address`` (an already running server) only step 2's client-side scenarios run
against it; the floors still run on local files and RSS and backlog are reported skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import secrets
import shutil
import sqlite3
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import Progress as RichProgress

from relay_bench import ceiling, floor, http, procs, runs, scenarios
from relay_bench.runs import targets

__all__ = ["FULL", "QUICK", "Bench", "Sizes", "backlog_run", "prune_run", "targets"]

SUBMIT_CONCURRENCY = (1, 4, 16)
LEASE_CONCURRENCY = (1, 4, 16, 64)
# The floors always run at both, whatever levels the Relay scenarios run at (issue 15).
FLOOR_SYNCHRONOUS = ("FULL", "NORMAL")
MAX_RUNS = 20


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
            floor_insert_one=s(self.floor_insert_one, 16),
            floor_batches=s(self.floor_batches, 16),
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
    floor_insert_one=4800,  # = submit_total: each floor does the work of its scenario
    floor_batches=320,  # = batch_total
    floor_claim_ack=3000,  # = lease_jobs[1]
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
    floor_insert_one=960,
    floor_batches=48,
    floor_claim_ack=500,
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


def interpreter_build(config_args: str | None = None, shared: object = None) -> str:
    """How the running CPython was built, as it bears on the server's CPU per request:
    ``"PGO+LTO, static libpython"``, ``"no PGO, no LTO, shared libpython"``...

    A build with ``--enable-shared`` reaches the thread state through ``__tls_get_addr`` (5%
    of a Relay server's instructions on pyenv's default build), and one without
    ``--enable-optimizations`` (PGO) or ``--with-lto`` runs Python code slower
    (docs/benchmarking.md, "The interpreter's build"). Args (tests only): the
    ``sysconfig`` variables ``CONFIG_ARGS`` and ``Py_ENABLE_SHARED``, read when None.
    """
    if config_args is None:
        config_args = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    if shared is None:
        shared = sysconfig.get_config_var("Py_ENABLE_SHARED")
    pgo = "--enable-optimizations" in config_args
    lto = "--with-lto" in config_args
    flags = {
        (True, True): "PGO+LTO",
        (True, False): "PGO, no LTO",
        (False, True): "LTO, no PGO",
        (False, False): "no PGO, no LTO",
    }[pgo, lto]
    return f"{flags}, {'shared' if shared else 'static'} libpython"


def machine() -> dict[str, Any]:
    """The machine's cores, CPU model, Python (version and build, ``interpreter_build``) and
    SQLite versions."""
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
        "python_build": interpreter_build(),
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
    """One benchmark: ``runs`` repetitions of the floors and the Relay scenarios, merged into
    medians with their spread (``relay_bench.runs``).

    Args:
        sizes: how much work (``FULL``, ``QUICK``, or ``.scaled(...)``).
        address: an already running server to measure instead of spawning one (then only one
            ``synchronous`` level: the server's own).
        progress: the progress hook.
        http_enabled: try the HTTP scenario (it is still skipped when unavailable).
        backlog_enabled: run the backlog scaling scenario.
        producers: the producer counts of the submission scenarios (default 1, 4, 16).
        workers: the worker counts of the lease+ack scenario (default 1, 4, 16, 64).
        runs: how many times every floor and Relay scenario runs (1..20); the report gives
            medians and min-max over them.
        synchronous: the ``synchronous`` levels to run the Relay scenarios at (each a
            ``RELAY_SQLITE_SYNCHRONOUS`` value; default: the configured one). The first is the
            document's top level; the floors always run at ``FULL`` and ``NORMAL`` too.
        with_ceiling: after the Relay scenarios of each level and run, the same TCP scenarios
            against ``relay_bench.ceiling`` (step 2b of the module doc).
        ceiling_schema: the ceiling's table and statements: ``"lean"`` (the lean floor's, on a
            fresh lean file) or ``"relay"`` (Relay's, on a copy of the migrated template).

    Raises:
        ValueError: ``runs`` out of range, several levels with ``address``, or an unknown
            ``ceiling_schema``.
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
        runs: int = 1,
        synchronous: tuple[str, ...] = (),
        with_ceiling: bool = False,
        ceiling_schema: str = "lean",
    ) -> None:
        from queue_core.conf import relay_settings

        if not 1 <= runs <= MAX_RUNS:
            raise ValueError(f"runs must be 1..{MAX_RUNS}")
        if ceiling_schema not in ceiling.SCHEMAS:
            raise ValueError(f"ceiling_schema must be one of {', '.join(ceiling.SCHEMAS)}")
        levels = tuple(dict.fromkeys(x.upper() for x in synchronous)) or (
            relay_settings().sqlite_synchronous.upper(),
        )
        if address is not None and len(levels) > 1:
            raise ValueError("a running server (--address) has one synchronous level")
        self.sizes = sizes
        self.address = address
        self.with_ceiling = with_ceiling
        self.ceiling_schema = ceiling_schema
        self.progress = progress or Progress()
        self.http_enabled = http_enabled
        self.backlog_enabled = backlog_enabled
        self.producers = producers
        self.workers = workers
        self.runs = runs
        self.levels = levels
        self.floor_levels = tuple(dict.fromkeys((*levels, *FLOOR_SYNCHRONOUS)))
        self.step_seconds: dict[str, float] = {}

    def run(self) -> dict[str, Any]:
        """Run every scenario ``runs`` times and return the merged result document."""
        started = time.time()
        sz = self.sizes
        primary = self.levels[0]
        doc: dict[str, Any] = {
            "meta": {
                "tool": "relay_bench",
                "sizes": sz.name,
                "started_at_ms": int(started * 1000),
                "machine": machine(),
                "loadavg_start": loadavg(),
                "synchronous": primary,
                "synchronous_levels": list(self.levels),
                "floor_synchronous_levels": list(self.floor_levels),
                "runs": self.runs,
                "journal_mode": "wal",
                "external_server": self.address,
                "with_ceiling": self.with_ceiling,
                "ceiling_schema": self.ceiling_schema if self.with_ceiling else None,
            }
        }
        workdir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
        per_run: list[dict[str, Any]] = []
        try:
            with self._step("migrate a template database"):
                template = procs.template_db(workdir)
            env = scenarios.Env(
                workdir=workdir,
                template=template,
                synchronous=primary,
                run_id=secrets.token_hex(3),
                deadline_s=sz.deadline_s,
            )
            for n in range(1, self.runs + 1):
                per_run.append(self._one_run(env, n))
            merged = {
                lv: runs.merge_parts([r["levels"][lv] for r in per_run]) for lv in self.floor_levels
            }
            doc.update(merged[primary])
            doc["other_synchronous"] = {lv: merged[lv] for lv in self.floor_levels[1:]}
            doc["meta"]["loadavg_runs"] = [
                {"run": r["run"], "start": r["loadavg_start"], "end": r["loadavg_end"]}
                for r in per_run
            ]
            self._http(doc, env)
            self._backlog(doc, env)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        doc["meta"]["loadavg_end"] = loadavg()
        doc["meta"]["duration_s"] = round(time.time() - started, 1)
        doc["meta"]["step_seconds"] = self.step_seconds
        doc["targets"] = targets(doc)
        return doc

    def _one_run(self, env: scenarios.Env, n: int) -> dict[str, Any]:
        """One repetition: at each level the floors and, for the asked levels, the Relay
        scenarios, each part with its ratios to the floors of the same run."""
        out: dict[str, Any] = {"run": n, "loadavg_start": loadavg(), "levels": {}}
        for lv in self.floor_levels:
            lenv = dataclasses.replace(env, synchronous=lv, run_id=f"{env.run_id}r{n}{lv[:1]}")
            tag = f"run {n}/{self.runs}, {lv}"
            part: dict[str, Any] = {"floor": {}}
            self._floor_inserts(part, lenv, tag)
            if lv in self.levels:
                self._relay(part, lenv, tag, primary=lv == self.levels[0])
                if self.with_ceiling:
                    self._ceiling(part, lenv, tag)
            else:
                self._floor_claims(part, lenv, tag)
            runs.ratios(part)
            out["levels"][lv] = part
        out["loadavg_end"] = loadavg()
        return out

    def _floor_inserts(self, part: dict[str, Any], env: scenarios.Env, tag: str) -> None:
        sz = self.sizes
        for kind in floor.KINDS:
            total = sz.floor_insert_one + sz.floor_batches * 100
            with self._step(f"[{tag}] {kind} floor: inserts", total) as tick:
                part["floor"].setdefault(kind, {}).update(
                    scenarios.floor_inserts(
                        env, sz.floor_insert_one, sz.floor_batches, tick, kind=kind
                    )
                )

    def _floor_claims(self, part: dict[str, Any], env: scenarios.Env, tag: str) -> None:
        sz = self.sizes
        for kind in floor.KINDS:
            with self._step(f"[{tag}] {kind} floor: claim+ack", sz.floor_claim_ack) as tick:
                part["floor"].setdefault(kind, {})["claim_ack"] = scenarios.floor_claim_ack(
                    env, sz.floor_claim_ack, tick, kind=kind
                )

    def _relay(self, part: dict[str, Any], env: scenarios.Env, tag: str, primary: bool) -> None:
        """The Relay scenarios on one server at ``env.synchronous``, with the claim floors
        between the submissions and the lease+acks they are compared with."""
        sz = self.sizes
        server: procs.ServerProcess | None = None
        db_path = procs.fresh_db(env.template, env.workdir, f"server-{env.run_id}")
        if self.address is None:
            with self._step(f"[{tag}] start relay_server"):
                server = procs.ServerProcess(db_path, RELAY_SQLITE_SYNCHRONOUS=env.synchronous)
            address = server.address
        else:
            address = self.address
        try:
            pid = server.pid if server is not None else None
            self._tcp(part, env, address, pid, tag)
            self._floor_claims(part, env, tag)
            self._lease(part, env, address, pid, tag)
            with self._step(f"[{tag}] submit-to-start latency", sz.submit_to_start) as tick:
                part["submit_to_start"] = scenarios.submit_to_start(
                    env, address, samples=sz.submit_to_start, tick=tick
                )
            if server is not None:
                with self._step(f"[{tag}] relay_worker process"):
                    part["worker"] = scenarios.worker_drain(
                        env, server, db_path, jobs=sz.worker_jobs, concurrency=16
                    )
                part["server"] = {"peak_rss_mb": server.peak_rss_mb()}
            else:
                part["worker"] = {"status": "skipped: --address given"}
                part["server"] = {"status": "skipped: --address given"}
        finally:
            if server is not None:
                server.stop()
            with contextlib.suppress(OSError):
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{db_path}{suffix}").unlink(missing_ok=True)

    def _ceiling(self, part: dict[str, Any], env: scenarios.Env, tag: str) -> None:
        """The TCP scenarios against ``relay_bench.ceiling`` on a fresh file at
        ``env.synchronous`` (a lean one, or a copy of the template with ``ceiling_schema``
        ``"relay"``), their ratios to this part's floors, into ``part["ceiling"]``."""
        sz = self.sizes
        tag = f"{tag}, ceiling"
        name = f"ceiling-{env.run_id}"
        if self.ceiling_schema == "relay":
            db_path = procs.fresh_db(env.template, env.workdir, name)
        else:
            db_path = Path(scenarios.lean_db(env, name))
        with self._step(f"[{tag}] start the ceiling server"):
            server = procs.CeilingProcess(db_path, env.synchronous, schema=self.ceiling_schema)
        found: dict[str, Any] = {"floor": part["floor"]}
        try:
            self._tcp(found, env, server.address, server.pid, tag)
            self._lease(found, env, server.address, server.pid, tag)
            with self._step(f"[{tag}] submit-to-start latency", sz.submit_to_start) as tick:
                found["submit_to_start"] = scenarios.submit_to_start(
                    env, server.address, samples=sz.submit_to_start, tick=tick
                )
            found["server"] = {"peak_rss_mb": server.peak_rss_mb()}
        finally:
            server.stop()
            with contextlib.suppress(OSError):
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{db_path}{suffix}").unlink(missing_ok=True)
        runs.ratios(found)
        del found["floor"]
        part["ceiling"] = found

    def _tcp(
        self, part: dict[str, Any], env: scenarios.Env, address: str, pid: int | None, tag: str
    ) -> None:
        sz = self.sizes
        rows = part.setdefault("submit", [])
        for batch in (None, 100):
            total = sz.submit_total if batch is None else sz.batch_total
            for c in self.producers:
                label = "one job" if batch is None else "batches of 100"
                with self._step(f"[{tag}] submit over TCP, {label}, {c} producers"):
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
        self, part: dict[str, Any], env: scenarios.Env, address: str, pid: int | None, tag: str
    ) -> None:
        rows = part.setdefault("lease_ack", [])
        plans = [(c, False) for c in self.workers]
        plans += [(c, True) for c in self.workers if c in runs.LEASE_NEXT_WORKERS]
        for c, lease_next in plans:
            jobs = self.sizes.lease_jobs.get(c) or max(2 * c, min(self.sizes.lease_jobs.values()))
            label = "ack with lease_next" if lease_next else "lease+ack"
            with self._step(f"[{tag}] {label}, {c} workers"):
                rows.append(
                    scenarios.lease_ack(
                        env,
                        address,
                        concurrency=c,
                        jobs=jobs,
                        server_pid=pid,
                        processes=runs.LEASE_PROCESSES.get(c),
                        lease_next=lease_next,
                    )
                )

    def _http(self, doc: dict[str, Any], env: scenarios.Env) -> None:
        """HTTP submissions, once (not repeated), at the configured synchronous level; their
        ratios are to the top level's median lean and schema floors."""
        reason = http.unavailable_reason() if self.http_enabled else "skipped: --no-http"
        if reason is None and self.address is not None:
            reason = "skipped: --address given"
        if reason is not None:
            doc["http"] = {"status": reason}
            return
        total = self.sizes.http_total
        with self._step("submit over HTTP (gunicorn), once"):
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
        doc["http"] = {"status": "ran once"}  # failed requests: report.failed_requests
        runs.ratios({"floor": doc["floor"], "submit": rows})
        doc.setdefault("submit", []).extend(rows)

    def _backlog(self, doc: dict[str, Any], env: scenarios.Env) -> None:
        """Backlog scaling, once (not repeated), at the top level's synchronous setting."""
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
        doc["backlog"] = {"status": "ran once", "sizes": rows}
        doc["backlog_controls"] = backlog_controls(self, env, sz)


def backlog_controls(steps: Steps, env: scenarios.Env, sz: Sizes) -> dict[str, Any]:
    """The backlog scenario with queue controls in force (``scenarios.backlog(controls=True)``)
    at each of ``sz.backlog_sizes``, once: ``{"status", "controls", "sizes": [row]}``."""
    rows = []
    for size in sz.backlog_sizes:
        name = f"backlog with a paused queue, a cap and a rate: {size:,} ready jobs"
        with steps._step(name, size + sz.backlog_claims) as tick:
            rows.append(
                scenarios.backlog(
                    env, size, claims=sz.backlog_claims, worker_jobs=0, tick=tick, controls=True
                )
            )
            _drop_db(env.workdir, f"backlog-{size}-controls")  # free the disk for the next
    return {"status": "ran once", "controls": dict(scenarios.CONTROLS), "sizes": rows}


def backlog_run(
    sizes: Sizes, *, runs_n: int = 1, progress: Progress | None = None
) -> dict[str, Any]:
    """Run only the backlog scenario, plain and with queue controls in force, at each of
    ``sizes.backlog_sizes`` (``relay bench --backlog-only``), ``runs_n`` times (1..20), at the
    configured synchronous level. At each size the plain scenario runs, then the controls
    variant, each on a fresh file and server.

    Returns:
        ``{"meta", "backlog", "backlog_controls", "backlog_runs", "targets"}``: ``backlog`` and
        ``backlog_controls`` hold one row per size, each figure the median over the runs
        (``runs.merge``; ``leased_from_paused`` summed); ``backlog_runs`` each run's load
        average and its ``runs.scaling`` of both; the targets are ``runs.backlog_targets``,
        judged on the median of each run's own ratio.
    Raises:
        ValueError: ``runs_n`` out of range.
    """
    from queue_core.conf import relay_settings

    if not 1 <= runs_n <= MAX_RUNS:
        raise ValueError(f"runs must be 1..{MAX_RUNS}")
    started = time.time()
    steps = Steps()
    steps.progress = progress or Progress()
    steps.step_seconds = {}
    doc: dict[str, Any] = {
        "meta": {
            "tool": "relay_bench",
            "database": "sqlite",
            "sizes": sizes.name,
            "runs": runs_n,
            "machine": machine(),
            "loadavg_start": loadavg(),
            "synchronous": relay_settings().sqlite_synchronous.upper(),
        }
    }
    workdir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    per_run: list[dict[str, Any]] = []
    try:
        with steps._step("migrate a template database"):
            template = procs.template_db(workdir)
        env = scenarios.Env(
            workdir=workdir,
            template=template,
            synchronous=doc["meta"]["synchronous"],
            run_id=secrets.token_hex(3),
            deadline_s=sizes.deadline_s,
        )
        for n in range(1, runs_n + 1):
            one: dict[str, Any] = {"run": n, "loadavg_start": loadavg()}
            plain: list[dict[str, Any]] = []
            controlled: list[dict[str, Any]] = []
            for size in sizes.backlog_sizes:
                for rows, controls in ((plain, False), (controlled, True)):
                    what = "a paused queue, a cap and a rate" if controls else "plain"
                    name = f"[run {n}/{runs_n}] backlog, {what}: {size:,} ready jobs"
                    units = size * (2 if controls else 1) + sizes.backlog_claims
                    with steps._step(name, units) as tick:
                        rows.append(
                            scenarios.backlog(
                                env,
                                size,
                                claims=sizes.backlog_claims,
                                worker_jobs=0,
                                tick=tick,
                                controls=controls,
                            )
                        )
                    # Free the disk before the next, larger file.
                    _drop_db(workdir, f"backlog-{size}" + ("-controls" if controls else ""))
            one.update(
                loadavg_end=loadavg(),
                plain=runs.scaling(plain),
                controls=runs.scaling(controlled),
                sizes={"plain": plain, "controls": controlled},
            )
            per_run.append(one)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    status = "ran once" if runs_n == 1 else f"medians of {runs_n} runs"
    doc["backlog"] = {"status": status, "sizes": _merge_sizes(per_run, "plain")}
    doc["backlog_controls"] = {
        "status": status,
        "controls": dict(scenarios.CONTROLS),
        "sizes": _merge_sizes(per_run, "controls"),
    }
    doc["backlog_runs"] = [{k: v for k, v in r.items() if k != "sizes"} for r in per_run]
    doc["meta"]["loadavg_end"] = loadavg()
    doc["meta"]["duration_s"] = round(time.time() - started, 1)
    doc["meta"]["step_seconds"] = steps.step_seconds
    doc["targets"] = runs.backlog_targets(doc)
    return doc


def _merge_sizes(per_run: list[dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    """One row per backlog size, merged over the runs (``runs.merge``: medians); the jobs
    leased from the paused queue are summed, so one in any run shows."""
    out = []
    for i, first in enumerate(per_run[0]["sizes"][variant]):
        rows = [r["sizes"][variant][i] for r in per_run]
        merged = runs.merge(rows)
        if "leased_from_paused" in first:
            merged["leased_from_paused"] = sum(r["leased_from_paused"] for r in rows)
        out.append(merged)
    return out


def _drop_db(workdir: Path, name: str) -> None:
    """Delete ``workdir/name.db`` and its WAL files (a scenario's file it is done with)."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{workdir / name}.db{suffix}").unlink(missing_ok=True)


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
