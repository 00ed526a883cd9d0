"""Instructions per job of a real ``relay_server``, counted by valgrind's callgrind.

A rate or a CPU time on a small shared machine moves by ±10% from one minute to the next;
the number of instructions a server runs for the same work hardly does (counts of the same
code agree within about 2%), so a change worth a few percent can be measured before and
after, as issue 15 asks. Usage, from the root of the tree to measure (a checkout or a
``git worktree``: the server runs the code of the current directory)::

    python -m relay_bench.instructions --jobs 500 --phases lease_next:1,lease_ack:1,submit:1
    python -m relay_bench.instructions --objects      # also split each count by shared object
    python -m relay_bench.instructions --server ceiling   # the same phases on relay_bench.ceiling
    python -m relay_bench.instructions --server ceiling --ceiling-schema relay   # on Relay's table
    python -m relay_bench.instructions --server ceiling --ceiling-reader protocol  # no streams

It starts ``relay_server`` on a fresh migrated file under ``valgrind --tool=callgrind
--instr-atstart=no``; for each phase (``KIND:CLIENTS``, kinds of ``relay_bench.load``) it fills
the queue first (not counted), switches instrumentation on (``callgrind_control -i on``), runs the
phase with ``relay_bench.load``, switches it off and dumps the counts (``callgrind_control -d``).
Only user-space instructions are counted (system calls are not: see ``strace -c``). With more
than one client the count depends on how many requests each group commit gathers, which under
valgrind follows its 20-50x slowdown: compare one-client phases across changes.

Needs valgrind (``apt-get install valgrind``: ``valgrind`` and ``callgrind_control``). Every
phase is bounded (``--jobs``, and a deadline per phase).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from relay_bench.ceiling import READERS, SCHEMAS

PHASE_DEADLINE_S = 900.0
DEFAULT_PHASES = "lease_next:1,lease_ack:1,submit:1"
KINDS = ("submit", "lease_ack", "lease_next", "ack_batch")
_TOTALS = re.compile(r"^totals:\s+(\d+)", re.MULTILINE)
_COST = re.compile(r"^(?:[+-]?\d+|\*) \d+$")


@dataclass
class Phase:
    """One counted phase: ``kind`` of ``relay_bench.load`` with ``clients`` connections.

    Attributes:
        jobs: jobs the phase completed; instructions: user-space instructions counted.
        objects: instructions by shared object (``--objects``), e.g. ``libpython3.13.so``.
    """

    kind: str
    clients: int
    jobs: int = 0
    instructions: int = 0
    objects: dict[str, int] = field(default_factory=dict)

    @property
    def per_job(self) -> float:
        """Instructions per job (0.0 when no job ran)."""
        return self.instructions / self.jobs if self.jobs else 0.0


def parse_phases(text: str) -> list[Phase]:
    """``"lease_next:1,submit:16"`` -> phases.

    Raises:
        ValueError: an unknown kind, or clients not an integer in 1..64.
    """
    phases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, clients = item.partition(":")
        if kind not in KINDS:
            raise ValueError(f"unknown phase kind {kind!r} (one of {', '.join(KINDS)})")
        if not clients.isdigit() or not 1 <= int(clients) <= 64:
            raise ValueError(f"clients of {item!r} must be 1..64")
        phases.append(Phase(kind, int(clients)))
    if not phases:
        raise ValueError("no phase given")
    return phases


def total(dump: str) -> int:
    """The ``totals:`` line of a callgrind dump (its text).

    Raises:
        ValueError: there is none (not a callgrind dump).
    """
    found = _TOTALS.search(dump)
    if found is None:
        raise ValueError("no totals line: not a callgrind dump")
    return int(found.group(1))


def by_object(dump: str) -> dict[str, int]:
    """Sum a callgrind dump's self costs by the shared object they ran in.

    The format (valgrind's "Callgrind Format Specification"): ``ob=`` names the object of the
    cost lines that follow (``ob=(N) name`` defines the compressed name ``(N)``, a later
    ``ob=(N)`` refers to it); a cost line is a position and a cost (``16 3``, ``+2 5``, ``* 4``);
    the cost line right after a ``calls=`` line is that call's inclusive cost, not self cost,
    and is skipped. Objects are named by their file name (``libpython3.13.so.1.0``).
    """
    names: dict[str, str] = {}
    out: Counter[str] = Counter()
    current = "?"
    skip_next = False
    for line in dump.splitlines():
        if line.startswith(("ob=", "cob=")):
            ref = line.partition("=")[2]
            key, _, name = ref.partition(" ") if ref.startswith("(") else ("", "", ref)
            if key and name:
                names[key] = name.rsplit("/", 1)[-1]  # cob= defines names too
            if line.startswith("ob="):
                current = names.get(key, "?") if key else name.rsplit("/", 1)[-1]
        elif line.startswith("calls="):
            skip_next = True
        elif _COST.match(line):
            if skip_next:
                skip_next = False
                continue
            out[current] += int(line.split()[1])
    return dict(out.most_common())


def control(*args: str) -> None:
    """Run ``callgrind_control ARGS`` (``-i on PID``, ``-d NAME PID``...).

    Raises:
        subprocess.CalledProcessError: it failed; subprocess.TimeoutExpired: after 60 s.
    """
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=60)


def need_valgrind() -> None:
    """Raises:
    RuntimeError: ``valgrind`` or ``callgrind_control`` is not installed."""
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: install valgrind (apt-get install valgrind)")


def count(
    phases: list[Phase],
    *,
    jobs: int,
    synchronous: str = "NORMAL",
    objects: bool = False,
    workdir: Path | None = None,
    server: str = "relay",
    ceiling_schema: str = "lean",
    ceiling_reader: str = "streams",
) -> list[Phase]:
    """Count each phase's instructions on one ``relay_server`` under callgrind (see module).

    Args:
        phases: what to run, in order, on one server and file (each on its own queue).
        jobs: jobs per phase (submit: spread over its clients).
        synchronous: ``RELAY_SQLITE_SYNCHRONOUS`` of the server.
        objects: also split each phase's count by shared object (``by_object``).
        workdir: where the file and dumps go (default: a temporary directory, removed).
        server: ``"relay"`` (``relay_server`` on a migrated file) or ``"ceiling"``
            (``relay_bench.ceiling`` on a lean floor file): the CPython ceiling's count.
        ceiling_schema: the ceiling's table and statements, ``"lean"`` or ``"relay"`` (on a
            migrated Relay file, ``relay_bench.ceiling.RelaySql``).
        ceiling_reader: how the ceiling reads its connections, ``"streams"`` or ``"protocol"``
            (``relay_bench.ceiling``'s ``--reader``).
    Returns:
        ``phases``, filled in.
    Raises:
        RuntimeError: valgrind is missing, or the server did not start or a phase failed.
        ValueError: an unknown ``server``, ``ceiling_schema`` or ``ceiling_reader``.
    """
    if server not in ("relay", "ceiling"):
        raise ValueError(f"unknown server {server!r} (relay or ceiling)")
    if ceiling_schema not in SCHEMAS:
        raise ValueError(f"unknown ceiling schema {ceiling_schema!r} (lean or relay)")
    if ceiling_reader not in READERS:
        raise ValueError(f"unknown ceiling reader {ceiling_reader!r} (streams or protocol)")
    need_valgrind()
    from relay_bench import floor, load, procs, scenarios

    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="relay-cg-")))
        dumps = workdir / "callgrind.out"
        prefix = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={dumps}",
        ]
        process: procs.ServerProcess | procs.CeilingProcess
        if server == "ceiling":
            if ceiling_schema == "relay":
                path = procs.fresh_db(procs.template_db(workdir), workdir, "ceiling")
            else:
                path = Path(floor.create_lean(str(workdir / "ceiling.db")))
            process = procs.CeilingProcess(
                path, synchronous, schema=ceiling_schema, reader=ceiling_reader, prefix=prefix
            )
        else:
            db = procs.fresh_db(procs.template_db(workdir), workdir, "server")
            process = procs.ServerProcess(db, prefix=prefix, RELAY_SQLITE_SYNCHRONOUS=synchronous)
        stack.callback(process.stop)
        pid = str(process.pid)
        for n, phase in enumerate(phases, 1):
            queue = f"{phase.kind}-{phase.clients}-{n}"
            if phase.kind != "submit":
                scenarios.prefill(process.address, queue, jobs)
            control("-z", pid)
            control("-i", "on", pid)
            result = load.run(
                process.address,
                phase.kind,
                concurrency=phase.clients,
                processes=min(phase.clients, 4),
                ops_per_thread=jobs if phase.kind != "submit" else max(1, jobs // phase.clients),
                deadline_s=PHASE_DEADLINE_S,
                queue=queue,
            )
            control("-i", "off", pid)
            control("-d", f"phase{n}", pid)
            if result["errors"]:
                raise RuntimeError(f"{queue}: {result['errors']} errors: {result['error_sample']}")
            dump = Path(f"{dumps}.{n}").read_text()
            phase.jobs = int(result["ops"])
            phase.instructions = total(dump)
            if objects:
                phase.objects = by_object(dump)
    return phases


def table(phases: list[Phase], objects: bool = False) -> str:
    """The phases as a Markdown table: thousands of instructions per job (and per object)."""
    head = "| phase | jobs | instructions per job (thousands) |"
    lines = [head, "| --- | ---: | ---: |"]
    for p in phases:
        lines.append(f"| {p.kind}, {p.clients} client(s) | {p.jobs} | {p.per_job / 1000:,.0f} |")
    if objects:
        names = list(dict.fromkeys(name for p in phases for name in p.objects))[:8]
        lines += ["", "| object | " + " | ".join(f"{p.kind}:{p.clients}" for p in phases) + " |"]
        lines.append("| --- |" + " ---: |" * len(phases))
        for name in names:
            cells = [f"{p.objects.get(name, 0) / max(1, p.jobs) / 1000:,.0f}" for p in phases]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m relay_bench.instructions``: count, print the table; 2 on a bad option."""
    parser = argparse.ArgumentParser(prog="python -m relay_bench.instructions")
    parser.add_argument("--jobs", type=int, default=500, help="jobs per phase (default 500)")
    parser.add_argument("--phases", default=DEFAULT_PHASES, help="KIND:CLIENTS,...")
    parser.add_argument("--synchronous", default="NORMAL", help="the server's level")
    parser.add_argument("--objects", action="store_true", help="split by shared object")
    parser.add_argument(
        "--server", choices=("relay", "ceiling"), default="relay", help="what to count"
    )
    parser.add_argument(
        "--ceiling-schema",
        choices=SCHEMAS,
        default="lean",
        help="with --server ceiling: the lean floor's table, or Relay's own",
    )
    parser.add_argument(
        "--ceiling-reader",
        choices=READERS,
        default="streams",
        help="with --server ceiling: asyncio streams (as Relay reads) or asyncio.Protocol",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.jobs <= 100_000:
        parser.error("--jobs must be 1..100000")
    try:
        phases = parse_phases(args.phases)
    except ValueError as exc:
        parser.error(str(exc))
    print(
        table(
            count(
                phases,
                jobs=args.jobs,
                synchronous=args.synchronous,
                objects=args.objects,
                server=args.server,
                ceiling_schema=args.ceiling_schema,
                ceiling_reader=args.ceiling_reader,
            ),
            args.objects,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
