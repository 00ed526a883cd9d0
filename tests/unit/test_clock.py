"""``StepGuard``: wall-clock steps detected against the monotonic clock (hardening item 13).

The guard on its own, with ``FakeClock`` (``step`` moves the wall clock alone): what each
reading judges by, when the judgement returns to the wall clock, and what it logs.
"""

from __future__ import annotations

import logging

import pytest

from queue_core.clock import (
    READ_TRIES,
    AnchoredClock,
    FakeClock,
    StepGuard,
    SystemClock,
    clock_from_path,
)
from tests.stepclock import StallingClock

HOUR_MS = 3_600_000
TOLERANCE_MS = 1_000
HORIZON_MS = 60_000


def read(guard: StepGuard) -> tuple[int, int, int, int]:
    r = guard.read(tolerance_ms=TOLERANCE_MS, horizon_ms=HORIZON_MS)
    return r.now_ms, r.judge_ms, r.mark_ms, r.ready_ms


def test_no_step_judges_by_the_wall_clock() -> None:
    clock = FakeClock()
    guard = StepGuard(clock)
    t0 = clock.now_ms()
    assert read(guard) == (t0, t0, -1, t0)
    clock.advance(seconds=3600)  # both clocks: time passing is not a step
    assert read(guard) == (t0 + HOUR_MS, t0 + HOUR_MS, -1, t0 + HOUR_MS)


def test_first_reading_detects_nothing() -> None:
    clock = FakeClock()
    clock.step(HOUR_MS)  # before the guard ever read the clock
    now = clock.now_ms()
    assert read(StepGuard(clock)) == (now, now, -1, now)


@pytest.mark.parametrize(("step_ms", "detected"), [(999, False), (1_000, False), (1_001, True)])
def test_forward_step_boundary(step_ms: int, detected: bool) -> None:
    clock = FakeClock()
    guard = StepGuard(clock)
    t0 = read(guard)[0]
    clock.advance(ms=500)
    clock.step(step_ms)
    now, judge, mark, _ = read(guard)
    assert now == t0 + 500 + step_ms
    if detected:
        assert (judge, mark) == (t0 + 500, t0 + 500)
    else:
        assert (judge, mark) == (now, -1)


@pytest.mark.parametrize(("step_ms", "longer"), [(-1_000, False), (-1_001, True)])
def test_backward_step_boundary_is_logged_not_compensated(
    step_ms: int, longer: bool, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    guard = StepGuard(clock)
    t0 = read(guard)[0]
    with caplog.at_level(logging.WARNING, logger="relay.clock"):
        clock.step(step_ms)
        now, judge, mark, ready = read(guard)
    assert (now, judge, mark) == (t0 + step_ms, t0 + step_ms, -1)
    assert ready == t0  # new READY jobs tie with the last ones: the id keeps FIFO
    assert [getattr(r, "step_ms", None) for r in caplog.records] == ([step_ms] if longer else [])


def test_forward_step_is_judged_by_the_old_time_until_the_horizon(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    guard = StepGuard(clock)
    t0 = read(guard)[0]
    with caplog.at_level(logging.INFO, logger="relay.clock"):
        clock.step(HOUR_MS)
        assert read(guard) == (t0 + HOUR_MS, t0, t0, t0 + HOUR_MS)
        clock.advance(ms=HORIZON_MS)
        # Old time t0 + horizon: a lease set by the old clock may still be live at its expiry.
        assert read(guard) == (
            t0 + HOUR_MS + HORIZON_MS,
            t0 + HORIZON_MS,
            t0,
            t0 + HOUR_MS + HORIZON_MS,
        )
        clock.advance(ms=1)
        # Past it: every such lease has expired on the old clock too; the wall clock judges.
        now = t0 + HOUR_MS + HORIZON_MS + 1
        assert read(guard) == (now, now, -1, now)
    events = [getattr(r, "event", None) for r in caplog.records]
    assert events == ["clock_step", "clock_step_settled"]


def test_a_step_back_cancels_an_outstanding_step_forward() -> None:
    clock = FakeClock()
    guard = StepGuard(clock)
    t0 = read(guard)[0]
    clock.step(HOUR_MS)
    read(guard)
    clock.step(-HOUR_MS // 2)  # half of it undone: still judged by the time before both
    assert read(guard) == (t0 + HOUR_MS // 2, t0, t0, t0 + HOUR_MS)
    clock.step(-HOUR_MS // 2)  # back where it was: the wall clock judges again
    assert read(guard) == (t0, t0, -1, t0 + HOUR_MS)


def test_two_forward_steps_add_up() -> None:
    clock = FakeClock()
    guard = StepGuard(clock)
    t0 = read(guard)[0]
    clock.step(HOUR_MS)
    read(guard)
    clock.advance(ms=10)
    clock.step(HOUR_MS)
    now, judge, mark, _ = read(guard)
    assert (now, judge) == (t0 + 2 * HOUR_MS + 10, t0 + 10)
    assert mark == t0 + HOUR_MS + 10  # what the once-stepped clock would read


def test_clock_from_path_builds_the_named_clock() -> None:
    assert isinstance(clock_from_path("queue_core.clock.SystemClock"), SystemClock)
    assert isinstance(clock_from_path("queue_core.clock.FakeClock"), FakeClock)
    with pytest.raises(AttributeError):
        clock_from_path("queue_core.clock.NoSuchClock")


# ------------------------------------------------------------------ AnchoredClock


def test_an_anchored_clock_ignores_its_sources_wall_steps() -> None:
    source = FakeClock(start_ms=1_000_000)
    clock = AnchoredClock(source)
    assert clock.now_ms() == 1_000_000
    source.step(3_600_000)  # the machine's clock stepped an hour forward
    assert clock.now_ms() == 1_000_000
    source.step(-7_200_000)  # and back past where it was
    assert clock.now_ms() == 1_000_000
    source.advance(ms=1_500)  # time passes: the interval clock moves it
    assert clock.now_ms() == 1_001_500
    assert clock.monotonic() == source.monotonic()


def test_a_reading_sets_an_anchored_clock_whole() -> None:
    source = FakeClock(start_ms=5_000_000)
    clock = AnchoredClock(source)
    assert clock.due()  # no reading yet
    clock.set(4_999_750, source.monotonic())  # the database read 250 ms behind
    assert clock.now_ms() == 4_999_750 and not clock.due()
    source.advance(ms=1_000)
    clock.set(5_000_790, source.monotonic() - 0.5)  # a reading whose midpoint was 500 ms ago
    assert clock.now_ms() == 5_001_290
    clock.set(5_000_790, source.monotonic() - 0.5)  # the same reading again: no change
    assert clock.now_ms() == 5_001_290
    source.advance(seconds=clock.every_s)
    assert clock.due()


def test_a_slow_reading_moves_an_anchored_clock_only_as_far_as_it_proves() -> None:
    # Read some time in [before, after]: the clock read 1,000,000..1,080,000 over it.
    source = FakeClock(start_ms=1_000_000)
    clock = AnchoredClock(source)
    before = source.monotonic()
    source.advance(seconds=80)
    after = source.monotonic()
    assert clock.bound(1_079_999, before, after) is False  # inside: no news (a midpoint: -40 s)
    assert clock.now_ms() == 1_080_000 and not clock.due()
    assert clock.bound(1_083_000, before, after) is True  # 3 s past its end: 3 s behind
    assert clock.now_ms() == 1_083_000  # it read 1,003,000..1,083,000 over the interval now
    assert clock.bound(1_001_000, before, after) is True  # 2 s before its start: 2 s ahead
    assert clock.now_ms() == 1_081_000


def test_an_anchored_clock_advances_with_the_interval_clock_it_is_given() -> None:
    source = FakeClock(start_ms=0)
    elapsed = [100.0]
    clock = AnchoredClock(source, lambda: elapsed[0])
    elapsed[0] += 2.5  # 2.5 s, counted while the source's monotonic clock stood still
    assert clock.now_ms() == 2_500 and clock.monotonic() == 102.5


@pytest.mark.parametrize("at", ["now_ms", "monotonic"])
@pytest.mark.parametrize("stalls", [1, 2, 10])
def test_a_reader_held_up_between_its_two_reads_is_no_step(at: str, stalls: int) -> None:
    # A reading whose wall and monotonic reads lay seconds apart paired them as one instant:
    # the next reading saw a forward step of the hold-up, and leases were judged by a clock
    # that far behind (in CI an ack was accepted 17 s past its lease's expiry).
    clock = StallingClock(at)
    guard = StepGuard(clock)
    read(guard)
    clock.stalls = stalls
    now, judge, mark, _ = read(guard)
    assert (judge, mark) == (now, -1)
    clock.stalls = 0
    clock.advance(ms=10)
    now = clock.now_ms()
    assert read(guard) == (now, now, -1, now)


@pytest.mark.parametrize("at", ["now_ms", "monotonic"])
def test_a_step_during_a_held_up_reading_is_caught_by_the_next_clean_one(at: str) -> None:
    clock = StallingClock(at)
    guard = StepGuard(clock)
    read(guard)
    clock.step(HOUR_MS)
    clock.stalls = 10  # every try of this reading is held up: it cannot measure the step
    now, judge, mark, _ = read(guard)
    # Yet the step is plain: leases set before it are judged by the old time carried to the
    # try's last read, at most its hold-up early, never late. Judged by the wall clock, a
    # sweep here expired every lease of the step (a hostile review).
    assert HOUR_MS - clock.stall_ms <= now - judge <= HOUR_MS
    assert mark == judge
    clock.stalls = 0
    now, judge, mark, _ = read(guard)
    # The hold-ups were time passing; the hour was the step.
    assert (now - judge, mark) == (HOUR_MS, judge)


def test_a_held_up_try_is_taken_again() -> None:
    # Paired across a 700 ms hold-up, a 1,200 ms step measured 500 ms, under the tolerance:
    # taken again, the reading measures it whole.
    clock = StallingClock("now_ms")
    clock.stall_ms = 700
    guard = StepGuard(clock)
    read(guard)
    clock.step(1_200)
    clock.stalls = 1
    now, judge, mark, _ = read(guard)
    assert (now - judge, mark) == (1_200, judge)


def test_unplaced_readings_are_logged_with_their_count_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = StallingClock("now_ms")
    guard = StepGuard(clock)
    read(guard)
    with caplog.at_level(logging.INFO, logger="relay.clock"):
        for _ in range(4):  # each held up on every try, all within a minute
            clock.stalls = READ_TRIES
            read(guard)
        clock.advance(seconds=60)
        clock.stalls = READ_TRIES
        read(guard)
    counts = [
        r.readings for r in caplog.records if getattr(r, "event", "") == "clock_reading_unplaced"
    ]
    assert counts == [1, 4]
