"""Attack tools for hostile-client tests: a raw NDJSON socket and a sentinel client.

Every hostile test runs a ``Sentinel`` beside the abuse and checks afterwards that it kept
completing submit -> lease -> ack cycles with bounded latency: while one client misbehaves,
the others are served.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import orjson

from queue_core.client import RelayClient


def rss_kib(pid: int) -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of process ``pid`` in KiB (Linux ``/proc``)."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def send_until(port: int, until: float, first: bytes, again: bytes, pace_s: float = 0.0) -> int:
    """On a new connection that reads nothing (a 4 KiB receive buffer): send ``first``, then
    ``again`` every ``pace_s`` (0: back to back; the client's pace, not a synchronisation)
    until ``until`` (``time.monotonic``), or until a send blocks past it (back-pressure) or
    the server cuts the connection. Return how many times ``again`` went out."""
    count = 0
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.settimeout(max(0.1, until - time.monotonic()))
        sock.sendall(first)
        while (left := until - time.monotonic()) > 0:
            if pace_s:
                time.sleep(min(pace_s, left))
                if time.monotonic() >= until:
                    break
            sock.settimeout(max(0.1, until - time.monotonic()))
            sock.sendall(again)
            count += 1
    except OSError:  # the send blocked past the deadline (back-pressure), or we were cut
        pass
    finally:
        sock.close()
    return count


class Raw:
    """A raw socket speaking (or abusing) NDJSON."""

    def __init__(self, port: int, timeout: float = 15.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.file = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> dict[str, Any]:
        line = self.file.readline()
        assert line.endswith(b"\n"), f"connection closed instead of a reply: {line!r}"
        reply: dict[str, Any] = orjson.loads(line)
        return reply

    def code(self, data: bytes) -> str:
        """Send ``data`` and return the error code of the reply."""
        self.send(data)
        reply = self.recv()
        assert reply["ok"] is False, reply
        return str(reply["error"]["code"])

    def ping(self) -> bool:
        self.send(b'{"id":"p","op":"ping"}\n')
        reply = self.recv()
        return reply["id"] == "p" and reply["ok"] is True

    def at_eof(self) -> bool:
        """True when the server closed the connection (a reset counts: it was closed)."""
        try:
            return self.file.read(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
            self.sock.close()


class Sentinel:
    """Submit -> lease -> ack cycles on one connection, in a thread, until stopped."""

    def __init__(self, port: int) -> None:
        self.client = RelayClient(f"127.0.0.1:{port}", timeout_s=10)
        self.cycles = 0
        self.errors: list[str] = []
        self.worst_s = 0.0
        self.took_s: list[float] = []  # each completed cycle
        self._stop = threading.Event()
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.client.submit("sentinel", {"n": self.cycles})
                (lease,) = self.client.lease(["sentinel"], worker_id="sentinel", wait_ms=2_000)
                self.client.ack(
                    lease["job_id"], worker_id="sentinel", lease_token=lease["lease_token"]
                )
            except Exception as exc:
                with self._progress:
                    self.errors.append(repr(exc))
                    self._progress.notify_all()
                return
            with self._progress:
                took = time.monotonic() - began
                self.took_s.append(took)
                self.worst_s = max(self.worst_s, took)
                self.cycles += 1
                self._progress.notify_all()

    def wait_cycles(self, n: int, timeout: float = 20.0) -> None:
        """Wait (bounded) until ``n`` more cycles have completed, or the sentinel failed."""
        with self._progress:
            target = self.cycles + n
            done = self._progress.wait_for(
                lambda: self.cycles >= target or bool(self.errors), timeout
            )
        assert done, f"sentinel stalled at {self.cycles} cycles"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)
        self.client.close()
