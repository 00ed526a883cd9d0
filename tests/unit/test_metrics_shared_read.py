"""``metrics.SharedRead``: the gauges' database read and fold, shared by the scrapes of one
process when slow (hostile reviews: 16 clients scraping ``/metrics`` on a database of 20,000
queues, 170 ms a read and 32 ms a fold, made the API wait 6.7 s at p99), with a fake clock."""

from __future__ import annotations

import threading

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


def test_scrapes_that_arrive_during_a_read_wait_for_it_and_run_no_other() -> None:
    started, release = threading.Event(), threading.Event()
    calls = [0]
    now = [0.0]

    def read() -> int:
        calls[0] += 1
        started.set()
        release.wait(10)
        now[0] += 1.0  # a slow read
        return calls[0]

    shared = SharedRead(read, lambda: now[0])
    got: list[int] = []
    first = threading.Thread(target=lambda: got.append(shared.get()))
    first.start()
    assert started.wait(10)
    others = [threading.Thread(target=lambda: got.append(shared.get())) for _ in range(4)]
    for t in others:
        t.start()
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert got == [1] * 5 and calls == [1]


def test_forget_drops_what_is_kept() -> None:
    r = Reads()
    shared = SharedRead(r.read, r.clock)
    r.took = 0.2
    assert shared.get() == 1
    shared.forget()
    assert shared.get() == 2
