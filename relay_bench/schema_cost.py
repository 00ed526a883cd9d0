"""What each part of Relay's job table costs an ack and the claim after it, in instructions.

The ceiling on Relay's schema (``relay_bench.ceiling --schema relay``) says how far a server of
this kind gets on Relay's table; this says which parts of the table that costs. For each
variant, a child process runs ``--jobs`` times, ``--group`` per transaction, the statements
Relay's service runs on SQLite for an ack with ``lease_next`` (``ack``, ``end_attempt``,
``sweep_probe``, ``claim_one``, ``insert_attempt`` of ``queue_core/storage/sqlite/queries.sql``)
on a copy of a migrated file, with one part taken away, under valgrind's callgrind with
instrumentation on only around that loop. No server, no service: the statements through
``sqlite3``, as the ceiling server runs them (``ceiling.LeanSql``, ``ceiling.RelaySql``, which
also build each lease's reply dict). Usage, from the root of the tree to measure::

    python -m relay_bench.schema_cost --jobs 500            # every variant, one commit per job
    python -m relay_bench.schema_cost --group 16            # 16 jobs per commit (group commit)
    python -m relay_bench.schema_cost --variants relay,lean

Variants (``VARIANTS``): ``lean`` (the lean floor's table and statements, ``floor.LEAN_*``),
``relay`` (all of the above), ``no-attempts`` (without ``end_attempt`` and ``insert_attempt``),
``no-trigger`` (the count trigger dropped), ``no-extra-indexes`` (the six indexes neither the
claim nor the sweep probe reads dropped), ``no-probe`` (without ``sweep_probe``). Needs valgrind
(``valgrind`` and ``callgrind_control``); every loop is bounded by ``--jobs``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD_TIMEOUT_S = 900.0
VARIANTS = ("lean", "relay", "no-attempts", "no-trigger", "no-extra-indexes", "no-probe")
# Indexes of relay_job that neither claim_one nor sweep_probe reads (the console's, pruning's,
# idempotency's): dropped by ``no-extra-indexes``.
EXTRA_INDEXES = (
    "relay_job_queue_state",
    "relay_job_succeeded_done",
    "relay_job_dead_done",
    "relay_job_cancelled_done",
    "relay_job_dead",
    "relay_job_idempotency_key",
)
QUEUE = "bench"


def child(path: str, variant: str, jobs: int, group: int) -> None:
    """Run the measured loop on ``path`` (prefilled), switching callgrind's instrumentation on
    and off around it; the caller reads the dump. The statements are the ceiling's
    (``ceiling.LeanSql``, ``ceiling.RelaySql``), plus Relay's ``sweep_probe``."""
    from relay_bench import ceiling, floor
    from relay_bench.instructions import control

    db = floor.connect(path, "FULL")
    sql: ceiling.LeanSql | ceiling.RelaySql
    if variant == "lean":
        sql, probe = ceiling.LeanSql(db), None
    else:
        sql = ceiling.RelaySql(db, attempts=variant != "no-attempts")  # sets Django up
        from queue_core.storage.sqlite.driver import NAMED_QUERIES

        probe = None if variant == "no-probe" else NAMED_QUERIES["sweep_probe"]
        if variant == "no-trigger":
            db.execute("DROP TRIGGER relay_job_count_update")
        if variant == "no-extra-indexes":
            for name in EXTRA_INDEXES:
                db.execute(f"DROP INDEX {name}")

    def step(held: tuple[str, str] | None) -> tuple[str, str]:
        """Ack ``held`` (job id, token) and claim the next job, as an ack with ``lease_next``."""
        now = time.time_ns() // 1_000_000
        if held is not None and not sql.ack(*held, "w", now):
            raise RuntimeError(f"the ack of {held[0]} was refused")
        if probe is not None:
            db.execute(probe, {"now_ms": now}).fetchall()
        token = secrets.token_urlsafe(24)
        lease = sql.claim(QUEUE, "w", token, now)
        if lease is None:
            raise RuntimeError("the queue ran dry")
        return lease["job_id"], token

    def transaction(held: list[tuple[str, str] | None]) -> list[tuple[str, str] | None]:
        db.execute("BEGIN IMMEDIATE")
        out: list[tuple[str, str] | None] = [step(h) for h in held]
        db.execute("COMMIT")
        return out

    held = transaction([None] * group)  # warm: statements prepared, pages cached
    pid = str(os.getpid())
    control("-i", "on", pid)
    for _ in range(jobs // group):
        held = transaction(held)
    control("-i", "off", pid)
    db.close()


def measure(
    variants: list[str], *, jobs: int, group: int = 1, workdir: Path | None = None
) -> dict[str, float]:
    """Instructions per job of each variant (see the module doc).

    Args:
        variants: names of ``VARIANTS``.
        jobs: jobs measured per variant (a multiple of ``group`` is measured: ``jobs // group``
            transactions); group: jobs per transaction, 1..64.
        workdir: where files and dumps go (default: a temporary directory, removed).
    Raises:
        ValueError: an unknown variant, or ``jobs``/``group`` out of range.
        RuntimeError: valgrind is missing, or a child failed.
    """
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        raise ValueError(f"variants must be some of {', '.join(VARIANTS)}, not {unknown}")
    if not 1 <= group <= 64 or not group <= jobs <= 100_000:
        raise ValueError("group must be 1..64 and jobs group..100000")
    from relay_bench import floor, procs
    from relay_bench.instructions import need_valgrind, total

    need_valgrind()

    with tempfile.TemporaryDirectory(prefix="relay-cost-") as scratch:
        base = workdir or Path(scratch)
        template = None
        out: dict[str, float] = {}
        for variant in variants:
            if variant == "lean":
                path = Path(floor.create_lean(str(base / "lean.db")))
                floor.prefill(str(path), jobs + 2 * group, "{}", QUEUE, kind="lean")
            else:
                template = template or procs.template_db(base)
                path = procs.fresh_db(template, base, variant)
                floor.prefill(str(path), jobs + 2 * group, "{}", QUEUE, kind="schema")
            dump = base / f"callgrind.{variant}"
            argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
            argv += [
                f"--callgrind-out-file={dump}",
                sys.executable,
                "-m",
                "relay_bench.schema_cost",
            ]
            argv += ["--child", variant, str(path), "--jobs", str(jobs), "--group", str(group)]
            done = subprocess.run(
                argv,
                env=procs.child_env(str(path)),
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT_S,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{variant}: exit {done.returncode}: {done.stderr[-2000:]}")
            out[variant] = total(dump.read_text()) / (jobs // group * group)
        return out


def main(argv: list[str] | None = None) -> int:
    """``python -m relay_bench.schema_cost``: measure and print the table; 2 on a bad option."""
    parser = argparse.ArgumentParser(prog="python -m relay_bench.schema_cost")
    parser.add_argument("--jobs", type=int, default=500, help="jobs per variant (default 500)")
    parser.add_argument("--group", type=int, default=1, help="jobs per transaction (default 1)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="NAME,... (VARIANTS)")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[1], args.child[0], args.jobs, args.group)
        return 0
    try:
        found = measure(
            [v for v in args.variants.split(",") if v], jobs=args.jobs, group=args.group
        )
    except ValueError as exc:
        parser.error(str(exc))
    relay = found.get("relay")
    print("| variant | instructions per job (thousands) | vs relay |")
    print("| --- | ---: | ---: |")
    for name, per_job in found.items():
        ratio = f"{per_job / relay:.2f}x" if relay else "-"
        print(f"| {name} | {per_job / 1000:,.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
