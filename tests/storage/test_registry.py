"""The server registry and the clock check, once per storage driver (fake clock).

A server is live while seen within three heartbeats (``RELAY_SERVER_HEARTBEAT_MS``); a dead
server's row is deleted an hour after it was last seen; ``clock_skew_ms`` compares this
process's clock with the database's."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test.utils import override_settings

from queue_core.clock import FakeClock
from queue_core.models import RelayServer
from queue_core.service import SERVER_FORGET_MS, QueueService, new_server_id
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

HEARTBEAT_MS = 5_000


def register(service: QueueService, server_id: str, port: int = 7400) -> int:
    return service.register_server(server_id, address=f"127.0.0.1:{port}", host="h", pid=42)


@override_settings(RELAY_SERVER_HEARTBEAT_MS=HEARTBEAT_MS)
def test_a_server_is_live_for_three_heartbeats(service: QueueService, clock: FakeClock) -> None:
    a, b = new_server_id(), new_server_id()
    register(service, a, 7400)
    started = clock.now_ms()
    clock.advance(ms=10)
    register(service, b, 7401)
    live = service.servers()
    assert [s["id"] for s in live] == [a, b]
    assert live[0] | {"clock_skew_ms": 0} == {
        "id": a,
        "address": "127.0.0.1:7400",
        "host": "h",
        "pid": 42,
        "started_at_ms": started,
        "seen_at_ms": started,
        "clock_skew_ms": 0,
    }
    clock.advance(ms=3 * HEARTBEAT_MS - 10)  # a: exactly three heartbeats ago
    assert [s["id"] for s in service.servers()] == [a, b]
    clock.advance(ms=1)
    assert [s["id"] for s in service.servers()] == [b]
    register(service, a)  # its heartbeat: live again, start time kept
    again = service.servers()
    assert [s["id"] for s in again] == [a, b]
    assert again[0]["started_at_ms"] == started and again[0]["seen_at_ms"] == clock.now_ms()


def test_stats_lists_the_live_servers(service: QueueService) -> None:
    server_id = new_server_id()
    register(service, server_id)
    assert [s["id"] for s in service.stats()["servers"]] == [server_id]


def test_a_clean_stop_leaves_the_registry(service: QueueService) -> None:
    a, b = new_server_id(), new_server_id()
    register(service, a)
    register(service, b)
    service.deregister_server(a)
    assert [s["id"] for s in service.servers()] == [b]


def test_a_dead_servers_row_is_forgotten_after_an_hour(
    service: QueueService, clock: FakeClock
) -> None:
    dead, other = new_server_id(), new_server_id()
    register(service, dead)
    clock.advance(ms=SERVER_FORGET_MS)
    register(service, other)  # exactly an hour: kept
    assert RelayServer.objects.filter(id=dead).exists()
    clock.advance(ms=1)
    register(service, other)
    assert list(RelayServer.objects.values_list("id", flat=True)) == [other]


def test_clock_skew_is_measured_against_the_database(service: QueueService) -> None:
    service.clock = FakeClock(start_ms=int(time.time() * 1000) + 60_000)
    skew = service.clock_skew_ms()
    assert 59_000 < skew < 61_000  # a minute ahead, give or take the round trip
    assert 59_000 < register(service, new_server_id()) < 61_000


@pytest.mark.parametrize(("database_at_s", "skew_ms"), [(12.5, 0), (-1, 1_000), (26, -1_000)])
def test_clock_skew_is_what_a_reading_proves_not_its_midpoint(
    service: QueueService, database_at_s: float, skew_ms: int
) -> None:
    # A reading held up 25 s by a network stall: the database's clock, read anywhere in it,
    # proves nothing wrong. Its midpoint made servers log clock_skew of -11.7 s (a review).
    clock = service.clock = FakeClock(start_ms=1_000_000)

    class Stalled:
        def one(self, name: str, params: Any = None) -> dict[str, Any]:
            assert name == "database_now"
            clock.advance(seconds=25)
            return {"now_ms": 1_000_000 + int(database_at_s * 1000)}

    assert service._skew(Stalled()) == (skew_ms, 1_025_000)  # type: ignore[arg-type]


def test_stats_without_finished_jobs_counts_only_live_states(service: QueueService) -> None:
    done = service.submit("q", 1)["job"]["id"]
    service.submit("q", 2)
    lease = service.claim(["q"], worker_id="w", max_jobs=1)[0]
    assert lease["job_id"] == done
    service.ack(done, worker_id="w", lease_token=lease["lease_token"])
    everything = service.stats()
    live = service.stats(finished=False)
    assert everything["queues"]["q"]["succeeded"] == 1 and everything["totals"]["succeeded"] == 1
    assert "succeeded" not in live["queues"]["q"] and "succeeded" not in live["totals"]
    assert live["queues"]["q"]["ready"] == 1 and live["totals"]["ready"] == 1


def test_ready_queues_names_the_queues_with_a_ready_job(service: QueueService) -> None:
    service.submit("a", 1)
    service.submit("b", 1, delay_ms=60_000)  # pending: not ready
    lease = service.claim(["c"], worker_id="w")  # nothing in c
    assert lease == []
    service.submit("c", 1)
    taken = service.claim(["c"], worker_id="w")[0]  # c's only job is leased now
    assert taken["queue"] == "c"
    assert service.ready_queues(["a", "b", "c", "nope"]) == ["a"]


def test_ready_queues_of_many_names_costs_the_queues_with_ready_jobs_not_the_names(
    service: QueueService, assert_queries: Any
) -> None:
    # 250 connections' long-polls on 256,000 names cost a seek a name for every commit another
    # process made, and kept the TCP server's core busy (a hostile review).
    service.submit_batch([{"queue": q, "payload": 1} for q in ("a", "m", "paused", "zz")])
    service.submit("later", 1, delay_ms=60_000)  # pending: not ready
    service.pause("paused")
    names = [f"idle{i:05d}" for i in range(2_000)] + ["zz", "paused", "later", "a"]
    with assert_queries(sqlite=2, postgresql=2):  # the controls, the READY queues
        assert service.ready_queues(names) == ["zz", "a"]
    # Fewer names than queues with READY jobs: then a seek a name (not the paused one), the
    # same answer.
    few = ["a", "later", "nope", "paused", "m", "x1", "x2", "x3", "x4"]
    service.submit_batch([{"queue": f"r{i:03d}", "payload": 1} for i in range(len(few))])
    with assert_queries(sqlite=2 + len(few) - 1, postgresql=2 + len(few) - 1):
        assert service.ready_queues(few) == ["a", "m"]
    assert service.ready_queues(few[:3]) == ["a"]  # under READY_SCAN_MIN: a seek a name
