"""Injectable time: every instant Relay stores or compares comes from a ``Clock``.

Stored instants are wall-clock epoch milliseconds (UTC); in-process intervals (renew timers,
long-poll waits) use ``monotonic()``. River threads a stubbable clock through its services the
same way; ``FakeClock`` makes expiry and aging boundaries testable to the millisecond.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


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

    def monotonic(self) -> float:
        """Return ``time.monotonic()`` in seconds."""
        return time.monotonic()

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

    def set_ms(self, now_ms: int) -> None:
        """Jump the wall clock to ``now_ms`` (never backwards)."""
        with self._lock:
            if now_ms < self._now_ms:
                raise ValueError("a clock never goes back")
            self._mono += (now_ms - self._now_ms) / 1000
            self._now_ms = now_ms
