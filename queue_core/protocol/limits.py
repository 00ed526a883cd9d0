"""The process's file-descriptor limit, and accept() failures without a log storm.

With ``ulimit -n 1024`` and 1,100 clients the server used to hit EMFILE in ``accept()``, log
thousands of tracebacks a second and stop serving new clients. At start the server raises
its soft ``RLIMIT_NOFILE`` to the hard limit (as nginx's ``worker_rlimit_nofile`` and
Redis's ``maxclients`` adjustment do), and caps ``RELAY_MAX_CONNECTIONS`` to what the limit
leaves after the descriptors it already holds and a reserve: a client past the cap is
accepted and told ``TOO_MANY_CONNECTIONS``, never left in the backlog. Should ``accept()``
still run out (descriptors used elsewhere), asyncio pauses accepting for a second; its error
is logged at most once per ``ACCEPT_LOG_EVERY_S`` with a count.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import resource
import socket
import sys
import termios
import time
from typing import Any

log = logging.getLogger("relay.server")

# Kept free: database files, logs, and refusals in progress (asyncio accepts up to 100 at once).
FD_RESERVE = 128
ACCEPT_LOG_EVERY_S = 10.0
FAILURE_LOG_EVERY_S = 10.0  # one line per failing background step and error code


def open_fds() -> int:
    """Descriptors this process holds now (Linux ``/proc/self/fd``; 0 if unknown)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_cap(wanted: int) -> int:
    """Raise the soft fd limit as far as allowed; return how many connections fit.

    Args:
        wanted: ``RELAY_MAX_CONNECTIONS``.
    Returns:
        ``wanted``, or less (at least 1) when the fd limit cannot hold that many besides
        the descriptors already open and ``FD_RESERVE``; logged once when capped.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + open_fds() + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = max(1, soft - open_fds() - FD_RESERVE)
    if room < wanted:
        log.warning(
            "event=connection_limit_capped max_connections=%d capped_to=%d nofile=%d",
            wanted,
            room,
            soft,
            extra={
                "event": "connection_limit_capped",
                "max_connections": wanted,
                "capped_to": room,
                "nofile": soft,
            },
        )
        return room
    return wanted


class Every:
    """Let one log line per key through every ``every_s`` seconds, counting the rest.

    Args:
        every_s: the least time between two lines with one key, in s.
    """

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def due(self, key: str) -> int | None:
        """None when a line with ``key`` went out less than ``every_s`` ago (this one is
        counted); else how many were held back since the last one (log this one)."""
        now = time.monotonic()
        if now - self._last.get(key, -self.every_s) < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)


def log_failure(every: Every, event: str, exc: BaseException) -> None:
    """Log a failed background step (group commit, reaper pass, heartbeat).

    A ``RelayError`` (storage full, database unavailable, ...) is an expected condition: one
    line without a traceback per event and code every ``every.every_s``, with the number held
    back. Anything else is a bug: logged with its traceback, at the same rate.
    """
    from queue_core.errors import RelayError

    code = exc.code if isinstance(exc, RelayError) else type(exc).__name__
    held = every.due(f"{event}:{code}")
    if held is None:
        return
    extra = {"event": event, "code": code, "held_back": held}
    if isinstance(exc, RelayError):
        log.error("event=%s code=%s error=%s held_back=%d", event, code, exc, held, extra=extra)
    else:
        log.error("event=%s code=%s held_back=%d", event, code, held, exc_info=exc, extra=extra)


class QuietAcceptErrors:
    """A loop exception handler that logs accept() resource errors once per interval.

    Everything else goes to the loop's default handler.
    """

    def __init__(self, every_s: float = ACCEPT_LOG_EVERY_S) -> None:
        self.every_s = every_s
        self.suppressed = 0
        self._last = -every_s

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "out of system resource" not in message:
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return
        self._last = now
        exc = context.get("exception")
        log.error(
            "event=accept_failed error=%r suppressed=%d",
            exc,
            self.suppressed,
            extra={"event": "accept_failed", "error": repr(exc), "suppressed": self.suppressed},
        )
        self.suppressed = 0


def kernel_queue(sock: socket.socket | None, request: int) -> int | None:
    """Bytes the kernel holds for ``sock``: its receive queue, not yet read
    (``termios.FIONREAD``), or its send queue, unsent or not yet acknowledged by the peer
    (``termios.TIOCOUTQ``, Linux's ``SIOCOUTQ``). None without a socket, or when the kernel
    does not say (closed, or not a socket the ioctl knows)."""
    if sock is None:
        return None
    try:
        raw = fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0")
    except (OSError, ValueError):
        return None
    return int.from_bytes(raw, sys.byteorder, signed=True)


# Where Linux's ``struct tcp_info`` keeps ``tcpi_bytes_acked`` (a u64, since Linux 4.1): the
# struct only grows at its end, so the offset holds on every later kernel.
TCPI_BYTES_ACKED = slice(120, 128)
# Linux's ioctl for the bytes of a TCP socket's send queue not sent yet (``SIOCOUTQNSD``,
# <linux/sockios.h>); ``termios.TIOCOUTQ`` (``SIOCOUTQ``) counts those and the unacknowledged.
SIOCOUTQNSD = 0x894B


def bytes_transmitted(sock: socket.socket | None) -> int | None:
    """Bytes of what ``sock`` sent that have left this machine, counted from the
    connection's first byte: acknowledged by the peer's kernel (Linux ``TCP_INFO``'s
    ``tcpi_bytes_acked``, RFC 4898's ``tcpEStatsAppHCThruOctetsAcked``) or in flight
    (``SIOCOUTQ`` less ``SIOCOUTQNSD``). A reset destroys what was sent beyond it, unread.
    What it counts may reach the peer all the same: acknowledged bytes stay readable after a
    reset, and bytes in flight may have arrived with their ACK delayed. The count is all
    sequence numbers, so it still reads right after the peer reset the connection, until
    the socket is closed. None without a socket, or when the kernel does not say (closed,
    not TCP, a kernel before 4.1)."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except (OSError, ValueError):
        return None
    unacked = kernel_queue(sock, termios.TIOCOUTQ)
    unsent = kernel_queue(sock, SIOCOUTQNSD)
    if len(info) < TCPI_BYTES_ACKED.stop or unacked is None or unsent is None:
        return None
    return int.from_bytes(info[TCPI_BYTES_ACKED], sys.byteorder) + unacked - unsent
