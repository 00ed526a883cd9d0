"""The file-descriptor limit, against a real ``relay_server`` (issue 13, item 2).

With ``ulimit -n 1024`` and 1,100 connections the server used to write a traceback per failed
``accept()`` (1,097,080 of them, 445 MB in two minutes) while new clients timed out. Now it
caps its connection limit to what the fd limit allows, says so once, and refuses clients past
the cap at once with ``TOO_MANY_CONNECTIONS``; a sentinel connected before keeps working.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from queue_core import errors
from queue_core.client import RelayClient
from tests.hostile.support import Sentinel
from tests.procs import spawner

pytestmark = [pytest.mark.slow]

NOFILE = 256
FLOOD = 300  # more connections than the fd limit allows


def test_more_connections_than_descriptors(tmp_path: Path) -> None:
    with spawner(str(tmp_path / "relay.db")) as spawn:
        proc, port = spawn.server(nofile=NOFILE)  # RELAY_MAX_CONNECTIONS stays 1024
        capped = proc.wait_event("connection_limit_capped")
        assert capped["max_connections"] == 1024 and 0 < capped["capped_to"] < NOFILE
        sentinel = Sentinel(port)
        sentinel.wait_cycles(3)
        flood: list[socket.socket] = []
        try:
            for _ in range(FLOOD):
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            began = time.monotonic()
            fresh = RelayClient(f"127.0.0.1:{port}", timeout_s=10)
            with pytest.raises(errors.TooManyConnections):
                fresh.ping()  # refused at once, not left hanging in the backlog
            assert time.monotonic() - began < 5
            fresh.close()
            sentinel.wait_cycles(3)  # served throughout
        finally:
            for sock in flood:
                sock.close()
        sentinel.wait_cycles(3)
        sentinel.stop()
        assert not sentinel.errors, sentinel.errors
        after = RelayClient(f"127.0.0.1:{port}", timeout_s=10)
        deadline = time.monotonic() + 10
        while True:  # the closed ones free their slots as the server sees them go
            try:
                assert after.ping()["pong"] is True
                break
            except errors.TooManyConnections:
                assert time.monotonic() < deadline, "slots never came back"
                after.close()
        after.close()
        log = proc.stderr_text()
        assert "Traceback" not in log and "out of system resource" not in log, log[-3000:]
        # A burst of accepts may still run out once (asyncio then pauses accepting for a
        # second): one line, not a line per attempt.
        assert sum(r.get("event") == "accept_failed" for r in proc.records) <= 1
