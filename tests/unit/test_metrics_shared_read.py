"""``metrics.SharedRead``: the gauges' database read and fold, shared by the scrapes of one
process when slow (hostile reviews: 16 clients scraping ``/metrics`` on a database of 20,000
queues, 170 ms a read and 32 ms a fold, made the API wait 6.7 s at p99), with a fake clock."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from queue_core.metrics import SharedRead


class Reads:
    """A read that takes ``took`` seconds of the fake clock and counts its calls."""

    def __init__(self) -> None:
        self.now = 0.0
        self.took = 0.0
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def read(self) -> int:
        self.calls += 1
        self.now += self.took
        return self.calls


def test_a_quick_read_is_never_reused() -> None:
    r = Reads()
    shared = SharedRead(r.read, r.clock)
    r.took = SharedRead.SLOW_S / 2
    assert [shared.get() for _ in range(3)] == [1, 2, 3]


def test_a_slow_read_is_reused_for_four_times_its_length_then_read_again() -> None:
    r = Reads()
    shared = SharedRead(r.read, r.clock)
    r.took = 0.2
    assert shared.get() == 1  # ends at 0.2: kept until 0.2 + 0.8
    r.now = 0.999
    assert shared.get() == 1
    r.now = 1.0
    assert shared.get() == 2


def test_reuse_is_capped() -> None:
    r = Reads()
    shared = SharedRead(r.read, r.clock)
    r.took = 30.0
    assert shared.get() == 1
    r.now = 30.0 + SharedRead.MAX_REUSE_S
    assert shared.get() == 2


def test_a_failed_read_is_not_kept() -> None:
    r = Reads()
    failing = [True]

    def read() -> int:
        r.now += 1.0
        if failing[0]:
            raise RuntimeError("database gone")
        return 7

    shared = SharedRead(read, r.clock)
    with pytest.raises(RuntimeError):
        shared.get()
    failing[0] = False
    assert shared.get() == 7


class Held:
    """A read held until ``release``: it counts its calls, adds ``took`` to the fake clock
    ``now``, and fails while ``fail`` is set."""

    def __init__(self, took: float) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.now = 0.0
        self.took = took
        self.calls = 0
        self.fail = False

    def read(self) -> int:
        self.calls += 1
        self.started.set()
        self.release.wait(10)
        self.now += self.took
        if self.fail:
            raise RuntimeError("database gone")
        return self.calls

    def clock(self) -> float:
        return self.now


def together(shared: SharedRead, held: Held, callers: int) -> list[object]:
    """Call ``shared.get`` from ``callers`` threads, all of them inside it (one running the
    held read, the others waiting) before the read is let go; return what each got or raised."""
    got: list[object] = []

    def scrape() -> None:
        try:
            got.append(shared.get())
        except RuntimeError as exc:
            got.append(exc)

    threads = [threading.Thread(target=scrape) for _ in range(callers)]
    threads[0].start()
    assert held.started.wait(10)
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 10
    while shared._callers < callers:  # all inside get: running or waiting
        assert time.monotonic() < deadline, "the calls did not arrive"
        time.sleep(0.001)
    held.release.set()
    for t in threads:
        t.join(10)
    return got


def test_scrapes_that_arrive_during_a_read_wait_for_it_and_run_no_other() -> None:
    held = Held(took=1.0)  # a slow read
    shared = SharedRead(held.read, held.clock)
    assert together(shared, held, 5) == [1] * 5 and held.calls == 1


def test_forget_drops_what_is_kept() -> None:
    r = Reads()
    shared = SharedRead(r.read, r.clock)
    r.took = 0.2
    assert shared.get() == 1
    shared.forget()
    assert shared.get() == 2


def test_a_quick_read_others_waited_for_is_theirs_and_kept_for_four_times_its_length() -> None:
    # A render takes 6 ms (150 queues): quick, so it was never kept, and 16 clients scraping
    # at once rendered it back to back; the API waited 1.1 s at p99 behind them.
    held = Held(took=SharedRead.SLOW_S / 4)  # quick
    shared = SharedRead(held.read, held.clock)
    assert together(shared, held, 5) == [1] * 5 and held.calls == 1
    ended = held.now
    held.now = ended + held.took * 4 - 0.0001
    assert shared.get() == 1  # others waited for it: kept for four times its length
    held.now = ended + held.took * 4
    assert shared.get() == 2  # then read again, and a lone call's quick read is not kept
    assert shared.get() == 3


def test_the_calls_that_waited_for_a_failed_read_get_its_error_and_nothing_is_kept() -> None:
    held = Held(took=0.5)
    held.fail = True
    shared = SharedRead(held.read, held.clock)
    got = together(shared, held, 3)
    assert [type(g) for g in got] == [RuntimeError] * 3 and held.calls == 1
    held.fail = False
    assert shared.get() == 2


def test_without_keep_slow_a_lone_callers_slow_read_is_fresh_and_a_shared_one_capped() -> None:
    r = Reads()
    shared = SharedRead(r.read, r.clock, keep_slow=False, max_reuse_s=1.0)
    r.took = 0.5
    assert [shared.get() for _ in range(3)] == [1, 2, 3]  # slow, but nobody waited
    held = Held(took=0.5)
    shared = SharedRead(held.read, held.clock, keep_slow=False, max_reuse_s=1.0)
    assert together(shared, held, 2) == [1, 1]
    ended = held.now
    held.now = ended + 0.9999
    assert shared.get() == 1  # kept for 1 s, not four times 0.5 s
    held.now = ended + 1.0
    assert shared.get() == 2


def test_a_lone_scrape_always_renders_afresh_however_slow_the_rendering(
    transactional_db: None,  # Relay's collector, if installed, reads the gauges
) -> None:
    # A second review: once a rendering took 20 ms (4,000 queues) it was kept, and 100 of 100
    # scrapes right after a returned submit did not show it.
    from prometheus_client import REGISTRY
    from prometheus_client.core import GaugeMetricFamily

    from queue_core import metrics

    seen = [0]

    class Slow:
        def describe(self) -> list[Any]:
            return []  # registering it does not collect

        def collect(self) -> Any:
            time.sleep(SharedRead.SLOW_S * 1.5)  # stands for a slow rendering
            seen[0] += 1
            yield GaugeMetricFamily("relay_test_slow", "a slow collector", value=seen[0])

    collector = Slow()
    REGISTRY.register(collector)
    try:
        bodies = [metrics.exposition() for _ in range(3)]
    finally:
        REGISTRY.unregister(collector)
    values = [
        next(line for line in body.splitlines() if line.startswith(b"relay_test_slow "))
        for body in bodies
    ]
    assert values == [b"relay_test_slow 1.0", b"relay_test_slow 2.0", b"relay_test_slow 3.0"]
