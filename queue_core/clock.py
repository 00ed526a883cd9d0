"""Injectable time: every instant Relay stores or compares comes from a ``Clock``.

Stored instants are wall-clock epoch milliseconds (UTC); in-process intervals (renew timers,
long-poll waits) use ``monotonic()``. River threads a stubbable clock through its services the
same way; ``FakeClock`` makes expiry and aging boundaries testable to the millisecond.

``StepGuard`` watches the wall clock against the monotonic one between readings, so that a
step of the wall clock (an operator, or NTP stepping instead of slewing) does not expire
healthy leases early (docs/failure-model.md, "Wall-clock steps").
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

log = logging.getLogger("relay.clock")


class Clock(Protocol):
    """Source of time for the service, server and worker."""

    def now_ms(self) -> int:
        """Wall clock as Unix epoch milliseconds (UTC)."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin; only for in-process intervals."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block for ``seconds`` (a FakeClock advances instead)."""
        ...


class SystemClock:
    """The real clock."""

    def now_ms(self) -> int:
        """Return ``time.time()`` in whole milliseconds."""
        return time.time_ns() // 1_000_000

    # ``time.monotonic`` itself, in seconds: no method frame around it (``StepGuard`` reads
    # it twice a reading).
    monotonic = staticmethod(time.monotonic)

    def sleep(self, seconds: float) -> None:
        """Sleep for real."""
        time.sleep(seconds)


class FakeClock:
    """A clock that moves only when told to. Thread-safe.

    Args:
        start_ms: initial wall time in epoch ms (default 2026-01-01T00:00:00Z).
    """

    def __init__(self, start_ms: int = 1_767_225_600_000) -> None:
        self._lock = threading.Lock()
        self._now_ms = start_ms
        self._mono = 0.0

    def now_ms(self) -> int:
        """Return the fake wall time in epoch ms."""
        with self._lock:
            return self._now_ms

    def monotonic(self) -> float:
        """Return the fake monotonic time in seconds."""
        with self._lock:
            return self._mono

    def sleep(self, seconds: float) -> None:
        """Advance instead of sleeping."""
        self.advance(seconds=seconds)

    def advance(self, *, seconds: float = 0.0, ms: int = 0) -> int:
        """Move both clocks forward by ``seconds`` plus ``ms``; return the new epoch ms."""
        delta_ms = round(seconds * 1000) + ms
        if delta_ms < 0:
            raise ValueError("a clock never goes back")
        with self._lock:
            self._now_ms += delta_ms
            self._mono += delta_ms / 1000
            return self._now_ms

    def step(self, ms: int) -> int:
        """Step the wall clock by ``ms`` (negative: backwards), leaving the monotonic clock
        where it is, as an operator or NTP stepping the system clock does; return the new
        epoch ms."""
        with self._lock:
            self._now_ms += ms
            return self._now_ms

    def set_ms(self, now_ms: int) -> None:
        """Jump the wall clock to ``now_ms`` (never backwards)."""
        with self._lock:
            if now_ms < self._now_ms:
                raise ValueError("a clock never goes back")
            self._mono += (now_ms - self._now_ms) / 1000
            self._now_ms = now_ms


BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def boot_seconds() -> float:
    """Seconds since boot, counting time suspended (Linux ``CLOCK_BOOTTIME``; elsewhere
    ``time.monotonic``)."""
    return time.clock_gettime(BOOTTIME) if BOOTTIME is not None else time.monotonic()


def outside(value: float, low: float, high: float) -> float:
    """How far ``value`` lies past ``high`` (positive) or short of ``low`` (negative); 0
    inside: the least a clock that read ``low``..``high`` while a reading ``value`` was taken
    is off by (``AnchoredClock.bound``, ``QueueService._skew``)."""
    if value > high:
        return value - high
    if value < low:
        return value - low
    return 0


class AnchoredClock:
    """The database's time, carried between readings of it by an interval clock: what every
    server sharing one PostgreSQL database reads, so they agree on every instant whatever
    their machines' wall clocks do.

    It reads ``source``'s wall clock once, at creation; from then on it advances with
    ``elapsed`` alone (seconds), and a reading of the database's clock sets it (``set``).
    Once ``every_s`` has passed since the last reading it says so (``due``), and its
    ``QueueService`` reads the database's clock again before its next instant
    (``QueueService._read``).
    So a step of this machine's wall clock changes nothing it reads: before, a server whose
    clock was stepped an hour forward expired the healthy leases other servers had renewed,
    and one stepped back let delayed jobs and retries run early through the others (a hostile
    review). River's servers read every instant from the database in SQL (``now()``); this
    keeps one injectable clock (``FakeClock`` in tests) and still takes the database's time.
    Between readings it drifts as the interval clock does (crystals: some ppm); each reading
    is good to half its round trip.

    Args:
        source: the clock it starts from and sleeps with.
        elapsed: the interval clock in seconds (default ``source.monotonic``; for the
            system clock, ``boot_seconds``, which counts time suspended, so a resumed machine
            does not read the time it was suspended at).
        every_s: how long a reading of the database's clock serves (seconds).
    """

    def __init__(
        self, source: Clock, elapsed: Callable[[], float] | None = None, every_s: float = 5.0
    ) -> None:
        self.source = source
        self._elapsed = elapsed or source.monotonic
        self.every_s = every_s
        # (epoch ms, elapsed s) of the last anchor: one tuple, replaced whole.
        self._anchor = (float(source.now_ms()), self._elapsed())
        self._due_s = float("-inf")  # elapsed s from which a new reading is due (none yet)
        self.reading = threading.Lock()  # held by the thread taking a reading (``due`` says)

    def now_ms(self) -> int:
        """The database's time as last measured, advanced by ``elapsed`` since: epoch ms."""
        base_ms, base_s = self._anchor
        return int(base_ms + (self._elapsed() - base_s) * 1000)

    def due(self) -> bool:
        """Whether a new reading of the database's clock is due (``every_s`` since the last
        one was made or tried, or none yet)."""
        return self._elapsed() >= self._due_s

    def monotonic(self) -> float:
        """``elapsed``: the interval clock ``now_ms`` advances with, in seconds."""
        return self._elapsed()

    def sleep(self, seconds: float) -> None:
        """``source.sleep``."""
        self.source.sleep(seconds)

    def set(self, database_ms: int, at_s: float) -> None:
        """Read ``database_ms`` at ``at_s`` (``elapsed``): a reading of the database's clock,
        taken whole, not as a difference from what the clock read before (two threads'
        readings of one moment then set it once, not twice)."""
        self._anchor = (float(database_ms), at_s)
        self.checked()

    def bound(self, database_ms: int, before_s: float, after_s: float) -> bool:
        """Take a slow reading of the database's clock: ``database_ms``, read some time between
        ``before_s`` and ``after_s`` (``elapsed``). The clock moves only as far as the reading
        proves it wrong: onto the nearer end of what it read over that interval, or not at all
        when the reading falls inside it (NTP's and Marzullo's interval, not a midpoint).
        Return whether it moved.

        A midpoint is good to half the round trip, and a statement held for a whole network
        stall runs only when the stall ends: a server cut off for 80 s set its clock 40 s
        ahead, expired a lease another server had just renewed and started a delayed job
        early (a hostile review).
        """
        base_ms, base_s = self._anchor
        low = base_ms + (before_s - base_s) * 1000
        off = outside(database_ms, low, base_ms + (after_s - base_s) * 1000)
        if off > 0:
            self.set(database_ms, after_s)  # behind by at least this much
        elif off < 0:
            self.set(database_ms, before_s)  # ahead by at least this much
        else:
            self.checked()
            return False
        return True

    def checked(self) -> None:
        """A reading of the database's clock was made or tried: the next is due in
        ``every_s``."""
        self._due_s = self._elapsed() + self.every_s


_DATABASE_CLOCKS: dict[str, AnchoredClock] = {}
_DATABASE_CLOCKS_LOCK = threading.Lock()


def database_clock(alias: str, source: Clock, every_s: float) -> AnchoredClock:
    """The process's ``AnchoredClock`` for database ``alias``: one per process, so every
    ``QueueService`` on that database (the HTTP API's, the console's, ``django.tasks``') keeps
    its time from the same readings.

    Args:
        source: the clock a new one starts from (``RELAY_CLOCK``); for ``SystemClock`` it
            advances with ``boot_seconds``.
        every_s: how long a reading of the database's clock serves, seconds.
    """
    with _DATABASE_CLOCKS_LOCK:
        clock = _DATABASE_CLOCKS.get(alias)
        if clock is None or type(clock.source) is not type(source):
            elapsed = boot_seconds if isinstance(source, SystemClock) else None
            clock = _DATABASE_CLOCKS[alias] = AnchoredClock(source, elapsed, every_s)
        return clock


def clock_from_path(path: str) -> Clock:
    """Build the clock named by a dotted path (``RELAY_CLOCK``), e.g.
    ``"queue_core.clock.SystemClock"``: a class (or factory) called with no arguments.

    Raises:
        ImportError: the module cannot be imported; AttributeError: it has no such name.
    """
    module, _, name = path.rpartition(".")
    factory = getattr(importlib.import_module(module), name)
    clock: Clock = factory()
    return clock


class Reading(NamedTuple):
    """One reading of the clock through a ``StepGuard``.

    Attributes:
        now_ms: the wall clock, epoch ms: what gets stored.
        judge_ms: the instant a lease stamped at or before ``mark_ms`` is judged expired by:
            ``now_ms`` minus the outstanding forward step (``now_ms`` when none).
        mark_ms: what the clock would have read when the outstanding forward step was
            detected had it not been stepped, epoch ms: a lease whose expiry was set
            (``updated_at_ms``) at or before it was set by the old clock, and is judged by
            ``judge_ms``; a later one by ``now_ms``. -1 when no step is outstanding.
        ready_ms: the instant a job made READY now is stamped with (``ready_since_ms``): the
            highest wall reading so far, so that after a backward step new jobs tie with the
            last ones and their ids (monotonic in this process) keep FIFO order.
    """

    now_ms: int
    judge_ms: int
    mark_ms: int
    ready_ms: int


_new_tuple = tuple.__new__  # a named tuple from its fields in order, in C

# How often a ``StepGuard`` reading is tried when its wall read cannot be placed between its
# monotonic ones within half the step tolerance (a reader held up between them).
READ_TRIES = 3
# Readings that could not be placed are logged (``event=clock_reading_unplaced``, with how
# many) at most once in this many seconds.
UNPLACED_LOG_EVERY_S = 60.0


class StepGuard:
    """Read a clock and detect steps of its wall time against its monotonic time.

    Between two readings the wall clock should advance as much as the monotonic one (NTP
    slews by at most 0.5 ms/s). When it advances more than ``tolerance_ms`` further, it was
    stepped forward by the difference: leases whose expiry was set before the step are then
    judged by the old time (``Reading.judge_ms``) until every lease set before it would have
    expired in the old time (``horizon_ms``, the longest lease, after the step),
    while leases set after the step are judged by the new time. A step back of ``s`` ms first
    cancels an outstanding forward step; what remains is not compensated: leases last up to
    ``s`` ms longer and due times come ``s`` ms later. Each detected step is logged once, as a
    warning (``event=clock_step``). Thread-safe: readings are taken under one lock, so they
    are ordered.

    Each reading places its wall read between two monotonic reads and pairs it with the second.
    A reading whose reads lie more than half the tolerance apart (its reader held up between
    them), ``READ_TRIES`` times running, measures nothing and is not compared against: the
    next placed reading measures any step from the last placed one. So a hold-up is never
    taken for a step: two placed readings' pairing errors differ by at most half the
    tolerance. An unplaced reading whose wall clock is plainly ahead of the last placed
    reading's carried forward (by more than the tolerance, to the latest instant it can have
    been read at) judges leases set before that by the carried time: at most the hold-up
    early, never late. Unplaced readings are logged, with how many, at most once a minute
    (``event=clock_reading_unplaced``).

    Note that Linux's monotonic clock stops while the machine is suspended: after a resume,
    the suspended time counts as a forward step (leases are judged by the time before it for
    the window, at most one step late).

    Args:
        clock: the clock to read (its ``now_ms`` and ``monotonic``).
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._monotonic = clock.monotonic  # bound once
        self._now_ms = clock.now_ms
        self._lock = threading.Lock()
        self._last: tuple[int, float] | None = None  # (wall ms, monotonic s), last placed
        self._high = -1  # the highest wall reading so far, ms
        self._offset = 0  # the outstanding forward step, ms
        self._mark = -1  # the last wall reading before it, ms
        self._until = -1  # judge_ms past which no lease set before it can be live, ms
        self._unplaced = 0  # readings that could not be placed since the last log of them
        self._unplaced_logged_at = float("-inf")  # monotonic s of that log

    def read(self, *, tolerance_ms: int, horizon_ms: int) -> Reading:
        """Read the clock; detect, log and account for a step since the last reading.

        Args:
            tolerance_ms: the largest disagreement (ms) between the wall and monotonic
                advances that is not a step (``RELAY_CLOCK_STEP_TOLERANCE_MS``).
            horizon_ms: the longest lease in ms (``RELAY_MAX_LEASE_MS``): how long after a
                forward step leases set before it may still be live.
        """
        monotonic, now_ms = self._monotonic, self._now_ms
        with self._lock:
            # The wall read between two monotonic ones, paired with the second: a reader held
            # up between its reads (preempted, waiting for the GIL) paired them as one instant,
            # and the next reading took the hold-up for a forward step (in CI, 17 s).
            before = monotonic()
            wall = now_ms()
            mono = monotonic()
            last = self._last
            if last is not None and not self._offset and (mono - before) * 2000 <= tolerance_ms:
                drift = (wall - last[0]) - round((mono - last[1]) * 1000)
                if -tolerance_ms <= drift <= tolerance_ms:
                    # No step now and none outstanding: the reading of almost every call,
                    # built without the named tuple's Python-level __new__.
                    self._last = (wall, mono)
                    high = self._high
                    if wall > high:
                        self._high = high = wall
                    return _new_tuple(Reading, (wall, wall, -1, high))
            reading, drift, settled = self._judge(
                before, wall, mono, tolerance_ms=tolerance_ms, horizon_ms=horizon_ms
            )
        wall = reading.now_ms
        if abs(drift) > tolerance_ms:
            log.warning(
                "event=clock_step step_ms=%s judge_offset_ms=%s",
                drift,
                wall - reading.judge_ms,
                extra={
                    "event": "clock_step",
                    "step_ms": drift,
                    "judge_offset_ms": wall - reading.judge_ms,
                    "now_ms": wall,
                },
            )
        if settled:
            log.info(
                "event=clock_step_settled now_ms=%s", wall, extra={"event": "clock_step_settled"}
            )
        return reading

    def _judge(
        self, before: float, wall: int, mono: float, *, tolerance_ms: int, horizon_ms: int
    ) -> tuple[Reading, int, bool]:
        """``read`` past its usual case, under its lock: take a reading that cannot be placed
        (``before``..``mono`` wider than half the tolerance) again, up to ``READ_TRIES`` in
        all; detect and account for a step. Return the reading, the step found (ms, 0 when
        none could be measured) and whether an outstanding step just settled."""
        monotonic, now_ms = self._monotonic, self._now_ms
        placed = (mono - before) * 2000 <= tolerance_ms
        tries = 1
        while not placed and tries < READ_TRIES:
            tries += 1
            before = monotonic()
            wall = now_ms()
            mono = monotonic()
            placed = (mono - before) * 2000 <= tolerance_ms
        last = self._last
        if placed:
            self._last = (wall, mono)
        if wall > self._high:
            self._high = wall
        # Nothing to compare, or a reading that cannot be placed, measures no step: the next
        # placed one measures it from the last placed one.
        drift = 0
        if last is not None and placed:
            drift = (wall - last[0]) - round((mono - last[1]) * 1000)
            if drift > tolerance_ms:
                # The old clock would read wall - drift now: every instant it stamped, in
                # any process, is at most that; every instant the new one stamps is later.
                self._offset += drift
                self._mark = wall - drift
                self._until = self._mark + horizon_ms
            elif drift < -tolerance_ms:
                self._offset = max(0, self._offset + drift)
        # The time leases set before any step are judged by, before the outstanding offset.
        basis = wall
        if not placed:
            self._count_unplaced(mono)
            if last is not None:
                # A step this reading cannot measure may still be plain: the wall clock ahead
                # of the old one carried from the last placed reading to the second monotonic
                # read (the latest instant the wall read can have been). Leases set before it
                # are then judged by that carried time: at most the hold-up early, never late.
                # Judged by the wall clock, a sweep expired every lease of a 1 h step (a
                # hostile review).
                carried = last[0] + round((mono - last[1]) * 1000)
                if wall - carried > tolerance_ms:
                    basis = carried
        settled = bool(self._offset) and basis - self._offset > self._until
        if settled:
            self._offset, self._mark, self._until = 0, -1, -1
        judge = basis - self._offset
        mark = self._mark if self._offset else -1
        if basis != wall:  # a step it cannot measure: leases set by the carried time are before it
            mark = basis
        reading = Reading(now_ms=wall, judge_ms=judge, mark_ms=mark, ready_ms=self._high)
        return reading, drift, settled

    def _count_unplaced(self, mono: float) -> None:
        """Count a reading that could not be placed; log the count at most once in
        ``UNPLACED_LOG_EVERY_S`` (``mono``: its monotonic read, s)."""
        self._unplaced += 1
        if mono >= self._unplaced_logged_at + UNPLACED_LOG_EVERY_S:
            self._unplaced_logged_at = mono
            log.info(
                "event=clock_reading_unplaced readings=%s",
                self._unplaced,
                extra={"event": "clock_reading_unplaced", "readings": self._unplaced},
            )
            self._unplaced = 0
