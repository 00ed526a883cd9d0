"""One condition wait for the tests: poll a check until it holds, within a deadline.

For what a test cannot be told directly (another process's or thread's state, PostgreSQL's
``pg_stat_activity``): the pause between looks only keeps the loop from taking a core the
code under test needs; the deadline fails the test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PAUSE_S = 0.01  # between two looks


def wait_until(check: Callable[[], Any], *, what: str = "", timeout_s: float = 60.0) -> Any:
    """Call ``check`` until it returns something truthy and return that.

    Raises:
        AssertionError: not within ``timeout_s`` (s), naming ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what or check}"
        time.sleep(PAUSE_S)
    return value
