"""Relay's Prometheus metrics: counters and histograms per process, gauges from the database.

Counters and histograms live in ``prometheus_client``'s default registry and count what *this*
process did; they start at zero when the process starts. Both surfaces record them in the
same way: the TCP server and the HTTP API call the op table's handlers
(``queue_core.protocol.dispatch``), each handler lists what happened as ``Event``s in its
``Outcome``, and the surface calls ``record()`` once the service call has committed. Lease
expiries happen inside the service's sweeps, so the service reports them to ``observe`` (its
``observer``) through the driver's ``after_commit``: counted once the sweep commits, never if it
rolls back. ``record`` queues the events; they are counted in bulk before any of these metrics
is collected (``flush``), so a scrape sees every event recorded before it.

Gauges (``RelayCollector``) are read from the database at scrape time with the service's
``stats(finished=False)`` (each live state counted from its own partial index, plus one MIN
per queue over the ready-job index), so every process reports the same values. SUCCEEDED
jobs are not counted: they pile up until purged and a scrape must not cost more as they do
(the counter ``relay_jobs_acked_total`` counts them as they happen).

Labels are bounded: ``queue`` (at most ``RELAY_METRICS_MAX_QUEUES`` names, then
``OTHER_QUEUES``), ``state`` (seven), ``op`` (the op table) and error ``code`` (the error
table). Never a job id or an error text. With 10,000 queues ``/metrics`` had 80,041 series
(12.7 MB); the counters now give their own series to the first queues they see, and the
gauges to the deepest queues, and fold the rest into ``queue="_other"`` (a name no queue can
have: queue names begin with a letter or digit), as Prometheus's advice on label cardinality
asks.
See ``docs/metrics.md`` for which process exports what.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import operator
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, disable_created_metrics
from prometheus_client import Counter as _LibraryCounter
from prometheus_client import Histogram as _LibraryHistogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

log = logging.getLogger("relay.metrics")

# No ``*_created`` series beside each counter: they double the output and Relay's counters
# simply start at zero with their process.
disable_created_metrics()  # type: ignore[no-untyped-call]


class Counter(_LibraryCounter):
    """prometheus_client's ``Counter``, whose labelled children count in fewer steps.

    The library checks on every ``inc`` that the metric is observable (not a labelled
    parent), which a child always is: two Python calls per count (the metrics took about 500
    bytecodes of a lease+ack with them, ``relay_bench.bytecodes``). A child's ``inc`` here adds
    to the library's own value object, so the exposition is the library's;
    ``tests/unit/test_metrics.py`` checks it against the stock class. Anything else (a
    parent, an exemplar, a negative amount) takes the library's path and its errors.
    """

    _labelvalues: tuple[str, ...]
    _value: Any

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if exemplar or not self._labelvalues or amount < 0:
            super().inc(amount, exemplar)
            return
        self._value.inc(amount)

    def collect(self) -> Iterable[Metric]:
        flush()  # the counts ``record`` queued first
        return super().collect()


class Histogram(_LibraryHistogram):
    """prometheus_client's ``Histogram``, whose ``observe`` finds the bucket by bisection.

    The library compares the amount with each bucket's bound in turn, in Python (16 bounds
    for the submit-to-start delay), and checks observability on every call. Here an
    observable histogram (a child, or one without labels) adds to the library's own sum and
    bucket objects, so the exposition is the library's (``tests/unit/test_metrics.py``);
    anything else (a labelled parent, an exemplar, NaN) takes the library's path.
    """

    _labelnames: tuple[str, ...]
    _labelvalues: tuple[str, ...]
    _upper_bounds: list[float]
    _buckets: list[Any]
    _sum: Any

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar or (self._labelnames and not self._labelvalues) or amount != amount:
            super().observe(amount, exemplar)
            return
        self._sum.inc(amount)
        # The first bound at or above the amount, as the library's scan finds (+Inf last).
        self._buckets[bisect.bisect_left(self._upper_bounds, amount)].inc(1)

    def observe_sorted(self, amounts: list[float]) -> None:
        """``observe`` each of ``amounts`` (sorted, lowest first; no NaN) in one addition to
        the sum and one to each bucket they fall in, whatever their number (``flush``)."""
        if self._labelnames and not self._labelvalues:
            for amount in amounts:
                self.observe(amount)  # the library's error
            return
        self._sum.inc(sum(amounts))
        counted, total = 0, len(amounts)
        for bucket, bound in zip(self._buckets, self._upper_bounds, strict=True):
            upto = bisect.bisect_right(amounts, bound)  # those at or below the bound
            if upto > counted:
                bucket.inc(upto - counted)
                if upto == total:
                    return
                counted = upto

    def collect(self) -> Iterable[Metric]:
        flush()  # the observations ``record`` queued first
        return super().collect()


JOBS_SUBMITTED = Counter(
    "relay_jobs_submitted", "Jobs created by submit (deduplicated submits excluded).", ["queue"]
)
JOBS_DEDUPLICATED = Counter(
    "relay_jobs_deduplicated",
    "Submits answered with an existing job because of their idempotency key.",
    ["queue"],
)
JOBS_LEASED = Counter("relay_jobs_leased", "Jobs handed to workers by lease.", ["queue"])
JOBS_LEASED_NEXT = Counter(
    "relay_jobs_leased_next",
    "Jobs handed out in the reply of an ack, fail or ack_batch (lease_next); also counted "
    "in relay_jobs_leased.",
    ["queue"],
)
JOBS_ACKED = Counter("relay_jobs_acked", "Leased jobs acknowledged as done.", ["queue"])
JOBS_FAILED = Counter(
    "relay_jobs_failed", "Attempts reported failed by workers (retried or dead).", ["queue"]
)
JOBS_DEAD = Counter(
    "relay_jobs_dead",
    "Jobs dead-lettered: failed without retries left, or lease expired with none left.",
    ["queue"],
)
JOBS_RELEASED = Counter(
    "relay_jobs_released", "Leased jobs given back by their worker without a failure.", ["queue"]
)
JOBS_PRUNED = Counter(
    "relay_jobs_pruned",
    "Finished jobs deleted by retention (RELAY_RETENTION_SUCCEEDED / _DEAD, relay prune).",
    ["queue"],
)
JOBS_REPLAYED = Counter(
    "relay_jobs_replayed", "Dead letters and cancelled jobs replayed to ready.", ["queue"]
)
JOBS_CANCELLED = Counter(
    "relay_jobs_cancelled",
    "Jobs that entered CANCELLED: cancelled while waiting, or stopped by their worker (or "
    "their lease expired) after a cancel was requested.",
    ["queue"],
)
JOBS_TIMED_OUT = Counter(
    "relay_jobs_timed_out",
    "Attempts that ran past their time limit (renew refused, or the lease ran out past it).",
    ["queue"],
)
LEASE_EXPIRATIONS = Counter(
    "relay_lease_expirations",
    "Leases that expired before their worker acked, failed or released them.",
    ["queue"],
)
STALE_TOKEN_REJECTIONS = Counter(
    "relay_stale_token_rejections",
    "renew/ack/fail/release refused with STALE_TOKEN (a fenced-out worker).",
    ["op"],
)
AUTH_FAILURES = Counter(
    "relay_auth_failures",
    "Requests refused for a missing or invalid API key, or a scope that does not allow them.",
    ["surface", "code"],
)
REPLY_BUDGET_CUTS = Counter(
    "relay_reply_budget_cuts",
    "TCP connections cut off by the server's reply budget: past RELAY_MAX_UNSENT_BYTES, the "
    "one holding most whose client left replies unread and drained nothing for a second.",
)
REQUEST_BUFFER_CUTS = Counter(
    "relay_request_buffer_cuts",
    "TCP connections cut off past RELAY_MAX_BUFFERED_REQUEST_BYTES: their request line was "
    "still arriving a second after it began.",
)
CLAIM_SECONDS = Histogram(
    "relay_claim_duration_seconds",
    "Time of one claim (lease) transaction, from the request reaching the database layer to "
    "its commit; long-poll waits between claims are not included.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
SUBMIT_TO_START_SECONDS = Histogram(
    "relay_job_submit_to_start_seconds",
    "From a job's submit to its first lease (includes any requested delay).",
    ["queue"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
)

_COUNTERS: dict[str, Counter] = {
    "submitted": JOBS_SUBMITTED,
    "deduplicated": JOBS_DEDUPLICATED,
    "leased": JOBS_LEASED,
    "leased_next": JOBS_LEASED_NEXT,
    "acked": JOBS_ACKED,
    "failed": JOBS_FAILED,
    "dead": JOBS_DEAD,
    "released": JOBS_RELEASED,
    "replayed": JOBS_REPLAYED,
    "lease_expired": LEASE_EXPIRATIONS,
    "pruned": JOBS_PRUNED,
    "cancelled": JOBS_CANCELLED,
    "timed_out": JOBS_TIMED_OUT,
}


OTHER_QUEUES = "_other"  # the label of queues past RELAY_METRICS_MAX_QUEUES

_labelled: set[str] = set()  # queues with their own counter series in this process
_labelled_lock = threading.Lock()


def queue_label(queue: str) -> str:
    """``queue``, or ``OTHER_QUEUES`` once this process labels ``RELAY_METRICS_MAX_QUEUES``
    others (first come, first labelled)."""
    if queue in _labelled:
        return queue
    from queue_core.conf import relay_settings

    with _labelled_lock:
        if len(_labelled) >= relay_settings().metrics_max_queues:
            return OTHER_QUEUES
        _labelled.add(queue)
    return queue


class Event(NamedTuple):
    """Something a request did, to be counted once it has committed.

    Attributes:
        name: a key of ``_COUNTERS``, or ``"start_delay"`` (observed in seconds).
        queue: the job's queue.
        value: the amount (1 for counters, seconds for ``start_delay``).
    """

    name: str
    queue: str
    value: float = 1.0


# (metric name, queue label) -> its labelled child: ``labels()`` checks and locks at each
# call; a child stays the same object for the process's life (none is ever removed), and
# there are at most (len(_COUNTERS) + 1) x (RELAY_METRICS_MAX_QUEUES + 1) of them.
_children: dict[tuple[str, str], Any] = {}


def _child(name: str, queue: str) -> Any:
    child = _children.get((name, queue))
    if child is None:
        metric = SUBMIT_TO_START_SECONDS if name == "start_delay" else _COUNTERS[name]
        child = _children[(name, queue)] = metric.labels(queue=queue)
    return child


# Events recorded and not yet counted. ``record`` only appends (one C call, thread-safe);
# they are counted in bulk when FLUSH_AT wait, and before any of these metrics is collected
# (``Counter.collect``, ``Histogram.collect``), so a scrape shows every event recorded before
# it. Counting each event as it came took about 300 Python bytecodes of a two-request
# lease+ack, 6% of them; in bulk, 2-6% fewer bytecodes and 1-2% fewer instructions per job
# (docs/benchmarking.md, round 15). A flush counts what waits: 256 events of one queue take
# about 0.1 ms; a batch's events on many queues (a ``submit_batch`` over 1,000) about 3 ms.
_pending: deque[tuple[str, str, float]] = deque()
FLUSH_AT = 256
_QUEUE = operator.itemgetter(1)
_AMOUNT = operator.itemgetter(2)
# One flush at a time: a flush that took events counts them before another (a scrape's) reads
# the metrics. Reentrant: counting never flushes, but a collect inside it would not deadlock.
_flushing = threading.RLock()


def record(events: Iterable[Event]) -> None:
    """Count ``events`` (call after the request's transaction committed); thread-safe, and
    never raises from counting (``flush``).

    Args:
        events: ``Event``s (or ``(name, queue, value)`` tuples).
    """
    _pending.extend(events)
    if len(_pending) >= FLUSH_AT:
        flush()


def claim_took(seconds: float) -> None:
    """Observe one claim transaction's time (``relay_claim_duration_seconds``), in seconds."""
    _pending.append(("claim", "", seconds))
    if len(_pending) >= FLUSH_AT:
        flush()


def flush() -> None:
    """Count the events ``record`` and ``claim_took`` queued; thread-safe: one flush at a
    time, so one that finds nothing left waits for another still counting what it took.

    Queues get their own series in the order their events came (``queue_label``). Then the
    events are sorted (in C), so each metric's come together, its amounts in order: a counter
    takes one addition, and a histogram one for its sum and one per bucket its amounts fall
    in, however many events there were. A negative ``start_delay`` (a clock stepped back)
    counts as 0 s, as before. Never raises: a fault while counting is logged
    (``event=metrics_flush_failed``) and the events it took are not counted, so a committed
    request is never answered with an error by its metrics.
    """
    with _flushing:
        waiting = len(_pending)
        if not waiting:
            return
        taken = list(itertools.starmap(_pending.popleft, itertools.repeat((), waiting)))
        try:
            _count(taken)
        except Exception:  # logged; the request or scrape goes on
            log.exception(
                "event=metrics_flush_failed events=%s",
                waiting,
                extra={"event": "metrics_flush_failed", "events": waiting},
            )


def _count(taken: list[tuple[str, str, float]]) -> None:
    """``flush``'s counting of the events it took, in the order they came."""
    for queue in dict.fromkeys(map(_QUEUE, taken)):  # first come, first labelled
        if queue and queue not in _labelled:  # "": the claim time's, no queue
            queue_label(queue)
    events = sorted(taken)
    start, total = 0, len(events)
    while start < total:
        name, queue, _ = events[start]
        # The first event of another metric or queue: no string sorts between a queue name
        # and that name followed by NUL.
        end = bisect.bisect_left(events, (name, queue + "\0"), start)
        amounts = list(map(_AMOUNT, events[start:end]))
        start = end
        if name == "claim":
            CLAIM_SECONDS.observe_sorted(amounts)
            continue
        if queue not in _labelled:
            queue = queue_label(queue)
        child = _children.get((name, queue)) or _child(name, queue)
        if name == "start_delay":
            negative = bisect.bisect_left(amounts, 0.0)
            if negative:
                amounts[:negative] = [0.0] * negative
            child.observe_sorted(amounts)
        else:
            child.inc(sum(amounts))


def rejected(op: str, exc: BaseException) -> None:
    """Count a refused request that matters for metrics (``STALE_TOKEN`` so far)."""
    if getattr(exc, "code", None) == "STALE_TOKEN":
        STALE_TOKEN_REJECTIONS.labels(op=op).inc()


def queue_of(job_id: str) -> str:
    """Return a job's queue (a primary-key read), or ``"unknown"`` when it is gone.

    The ack and fail results do not name the queue; inside the service's transaction this
    read sees the job as the request left it.
    """
    from queue_core.conf import relay_settings
    from queue_core.models import Job

    jobs = Job.objects.using(relay_settings().database)  # Relay's alias, not Django's default
    queue = jobs.filter(pk=job_id).values_list("queue", flat=True).first()
    return queue if queue is not None else "unknown"


# ---------------------------------------------------------------------- lease expiries


def observe(event: str, queue: str) -> None:
    """``QueueService``'s observer: count a transition no request returns (a lease expiry,
    the dead letter it may cause, a job deleted by retention). The service calls it after
    the sweep or prune batch commits."""
    record([Event(event, queue)])


# ---------------------------------------------------------------------- gauges


class SharedRead:
    """Scrapes of one process share work that is slow, or asked for by several at once.

    The work runs once at a time, and a scrape that arrives meanwhile waits for it and takes
    its result (single flight). Work that took ``t`` seconds is also given to the scrapes of
    the next ``REUSE_FACTOR * t`` seconds (at most ``max_reuse_s``) when others waited for
    it, or, with ``keep_slow``, when it was slow (at least ``SLOW_S``): so however many
    clients scrape (``/metrics`` needs no key), the work keeps at most about a fifth of the
    process's time. Two uses: the gauges' database read and fold of the queues into at most
    ``RELAY_METRICS_MAX_QUEUES`` series (``keep_slow``: a lone scraper may get gauges up to
    10 s old, never counters), and the whole rendering (not ``keep_slow``, at most 1 s: a
    lone scraper always gets fresh counters; a second review found a slow rendering kept
    hid a returned submit from 100 of 100 sequential scrapes, and kept ``relay_database_up
    0`` after the database came back). Before, 16 clients scraping a database of 20,000
    queues (170 ms a read, 32 ms a fold) made the same processes' API answers wait 6.7 s at
    p99, and a TCP server's own ``--metrics-address`` its clients' 0.9 s (hostile reviews);
    with the read shared and the rendering not, still 1.1 s and 158 ms.

    Args:
        read: the work; its errors reach the caller (and the scrapes that waited for it)
            and are not kept.
        clock: monotonic seconds (``time.monotonic``).
        keep_slow: keep slow work for lone callers too.
        max_reuse_s: the longest work is kept, in seconds.
    """

    SLOW_S = 0.02
    REUSE_FACTOR = 4.0
    MAX_REUSE_S = 10.0

    def __init__(
        self,
        read: Callable[[], Any],
        clock: Callable[[], float] = time.monotonic,
        *,
        keep_slow: bool = True,
        max_reuse_s: float = MAX_REUSE_S,
    ) -> None:
        self._read = read
        self._clock = clock
        self._keep_slow = keep_slow
        self._max_reuse_s = max_reuse_s
        self._lock = threading.Lock()  # held while the work runs
        self._count = threading.Lock()  # guards the two counters below
        self._callers = 0  # inside get(): running the work or waiting for it
        self._runs = 0  # works ended (with a result or an error)
        self._last: tuple[int, bool, Any] | None = None  # (run, ok, result or error)
        self._kept: tuple[float, Any] | None = None  # (until, result)

    def forget(self) -> None:
        """Keep nothing: the next ``get`` does the work (a test's fresh database)."""
        with self._lock:
            self._kept = None
            self._last = None

    def get(self) -> Any:
        """The work's result: one kept, the one that ended while this call waited, or new.

        Raises:
            What the work raised (also to the calls that waited for that work).
        """
        with self._count:
            self._callers += 1
            arrived = self._runs
        try:
            with self._lock:
                last = self._last
                if last is not None and last[0] > arrived:  # ended while this call waited
                    if last[1]:
                        return last[2]
                    raise last[2]
                now = self._clock()
                if self._kept is not None and now < self._kept[0]:
                    return self._kept[1]
                self._kept = None
                try:
                    result = self._read()
                except BaseException as exc:
                    self._ended(False, exc)
                    raise
                took = self._clock() - now
                with self._count:
                    waited = self._callers > 1
                if waited or (self._keep_slow and took >= self.SLOW_S):
                    reuse = min(self._max_reuse_s, self.REUSE_FACTOR * took)
                    self._kept = (now + took + reuse, result)
                self._ended(True, result)
                return result
        finally:
            with self._count:
                self._callers -= 1

    def _ended(self, ok: bool, value: Any) -> None:
        with self._count:
            self._runs += 1
            self._last = (self._runs, ok, value)


class Gauges(NamedTuple):
    """What ``RelayCollector`` reads for a scrape: the folded queues (``_fold``) and the
    controlled queues' controls, at most ``RELAY_METRICS_MAX_QUEUES`` of each; how many queues
    hold jobs, and ``RELAY_MAX_QUEUES``."""

    queues: list[tuple[str, dict[str, Any]]]
    controls: list[tuple[str, dict[str, Any]]]
    held: int
    limit: int


def _read_gauges() -> Gauges:
    from queue_core.conf import relay_settings
    from queue_core.service import QueueService

    service = QueueService()
    stats = service.stats(finished=False)
    s = relay_settings()
    keep = s.metrics_max_queues
    return Gauges(
        _fold(stats["queues"], keep),
        sorted(stats.get("controls", {}).items())[:keep],
        service.count_queues(),
        s.max_queues,
    )


class RelayCollector(Collector):
    """Queue depth by queue and state, and the oldest ready job's age, read at scrape time
    (``SharedRead``: slow reads are shared by the scrapes of the next moments)."""

    def __init__(self) -> None:
        self.gauges = SharedRead(_read_gauges)

    def describe(self) -> Iterator[Metric]:
        """Name the families without reading the database (the registry calls this)."""
        yield from self._families()
        yield from self._controls()
        yield from self._held()

    @staticmethod
    def _held() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        held = GaugeMetricFamily(
            "relay_queues",
            "Queues holding jobs in any state, SUCCEEDED included: what RELAY_MAX_QUEUES caps "
            "(read at scrape).",
        )
        limit = GaugeMetricFamily(
            "relay_queues_limit",
            "RELAY_MAX_QUEUES: past it a job for a new queue is refused TOO_MANY_QUEUES.",
        )
        return held, limit

    @staticmethod
    def _controls() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        paused = GaugeMetricFamily(
            "relay_queue_paused",
            "1 for each paused queue (relay pause), 0 for a controlled queue that runs; the sum "
            "is the number of paused queues (read at scrape).",
            labels=["queue"],
        )
        cap = GaugeMetricFamily(
            "relay_queue_max_leased",
            "The cap on a queue's leased jobs across all workers, for each capped queue.",
            labels=["queue"],
        )
        rate = GaugeMetricFamily(
            "relay_queue_rate_per_second",
            "The most jobs a queue starts per second, for each rate-limited queue.",
            labels=["queue"],
        )
        return paused, cap, rate

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        jobs = GaugeMetricFamily(
            "relay_queue_jobs",
            "Jobs in each queue by live state, SUCCEEDED excluded (read at scrape).",
            labels=["queue", "state"],
        )
        age = GaugeMetricFamily(
            "relay_queue_oldest_ready_age_seconds",
            "How long the longest-waiting ready job of each queue has waited (read at scrape).",
            labels=["queue"],
        )
        up = GaugeMetricFamily("relay_database_up", "1 when the scrape could read the database.")
        return jobs, age, up

    def collect(self) -> Iterator[Metric]:
        """Yield ``relay_queue_jobs``, ``relay_queue_oldest_ready_age_seconds``,
        ``relay_database_up``, and the controls of paused, capped and rate-limited queues
        (``relay_queue_paused``, ``relay_queue_max_leased``, ``relay_queue_rate_per_second``;
        a series per controlled queue, at most ``RELAY_METRICS_MAX_QUEUES`` of them), and
        ``relay_queues`` and ``relay_queues_limit`` (the queue cap)."""
        jobs, age, up = self._families()
        try:
            gauges = self.gauges.get()
        except Exception:
            log.exception("event=metrics_collect_failed")
            up.add_metric([], 0)
            yield up
            return
        for queue, counts in gauges.queues:
            for state, n in counts.items():
                if state != "oldest_ready_age_ms":
                    jobs.add_metric([queue, state], n)
            ms = counts.get("oldest_ready_age_ms")
            age.add_metric([queue], 0.0 if ms is None else ms / 1000)
        up.add_metric([], 1)
        paused, cap, rate = self._controls()
        for queue, c in gauges.controls:
            paused.add_metric([queue], 1 if c["paused"] else 0)
            if c["max_leased"] is not None:
                cap.add_metric([queue], c["max_leased"])
            if c["rate_per_s"] is not None:
                rate.add_metric([queue], c["rate_per_s"])
        yield jobs
        yield age
        yield up
        yield paused
        yield cap
        yield rate
        held, limit = self._held()
        held.add_metric([], gauges.held)
        limit.add_metric([], gauges.limit)
        yield held
        yield limit


def _fold(queues: dict[str, dict[str, Any]], keep: int) -> list[tuple[str, dict[str, Any]]]:
    """The ``keep`` deepest queues (most live jobs; ties by name) by name, then the rest
    summed as ``OTHER_QUEUES`` (its age: the oldest among them)."""
    if len(queues) <= keep:
        return sorted(queues.items())

    def depth(item: tuple[str, dict[str, Any]]) -> tuple[int, str]:
        name, counts = item
        return (-sum(n for k, n in counts.items() if k != "oldest_ready_age_ms"), name)

    ranked = sorted(queues.items(), key=depth)
    rest: dict[str, Any] = {}
    ages = []
    for _, counts in ranked[keep:]:
        for state, n in counts.items():
            if state == "oldest_ready_age_ms":
                if n is not None:
                    ages.append(n)
            else:
                rest[state] = rest.get(state, 0) + n
    rest["oldest_ready_age_ms"] = max(ages, default=None)
    return [*sorted(ranked[:keep]), (OTHER_QUEUES, rest)]


class TcpServerCollector(Collector):
    """``relay_tcp_connections`` and ``relay_reply_bytes_held`` of the TCP server running in
    this process (``watch_tcp_server``), read at scrape time; nothing when none runs."""

    def __init__(self) -> None:
        self.read: Callable[[], tuple[int, int]] | None = None

    def collect(self) -> Iterator[Metric]:
        read = self.read
        if read is None:
            return
        connections, held = read()  # two ints, read from the scrape's thread
        yield GaugeMetricFamily(
            "relay_tcp_connections", "Open TCP connections of this server.", value=connections
        )
        yield GaugeMetricFamily(
            "relay_reply_bytes_held",
            "Reply bytes this TCP server holds for its clients: reserved for reads and leases "
            "in progress, or not yet taken by the kernel (RELAY_MAX_UNSENT_BYTES bounds them).",
            value=held,
        )


TCP_SERVER = TcpServerCollector()
REGISTRY.register(TCP_SERVER)


def watch_tcp_server(read: Callable[[], tuple[int, int]] | None) -> None:
    """Report a TCP server's open connections and reply bytes held (``read`` returns them),
    or stop reporting (None). The latest server started in this process wins."""
    TCP_SERVER.read = read


_installed: list[CollectorRegistry] = []
_install_lock = threading.Lock()


_collectors: list[RelayCollector] = []


def install_collector(registry: CollectorRegistry = REGISTRY) -> None:
    """Register ``RelayCollector`` on ``registry`` once per process."""
    with _install_lock:
        if registry not in _installed:
            collector = RelayCollector()
            registry.register(collector)
            _installed.append(registry)
            _collectors.append(collector)


def forget_gauges() -> None:
    """Make the next scrape read the gauges and render afresh, whatever an earlier one left
    kept (``SharedRead.forget``): for tests, each on a fresh database."""
    with _install_lock:
        for collector in _collectors:
            collector.gauges.forget()
    _RENDERED.forget()


_RENDERED = SharedRead(lambda: generate_latest(REGISTRY), keep_slow=False, max_reuse_s=1.0)


def exposition(registry: CollectorRegistry = REGISTRY) -> bytes:
    """Return the registry in Prometheus text format; the default one rendered once for the
    scrapes that arrive together (``SharedRead``: 6 ms for 150 queues, and 16 clients
    scraping at once rendered it 16 times over)."""
    if registry is not REGISTRY:
        return generate_latest(registry)
    result: bytes = _RENDERED.get()
    return result


# ---------------------------------------------------------------------- the TCP process's /metrics


# The exporter's bounds (``MetricsServer``): a thread and a descriptor per connection, with
# no timeout, let 230 idle connections take every descriptor of a server whose limit was 250
# (its TCP clients were reset, its database could not be opened: a review).
METRICS_CONNECTIONS = 8  # connections served at once; more are answered 503 and closed
# At the limit, a newcomer takes the slot of the oldest connection that has not sent a whole
# request head (it is answered 503 and closed), waiting this long for its thread to end: a
# client reconnecting as fast as it was cut kept 43 of 44 scrapes out (a review).
METRICS_EVICT_WAIT_S = 1.0
METRICS_TIMEOUT_S = 10.0  # a connection silent this long (mid-request, or between) is closed
# A connection still open this long is cut, however it trickles (a second review: a byte
# every 7 s from 8 connections kept every scrape out for good).
METRICS_CONNECTION_S = 30.0
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: 33\r\n\r\n"
    b"too many connections to /metrics\n"
)


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_TIMEOUT_S  # StreamRequestHandler: the socket's timeout
    server: _ThreadingWSGIServer

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.headed(self.request)  # its whole head came: no longer evictable
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("event=metrics_request %s", format % args)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """A thread a connection, at most ``METRICS_CONNECTIONS`` at once; at the limit, a
    newcomer evicts the oldest one still without a whole request head (as the TCP server
    evicts the oldest connection without a key), else it is answered 503."""

    daemon_threads = True
    slots = METRICS_CONNECTIONS
    connection_s = METRICS_CONNECTION_S
    evict_wait_s = METRICS_EVICT_WAIT_S
    request_queue_size = 64  # the listen backlog (socketserver's 5 dropped bursts of scrapes)

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.slots)
        # Connections holding a slot before their request head is whole, oldest first.
        self._headless: dict[socket.socket, None] = {}
        self._headless_lock = threading.Lock()
        super().server_activate()

    def headed(self, request: socket.socket) -> None:
        """``request``'s head has been read (its handler's thread)."""
        with self._headless_lock:
            self._headless.pop(request, None)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not self._evict_for_newcomer():
            with contextlib.suppress(OSError):
                request.setblocking(False)  # never wait on a client that reads nothing
                request.send(_REFUSAL)
            self.shutdown_request(request)
            return
        with self._headless_lock:
            self._headless[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.headed(request)
            self._slots.release()  # no thread took it
            raise

    def _evict_for_newcomer(self) -> bool:
        """Close the oldest connection without a whole head (a 503 first, if its buffer
        takes it) and take its slot once its thread lets it go; return whether a slot was
        taken."""
        with self._headless_lock:
            if not self._headless:
                return False
            victim = next(iter(self._headless))
            del self._headless[victim]
        with contextlib.suppress(OSError):
            victim.send(_REFUSAL, socket.MSG_DONTWAIT)
        _cut(victim)  # its handler's read ends at once, and its thread with it
        return self._slots.acquire(timeout=self.evict_wait_s)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        cut = threading.Timer(self.connection_s, _cut, (request,))
        cut.daemon = True
        cut.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self.headed(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went silent (the timeout) or away is one debug line, not a
        traceback on stderr (socketserver's default)."""
        if isinstance(sys.exception(), OSError):
            log.debug("event=metrics_connection_closed peer=%s", client_address)
        else:
            log.exception("event=metrics_request_failed peer=%s", client_address)


def _cut(request: socket.socket) -> None:
    """End a connection past ``METRICS_CONNECTION_S``: its handler's read or write fails."""
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


def _metrics_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    from django.db import connections

    if environ.get("PATH_INFO", "/") not in ("/metrics", "/metrics/", "/"):
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: scrape /metrics\n"]
    try:
        body = exposition()
    finally:
        connections.close_all()  # this thread's connection; the next scrape opens its own
    start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
    return [body]


class MetricsServer:
    """``/metrics`` on a small HTTP server thread, for processes without Django's HTTP stack.

    Args:
        host, port: where to listen (port 0 picks a free one; ``port`` then holds it).
    """

    def __init__(self, host: str, port: int) -> None:
        install_collector()
        server_class = _ThreadingWSGIServer6 if ":" in host else _ThreadingWSGIServer
        self._httpd = make_server(
            host, port, _metrics_app, server_class=server_class, handler_class=_QuietHandler
        )
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="relay-metrics", daemon=True
        )

    def start(self) -> MetricsServer:
        """Start serving in a daemon thread; return self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
