"""``Driver.bulk_turn``: one bulk chunk at a time across processes where writers take turns at
one lock (SQLite), nothing to hold where they lock rows (PostgreSQL).

Four HTTP workers running bulk replays at once each paused after their own chunks but filled
each other's pauses, and SQLite's lock is not fair: a TCP sentinel waited up to 391 ms (a chaos
review; 21-44 ms with the turn, docs/failure-model.md). The turn is an ``flock`` on
``<database>-bulk.lock``; here another process holds it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
from django.db import connections

from queue_core.clock import FakeClock
from queue_core.storage import Driver
from queue_core.storage.sqlite.driver import BULK_TURN_WAIT_S
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def _enter(driver: Driver, entered: threading.Event, leave: threading.Event) -> None:
    with driver.bulk_turn():
        entered.set()
        leave.wait(30)


class Holder:
    """Another process holding the turn's lock file of ``driver``'s database."""

    def __init__(self, driver: Driver) -> None:
        path = os.path.realpath(str(connections[driver.alias].settings_dict["NAME"]))
        self.popen = subprocess.Popen(
            [sys.executable, "-c", HOLD, path + "-bulk.lock"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.popen.stdout is not None and self.popen.stdout.readline() == "held\n"

    def end(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.close()
        self.popen.stdout.close()


@pytest.mark.parametrize("backend", ["sqlite"])  # PostgreSQL has no turn to wait for
def test_a_bulk_turn_held_by_a_stopped_process_is_waited_for_a_bounded_time(
    driver: Driver, backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A holder that is stopped (SIGSTOP, a debugger) keeps its descriptor: a chunk goes ahead
    # without the turn after BULK_TURN_WAIT_S, as before there was one.
    clock = FakeClock()
    monkeypatch.setattr(driver, "clock", clock)
    holder = Holder(driver)
    try:
        began = clock.monotonic()
        entered, leave = threading.Event(), threading.Event()
        leave.set()
        _enter(driver, entered, leave)
        assert entered.is_set()
        assert BULK_TURN_WAIT_S <= clock.monotonic() - began < BULK_TURN_WAIT_S + 0.011
        assert holder.popen.poll() is None  # it still held the lock throughout
        assert "event=bulk_turn_skipped" in caplog.text
    finally:
        holder.end()


def test_a_bulk_turn_waits_for_another_process_and_not_for_a_dead_one(
    driver: Driver, backend: str
) -> None:
    entered, leave = threading.Event(), threading.Event()
    if backend == "postgresql":
        _enter(driver, entered, threading.Event())  # nothing held: it enters at once
        assert entered.is_set()
        return
    holder = Holder(driver)
    try:
        waiter = threading.Thread(target=_enter, args=(driver, entered, leave), daemon=True)
        waiter.start()
        # A negative observation, bounded: the other process's turn keeps this one out.
        assert not entered.wait(0.5)
        holder.popen.send_signal(signal.SIGKILL)  # a holder that dies frees the turn
        holder.popen.wait(10)
        assert entered.wait(10)
        leave.set()
        waiter.join(10)
        assert not waiter.is_alive()
    finally:
        leave.set()
        holder.end()
