"""10,000 queues against a real ``relay_server`` (issue 13, item 14).

``relay stats`` used to fail with ``FRAME_TOO_LARGE`` (one reply held every queue) and
``/metrics`` grew to 80,041 series (12.7 MB). Now stats come a page of queues at a time and
the CLI pages through them; metric labels stop at ``RELAY_METRICS_MAX_QUEUES`` (100).
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from queue_core.client import RelayClient
from tests.procs import spawner

pytestmark = [pytest.mark.slow]

QUEUES = 10_000


def test_ten_thousand_queues(tmp_path: Path) -> None:
    with spawner(str(tmp_path / "relay.db")) as spawn:
        proc, port = spawn.server("--metrics-address", "127.0.0.1:0")
        metrics_port = proc.wait_event("metrics_ready")["port"]
        with RelayClient(f"127.0.0.1:{port}", timeout_s=60) as client:
            for start in range(0, QUEUES, 1000):
                client.submit_batch(
                    [{"queue": f"q{i:05d}", "payload": i} for i in range(start, start + 1000)]
                )
            first = client.stats()
            assert len(first["queues"]) == 1000 and first["next_after"] == "q00999"
            assert first["totals"]["ready"] == QUEUES
        done = spawn.run("relay_stats", "--json", "--address", f"127.0.0.1:{port}")
        assert done.returncode == 0, done.stderr
        result = orjson.loads(done.stdout)
        assert len(result["queues"]) == QUEUES and result["next_after"] is None
        assert result["queues"]["q09999"]["ready"] == 1
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=60) as response:
            text = response.read().decode()
        series = sum(len(f.samples) for f in text_string_to_metric_families(text))
        depth = [
            s
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "relay_queue_jobs"
        ]
        assert {s.labels["queue"] for s in depth} >= {"_other"}
        assert len({s.labels["queue"] for s in depth}) == 101
        assert sum(s.value for s in depth if s.labels["state"] == "ready") == QUEUES
        assert series < 2_000 and len(text) < 500_000, (series, len(text))
