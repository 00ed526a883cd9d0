"""Test clocks: a system clock a test steps from outside the process (the test hook of
``RELAY_CLOCK``), and a fake clock whose reader is held up between its reads.

A server started with ``RELAY_CLOCK=tests.stepclock.FileStepClock`` and
``RELAY_TEST_CLOCK_STEP_FILE=<path>`` reads its wall clock as the system clock plus the integer
number of ms written in that file (0 while there is none); its monotonic clock is the system's.
Writing the file (``step_to``) therefore steps the server's wall clock exactly as an operator
or NTP stepping the system clock would, without touching the machine's clock. It lives in
``tests/``: only a process configured with both variables uses it.

``timed_transactions`` gives a service's transactions a duration on a fake clock, to measure
the pauses a caller leaves between them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from queue_core.clock import FakeClock, SystemClock

if TYPE_CHECKING:  # a server loads this module as its clock: it imports no service
    from queue_core.service import QueueService

STEP_FILE_ENV = "RELAY_TEST_CLOCK_STEP_FILE"


class FileStepClock(SystemClock):
    """``SystemClock`` with its wall clock offset by the ms in ``$RELAY_TEST_CLOCK_STEP_FILE``.

    The file is looked at (one ``stat``) on every ``now_ms`` and read again when it was
    replaced. Raises ``KeyError`` when the variable is not set: a misconfigured process fails
    at start rather than run on an unintended clock.
    """

    def __init__(self) -> None:
        self._path = Path(os.environ[STEP_FILE_ENV])
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None
        self._offset_ms = 0

    def now_ms(self) -> int:
        """Return the system clock plus the file's offset, in epoch ms."""
        return super().now_ms() + self._offset()

    def _offset(self) -> int:
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return 0
        with self._lock:
            if (st.st_ino, st.st_mtime_ns) != self._seen:
                self._offset_ms = int(self._path.read_text() or "0")
                self._seen = (st.st_ino, st.st_mtime_ns)
            return self._offset_ms


def step_to(path: Path, offset_ms: int) -> None:
    """Set the offset of the processes whose step file is ``path`` (atomically: a new file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(offset_ms))
    os.replace(tmp, path)


class StallingClock(FakeClock):
    """A ``FakeClock`` whose reader is held up for ``stall_ms`` (both clocks move on, as
    real time does) right after its next ``stalls`` calls of ``at`` (``"now_ms"`` or
    ``"monotonic"``): a thread preempted, or waiting for the GIL, between two reads."""

    def __init__(self, at: str = "now_ms") -> None:
        super().__init__()
        self.at = at
        self.stalls = 0
        self.stall_ms = 5_000

    def _held_up(self, name: str) -> None:
        if name == self.at and self.stalls > 0:
            self.stalls -= 1
            self.advance(ms=self.stall_ms)

    def now_ms(self) -> int:
        now = super().now_ms()
        self._held_up("now_ms")
        return now

    def monotonic(self) -> float:
        mono = super().monotonic()
        self._held_up("monotonic")
        return mono


def timed_transactions(
    monkeypatch: Any, service: QueueService, clock: FakeClock, *, work_ms: int
) -> list[float]:
    """Make each ``service.transaction()`` take ``work_ms`` on ``clock`` (advanced before its
    COMMIT); return the list that gets, after each one, the time between its start and the
    end of the one before (the pause a caller left), in s."""
    real = service.transaction
    gaps: list[float] = []
    ended: list[float] = []

    @contextlib.contextmanager
    def transaction(**kwargs: Any) -> Iterator[Any]:
        began = clock.monotonic()
        if ended:
            gaps.append(began - ended[-1])
        with real(**kwargs) as tx:
            yield tx
            clock.advance(ms=work_ms)
        ended.append(clock.monotonic())

    monkeypatch.setattr(service, "transaction", transaction)
    return gaps
