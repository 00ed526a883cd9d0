"""``relay_bench.giveback`` on a real ``relay_server``, on SQLite and on PostgreSQL: clients
that pipelined one-job leases and read nothing reset at once, the jobs their kernels never had
go back READY, and a sentinel client is served throughout.

The figures (the sentinel's latency) are the bench's to report, not a test's to judge; what is
checked here is what the run must show whatever the machine's speed: every job was leased, at
most a receive window's worth per ghost stays LEASED after the resets, and the sentinel ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from relay_bench import giveback
from tests.settings import POSTGRESQL_URL

GHOSTS, EACH = 2, 300
# The lease replies a 4 KiB receive buffer (doubled by the kernel) can hold or have on the
# way at the reset; their jobs stay LEASED (docs/failure-model.md). Each reply is at least
# 300 bytes (one job of this bench: 412 measured).
WINDOW = 2 * giveback.GHOST_RCVBUF // 300 + 1


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_mass_reset_gives_back_what_the_kernels_never_had_and_the_sentinel_is_served(
    database: str, tmp_path: Path
) -> None:
    url = POSTGRESQL_URL if database == "postgresql" else None
    result = giveback.one_run(GHOSTS, EACH, url, tmp_path)
    assert result["leased"] == GHOSTS * EACH
    assert 0 < result["left_leased"] <= GHOSTS * WINDOW
    assert result["sentinel_calls"] > 0 and result["sentinel_max_ms"] > 0
