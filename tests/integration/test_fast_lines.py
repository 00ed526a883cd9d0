"""Lines started as they arrive (``listener.Listener.fast_lines``), over real sockets.

While a connection's read loop waits for a line with nothing buffered, whole lines are
started from the protocol's ``data_received``; the first line it cannot start so, and all
after it, go to the read loop as before. These tests hold the two paths to the read loop's
rules: idleness, order, in-flight slots, refusals, and the budget check before each line.
Paced writes below stand for a client's think time, not for synchronisation.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from django.test import override_settings

from queue_core.protocol.budget import ReplyBudget
from queue_core.protocol.reading import WEIGHED_LINE_BYTES, FrameReader
from queue_core.protocol.requests import Requests
from tests.integration.test_tcp_server import Client, Running

pytestmark = pytest.mark.django_db(transaction=True)


def _line(frame: dict[str, Any]) -> bytes:
    return orjson.dumps(frame) + b"\n"


def _readers(running: Running) -> list[FrameReader]:
    readers = [c.reader for c in running.server._listener.conns]
    return [r for r in readers if isinstance(r, FrameReader)]


def test_lines_started_as_they_arrive_keep_a_connection_alive(
    start: Callable[..., Running],
) -> None:
    # Idle after 300 ms: 1.2 s of pings 50 ms apart is activity throughout, and the idle
    # deadline counts from the last of them. Without the fast path's activity the read loop
    # took its deadline from its last own line and closed the connection at 300 ms.
    with override_settings(RELAY_IDLE_TIMEOUT_MS=300):
        running = start()
        c = Client(running.port, timeout=5)
        try:
            began = last = time.monotonic()
            n = 0
            while last - began < 1.2:
                reply = c.call("ping")
                last = time.monotonic()  # the server read this ping before: its deadline is sooner
                assert reply["ok"], reply
                n += 1
                time.sleep(0.05)
            (reader,) = _readers(running)
            assert reader.fast_taken >= n - 1  # every ping after the first took the fast path
            closing = c.recv()
            gap = time.monotonic() - last
            assert closing["id"] is None and closing["error"]["code"] == "TIMEOUT"
            # Measured from the last reply (0.247 s once when measured after the sleep that
            # followed it, under load): at most a round trip short of the 300 ms.
            assert 0.2 <= gap < 2, gap
            assert c.at_eof()
        finally:
            c.close()


def test_a_write_mixing_lines_either_path_takes_answers_each(
    start: Callable[..., Running],
) -> None:
    """One write whose lines the fast path stops at (a bad frame, a long line, a hello, an
    unfinished line), with lines it takes around them: each answered as the read loop
    answers it, the bad frame counted but not closing the connection."""
    running = start()
    c = Client(running.port, timeout=10)
    try:
        assert c.ok("ping")["pong"] is True  # the read loop's first line
        long_payload = "x" * (2 * WEIGHED_LINE_BYTES)
        first = b"".join(
            [
                _line({"id": 1, "op": "ping"}),
                _line({"id": 2, "op": "submit", "args": {"queue": "mix", "payload": 2}}),
                b"{nope\n",
                _line({"id": 3, "op": "ping"}),
                _line({"id": 4, "op": "submit", "args": {"queue": "mix", "payload": long_payload}}),
                _line({"id": 5, "op": "ping"}),
                _line({"id": 6, "op": "hello", "args": {"api_key": "not-a-key"}}),
                _line({"id": 7, "op": "submit", "args": {"queue": "mix", "payload": 7}}),
            ]
        )
        unfinished = _line({"id": 8, "op": "ping"})
        c.send_raw(first + unfinished[:5])
        replies = [c.recv() for _ in range(8)]
        c.send_raw(unfinished[5:] + _line({"id": 9, "op": "ping"}))
        replies += [c.recv(), c.recv()]
        by_id: dict[Any, dict[str, Any]] = {}
        for reply in replies:
            assert reply["id"] not in by_id, reply
            by_id[reply["id"]] = reply
        assert sorted(by_id, key=str) == sorted([1, 2, 3, 4, 5, 6, 7, 8, 9, None], key=str)
        assert by_id[None]["error"]["code"] == "BAD_FRAME"
        for req_id in (1, 3, 5, 8, 9):
            assert by_id[req_id]["result"]["pong"] is True
        assert by_id[6]["error"]["code"] == "UNAUTHENTICATED", by_id[6]  # answered, then on
        payloads = {}
        for req_id in (2, 4, 7):
            job = by_id[req_id]["result"]["job"]
            payloads[req_id] = c.ok("inspect", job_id=job["id"])["job"]["payload"]
        assert payloads == {2: 2, 4: long_payload, 7: 7}
        (reader,) = _readers(running)
        assert reader.fast_taken >= 3  # some of the lines took the fast path
        assert c.ok("ping")["pong"] is True
    finally:
        c.close()


def test_pipelined_lines_past_the_in_flight_slots_wait_for_them(
    start: Callable[..., Running],
) -> None:
    # 40 submits in one write, 3 slots: the fast path takes what slots are free, the read
    # loop the rest as slots come back. Each answered once, in a job of its own.
    with override_settings(RELAY_MAX_INFLIGHT_PER_CONNECTION=3):
        running = start()
        c = Client(running.port, timeout=10)
        try:
            assert c.ok("ping")["pong"] is True
            frames = [
                {"id": n, "op": "submit", "args": {"queue": "slots", "payload": n}}
                for n in range(40)
            ]
            c.send_raw(b"".join(_line(f) for f in frames))
            replies = [c.recv() for _ in frames]
            assert sorted(r["id"] for r in replies) == list(range(40))
            assert all(r["ok"] for r in replies), [r for r in replies if not r["ok"]]
            assert len({r["result"]["job"]["id"] for r in replies}) == 40
            assert c.ok("stats", queue="slots")["queues"]["slots"]["ready"] == 40
        finally:
            c.close()


def test_each_line_is_checked_against_the_reply_budget_after_the_one_before_started(
    start: Callable[..., Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read loop checks a connection's reply budget before each line it reads; a line the
    fast path hands it after starting others must be checked again, not read on the check
    made before them. Recorded in order: each budget check and each start."""
    events: list[tuple[str, Any]] = []
    over, start_request = ReplyBudget.over, Requests.start

    def recording_over(self: ReplyBudget, conn: Any) -> bool:
        events.append(("over", None))
        return over(self, conn)

    def recording_start(self: Requests, conn: Any, request: Any, held: int = 0) -> Any:
        events.append(("start", request.id))
        return start_request(self, conn, request, held)

    monkeypatch.setattr(ReplyBudget, "over", recording_over)
    monkeypatch.setattr(Requests, "start", recording_start)
    running = start()
    c = Client(running.port, timeout=10)
    try:
        assert c.ok("ping")["pong"] is True
        long_id = "L" * 100
        padding = "p" * WEIGHED_LINE_BYTES
        for n in range(5):
            # A short line the fast path takes, then one it leaves to the read loop (longer
            # than it weighs), then a bad one; each write's replies before the next write.
            c.send_raw(
                _line({"id": f"s{n}", "op": "ping"})
                + _line({"id": f"{long_id}{n}", "op": "ping", "args": {"pad": padding}})
                + b"[1]\n"
            )
            replies = [c.recv() for _ in range(3)]
            assert {r["id"] for r in replies} == {f"s{n}", f"{long_id}{n}", None}
        (reader,) = _readers(running)
        assert reader.fast_taken >= 5
    finally:
        c.close()
    starts = [i for i, (kind, _) in enumerate(events) if kind == "start"]
    assert len(starts) == 11  # the first ping, then two a write
    for before, after in itertools.pairwise(starts):
        checks = [kind for kind, _ in events[before + 1 : after]]
        assert "over" in checks, (events[before], events[after], events)
