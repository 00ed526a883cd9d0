"""``Requests.give_back``: the jobs of replies that never reached their client go back in
batches of any workers' jobs, written one at a time, so other requests wait behind one batch
at most; at shutdown, with no connection left, several at a time, and what is left when the
shutdown stops waiting is dropped.

A reset connection gives back each of its unsent replies' jobs by its own call, one job each
when a client pipelines one-job leases. Written one per job, 10 connections reset at once
with 1,000 jobs each held a sentinel client's requests 643 ms on SQLite and 3.9 s on
PostgreSQL (medians); as batches of 100 written one after another, 17-36 ms
(docs/benchmarking.md, "Give-backs in batches").
Here the database is a fake that records each write and answers it when told to, so the order
is checked, not timed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import pytest

from queue_core import errors
from queue_core.protocol.requests import GIVE_BACK_BATCH, GIVE_BACK_FLUSH, Requests


@dataclasses.dataclass
class Write:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    durable: bool
    weight: int


class FakeDb:
    """Records ``put_write`` calls; ``answer`` runs one and settles its future."""

    def __init__(self) -> None:
        self.writes: list[Write] = []

    def put_write(self, fn: Callable[[], Any], future: asyncio.Future[Any], **options: Any) -> None:
        """``Database.put_write``, keeping the two options a give-back sets."""
        self.writes.append(Write(fn, future, options["durable"], options["weight"]))

    def answer(self, write: Write, exc: Exception | None = None) -> None:
        if exc is not None:
            write.future.set_exception(exc)
        else:
            write.future.set_result(write.fn())


class FakeService:
    class capabilities:  # QueueService.capabilities: the one attribute Requests reads
        single_writer = True

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, str]]] = []  # (worker id, job id) per write

    def release_batch(self, leases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        self.batches.append([(lease["worker_id"], lease["job_id"]) for lease in leases])
        return [
            {"job_id": lease["job_id"], "ok": True, "state": "ready", "queue": lease["queue"]}
            if not lease["job_id"].startswith("stale")
            else {"job_id": lease["job_id"], "ok": False, "error": {"code": "STALE_TOKEN"}}
            for lease in leases
        ]


class FakeWakeups:
    def __init__(self) -> None:
        self.woken: list[list[str]] = []

    def wake(self, queues: list[str]) -> None:
        self.woken.append(list(queues))


def leases(prefix: str, n: int, queue: str = "q") -> list[dict[str, Any]]:
    return [{"job_id": f"{prefix}{i}", "lease_token": "t", "queue": queue} for i in range(n)]


def make() -> tuple[Requests, FakeDb, FakeService, FakeWakeups]:
    db, service, wakeups = FakeDb(), FakeService(), FakeWakeups()
    requests = Requests(
        cast(Any, service), cast(Any, db), cast(Any, wakeups), cast(Any, None), lambda _: None
    )
    return requests, db, service, wakeups


async def a_pass() -> None:
    """Let the loop run the callbacks already scheduled (one pass, and the callbacks those
    schedule)."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_the_calls_of_one_pass_go_back_in_batches_written_one_at_a_time() -> None:
    async def main() -> None:
        requests, db, service, wakeups = make()
        # 250 one-job replies, each leased to a worker of its own (a client may name one per
        # lease), and one of worker b on another queue, in the same pass.
        futures = [requests.give_back([lease], f"w{i}") for i, lease in enumerate(leases("a", 250))]
        futures.append(requests.give_back(leases("b", 1, queue="r"), "b"))
        assert db.writes == []  # gathered until the next pass
        await a_pass()
        assert len(db.writes) == 1  # one batch in flight, the others wait for it
        first = db.writes[0]
        assert (first.durable, first.weight) == (False, GIVE_BACK_BATCH)
        db.answer(first)
        await a_pass()
        assert len(db.writes) == 2 and not any(f.done() for f in futures)
        db.answer(db.writes[1])
        await a_pass()
        assert len(db.writes) == 3 and not any(f.done() for f in futures)
        db.answer(db.writes[2])
        await a_pass()
        assert len(db.writes) == 3 and all(f.done() for f in futures)
        assert [len(batch) for batch in service.batches] == [100, 100, 51]
        entries = [entry for batch in service.batches for entry in batch]
        assert entries == [(f"w{i}", f"a{i}") for i in range(250)] + [("b", "b0")]
        assert wakeups.woken == [["q"], ["q"], ["q", "r"]]

    asyncio.run(main())


def test_a_batch_that_fails_whole_is_logged_and_the_next_is_still_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        requests, db, service, wakeups = make()
        requests.give_back(leases("a", 150) + leases("stale", 1), "a")
        await a_pass()
        db.answer(db.writes[0], errors.StoreBusy("busy"))
        await a_pass()
        db.answer(db.writes[1])
        await a_pass()
        assert len(db.writes) == 2
        assert [len(batch) for batch in service.batches] == [51]  # the first never ran
        assert wakeups.woken == [["q"]]

    with caplog.at_level("INFO", logger="relay.server"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records]
    assert any("release_unsent_failed code=BUSY job_ids=a0 a1" in m for m in lines)
    assert any("release_unsent_failed job_id=stale0 code=STALE_TOKEN" in m for m in lines)


def test_at_shutdown_the_batches_left_go_several_at_once_and_given_back_waits_for_all() -> None:
    # Once the connections are closed nobody else waits behind them: GIVE_BACK_FLUSH batches
    # in flight at once (one per PostgreSQL writer).
    async def main() -> None:
        requests, db, service, _ = make()
        requests.give_back(leases("a", 650), "a")
        await a_pass()
        assert len(db.writes) == 1
        waiting = asyncio.ensure_future(requests.given_back())
        await a_pass()
        assert len(db.writes) == GIVE_BACK_FLUSH == 4
        requests.give_back(leases("b", 1), "b")  # a later pass, behind the first's batches
        await a_pass()
        while not waiting.done():
            pending = [w for w in db.writes if not w.future.done()]
            assert 0 < len(pending) <= GIVE_BACK_FLUSH
            db.answer(pending[0])
            await a_pass()
        assert [len(batch) for batch in service.batches] == [100] * 6 + [50, 1]

    asyncio.run(main())


def test_what_is_left_when_the_shutdown_stops_waiting_is_dropped() -> None:
    async def main() -> None:
        requests, db, service, _ = make()
        first = requests.give_back(leases("a", 650), "a")
        await a_pass()
        waiting = asyncio.ensure_future(requests.given_back())
        await a_pass()
        assert len(db.writes) == 4
        assert requests.drop_give_backs() == 250  # 7 batches: 4 written, 3 left
        assert first.done() and not waiting.done()  # its pass's last batch was dropped
        for write in db.writes:
            db.answer(write)
        await a_pass()
        assert waiting.done() and len(db.writes) == 4
        assert sum(len(batch) for batch in service.batches) == 400

    asyncio.run(main())


def test_an_empty_give_back_is_answered_without_a_write() -> None:
    async def main() -> None:
        requests, db, _, _ = make()
        done = requests.give_back([], "a")
        await a_pass()
        assert done.done() and db.writes == []
        await asyncio.wait_for(requests.given_back(), 1)  # nothing to wait for

    asyncio.run(main())
