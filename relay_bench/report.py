"""Present a benchmark document: rich tables for people, JSON for machines, a PNG plot.

The JSON document's keys: ``meta`` (machine, load averages, sizes, pragmas), ``floor``
(``insert_one``, ``insert_batch100``, ``claim_ack``), ``submit`` (one row per transport, mode
and concurrency), ``lease_ack`` (one row per worker concurrency), ``submit_to_start``,
``worker`` (a real ``relay_worker`` process), ``server`` (peak RSS), ``http`` (status),
``backlog`` (``status``, ``sizes``: one row per backlog size) and ``targets``.
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


def _lat(summary: dict[str, Any] | None) -> list[str]:
    if not summary or not summary.get("n"):
        return ["-"] * 4
    return [_num(summary[k], 2) for k in ("p50", "p95", "p99", "max")]


Section = tuple[str, list[str], list[list[str]]]  # title, headers, rows (None row: a rule)


def headline(doc: dict[str, Any]) -> str:
    """One line: machine, versions, pragmas, load averages and duration of the run."""
    meta = doc["meta"]
    m = meta["machine"]
    return (
        f"relay_bench ({meta['sizes']}) on {m['cores']} cores, {m['cpu_model']}, Python "
        f"{m['python']}, SQLite {m['sqlite']}, synchronous={meta['synchronous']}, WAL; load "
        f"average {meta.get('loadavg_start')} -> {meta.get('loadavg_end')}; "
        f"{meta.get('duration_s', '?')} s"
    )


def sections(doc: dict[str, Any]) -> list[Section]:
    """The run as titled tables of strings (shared by the terminal and the Markdown output)."""
    out: list[Section] = []
    head = [
        "scenario",
        "clients",
        "jobs/s",
        "vs floor",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "max ms",
        "server CPU µs/job",
    ]
    rows: list[list[str]] = []
    fl = doc["floor"]
    for label, key, lat in (
        ("raw SQLite: insert, 1 per txn", "insert_one", "latency_ms"),
        ("raw SQLite: insert, 100 per txn", "insert_batch100", "latency_ms"),
        ("raw SQLite: claim txn + ack txn", "claim_ack", "claim_latency_ms"),
    ):
        if key in fl:
            rows.append([label, "1", _num(fl[key]["per_s"]), "1.00x", *_lat(fl[key][lat]), "-"])
    for row in doc.get("submit", []):
        mode = "1 job/request" if row["mode"] == "single" else "100 jobs/request"
        lat = row["latency_ms"].get("submit") or row["latency_ms"].get("submit_batch")
        rows.append(
            [
                f"submit {row['transport'].upper()}, {mode}",
                f"{row['concurrency']} ({row['processes']}p)",
                _num(row["per_s"]),
                _ratio(row.get("ratio_to_floor")),
                *_lat(lat),
                _num(row.get("server_cpu_us_per_job")),
            ]
        )
    for row in doc.get("lease_ack", []):
        clients = f"{row['concurrency']} ({row['processes']}p)"
        rows.append(
            [
                "lease+ack: lease",
                clients,
                _num(row["per_s"]),
                _ratio(row.get("ratio_to_floor")),
                *_lat(row["latency_ms"].get("lease")),
                _num(row.get("server_cpu_us_per_job")),
            ]
        )
        rows.append(["lease+ack: ack", "", "", "", *_lat(row["latency_ms"].get("ack")), ""])
    worker = doc.get("worker", {})
    if "per_s" in worker:
        rows.append(
            [
                f"relay_worker process, --concurrency {worker['concurrency']}",
                "1p",
                _num(worker["per_s"]),
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
            ]
        )
    s2s = doc.get("submit_to_start")
    if s2s:
        rows.append(
            [
                "submit-to-start, idle server, 1 waiting worker",
                "1",
                "-",
                "-",
                *_lat(s2s["latency_ms"]),
                "-",
            ]
        )
    out.append(("Throughput and request latency", head, rows))

    bl = doc.get("backlog", {})
    rows = [
        [
            _num(r["ready_jobs"]),
            _num(r["fill_s"], 1),
            _num(r["server_startup_s"], 1),
            *_lat(r["lease_latency_ms"]),
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

    rows = [
        [
            "relay_server, through the TCP scenarios",
            _num(doc.get("server", {}).get("peak_rss_mb"), 1),
        ],
        [
            f"relay_worker --concurrency {worker.get('concurrency', 16)}",
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

    rows = [
        [
            t["name"],
            t["target"],
            _num(t["value"], 2),
            {True: "yes", False: "NO", None: "not measured"}[t["met"]],
        ]
        for t in doc.get("targets", [])
    ]
    out.append(
        ("Targets (ratios measured in this run)", ["target", "goal", "measured", "met"], rows)
    )
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
    fl = doc["floor"]
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
                label=f"raw SQLite {floor_key.replace('_', ' ')}",
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

    lease = sorted(doc.get("lease_ack", []), key=lambda r: r["concurrency"])
    if lease:
        ax2.plot(
            [r["concurrency"] for r in lease],
            [r["per_s"] for r in lease],
            "o-",
            color="tab:orange",
            label="Relay lease+ack",
        )
    if "claim_ack" in fl:
        ax2.axhline(
            fl["claim_ack"]["per_s"],
            color="tab:orange",
            ls="--",
            lw=1,
            label="raw SQLite claim txn + ack txn",
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
        f"relay_bench ({doc['meta']['sizes']}): {m['cores']} cores, {m['cpu_model']}, "
        f"SQLite {m['sqlite']} WAL synchronous={doc['meta']['synchronous']}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
