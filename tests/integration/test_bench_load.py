"""``relay_bench.load``'s ``ack_batch`` kind on a real ``relay_server``: each request acks the
jobs the last one leased and leases the next ones, until the queue is drained."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from relay_bench import load, procs, scenarios


def test_ack_batch_clients_drain_the_queue_acking_in_batches(tmp_path: Path) -> None:
    db = procs.fresh_db(procs.template_db(tmp_path), tmp_path, "server")
    server = procs.ServerProcess(db)
    try:
        scenarios.prefill(server.address, "q", 42)  # not a multiple of the batch
        result = load.run(
            server.address,
            "ack_batch",
            concurrency=2,
            processes=1,
            ops_per_thread=100,
            deadline_s=60,
            queue="q",
        )
    finally:
        server.stop()
    assert (result["ops"], result["errors"]) == (42, 0)
    # Each client leased at its start and once more when a reply brought no next job (the
    # queue drained); between them, one ack_batch per ACK_BATCH jobs (the last may be short).
    assert len(result["latency_ms"]["lease"]) <= 4
    batches = len(result["latency_ms"]["ack"])
    assert 42 // load.ACK_BATCH <= batches <= 42 // load.ACK_BATCH + 2
    with contextlib.closing(sqlite3.connect(db)) as conn:
        states = dict(conn.execute("SELECT state, COUNT(*) FROM relay_job GROUP BY state"))
    assert states == {"succeeded": 42}
