"""10,000 queues against a real ``relay_server`` (issue 13, item 14).

``relay stats`` used to fail with ``FRAME_TOO_LARGE`` (one reply held every queue) and
``/metrics`` grew to 80,041 series (12.7 MB). Now stats come a page of queues at a time and
the CLI pages through them; metric labels stop at ``RELAY_METRICS_MAX_QUEUES`` (100). And
10,000 is ``RELAY_MAX_QUEUES``: a job for a 10,001st queue is refused.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from queue_core import errors
from queue_core.client import RelayClient
from tests.hostile.support import Sentinel
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
            # RELAY_MAX_QUEUES (10,000): the next new name is refused, a held queue is not.
            with pytest.raises(errors.TooManyQueues) as caught:
                client.submit_batch(
                    [{"queue": "q00000", "payload": 0}, {"queue": "zz", "payload": 0}]
                )
            assert caught.value.details == {"limit": QUEUES, "queue": "zz"}
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
        held = {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name in ("relay_queues", "relay_queues_limit")
        }
        assert held == {"relay_queues": QUEUES, "relay_queues_limit": QUEUES}


def _new_names(port: int, tag: str, until: float, tally: dict[str, int]) -> None:
    """Submit to a new queue name each time, singly and in batches of 100, until ``until``
    (``time.monotonic``) or 5,000 requests; count what came back by error code."""
    with RelayClient(f"127.0.0.1:{port}", timeout_s=30) as client:
        for i in range(5_000):
            if time.monotonic() >= until:
                return
            try:
                if i % 2:
                    client.submit(f"{tag}{i}", 1)
                else:
                    client.submit_batch(
                        [{"queue": f"{tag}{i}x{k}", "payload": 1} for k in range(100)]
                    )
                code = "ok"
            except errors.RelayError as exc:
                code = exc.code
            tally[code] = tally.get(code, 0) + 1


def test_new_queue_names_stop_at_the_cap_while_a_sentinel_is_served(tmp_path: Path) -> None:
    """Two clients each try a new queue name per request for 3 s (a hostile review made
    200,000 names in 5.5 s, after which each ``stats`` took 1.5-1.7 s). The queues stop at
    ``RELAY_MAX_QUEUES`` exactly, every refusal is ``TOO_MANY_QUEUES``, and a sentinel keeps
    completing submit -> lease -> ack cycles throughout."""
    cap = 300
    with spawner(str(tmp_path / "relay.db")) as spawn:
        _, port = spawn.server(RELAY_MAX_QUEUES=str(cap))
        sentinel = Sentinel(port)
        sentinel.wait_cycles(3)
        tallies: list[dict[str, int]] = [{}, {}]
        until = time.monotonic() + 3.0
        attackers = [
            threading.Thread(target=_new_names, args=(port, tag, until, tally))
            for tag, tally in zip(("a", "b"), tallies, strict=True)
        ]
        for t in attackers:
            t.start()
        sentinel.wait_cycles(3, timeout=25)  # served while the attack runs
        for t in attackers:
            t.join(40)
        sentinel.wait_cycles(3)
        sentinel.stop()
        assert not sentinel.errors, sentinel.errors
        codes = {code for tally in tallies for code in tally}
        assert codes <= {"ok", "TOO_MANY_QUEUES"}, tallies
        assert sum(tally.get("TOO_MANY_QUEUES", 0) for tally in tallies) > 0, tallies
        with RelayClient(f"127.0.0.1:{port}", timeout_s=30) as client:
            names = client.stats(limit=1000)["queues"]
        assert len(names) == cap and "sentinel" in names, len(names)
