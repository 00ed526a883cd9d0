"""``queue_core.metrics``' own ``Counter`` and ``Histogram``: their shorter hot paths write
into the library's value objects, so what a scrape shows must be what prometheus_client's
stock classes show for the same calls, byte for byte, and their errors the library's."""

from __future__ import annotations

import math

import prometheus_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from queue_core import metrics

BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
AMOUNTS = st.one_of(
    st.sampled_from([*BOUNDS, 0.0, -1.0, math.inf, -math.inf, math.nan]),
    st.floats(-1, 10, allow_nan=False),
)
CALLS = st.lists(
    st.tuples(st.sampled_from(["inc", "observe", "plain"]), st.sampled_from(["a", "b"]), AMOUNTS),
    max_size=40,
)


def _scrape(counter_cls: type, histogram_cls: type, calls: list[tuple[str, str, float]]) -> bytes:
    registry = CollectorRegistry()
    counter = counter_cls("t_jobs", "jobs", ["queue"], registry=registry)
    labelled = histogram_cls("t_delay", "delay", ["queue"], buckets=BOUNDS, registry=registry)
    plain = histogram_cls("t_claim", "claim", buckets=BOUNDS, registry=registry)
    for op, queue, amount in calls:
        if op == "inc":
            if amount >= 0 and not math.isinf(amount):
                counter.labels(queue=queue).inc(amount)
        elif op == "observe":
            labelled.labels(queue=queue).observe(amount)
        else:
            plain.observe(amount)
    return generate_latest(registry)


@settings(max_examples=200, deadline=None)
@given(calls=CALLS)
def test_a_scrape_shows_what_the_librarys_classes_show(calls: list[tuple[str, str, float]]) -> None:
    ours = _scrape(metrics.Counter, metrics.Histogram, calls)
    assert ours == _scrape(prometheus_client.Counter, prometheus_client.Histogram, calls)


def test_misuse_gets_the_librarys_errors() -> None:
    registry = CollectorRegistry()
    counter = metrics.Counter("t_c", "c", ["queue"], registry=registry)
    histogram = metrics.Histogram("t_h", "h", ["queue"], registry=registry)
    with pytest.raises(ValueError, match="missing label values"):
        counter.inc()
    with pytest.raises(ValueError, match="missing label values"):
        histogram.observe(1.0)
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels(queue="q").inc(-1)
