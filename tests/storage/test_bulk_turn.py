"""``Driver.bulk_turn``: one bulk chunk at a time across processes where writers take turns at
one lock (SQLite), nothing to hold where they lock rows (PostgreSQL).

Four HTTP workers running bulk replays at once each paused after their own chunks but filled
each other's pauses, and SQLite's lock is not fair: a TCP sentinel waited up to 391 ms (a chaos
review). The turn is an ``flock`` on ``<database>-bulk.lock``; here another process holds it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
from django.db import connections

from queue_core.storage import Driver
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


def test_a_bulk_turn_waits_for_another_process_and_not_for_a_dead_one(
    driver: Driver, backend: str
) -> None:
    entered, leave = threading.Event(), threading.Event()
    if backend == "postgresql":
        _enter(driver, entered, threading.Event())  # nothing held: it enters at once
        assert entered.is_set()
        return
    path = os.path.realpath(str(connections[driver.alias].settings_dict["NAME"]))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, path + "-bulk.lock"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        waiter = threading.Thread(target=_enter, args=(driver, entered, leave), daemon=True)
        waiter.start()
        # A negative observation, bounded: the other process's turn keeps this one out.
        assert not entered.wait(0.5)
        holder.send_signal(signal.SIGKILL)  # a holder that dies frees the turn
        holder.wait(10)
        assert entered.wait(10)
        leave.set()
        waiter.join(10)
        assert not waiter.is_alive()
    finally:
        leave.set()
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.stdout.close()
