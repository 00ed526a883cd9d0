"""Rate-limited failure lines and the fd-limit cap (``queue_core.protocol.limits``)."""

from __future__ import annotations

import contextlib
import logging
import resource
import socket
import struct
import termios

import pytest

from queue_core import errors
from queue_core.protocol import limits
from tests.waits import wait_until


def test_expected_failures_log_one_line_per_interval_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    every = limits.Every(3600)
    caplog.set_level(logging.ERROR, logger="relay.server")
    for _ in range(100):  # a full disk fails every group commit and reaper pass
        limits.log_failure(every, "group_commit_failed", errors.StorageFull())
        limits.log_failure(every, "reaper_failed", errors.StorageFull())
    lines = [r for r in caplog.records if r.getMessage().startswith("event=")]
    assert [r.getMessage().split()[0] for r in lines] == [
        "event=group_commit_failed",
        "event=reaper_failed",
    ]
    assert all(r.exc_info is None for r in lines)
    every.every_s = 0  # the interval has passed: the next line says how many were held back
    limits.log_failure(every, "reaper_failed", errors.StorageFull())
    assert "held_back=99" in caplog.records[-1].getMessage()


def test_a_bug_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="relay.server")
    limits.log_failure(limits.Every(3600), "reaper_failed", KeyError("boom"))
    (record,) = caplog.records
    assert record.exc_info is not None and "code=KeyError" in record.getMessage()


def test_the_connection_limit_fits_the_descriptors_left() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard != resource.RLIM_INFINITY  # so no limit can hold this many:
    capped = limits.connection_cap(10**9)
    soft_now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert soft <= soft_now <= hard  # raised as far as allowed, never lowered
    assert 0 < capped <= soft_now - limits.FD_RESERVE
    assert limits.connection_cap(10) == 10  # a limit that fits is kept


def test_kernel_queue_reads_both_queues_of_a_real_tcp_connection() -> None:
    """``kernel_queue`` (``Conn.keeps_up``'s send queue, the HTTP worker's unread bytes):
    what the peer sent and nobody read, and what was sent to a peer that reads nothing."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            client.sendall(b"x" * 1000)
            wait_until(
                lambda: limits.kernel_queue(accepted, termios.FIONREAD) == 1000,
                what="the 1,000 bytes sent, unread, in the receive queue",
                timeout_s=10,
            )
            accepted.setblocking(False)
            sent = 0
            with contextlib.suppress(BlockingIOError):
                while True:  # until the kernel takes no more: the client reads nothing
                    sent += accepted.send(b"y" * 65536)
            queued = limits.kernel_queue(accepted, termios.TIOCOUTQ)
            assert queued is not None and 0 < queued <= sent
        assert limits.kernel_queue(accepted, termios.FIONREAD) is None  # closed
    assert limits.kernel_queue(None, termios.TIOCOUTQ) is None


def test_bytes_transmitted_counts_what_left_for_the_peer_and_survives_its_reset() -> None:
    """``bytes_transmitted`` (``Conn.transmitted``): of the bytes sent, those the kernel sent
    on, which a peer reading nothing caps at its receive window; the count still reads the
    same after the peer resets the connection (``listener.ConnProtocol``)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and reads nothing
        client.connect(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            assert limits.bytes_transmitted(accepted) == 0
            accepted.sendall(b"x" * 1000)
            wait_until(lambda: limits.bytes_transmitted(accepted) == 1000, what="1,000 sent")
            accepted.setblocking(False)
            sent = 1000
            with contextlib.suppress(BlockingIOError):
                while True:  # until the kernel takes no more
                    sent += accepted.send(b"y" * 65536)

            def on_the_way() -> int:
                return sent - (limits.kernel_queue(accepted, limits.SIOCOUTQNSD) or 0)

            wait_until(lambda: limits.bytes_transmitted(accepted) == on_the_way(), timeout_s=10)
            transmitted = limits.bytes_transmitted(accepted)
            assert transmitted is not None and 1000 < transmitted < sent
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            wait_until(lambda: _reset_seen(accepted), what="the reset", timeout_s=10)
            assert limits.bytes_transmitted(accepted) == transmitted
        assert limits.bytes_transmitted(accepted) is None  # closed
    assert limits.bytes_transmitted(None) is None


def _reset_seen(sock: socket.socket) -> bool:
    try:
        sock.recv(1)
    except ConnectionResetError:
        return True
    except BlockingIOError:
        return False
    return True
