"""Present a benchmark document: rich tables for people, JSON for machines, a PNG plot.

The JSON document's keys: ``meta`` (machine, sizes, ``runs``, ``synchronous`` (the first
level), ``synchronous_levels``, ``floor_synchronous_levels``, load averages at start and end
and ``loadavg_runs``: each run's), then, at the first ``synchronous`` level and merged over the
runs (``relay_bench.runs``): ``floor`` (``lean`` and ``schema``, each ``insert_one``,
``insert_batch100``, ``claim_ack``), ``submit`` (one row per transport, mode and concurrency),
``lease_ack`` (one row per worker concurrency, and one with ``mode: "lease_next"`` for each
of ``runs.LEASE_NEXT_WORKERS``), ``submit_to_start``, ``worker`` (a real
``relay_worker`` process), ``server`` (peak RSS); ``other_synchronous`` (the same keys for each
other level: always the floors at ``FULL`` and ``NORMAL``, the Relay scenarios when asked);
``http`` (status; its rows are in ``submit``, run once), ``backlog`` (``status``, ``sizes``:
one row per backlog size, run once), ``backlog_controls`` (the same with queue controls in
force, plus ``controls``; each row also ``controls``: the server's replies, and
``leased_from_paused``) and ``targets``. A merged figure is the median over the
runs; its row's ``spread`` gives ``{"median", "min", "max", "runs"}`` for ``per_s``, the
ratios, the server's CPU per job and the least-served share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

PLOT_MISSING = (
    "matplotlib is not installed, so no plot was drawn: install the dev tools "
    "(bin/setup --dev, or pip install -r requirements-dev.lock)"
)


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _lat(summary: dict[str, Any] | None, keys: tuple[str, ...] = ("p50", "p99")) -> list[str]:
    if not summary or not summary.get("n"):
        return ["-"] * len(keys)
    return [_num(summary[k], 2) for k in keys]


def _span(row: dict[str, Any] | None, key: str = "per_s", digits: int = 0) -> str:
    """``min-max`` of a merged figure over the runs, or ``-`` (one run, or not measured)."""
    sp = (row or {}).get("spread", {}).get(key)
    if not sp or sp.get("min") is None or len([v for v in sp["runs"] if v is not None]) < 2:
        return "-"
    if key.startswith("ratio"):
        return f"{sp['min']:.2f}-{sp['max']:.2f}"
    return f"{_num(sp['min'], digits)}-{_num(sp['max'], digits)}"


Section = tuple[str, list[str], list[list[str]]]  # title, headers, rows


def headline(doc: dict[str, Any]) -> str:
    """Machine, versions, runs, pragmas and the load averages (start, per run, end)."""
    meta = doc["meta"]
    m = meta["machine"]
    n = meta.get("runs", 1)
    levels = ", ".join(meta.get("synchronous_levels") or [meta["synchronous"]])
    floors = ", ".join(meta.get("floor_synchronous_levels") or [meta["synchronous"]])
    per_run = "; ".join(
        f"run {r['run']} {r['start']} -> {r['end']}" for r in meta.get("loadavg_runs", [])
    )
    return (
        f"relay_bench ({meta['sizes']}, {n} run{'s' if n != 1 else ''}: "
        f"{'medians' if n > 1 else 'one run, no spread'}) on {m['cores']} cores, "
        f"{m['cpu_model']}, Python {m['python']}{_build(m)}, SQLite {m['sqlite']}, WAL; Relay at "
        f"synchronous={levels}, floors at {floors}; load average {meta.get('loadavg_start')} "
        f"-> {meta.get('loadavg_end')}"
        + (f" ({per_run})" if per_run else "")
        + f"; {meta.get('duration_s', '?')} s"
    )


def _build(m: dict[str, Any]) -> str:
    """`` (PGO+LTO, static libpython)``: the interpreter's build, when the run recorded it."""
    return f" ({m['python_build']})" if m.get("python_build") else ""


def _others(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The other ``synchronous`` levels of the run: ``[(name, part)]``."""
    return list(doc.get("other_synchronous", {}).items())


def _floor_row(part: dict[str, Any] | None, kind: str, key: str) -> dict[str, Any] | None:
    row: dict[str, Any] | None = ((part or {}).get("floor", {}).get(kind) or {}).get(key)
    return row


def _match(part: dict[str, Any], section: str, row: dict[str, Any]) -> dict[str, Any] | None:
    other: dict[str, Any]
    for other in part.get(section, []):
        if all(other.get(k) == row.get(k) for k in ("transport", "mode", "concurrency")):
            return other
    return None


def sections(doc: dict[str, Any]) -> list[Section]:
    """The run as titled tables of strings (shared by the terminal and the Markdown output).

    Figures are medians over the runs with their min-max; ratios are medians of each run's
    ratio to the floor of the same run and level (``relay_bench.runs``). The first level's
    columns come first, then for each other level its jobs/s and ratio to its lean floor.
    """
    out: list[Section] = []
    primary = doc["meta"]["synchronous"]
    others = _others(doc)
    head = [
        "scenario",
        "clients",
        f"{primary} jobs/s",
        "min-max",
        "vs lean floor",
        "vs schema floor",
        "p50 ms",
        "p99 ms",
        "server CPU µs/job",
    ]
    for name, _ in others:
        head += [f"{name} jobs/s", f"{name} vs lean"]
    rows: list[list[str]] = []
    lat_keys = {"insert_one": "latency_ms", "insert_batch100": "latency_ms"}
    for kind, label in (("lean", "lean floor"), ("schema", "schema floor")):
        for key, what in (
            ("insert_one", "insert, 1 per txn"),
            ("insert_batch100", "insert, 100 per txn (executemany)"),
            ("claim_ack", "claim txn + ack txn"),
        ):
            row = _floor_row(doc, kind, key)
            if row is None:
                continue
            cells = [
                f"{label}: {what}",
                "1",
                _num(row["per_s"]),
                _span(row),
                _ratio(1.0 if kind == "lean" else row.get("ratio_to_floor")),
                "-",
                *_lat(row.get(lat_keys.get(key, "claim_latency_ms"))),
                "-",
            ]
            for _, part in others:
                orow = _floor_row(part, kind, key) or {}
                cells += [
                    _num(orow.get("per_s")),
                    _ratio(1.0 if kind == "lean" and orow else orow.get("ratio_to_floor")),
                ]
            rows.append(cells)

    def relay_row(label: str, clients: str, row: dict[str, Any], section: str) -> list[str]:
        lat = row.get("latency_ms", {})
        summary = (
            lat.get("submit")
            or lat.get("submit_batch")
            or (lat.get("ack") if row.get("mode") == "lease_next" else lat.get("lease"))
        )
        cells = [
            label,
            clients,
            _num(row.get("per_s")),
            _span(row),
            _ratio(row.get("ratio_to_floor")),
            _ratio(row.get("ratio_to_schema_floor")),
            *_lat(summary),
            _num(row.get("server_cpu_us_per_job")),
        ]
        for _, part in others:
            other = _match(part, section, row) if section else part.get("worker")
            other = other if other and "per_s" in other else None
            cells += [
                _num(other.get("per_s")) if other else "-",
                _ratio(other.get("ratio_to_floor")) if other else "-",
            ]
        return cells

    for row in doc.get("submit", []):
        mode = "1 job/request" if row["mode"] == "single" else "100 jobs/request"
        rows.append(
            relay_row(
                f"submit {row['transport'].upper()}, {mode}",
                f"{row['concurrency']} ({row['processes']}p)",
                row,
                "submit",
            )
        )
    for row in doc.get("lease_ack", []):
        rows.append(
            relay_row(
                "ack with lease_next, 1 request/job (ack latency)"
                if row.get("mode") == "lease_next"
                else "lease+ack (lease latency)",
                f"{row['concurrency']} ({row['processes']}p)",
                row,
                "lease_ack",
            )
        )
    worker = doc.get("worker", {})
    if "per_s" in worker:
        rows.append(
            relay_row(
                f"relay_worker process, --concurrency {worker['concurrency']}", "1p", worker, ""
            )
        )
    s2s = doc.get("submit_to_start")
    if s2s:
        rows.append(
            [
                "submit-to-start, idle server, 1 waiting worker",
                "1",
                "-",
                "-",
                "-",
                "-",
                *_lat(s2s["latency_ms"]),
                "-",
            ]
            + ["-", "-"] * len(others)
        )
    out.append(("Throughput and request latency", head, rows))

    bl = doc.get("backlog", {})
    rows = [
        [
            _num(r["ready_jobs"]),
            _num(r["fill_s"], 1),
            _num(r["server_startup_s"], 1),
            *_lat(r["lease_latency_ms"], ("p50", "p95", "p99", "max")),
            _num(r["lease_ack_per_s"]),
            _num(r["server_peak_rss_mb"], 1),
        ]
        for r in bl.get("sizes", [])
    ]
    out.append(
        (
            f"Backlog scaling ({bl.get('status', '-')})",
            [
                "ready jobs",
                "fill s",
                "server start s",
                "claim p50 ms",
                "p95 ms",
                "p99 ms",
                "max ms",
                "lease+ack/s (1 worker)",
                "server peak RSS MiB",
            ],
            rows,
        )
    )

    if doc.get("backlog_controls"):
        out.append(backlog_controls_section(doc))

    rows = [
        [
            "relay_server, through the TCP scenarios (highest of the runs)",
            _num(doc.get("server", {}).get("peak_rss_mb"), 1),
        ],
        [
            f"relay_worker --concurrency {worker.get('concurrency', 16)} (median)",
            _num(worker.get("worker_peak_rss_mb"), 1),
        ],
    ]
    for r in bl.get("sizes", []):
        rows.append([f"relay_server, {r['ready_jobs']:,} ready", _num(r["server_peak_rss_mb"], 1)])
        if r.get("worker"):
            rows.append(
                [
                    f"relay_worker, {r['ready_jobs']:,} ready",
                    _num(r["worker"]["worker_peak_rss_mb"], 1),
                ]
            )
    out.append(("Peak RSS", ["process", "peak RSS MiB"], rows))

    out.append(targets_section(doc))
    return out


def targets_section(doc: dict[str, Any]) -> Section:
    """The targets (``doc["targets"]``, from ``runs.targets``): each one's median, spread,
    runs and verdict, and with ``--with-ceiling`` what the ceiling reached (its column names
    the ceiling's schema when it ran on Relay's)."""
    with_ceiling = bool(doc.get("meta", {}).get("with_ceiling"))
    where = " on Relay's schema" if doc.get("meta", {}).get("ceiling_schema") == "relay" else ""
    rows = [
        [
            t["name"],
            t["target"],
            _num(t["value"], 2),
            "-"
            if t.get("min") is None or t.get("runs", 0) < 2
            else f"{_num(t['min'], 2)}-{_num(t['max'], 2)}",
            str(t.get("runs", "-")),
            {True: "yes", False: "NO", None: "not measured"}[t["met"]],
            *([_ceiling_cell(t.get("ceiling"))] if with_ceiling else []),
        ]
        for t in doc.get("targets", [])
    ]
    return (
        "Targets (median over the runs; ratios to the lean floor of the same run)",
        ["target", "goal", "median", "min-max", "runs", "met"]
        + ([f"ceiling server{where}: median (min-max), met"] if with_ceiling else []),
        rows,
    )


def _ceiling_cell(reached: dict[str, Any] | None) -> str:
    """What ``relay_bench.ceiling`` reached on a target: ``0.61 (0.55-0.67) no``, or ``-``."""
    if not reached:
        return "-"
    spread = ""
    if reached.get("min") is not None and reached["min"] != reached["max"]:
        spread = f" ({_num(reached['min'], 2)}-{_num(reached['max'], 2)})"
    return f"{_num(reached['value'], 2)}{spread} {'yes' if reached['met'] else 'no'}"


def backlog_controls_section(doc: dict[str, Any]) -> Section:
    """The claim at each backlog size, plain (``backlog``) beside queue controls in force
    (``backlog_controls``), then the largest size's latency over the smallest's
    (``runs.scaling``; with several runs, ``backlog_runs``: the median of each run's own ratio
    and its min-max). Used by SQLite and PostgreSQL documents alike."""
    from relay_bench.runs import scaling
    from relay_bench.stats import spread

    plain = {r["ready_jobs"]: r for r in doc.get("backlog", {}).get("sizes", [])}
    ctl = {r["ready_jobs"]: r for r in doc.get("backlog_controls", {}).get("sizes", [])}
    rows = []
    for size in sorted(set(plain) | set(ctl)):
        p, c = plain.get(size), ctl.get(size)
        rows.append(
            [
                _num(size),
                *_lat(p["lease_latency_ms"] if p else None),
                *_lat(c["lease_latency_ms"] if c else None),
                _num(c.get("leased_from_paused")) if c else "-",
            ]
        )
    sp, sc = scaling(list(plain.values())), scaling(list(ctl.values()))
    ends = sp or sc
    each = doc.get("backlog_runs", [])
    if ends and len(each) > 1:
        # Each ratio within its own run, then the median and min-max over the runs.
        cells = []
        for var in ("plain", "controls"):
            for key in ("p50_ratio", "p99_ratio"):
                st = spread([(r.get(var) or {}).get(key) for r in each])
                cells.append(
                    "-"
                    if st["median"] is None
                    else f"{_ratio(st['median'])} ({st['min']:.2f}-{st['max']:.2f})"
                )
        label = f"ratio {_num(ends['big'])} / {_num(ends['small'])}, median of each run's"
        rows.append([label, *cells, "-"])
    elif ends:
        rows.append(
            [
                f"ratio {_num(ends['big'])} / {_num(ends['small'])}",
                _ratio(sp["p50_ratio"]) if sp else "-",
                _ratio(sp["p99_ratio"]) if sp else "-",
                _ratio(sc["p50_ratio"]) if sc else "-",
                _ratio(sc["p99_ratio"]) if sc else "-",
                "-",
            ]
        )
    controls = doc.get("backlog_controls", {}).get("controls") or {}
    title = (
        f"Claim with queue controls in force ({doc.get('backlog_controls', {}).get('status', '-')}"
        f"; paused queue as full as the claimed one, max_leased {controls.get('max_leased')}, "
        f"rate {controls.get('rate_per_s')}/s burst {controls.get('burst')})"
    )
    head = [
        "ready jobs",
        "plain claim p50 ms",
        "plain p99 ms",
        "controls claim p50 ms",
        "controls p99 ms",
        "leased from the paused queue",
    ]
    return title, head, rows


def backlog_markdown(doc: dict[str, Any]) -> str:
    """A ``relay bench --backlog-only`` document as Markdown: the machine and load, the
    plain-vs-controls table (``backlog_controls_section``) and the flat-claim targets."""
    m = doc["meta"]
    where = (
        f"PostgreSQL {m.get('postgresql')}, synchronous_commit={m.get('synchronous_commit')}"
        if m.get("database") == "postgresql"
        else f"SQLite {m['machine']['sqlite']} WAL, synchronous={m.get('synchronous')}"
    )
    lines = [
        f"{where}; {m['machine']['cores']} cores, {m['machine']['cpu_model']}; load average "
        f"{m.get('loadavg_start')} -> {m.get('loadavg_end')}; sizes {m.get('sizes')}, "
        f"{m.get('duration_s')} s",
        "",
    ]
    title, head, rows = backlog_controls_section(doc)
    lines += [
        f"**{title}**",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += [
        "",
        "| target | goal | measured (min-max over the runs) | met |",
        "|---|---|---:|---|",
    ]
    for t in doc.get("targets", []):
        met = {True: "yes", False: "NO", None: "not measured"}[t["met"]]
        value = _num(t["value"], 2)
        if t.get("runs", 0) > 1 and t.get("min") is not None:
            value += f" ({_num(t['min'], 2)}-{_num(t['max'], 2)}, {t['runs']} runs)"
        lines.append(f"| {t['name']} | {t['target']} | {value} | {met} |")
    return "\n".join(lines) + "\n"


def failed_requests(doc: Any, path: str = "") -> list[str]:
    """One line per measured row of ``doc`` whose requests failed (``errors`` > 0), at any
    depth: ``"submit[http, single, 16]: 640 of 640 requests failed (RuntimeError: ...)"``.

    A row's rate counts completed jobs only, so a scenario whose requests all failed reads
    0 jobs/s with latencies: these lines say so next to the tables.
    """
    out: list[str] = []
    if isinstance(doc, dict):
        if isinstance(doc.get("errors"), int) and doc["errors"] > 0:
            names = [str(doc[k]) for k in ("transport", "mode", "concurrency") if k in doc]
            where = f"{path}[{', '.join(names)}]" if names else path
            out.append(
                f"{where}: {doc['errors']} of {doc.get('requests', '?')} requests failed"
                f" ({doc.get('error_sample') or 'no sample'})"
            )
        for key, value in doc.items():
            out += failed_requests(value, f"{path}.{key}" if path else str(key))
    elif isinstance(doc, list):
        for item in doc:
            out += failed_requests(item, path)
    return out


def tables(doc: dict[str, Any]) -> list[RenderableType]:
    """The run as rich renderables."""
    # Two lines, each narrower than a terminal, rather than one wrapped inside the load list.
    out: list[RenderableType] = [Text(headline(doc).replace("; load average", ";\nload average"))]
    for title, head, rows in sections(doc):
        table = Table(title=title, title_justify="left")
        for n, col in enumerate(head):
            table.add_column(col, justify="left" if n == 0 else "right")
        for row in rows:
            table.add_row(*row)
        out.append(table)
    out.append(Text(f"HTTP: {doc.get('http', {}).get('status', '-')}"))
    out += [Text(f"FAILED REQUESTS: {line}", style="bold red") for line in failed_requests(doc)]
    return out


def render(doc: dict[str, Any]) -> Group:
    """All tables as one renderable."""
    return Group(*tables(doc))


def markdown(doc: dict[str, Any]) -> str:
    """The run as Markdown tables (what docs/benchmarking.md shows)."""
    lines = [headline(doc), ""]
    for title, head, rows in sections(doc):
        lines += [
            f"**{title}**",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    lines.append(f"HTTP: {doc.get('http', {}).get('status', '-')}")
    lines += [f"\nFAILED REQUESTS: {line}" for line in failed_requests(doc)]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> str | None:
    """Draw the scaling curves to ``path`` (PNG); return None, or why nothing was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return PLOT_MISSING

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.6))
    fl = doc["floor"]["lean"]
    sub = [r for r in doc.get("submit", []) if r["transport"] == "tcp"]
    for mode, label, floor_key, color in (
        ("single", "submit, 1 job/request", "insert_one", "tab:blue"),
        ("batch100", "submit, 100 jobs/request", "insert_batch100", "tab:green"),
    ):
        rows = sorted((r for r in sub if r["mode"] == mode), key=lambda r: r["concurrency"])
        if rows:
            ax1.plot(
                [r["concurrency"] for r in rows],
                [r["per_s"] for r in rows],
                "o-",
                color=color,
                label=f"Relay {label}",
            )
            ax1.axhline(
                fl[floor_key]["per_s"],
                color=color,
                ls="--",
                lw=1,
                label=f"lean floor {floor_key.replace('_', ' ')}",
            )
    http_rows = sorted(
        (r for r in doc.get("submit", []) if r["transport"] == "http"),
        key=lambda r: r["concurrency"],
    )
    if http_rows:
        ax1.plot(
            [r["concurrency"] for r in http_rows],
            [r["per_s"] for r in http_rows],
            "s-",
            color="tab:purple",
            label="Relay submit over HTTP",
        )
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="concurrent producers",
        ylabel="jobs/s",
        title="Submission",
    )
    ax1.set_xticks([1, 4, 16], ["1", "4", "16"])
    if sub or http_rows:
        ax1.legend(fontsize=7)

    rows = sorted(doc.get("lease_ack", []), key=lambda r: r["concurrency"])
    lease = [r for r in rows if r.get("mode") is None]
    following = [r for r in rows if r.get("mode") == "lease_next"]
    for series, style, label in (
        (lease, "o-", "Relay lease+ack"),
        (following, "^:", "Relay ack with lease_next"),
    ):
        if series:
            ax2.plot(
                [r["concurrency"] for r in series],
                [r["per_s"] for r in series],
                style,
                color="tab:orange",
                label=label,
            )
    if "claim_ack" in fl:
        ax2.axhline(
            fl["claim_ack"]["per_s"],
            color="tab:orange",
            ls="--",
            lw=1,
            label="lean floor: claim txn + ack txn",
        )
    ax2.set(xscale="log", xlabel="concurrent workers", ylabel="jobs/s", title="Lease + ack")
    ax2.set_xticks([1, 4, 16, 64], ["1", "4", "16", "64"])
    ax2.set_ylim(bottom=0)
    if lease:
        ax2.legend(fontsize=7)

    sizes = doc.get("backlog", {}).get("sizes", [])
    if sizes:
        xs = [r["ready_jobs"] for r in sizes]
        for key, style in (("p50", "o-"), ("p99", "s--")):
            ax3.plot(
                xs,
                [r["lease_latency_ms"][key] for r in sizes],
                style,
                label=f"claim (lease request) {key}",
            )
        ax3.set_xscale("log")
    ax3.set(xlabel="ready jobs waiting", ylabel="ms", title="Claim latency vs backlog")
    ax3.set_ylim(bottom=0)
    if sizes:
        ax3.legend(fontsize=7)

    m = doc["meta"]["machine"]
    fig.suptitle(
        f"relay_bench ({doc['meta']['sizes']}, medians of {doc['meta'].get('runs', 1)} runs): "
        f"{m['cores']} cores, {m['cpu_model']}, "
        f"SQLite {m['sqlite']} WAL synchronous={doc['meta']['synchronous']}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
