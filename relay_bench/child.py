"""A child process whose stderr JSON log lines are read as they arrive.

Relay's processes log one JSON object a line on stderr, and announce readiness with one
(``{"event": "ready", "port": ...}``), so whoever starts one waits for that line instead of
sleeping (River's test signals). The benchmark (``procs.ServerProcess``, ``WorkerProcess``) and
the test suite (``tests/procs.py``) both use ``Child``. This module imports neither Django nor
psutil.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

import orjson

STOP_TIMEOUT_S = 30.0
REAP_TIMEOUT_S = 10.0


class LogWaitError(RuntimeError):
    """The child exited, or gave no matching log line in time; the message ends with its log."""


class Child:
    """A started process whose stderr is read by a thread, line by line.

    Args:
        popen: the started process; its stderr must be a pipe.
        name: a label for failure messages.
        events: keep only the records whose ``event`` is one of these, and parse only the lines
            that contain one of them (for a child that logs every job); None keeps every record.
        lines: keep only the last this many stderr lines in ``raw``; None keeps them all.

    Attributes:
        records: the log records kept so far (JSON objects), in order.
    """

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        name: str,
        *,
        events: Collection[str] | None = None,
        lines: int | None = None,
    ) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.name = name
        self.records: list[dict[str, Any]] = []
        self._raw: deque[str] = deque(maxlen=lines)
        self._events = events
        self._cond = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        events = self._events
        for line in self.popen.stderr:
            text = line.decode("utf-8", "replace").rstrip("\n")
            record = None
            if events is None or any(event in text for event in events):
                try:
                    record = orjson.loads(text)
                except orjson.JSONDecodeError:
                    record = None
            with self._cond:
                self._raw.append(text)
                if isinstance(record, dict) and (events is None or record.get("event") in events):
                    self.records.append(record)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float = 30.0,
        what: str = "the expected log line",
    ) -> dict[str, Any]:
        """Return the first kept record matching ``predicate``, waiting up to ``timeout`` s.

        Raises:
            LogWaitError: the child's stderr ended first, or ``timeout`` passed; the message
                names ``what`` and ends with the last 20 stderr lines.
        """
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for record in self.records[seen:]:
                    if predicate(record):
                        return record
                seen = len(self.records)
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    why = "exited" if self._eof else f"timed out after {timeout:g} s"
                    tail = "\n".join(list(self._raw)[-20:])
                    raise LogWaitError(f"{self.name} {why} before {what}:\n{tail}")
                self._cond.wait(left)

    def wait_line(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """Return the match of the first kept stderr line (JSON or plain text) that matches the
        regular expression ``pattern``, waiting up to ``timeout`` s.

        Raises:
            LogWaitError: the child's stderr ended first, or ``timeout`` passed.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self._raw:
                    if match := regex.search(line):
                        return match
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    why = "exited" if self._eof else f"timed out after {timeout:g} s"
                    tail = "\n".join(list(self._raw)[-20:])
                    raise LogWaitError(
                        f"{self.name} {why} before a line matching {pattern!r}:\n{tail}"
                    )
                self._cond.wait(left)

    def wait_event(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        """Return the first record with ``event == event`` (see ``wait_for``)."""
        return self.wait_for(lambda r: r.get("event") == event, timeout, f"an event={event} line")

    @property
    def raw(self) -> list[str]:
        """A copy of the stderr lines kept so far, without their newlines (safe to iterate while
        the reader thread appends)."""
        with self._cond:
            return list(self._raw)

    def stderr_text(self) -> str:
        """The stderr lines kept so far, joined by newlines."""
        with self._cond:
            return "\n".join(self._raw)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait up to ``timeout`` s for the process to exit; return its exit code.

        Raises:
            subprocess.TimeoutExpired: it was still running.
        """
        code = self.popen.wait(timeout)
        self._reader.join(timeout)
        return code

    def signal(self, sig: int) -> None:
        """Send ``sig`` (e.g. ``signal.SIGKILL`` for a real kill -9) unless it has exited."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL unless it has exited, reap it, and close the stderr pipe."""
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(REAP_TIMEOUT_S)
        self._reader.join(REAP_TIMEOUT_S)
        if self.popen.stderr is not None:
            self.popen.stderr.close()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait up to ``timeout_s`` s, then ``kill``; return the exit code."""
        self.signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout_s)
        self.kill()
        return self.popen.returncode
