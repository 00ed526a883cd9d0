"""Wall-clock steps (hardening item 13), fake clock, once per storage driver.

``FakeClock.step`` moves the wall clock alone, as an operator or NTP stepping the system clock
does; ``advance`` moves both clocks. The service reads time through ``StepGuard``: after a
forward step detected between two readings (wall advanced more than monotonic plus
``RELAY_CLOCK_STEP_TOLERANCE_MS``), a lease whose expiry was set before the step is judged by
the old time, a lease set after it by the new time. A backward step keeps FIFO by the id.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.test.utils import override_settings

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job, JobAttempt
from queue_core.service import QueueService
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

HOUR_MS = 3_600_000


def args(lease: dict[str, Any], worker_id: str = "w") -> dict[str, Any]:
    return {"worker_id": worker_id, "lease_token": lease["lease_token"]}


def state(job_id: str) -> str:
    return str(Job.objects.get(id=job_id).state)


def test_forward_hour_step_keeps_five_renewing_leases(
    service: QueueService, clock: FakeClock
) -> None:
    # The report: a 1 h forward step expired five healthy, renewing leases and dead-lettered
    # their jobs (no retry budget).
    ids = [service.submit("q", i, max_retries=0)["job"]["id"] for i in range(5)]
    leases = service.claim(["q"], worker_id="w", max_jobs=5, lease_ms=30_000)
    assert [lease["job_id"] for lease in leases] == ids
    clock.advance(ms=10_000)
    for lease in leases:
        service.renew(lease["job_id"], **args(lease), lease_ms=30_000)
    clock.step(HOUR_MS)
    assert service.sweep() == []  # the reaper's pass right after the step
    assert [state(i) for i in ids] == ["leased"] * 5
    clock.advance(ms=10_000)  # the workers renew on their timers, against the new clock
    renewed = [service.renew(lease["job_id"], **args(lease), lease_ms=30_000) for lease in leases]
    assert all(r["lease_expires_at_ms"] == clock.now_ms() + 30_000 for r in renewed)
    clock.advance(ms=29_999)
    service.sweep()
    for lease in leases:
        assert service.ack(lease["job_id"], **args(lease))["state"] == "succeeded"
    assert not JobAttempt.objects.filter(outcome="lease_expired").exists()


@pytest.mark.parametrize(
    ("step_ms", "expired"),
    [(1_000, True), (1_001, False)],
    ids=["at-tolerance-not-a-step", "just-over-tolerance"],
)
def test_step_boundary_is_the_tolerance(
    service: QueueService, clock: FakeClock, step_ms: int, expired: bool
) -> None:
    job = service.submit("q", 1, max_retries=0)["job"]["id"]
    (lease,) = service.claim(["q"], worker_id="w", lease_ms=30_000)
    clock.advance(ms=29_000)
    clock.step(step_ms)  # wall: claim + 30 000 (+ 1): at or past the expiry on the new clock
    service.sweep()
    assert state(job) == ("dead" if expired else "leased")
    if not expired:
        # Judged by the old time, the lease has 1 000 ms left, to the millisecond.
        clock.advance(ms=999)
        service.sweep()
        assert state(job) == "leased"
        clock.advance(ms=1)
        service.sweep()
        assert state(job) == "dead"
        with pytest.raises(errors.LeaseExpired):
            service.renew(job, **args(lease))


@override_settings(RELAY_CLOCK_STEP_TOLERANCE_MS=50)
def test_tolerance_is_a_setting(service: QueueService, clock: FakeClock) -> None:
    job = service.submit("q", 1, max_retries=0)["job"]["id"]
    service.claim(["q"], worker_id="w", lease_ms=1_000)
    clock.advance(ms=990)
    clock.step(51)  # 41 ms past the expiry on the new clock, a step of more than 50 ms
    service.sweep()
    assert state(job) == "leased"


@pytest.mark.parametrize("verb", ["renew", "ack", "fail", "release"])
def test_lease_set_before_a_forward_step_is_live_for_every_verb(
    service: QueueService, clock: FakeClock, verb: str
) -> None:
    job = service.submit("q", 1)["job"]["id"]
    (lease,) = service.claim(["q"], worker_id="w", lease_ms=5_000)
    clock.advance(ms=4_000)
    clock.step(HOUR_MS)
    extra = {"error": "x"} if verb == "fail" else {}
    getattr(service, verb)(job, **args(lease), **extra)  # no LEASE_EXPIRED


def test_lease_set_after_the_step_expires_on_the_new_clock(
    service: QueueService, clock: FakeClock
) -> None:
    old = service.submit("q", "old", max_retries=0)["job"]["id"]
    service.claim(["q"], worker_id="w", lease_ms=60_000)
    clock.step(HOUR_MS)
    new = service.submit("q", "new", max_retries=0)["job"]["id"]
    (lease,) = service.claim(["q"], worker_id="w", lease_ms=10_000)
    assert lease["job_id"] == new
    clock.advance(ms=9_999)
    service.sweep()
    assert state(new) == "leased"
    clock.advance(ms=1)  # exactly at its expiry on the new clock: not one step late
    service.sweep()
    assert (state(old), state(new)) == ("leased", "dead")
    clock.advance(ms=60_000 - 10_000 - 1)
    service.sweep()
    assert state(old) == "leased"
    clock.advance(ms=1)  # the old lease: exactly at its expiry on the old clock
    service.sweep()
    assert state(old) == "dead"


def test_one_warning_per_step(
    service: QueueService, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    service.submit("q", 1)
    service.claim(["q"], worker_id="w", lease_ms=60_000)
    with caplog.at_level(logging.WARNING, logger="relay.clock"):
        clock.step(HOUR_MS)
        for _ in range(3):
            service.sweep()
            clock.advance(ms=1_000)
        clock.step(-5_000)
        for _ in range(3):
            service.sweep()
    steps = [r for r in caplog.records if getattr(r, "event", None) == "clock_step"]
    assert [r.step_ms for r in steps] == [HOUR_MS, -5_000]  # type: ignore[attr-defined]
    assert all(r.levelno == logging.WARNING for r in steps)


def test_backward_step_keeps_fifo_by_id(service: QueueService, clock: FakeClock) -> None:
    before = [service.submit("q", f"before-{i}")["job"]["id"] for i in range(2)]
    clock.step(-HOUR_MS)
    after = [service.submit("q", f"after-{i}")["job"]["id"] for i in range(2)]
    batch = [r["job_id"] for r in service.submit_batch([{"queue": "q", "payload": "b"}])]
    leases = service.claim(["q"], worker_id="w", max_jobs=10)
    assert [lease["job_id"] for lease in leases] == [*before, *after, *batch]


def test_backward_step_makes_leases_last_longer(service: QueueService, clock: FakeClock) -> None:
    # Documented, not compensated: judged by the earlier clock, a lease lasts the step longer.
    job = service.submit("q", 1, max_retries=0)["job"]["id"]
    service.claim(["q"], worker_id="w", lease_ms=30_000)
    clock.step(-60_000)
    clock.advance(ms=30_000)
    service.sweep()
    assert state(job) == "leased"
    clock.advance(ms=60_000)
    service.sweep()
    assert state(job) == "dead"
