"""docs/metrics.md lists every metric Relay exports, with its type and labels, and no other."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from queue_core import metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def exported() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Relay's own metrics as a scrape names them: ``{name: (type, label names)}``."""
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase) and value._name.startswith("relay_"):
            kind = value._type
            name = value._name + ("_total" if kind == "counter" else "")
            found[name] = (kind, tuple(value._labelnames))
    tcp = metrics.TcpServerCollector()
    tcp.read = lambda: (0, 0)
    families = [*metrics.RelayCollector().describe(), *tcp.collect()]
    for family in families:
        labels = getattr(family, "_labelnames", ())
        found[family.name] = (family.type, tuple(labels))
    return found


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """The rows of the doc's "Relay's metrics" table: ``{name: (type, label names)}``."""
    section = DOC.read_text().split("## Relay's metrics", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`relay_"):
            continue
        name = cells[0].strip("`")
        assert name not in rows, f"{name} is listed twice"
        rows[name] = (cells[1], tuple(re.findall(r"`([a-z_]+)`", cells[2])))
    return rows


def test_the_exports_are_found() -> None:
    found = exported()
    assert found["relay_jobs_acked_total"] == ("counter", ("queue",))
    assert found["relay_queue_jobs"] == ("gauge", ("queue", "state"))
    assert found["relay_tcp_connections"] == ("gauge", ())
    assert len(found) > 20


def test_the_doc_lists_every_metric_with_its_type_and_labels() -> None:
    assert documented() == exported()
