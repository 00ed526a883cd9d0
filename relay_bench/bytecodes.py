"""Python bytecodes and calls per job of a real ``relay_server``, by function.

``relay_bench.instructions`` counts a server's machine instructions (callgrind) but cannot
say which Python function ran them: the interpreter's own C functions run every function's
code. This counts, with ``sys.monitoring`` (PEP 669), each bytecode instruction the server's
Python runs and each call of a Python function, by code object, over one measured phase. The
counts are exact and the same from run to run for the same code and requests (one client),
so a change of a few bytecodes in a hot function shows; a bytecode is not a fixed number of
machine instructions, so the totals compare code with code, not with ``instructions``.
Usage, from the root of the tree to measure::

    python -m relay_bench.bytecodes --jobs 2000 --phases submit:1,lease_ack:1,lease_next:1
    python -m relay_bench.bytecodes --server ceiling --phases submit:1   # relay_bench.ceiling
    python -m relay_bench.bytecodes --top 40 --save counts.json          # the busiest functions

The server runs under ``python -m relay_bench.bytecodes --hook OUT -- ARGV``, which installs
two signal handlers and runs ``ARGV``'s module: ``SIGUSR1`` starts counting, ``SIGUSR2`` stops
and writes the counts to ``OUT`` (JSON: ``{"file:line:qualname": [bytecodes, calls]}``).
Counting slows the server about tenfold. Every phase is bounded (``--jobs``, a deadline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from relay_bench.instructions import Phase, parse_phases

PHASE_DEADLINE_S = 600.0
WRITE_WAIT_S = 30.0
_TOOL = 3  # a sys.monitoring tool id no debugger or profiler of ours takes


def _name(code: CodeType) -> str:
    path = code.co_filename.split("site-packages/")[-1]
    with contextlib.suppress(ValueError):
        path = str(Path(path).relative_to(Path.cwd()))
    name = f"{path}:{code.co_firstlineno}:{code.co_qualname}"
    if path == "<string>":  # a dataclass's generated method: name it by its arguments
        name += f"({', '.join(code.co_varnames[1 : code.co_argcount])})"
    return name


def hook(out: str, argv: list[str]) -> None:
    """Run ``argv`` (``[python, -m, MODULE, ARGS...]``) counting between SIGUSR1 and SIGUSR2."""
    mon = sys.monitoring
    bytecodes: Counter[CodeType] = Counter()
    calls: Counter[CodeType] = Counter()

    def on_instruction(code: CodeType, offset: int) -> None:
        bytecodes[code] += 1

    def on_start(code: CodeType, offset: int) -> None:
        calls[code] += 1

    def start(signum: int, frame: FrameType | None) -> None:
        bytecodes.clear()
        calls.clear()
        mon.use_tool_id(_TOOL, "relay_bench.bytecodes")
        mon.register_callback(_TOOL, mon.events.INSTRUCTION, on_instruction)
        mon.register_callback(_TOOL, mon.events.PY_START, on_start)
        mon.set_events(_TOOL, mon.events.INSTRUCTION | mon.events.PY_START)

    def stop(signum: int, frame: FrameType | None) -> None:
        mon.set_events(_TOOL, 0)
        mon.free_tool_id(_TOOL)
        counts: dict[str, list[int]] = {}
        for code in bytecodes.keys() | calls.keys():
            entry = counts.setdefault(_name(code), [0, 0])
            entry[0] += bytecodes[code]
            entry[1] += calls[code]
        tmp = f"{out}.tmp"
        Path(tmp).write_text(json.dumps(counts))
        os.replace(tmp, out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit(f"--hook runs 'python -m MODULE ...', not {argv!r}")
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


def count(
    phases: list[Phase], *, jobs: int, server: str = "relay", synchronous: str = "NORMAL"
) -> list[tuple[Phase, dict[str, list[int]]]]:
    """Count each phase on its own fresh server (``phase.instructions`` holds bytecodes).

    Returns:
        ``(phase, {"file:line:qualname": [bytecodes, calls]})`` per phase, in order.
    Raises:
        RuntimeError: the server did not start, a phase failed, or no counts came back.
    """
    from relay_bench import load, procs, scenarios

    results = []
    for n, phase in enumerate(phases, 1):
        with tempfile.TemporaryDirectory(prefix="relay-bc-") as tmp:
            work = Path(tmp)
            out = work / "counts.json"
            prefix = [sys.executable, "-m", "relay_bench.bytecodes", "--hook", str(out), "--"]
            process: procs.ServerProcess | procs.CeilingProcess
            if server == "ceiling":
                path = procs.fresh_db(procs.template_db(work), work, "ceiling")
                process = procs.CeilingProcess(path, synchronous, schema="relay", prefix=prefix)
            else:
                db = procs.fresh_db(procs.template_db(work), work, "server")
                process = procs.ServerProcess(
                    db, prefix=prefix, RELAY_SQLITE_SYNCHRONOUS=synchronous
                )
            try:
                queue = f"{phase.kind}-{phase.clients}-{n}"
                if phase.kind != "submit":
                    scenarios.prefill(process.address, queue, jobs)
                os.kill(process.pid, signal.SIGUSR1)
                result = load.run(
                    process.address,
                    phase.kind,
                    concurrency=phase.clients,
                    processes=min(phase.clients, 4),
                    ops_per_thread=(
                        jobs if phase.kind != "submit" else max(1, jobs // phase.clients)
                    ),
                    deadline_s=PHASE_DEADLINE_S,
                    queue=queue,
                )
                os.kill(process.pid, signal.SIGUSR2)
                deadline = time.monotonic() + WRITE_WAIT_S
                while not out.exists():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{queue}: the server wrote no counts")
                    time.sleep(0.05)
            finally:
                process.stop()
            if result["errors"]:
                raise RuntimeError(f"{queue}: {result['errors']} errors: {result['error_sample']}")
            counts: dict[str, list[int]] = json.loads(out.read_text())
        phase.jobs = int(result["ops"])
        phase.instructions = sum(b for b, _ in counts.values())
        results.append((phase, counts))
    return results


def table(results: list[tuple[Phase, dict[str, list[int]]]], top: int) -> str:
    """Markdown: per phase, bytecodes and calls per job, then its ``top`` busiest functions."""
    lines = ["| phase | jobs | bytecodes per job | Python calls per job |"]
    lines.append("| --- | ---: | ---: | ---: |")
    for phase, counts in results:
        calls = sum(c for _, c in counts.values())
        lines.append(
            f"| {phase.kind}, {phase.clients} client(s) | {phase.jobs} | "
            f"{phase.per_job:,.0f} | {calls / max(1, phase.jobs):,.1f} |"
        )
    for phase, counts in results if top else []:
        jobs = max(1, phase.jobs)
        lines += ["", f"{phase.kind}:{phase.clients}", ""]
        lines.append("| function | bytecodes/job | calls/job |")
        lines.append("| --- | ---: | ---: |")
        for name, (b, c) in sorted(counts.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"| `{name}` | {b / jobs:,.1f} | {c / jobs:,.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m relay_bench.bytecodes``: count, print the table; 2 on a bad option."""
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--hook"]:
        if len(args_in) < 4 or args_in[2] != "--":
            print("usage: --hook OUT -- python -m MODULE ...", file=sys.stderr)
            return 2
        hook(args_in[1], args_in[3:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m relay_bench.bytecodes")
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per phase (default 2000)")
    parser.add_argument("--phases", default="submit:1,lease_ack:1,lease_next:1")
    parser.add_argument("--synchronous", default="NORMAL", help="the server's level")
    parser.add_argument("--server", choices=("relay", "ceiling"), default="relay")
    parser.add_argument("--top", type=int, default=0, help="list each phase's N busiest functions")
    parser.add_argument("--save", help="write the counts as JSON here")
    args = parser.parse_args(args_in)
    try:
        phases = parse_phases(args.phases)
    except ValueError as exc:
        parser.error(str(exc))
    results = count(phases, jobs=args.jobs, server=args.server, synchronous=args.synchronous)
    print(table(results, args.top))
    if args.save:
        saved: dict[str, Any] = {
            f"{p.kind}:{p.clients}": {"jobs": p.jobs, "counts": c} for p, c in results
        }
        Path(args.save).write_text(json.dumps(saved))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
