"""A reader held up between its clock reads (``tests.stepclock.StallingClock``), once per
storage driver: the service's leases are judged as ``StepGuard`` promises, a hold-up is no
step, and a step whose reading is held up expires no lease early by more than the hold-up."""

from __future__ import annotations

import pytest

from queue_core.clock import READ_TRIES
from queue_core.models import Job
from queue_core.service import QueueService
from tests.stepclock import StallingClock
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

HOUR_MS = 3_600_000


@pytest.fixture
def clock() -> StallingClock:
    clock = StallingClock("now_ms")
    clock.stall_ms = 600  # over half the step tolerance (1,000 ms)
    return clock


def leased(ids: list[str]) -> int:
    return Job.objects.filter(id__in=ids, state="leased").count()


def test_a_sweep_held_up_right_after_a_step_expires_no_lease(
    service: QueueService, clock: StallingClock
) -> None:
    # A hostile review: the sweep's reading after a 1 h step was held up on every try, so it
    # measured nothing, judged every lease by the new time and dead-lettered all five jobs.
    ids = [service.submit("q", i, max_retries=0)["job"]["id"] for i in range(5)]
    service.claim(["q"], worker_id="w", max_jobs=5, lease_ms=30_000)
    clock.advance(ms=10_000)
    clock.step(HOUR_MS)
    clock.stalls = READ_TRIES
    service.sweep()
    assert leased(ids) == 5
    clock.advance(ms=20_000 - READ_TRIES * clock.stall_ms - 1)  # the old clock's last live ms
    service.sweep()
    assert leased(ids) == 5
    clock.advance(ms=1)
    service.sweep()
    assert leased(ids) == 0  # on time by the old clock: not late either


def test_a_hold_up_expires_no_lease_early_or_late(
    service: QueueService, clock: StallingClock
) -> None:
    ids = [service.submit("q", i, max_retries=0)["job"]["id"] for i in range(3)]
    service.claim(["q"], worker_id="w", max_jobs=3, lease_ms=30_000)
    for stalls in (1, READ_TRIES, 1, READ_TRIES):
        # Held up: before, the next reading took each hold-up for a step.
        clock.stalls = stalls
        service.sweep()
    held = (2 + 2 * READ_TRIES) * clock.stall_ms
    clock.advance(ms=30_000 - held - 1)
    service.sweep()
    assert leased(ids) == 3
    clock.advance(ms=1)
    service.sweep()
    assert leased(ids) == 0
