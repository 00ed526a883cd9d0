"""The transition table is what QueueService checks, and all of it is used, once per driver.

Each path that changes a job's state is driven on its own; around it the test reads every
job's (state, lease expiry) and records the moves the service checked (``states.check``). Every
change seen in the database must be a move the service checked in that step (so one the table
lists), and the moves actually made, over all steps, must be the whole table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from queue_core import service as service_mod
from queue_core import states
from queue_core.clock import FakeClock
from queue_core.models import Job, JobEvent
from queue_core.service import QueueService
from queue_core.states import JobState, Transition
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

Move = tuple[Transition, JobState | None, JobState | None]
Pair = tuple[JobState | None, JobState | None]


class Moves:
    """Records each ``states.check`` the service makes, and what changed in the database."""

    def __init__(self) -> None:
        self.checked: list[Move] = []
        self.made: set[Move] = set()

    def check(self, t: Transition, a: JobState | None, b: JobState | None) -> None:
        self.checked.append((t, a, b))
        states.check(t, a, b)

    @staticmethod
    def snapshot() -> dict[str, tuple[str, int | None]]:
        return {
            job_id: (state, expiry)
            for job_id, state, expiry in Job.objects.values_list(
                "id", "state", "lease_expires_at_ms"
            )
        }

    def step(self, call: Callable[[], Any], *expected: Pair) -> None:
        """Run ``call``; assert the state changes it made are exactly ``expected`` (as a set)
        and each was checked by the service; remember the moves made."""
        before = self.snapshot()
        self.checked.clear()
        call()
        after = self.snapshot()
        seen: set[Pair] = set()
        for job_id in before.keys() | after.keys():
            old, new = before.get(job_id), after.get(job_id)
            if old != new:
                seen.add(
                    (
                        JobState(old[0]) if old else None,
                        JobState(new[0]) if new else None,
                    )
                )
        assert seen == set(expected)
        for pair in seen:
            matched = {m for m in self.checked if (m[1], m[2]) == pair}
            assert matched, f"{pair} happened, but the service checked only {self.checked}"
            self.made |= matched


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> Moves:
    recorder = Moves()
    monkeypatch.setattr(service_mod, "check", recorder.check)
    return recorder


def lease_one(service: QueueService, queue: str, **kw: Any) -> dict[str, Any]:
    leases = service.claim([queue], worker_id="w1", **kw)
    assert len(leases) == 1
    return leases[0]


def ids(lease: dict[str, Any]) -> dict[str, Any]:
    return {"worker_id": "w1", "lease_token": lease["lease_token"]}


def test_every_state_change_is_checked_and_the_whole_table_is_used(
    service: QueueService, clock: FakeClock, moves: Moves
) -> None:
    R, P, L, T, S, D = (
        JobState.READY,
        JobState.PENDING,
        JobState.LEASED,
        JobState.RETRYING,
        JobState.SUCCEEDED,
        JobState.DEAD,
    )
    retry = {"max_retries": 1, "backoff": "fixed", "backoff_base_ms": 1000, "jitter": False}
    # submit (one, and a batch), delayed submit, promotion of a pending job
    moves.step(lambda: service.submit("a", 1), (None, R))
    moves.step(lambda: service.submit_batch([{"queue": "b", "payload": 2}]), (None, R))
    moves.step(lambda: service.submit("c", 3, delay_ms=1000, **retry), (None, P))
    clock.advance(ms=1000)
    moves.step(service.promote_due, (P, R))
    # claim, renew, ack
    acked: dict[str, Any] = {}
    moves.step(lambda: acked.update(lease_one(service, "a")), (R, L))
    clock.advance(ms=10)
    moves.step(lambda: service.renew(acked["job_id"], **ids(acked)), (L, L))
    moves.step(lambda: service.ack(acked["job_id"], **ids(acked)), (L, S))
    # fail with a retry left, promotion of the retrying job, fail without one
    failing = lease_one(service, "c")
    moves.step(lambda: service.fail(failing["job_id"], **ids(failing), error="x"), (L, T))
    clock.advance(ms=1000)
    moves.step(service.promote_due, (T, R))
    failing = lease_one(service, "c")
    moves.step(lambda: service.fail(failing["job_id"], **ids(failing), error="y"), (L, D))
    # release; a lost lease with a retry left, and one without
    released = lease_one(service, "b")
    moves.step(lambda: service.release(released["job_id"], **ids(released)), (L, R))
    lease_one(service, "b", lease_ms=1000)
    service.submit("e", 5, max_retries=0)
    lease_one(service, "e", lease_ms=1000)
    clock.advance(ms=1000)
    moves.step(service.expire_leases, (L, R), (L, D))
    # replay, purge of a dead and of a succeeded job
    moves.step(lambda: service.replay(failing["job_id"]), (D, R))
    dead = service.dead_list()["jobs"]
    assert len(dead) == 1
    moves.step(lambda: service.purge(dead[0]["id"]), (D, None))
    moves.step(lambda: service.purge(acked["job_id"]), (S, None))
    # cancel: a ready, a pending and a retrying job at once; a leased one is marked, then
    # ends cancelled when its worker gives it up; a cancelled job is replayed and purged
    C = JobState.CANCELLED
    ready = service.submit("x", 1)["job"]["id"]
    moves.step(lambda: service.cancel(ready), (R, C))
    pending = service.submit("x", 2, delay_ms=60_000)["job"]["id"]
    moves.step(lambda: service.cancel(pending), (P, C))
    service.submit("y", 3, **retry)
    retried = lease_one(service, "y")
    service.fail(retried["job_id"], **ids(retried), error="x")
    moves.step(lambda: service.cancel(retried["job_id"]), (T, C))
    service.submit("z", 4)
    stopping = lease_one(service, "z")
    # LEASED -> LEASED: neither state nor expiry change (the snapshot sees nothing), so the
    # check and the cancel_requested_at_ms it set are asserted here.
    moves.checked.clear()
    service.cancel(stopping["job_id"])
    assert moves.checked == [(Transition.REQUEST_CANCEL, L, L)]
    assert Job.objects.get(id=stopping["job_id"]).cancel_requested_at_ms == clock.now_ms()
    moves.made.add((Transition.REQUEST_CANCEL, L, L))
    moves.step(lambda: service.release(stopping["job_id"], **ids(stopping)), (L, C))
    moves.step(lambda: service.replay(ready), (C, R))
    moves.step(lambda: service.purge(pending), (C, None))
    # recovery at a server start: only where one server serves the database
    lease_one(service, "b")
    table = {(t, a, b) for t, pairs in states.TRANSITIONS.items() for a, b in pairs}
    logged = {t.value for t in states.LOGGED_EVENTS}
    if service.capabilities.single_writer:
        moves.step(service.recover, (L, R))
    else:
        moves.step(service.recover)
        table.discard((Transition.RECOVER, L, R))
        logged.discard(Transition.RECOVER.value)
    assert moves.made == table
    # The event log records exactly the names LOGGED_EVENTS says.
    assert set(JobEvent.objects.values_list("event", flat=True)) == logged


def test_a_move_the_table_does_not_list_raises_and_changes_nothing(
    service: QueueService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service.submit("q", 1)
    lease = lease_one(service, "q")
    without_ack = states._ALLOWED - {(Transition.ACK, JobState.LEASED, JobState.SUCCEEDED)}
    monkeypatch.setattr(states, "_ALLOWED", without_ack)
    with pytest.raises(states.IllegalTransition, match="ACK"):
        service.ack(lease["job_id"], **ids(lease))
    assert Job.objects.get(id=lease["job_id"]).state == JobState.LEASED
    monkeypatch.undo()
    assert service.ack(lease["job_id"], **ids(lease))["state"] == "succeeded"
