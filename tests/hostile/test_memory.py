"""Clients that never read their replies, against a real ``relay_server`` (issue 13, item 1).

Sixteen connections pipeline ``dead_list`` (each reply about a frame) and read nothing. Before
the reply budget (``queue_core.protocol.budget``) this took the server from 85 MB to 1.2 GB
RSS in six seconds, and a sentinel's ping waited 8 s. Now each connection holds at most its
budget, the ones that stall the server budget are cut, and a sentinel keeps cycling.

With 160 such connections the budget itself gave way: each took a frame past the server's
limit, each buffered 2 MiB of requests, 10,000 of them waited as tasks (holding their pages
too), and every waiter scanned every connection on every returned reply. The server reached
688 MiB and the sentinel got no reply for 12 s. Now 160 stay under the same 250 MB.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import orjson
import pytest

from queue_core.client import RelayClient
from tests.hostile.support import Sentinel, rss_kib, send_until
from tests.procs import spawner

pytestmark = [pytest.mark.slow]

HOGS = 16
ATTACK_S = 5.0
RSS_LIMIT_KIB = 250 * 1024  # the target


def _dead_letters(client: RelayClient, jobs: int, size: int) -> None:
    """Make ``jobs`` DEAD jobs with ``size``-byte payloads (through the server)."""
    pad = "x" * size
    for start in range(0, jobs, 50):  # a batch must fit a frame too
        client.submit_batch(
            [
                {"queue": "d", "payload": {"pad": pad, "n": i}, "max_retries": 0}
                for i in range(start, min(jobs, start + 50))
            ]
        )
    while leases := client.lease(["d"], worker_id="w", max_jobs=100):
        for lease in leases:
            client.fail(
                lease["job_id"],
                worker_id="w",
                lease_token=lease["lease_token"],
                error="x",
                retryable=False,
            )


def _hog(port: int, until: float, sent: list[int]) -> None:
    """Pipeline ``dead_list`` and read nothing, until ``until`` or the server cuts us off."""
    frames = orjson.dumps({"op": "dead_list", "args": {"limit": 1000}}) + b"\n"
    sent.append(16 * send_until(port, until, b"", frames * 16))


@pytest.mark.parametrize("hogs", [HOGS, 10 * HOGS])
def test_clients_that_never_read_keep_the_server_under_250_mb(tmp_path: Path, hogs: int) -> None:
    with spawner(str(tmp_path / "relay.db")) as spawn:
        proc, port = spawn.server()
        client = RelayClient(f"127.0.0.1:{port}", timeout_s=30)
        _dead_letters(client, 150, 8_000)  # a dead_list page is about a 1 MiB frame
        page = client.dead_list(limit=1000)
        assert len(orjson.dumps(page)) > 900_000
        client.close()
        sentinel = Sentinel(port)
        sentinel.wait_cycles(3)
        before = rss_kib(proc.popen.pid)[0]
        sent: list[int] = []
        until = time.monotonic() + ATTACK_S
        threads = [threading.Thread(target=_hog, args=(port, until, sent)) for _ in range(hogs)]
        for hog in threads:
            hog.start()
        sentinel.wait_cycles(5, timeout=ATTACK_S + 10)  # served while the attack runs
        for hog in threads:
            hog.join(ATTACK_S + 10)
        sentinel.wait_cycles(3)
        sentinel.stop()
        peak = rss_kib(proc.popen.pid)[1]
        assert sum(sent) >= hogs * 64, sent  # each asked for far more than it read
        assert not sentinel.errors, sentinel.errors
        assert sentinel.worst_s < 5, f"a sentinel cycle took {sentinel.worst_s:.1f}s"
        assert peak < RSS_LIMIT_KIB, (
            f"server RSS peaked at {peak // 1024} MiB (from {before // 1024})"
        )
        assert proc.popen.poll() is None
        log = proc.stderr_text()
        assert "Traceback" not in log and "internal_error" not in log, log[-3000:]
