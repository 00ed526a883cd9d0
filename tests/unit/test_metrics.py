"""``queue_core.metrics``' own ``Counter`` and ``Histogram``: their shorter hot paths write
into the library's value objects, so what a scrape shows must be what prometheus_client's
stock classes show for the same calls, byte for byte, and their errors the library's."""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import prometheus_client
import pytest
from hypothesis import HealthCheck, given, settings
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


OURS = (
    metrics.JOBS_ACKED,
    metrics.JOBS_LEASED,
    metrics.SUBMIT_TO_START_SECONDS,
    metrics.CLAIM_SECONDS,
)


def _sample(name: str, labels: dict[str, str]) -> float:
    """A sample of Relay's own counters, as a scrape reads it (their ``collect``; the
    registry's gauges would read the database)."""
    for metric in OURS:
        for family in metric.collect():
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
    return 0.0


def test_events_recorded_from_several_threads_are_all_counted_by_a_scrape_during_them() -> None:
    """``record`` only queues; flushes at ``FLUSH_AT`` on the recording threads and at each
    scrape on other threads take every event exactly once, and a scrape shows every event
    recorded before it began (a hostile review: two flushes at once lost events, raised
    ``IndexError`` into ``record``'s caller, and let a scrape miss events another thread had
    taken but not yet counted). The interpreter switches threads every 10 µs here, so the
    threads meet inside ``flush``."""
    queue = metrics.queue_label("t-threads-counted")  # this process may fold it into _other
    keys: dict[str, tuple[str, dict[str, str]]] = {
        "acked": ("relay_jobs_acked_total", {"queue": queue}),
        "delays": ("relay_job_submit_to_start_seconds_count", {"queue": queue}),
        "slow": ("relay_job_submit_to_start_seconds_bucket", {"queue": queue, "le": "+Inf"}),
        "fast": ("relay_job_submit_to_start_seconds_bucket", {"queue": queue, "le": "0.005"}),
        "claims": ("relay_claim_duration_seconds_count", {}),
    }
    before = {name: _sample(*key) for name, key in keys.items()}
    threads_n, scrapers_n, per_thread = 6, 2, 8 * metrics.FLUSH_AT
    start = threading.Barrier(threads_n + scrapers_n)
    done = threading.Event()
    recorded = [0] * threads_n  # each recorder's events returned from record, its own slot
    faults: list[BaseException] = []
    short: list[tuple[float, int]] = []  # scrapes that showed fewer acks than recorded
    scrapes = 0

    def recorder(index: int) -> None:
        try:
            start.wait(30)
            for i in range(per_thread):
                metrics.record(
                    [
                        metrics.Event("acked", queue),
                        metrics.Event("start_delay", queue, (i % 2) * 10.0),
                    ]
                )
                recorded[index] += 1
                if i % 3 == 0:
                    metrics.claim_took(0.001)
        except BaseException as exc:  # asserted below
            faults.append(exc)

    def scraper() -> None:
        nonlocal scrapes
        try:
            start.wait(30)
            while not done.is_set():
                least = sum(recorded)
                shown = _sample(*keys["acked"]) - before["acked"]
                if shown < least:
                    short.append((shown, least))
                scrapes += 1
        except BaseException as exc:  # asserted below
            faults.append(exc)

    workers = [threading.Thread(target=recorder, args=(i,)) for i in range(threads_n)]
    readers = [threading.Thread(target=scraper) for _ in range(scrapers_n)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for thread in [*workers, *readers]:
            thread.start()
        for thread in workers:
            thread.join(120)
        done.set()
        for thread in readers:
            thread.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not faults
    assert scrapes > 0
    assert not short, short[:5]
    after = {name: _sample(*key) - before[name] for name, key in keys.items()}
    jobs = threads_n * per_thread
    assert after["acked"] == jobs
    assert after["delays"] == jobs
    assert after["slow"] == jobs
    assert after["fast"] == jobs / 2  # the zero delays
    assert after["claims"] == threads_n * len(range(0, per_thread, 3))
    assert len(metrics._pending) < metrics.FLUSH_AT


def test_a_scrape_right_after_record_shows_the_event() -> None:
    queue = metrics.queue_label("t-scrape-after")
    key = ("relay_jobs_leased_total", {"queue": queue})
    before = _sample(*key)
    metrics.record([metrics.Event("leased", queue, 3.0)])
    assert metrics._pending  # queued, not yet counted
    assert _sample(*key) == before + 3.0
    assert not metrics._pending


QUEUES = ("hq-a", "hq-b", "hq-a-b")  # one a prefix of another: they sort apart
EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["acked", "leased", "start_delay", "claim"]),
        st.sampled_from(QUEUES),
        st.one_of(
            st.sampled_from([*BOUNDS, 0.0, -1.0, -0.0, 3600.0, 1e6]),  # finite: sums subtract
            st.floats(-1, 10, allow_nan=False),
        ),
    ),
    max_size=80,
)


def _ours() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Relay's own samples of ``QUEUES`` (and the unlabelled claim histogram)."""
    found = {}
    for metric in OURS:
        for family in metric.collect():
            for sample in family.samples:
                if sample.labels.get("queue", QUEUES[0]) in QUEUES:
                    found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(events=EVENTS)
def test_counted_in_bulk_as_the_library_counts_each_event(
    events: list[tuple[str, str, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``flush`` sorts the queued events and counts each metric's at once: the counts and
    buckets are those of the stock classes observing each event in turn (the sums agree to
    rounding: they add in another order)."""
    monkeypatch.setattr(metrics, "_labelled", set())  # QUEUES get series of their own
    registry = CollectorRegistry()
    stock: dict[str, Any] = {
        "acked": prometheus_client.Counter("relay_jobs_acked", "", ["queue"], registry=registry),
        "leased": prometheus_client.Counter("relay_jobs_leased", "", ["queue"], registry=registry),
        "start_delay": prometheus_client.Histogram(
            "relay_job_submit_to_start_seconds",
            "",
            ["queue"],
            registry=registry,
            buckets=metrics.SUBMIT_TO_START_SECONDS._upper_bounds,
        ),
        "claim": prometheus_client.Histogram(
            "relay_claim_duration_seconds",
            "",
            registry=registry,
            buckets=metrics.CLAIM_SECONDS._upper_bounds,
        ),
    }
    before = _ours()
    for name, queue, value in events:
        if name == "claim":
            stock[name].observe(value)
            metrics.claim_took(value)
        elif name == "start_delay":
            stock[name].labels(queue=queue).observe(max(0.0, value))
            metrics.record([metrics.Event(name, queue, value)])
        else:
            stock[name].labels(queue=queue).inc(abs(value))
            metrics.record([metrics.Event(name, queue, abs(value))])
    assert len(metrics._pending) == len(events)  # fewer than FLUSH_AT: none counted yet
    after = _ours()
    expected = {}
    for family in registry.collect():
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            expected[key] = sample.value
    for key, value in expected.items():
        moved = after.get(key, 0.0) - before.get(key, 0.0)
        if key[0].endswith("_sum") or key[0].endswith("_total"):
            # The totals run on across examples: a difference is good to their magnitude.
            tolerance = 1e-9 * max(1.0, abs(after.get(key, 0.0)))
            assert moved == pytest.approx(value, rel=1e-9, abs=tolerance), key
        else:
            assert moved == value, key


def test_queues_get_series_in_the_order_their_events_came_not_sorted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``flush`` sorts the events but labels their queues first, as they came (a hostile
    review: with two series left, zeta, beta, alpha labelled alpha and beta)."""
    from django.test import override_settings

    metrics.flush()  # events earlier tests left here would take the two series first
    monkeypatch.setattr(metrics, "_labelled", set())
    with override_settings(RELAY_METRICS_MAX_QUEUES=2):
        for queue in ("t-zeta", "t-beta", "t-alpha"):
            metrics.record([metrics.Event("acked", queue)])
        metrics.flush()
    assert metrics._labelled == {"t-zeta", "t-beta"}


def test_a_fault_while_counting_is_logged_and_not_raised_to_the_recorder(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A request's events are recorded after it committed: counting them must not turn its
    reply into an error (a retried submit would be a duplicate job)."""

    def broken(taken: list[tuple[str, str, float]]) -> None:
        raise IndexError("a fault while counting")

    metrics.flush()
    monkeypatch.setattr(metrics, "_count", broken)
    for _ in range(metrics.FLUSH_AT):
        metrics.record([metrics.Event("acked", "t-fault")])  # the last one flushes
    assert not metrics._pending
    assert [r.getMessage() for r in caplog.records if "metrics_flush_failed" in r.getMessage()] == [
        f"event=metrics_flush_failed events={metrics.FLUSH_AT}"
    ]
