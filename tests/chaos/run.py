"""Run the crash/restart chaos scenario for a bounded number of cycles and print a summary.

    python -m tests.chaos.run --cycles 20 --jobs 2000 [--workers 3] [--seed N] [--db PATH]

Exits 0 when every job ended as its payload dictates with none lost, no lease acked twice,
duplicates within the leases in flight at the kills and every audit clean; 1 on any violation.
The long run is opt-in (this script); ``tests/crash/test_crash_recovery.py`` runs a short one
in the default test run.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

from tests.chaos.scenario import ChaosConfig, run_chaos


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the scenario, print the summary; return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.run", description=__doc__)
    parser.add_argument("--cycles", type=int, default=10, help="kill/restart cycles (10)")
    parser.add_argument("--jobs", type=int, default=1000, help="jobs to run (1000)")
    parser.add_argument("--workers", type=int, default=2, help="relay_worker processes (2)")
    parser.add_argument("--concurrency", type=int, default=8, help="jobs per worker (8)")
    parser.add_argument("--lease-ms", type=int, default=2000, help="worker lease length (2000)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument("--db", type=Path, default=None, help="database file (default: temp)")
    args = parser.parse_args(argv)
    if args.cycles < 0 or args.jobs < 1 or args.workers < 1:
        parser.error("--cycles must be >= 0, --jobs and --workers >= 1")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    with tempfile.TemporaryDirectory(prefix="relay-chaos-") as tmp:
        db = args.db or Path(tmp) / "chaos.db"
        if db.exists():
            parser.error(f"--db {db} exists; give a new file")
        print(f"chaos: seed={seed} cycles={args.cycles} jobs={args.jobs} db={db}", flush=True)
        result = run_chaos(
            ChaosConfig(
                db=db,
                cycles=args.cycles,
                jobs=args.jobs,
                workers=args.workers,
                concurrency=args.concurrency,
                lease_ms=args.lease_ms,
                seed=seed,
                settle_timeout_s=max(180.0, args.jobs * 0.2),
            ),
            log=lambda line: print(line, flush=True),
        )
        print(result.summary(), flush=True)
        if not result.ok:
            print(f"chaos: FAILED (seed={seed}; rerun with --seed {seed})", file=sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relayproject.settings")
    sys.exit(main())
