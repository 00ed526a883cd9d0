"""Results stored by the service (``relay_result``), once per storage driver.

The rules under test (docs/protocol.md, ``ack``/``fail``/``result``): an ack stores the result
it carries in the transaction that ends the attempt; a fail with ``exception_class`` appends a
structured error; both are bounded by ``RELAY_MAX_RESULT_BYTES`` (a result over it is refused
and changes nothing; the errors keep the newest that fit); ``result`` reads them by job id or
by queue and idempotency key; purge and prune delete them with the job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
from django.test.utils import override_settings

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job, JobResult
from queue_core.service import QueueService
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

Factory = Callable[..., dict[str, Any]]
DAY_MS = 86_400_000


def test_ack_stores_the_result_and_result_reads_it_back(
    service: QueueService, leased_job: Factory
) -> None:
    lease = leased_job(payload={"n": 1})
    value = {"total": 42, "items": ["a", "é"], "nested": {"ok": True}, "none": None}
    service.ack(lease["job_id"], worker_id="w1", lease_token=lease["lease_token"], result=value)
    out = service.result(lease["job_id"])
    assert out["return_value"] == value
    assert out["errors"] == []
    assert out["job"]["state"] == "succeeded"
    assert [a["outcome"] for a in out["job"]["history"]] == ["succeeded"]


def test_an_ack_without_a_result_stores_nothing_and_a_repeat_stores_nothing(
    service: QueueService, leased_job: Factory
) -> None:
    lease = leased_job()
    ids = {"worker_id": "w1", "lease_token": lease["lease_token"]}
    service.ack(lease["job_id"], **ids)
    assert not JobResult.objects.filter(job_id=lease["job_id"]).exists()
    assert service.ack(lease["job_id"], **ids, result=7)["duplicate"] is True
    assert not JobResult.objects.filter(job_id=lease["job_id"]).exists()
    assert service.result(lease["job_id"])["return_value"] is None


def test_a_result_over_the_limit_is_refused_and_changes_nothing(
    service: QueueService, leased_job: Factory
) -> None:
    lease = leased_job()
    ids = {"worker_id": "w1", "lease_token": lease["lease_token"]}
    with override_settings(RELAY_MAX_RESULT_BYTES=100):
        fits = "x" * 98  # '"' + 98 + '"' = 100 bytes: exactly the limit
        over = "x" * 99
        with pytest.raises(errors.FrameTooLarge) as refused:
            service.ack(lease["job_id"], **ids, result=over)
        assert refused.value.details == {"field": "result", "limit": 100}
        assert service.get(lease["job_id"], history=False)["state"] == "leased"
        service.ack(lease["job_id"], **ids, result=fits)
    assert service.result(lease["job_id"])["return_value"] == fits


@pytest.mark.parametrize("bad", [float("nan"), {"x": [float("inf")]}, "\ud800"])
def test_a_result_json_cannot_carry_is_refused(
    service: QueueService, leased_job: Factory, bad: Any
) -> None:
    lease = leased_job()
    with pytest.raises(errors.InvalidArgument) as refused:
        service.ack(lease["job_id"], worker_id="w1", lease_token=lease["lease_token"], result=bad)
    assert str(refused.value.details["field"]).startswith("result")
    assert service.get(lease["job_id"], history=False)["state"] == "leased"


def test_fails_append_structured_errors_per_attempt(
    service: QueueService, clock: FakeClock, leased_job: Factory
) -> None:
    lease = leased_job(max_retries=1, backoff="fixed", backoff_base_ms=1000, jitter=False)
    job_id = lease["job_id"]
    service.fail(
        job_id,
        worker_id="w1",
        lease_token=lease["lease_token"],
        error="first",
        exception_class="app.errors.Flaky",
        traceback="Traceback...\napp.errors.Flaky: first\n",
    )
    clock.advance(ms=1000)
    service.promote_due()
    second = service.claim(["default"], worker_id="w2", lease_ms=30_000)[0]
    service.fail(job_id, worker_id="w2", lease_token=second["lease_token"], error="no class given")
    third_try = service.result(job_id)
    assert third_try["job"]["state"] == "dead"
    assert third_try["errors"] == [
        {
            "attempt": 1,
            "exception_class": "app.errors.Flaky",
            "traceback": "Traceback...\napp.errors.Flaky: first\n",
        }
    ]
    # A repeated fail (same token) answers the first outcome and stores nothing more.
    again = service.fail(
        job_id,
        worker_id="w2",
        lease_token=second["lease_token"],
        error="again",
        exception_class="app.errors.Other",
    )
    assert again["duplicate"] is True
    assert len(service.result(job_id)["errors"]) == 1


def test_stored_errors_keep_the_newest_that_fit(
    service: QueueService, clock: FakeClock, leased_job: Factory
) -> None:
    # One entry is 150 bytes of JSON; three in a list are 2 + 3 * 150 + 2 = 454.
    with override_settings(RELAY_MAX_RESULT_BYTES=454):
        lease = leased_job(max_retries=5, backoff="fixed", backoff_base_ms=0, jitter=False)
        job_id = lease["job_id"]
        token, worker = lease["lease_token"], "w1"
        for n in range(1, 5):
            service.fail(
                job_id,
                worker_id=worker,
                lease_token=token,
                error=f"e{n}",
                exception_class="E",
                traceback="t" * 100,
            )
            service.promote_due()
            if n < 4:
                token = service.claim(["default"], worker_id=worker, lease_ms=30_000)[0][
                    "lease_token"
                ]
        row = JobResult.objects.get(job_id=job_id)
        assert len(row.errors.encode()) == 454  # exactly the limit: kept
        kept = service.result(job_id)["errors"]
        assert [e["attempt"] for e in kept] == [2, 3, 4]
        token = service.claim(["default"], worker_id=worker, lease_ms=30_000)[0]["lease_token"]
        with pytest.raises(errors.InvalidArgument) as refused:
            service.fail(
                job_id,
                worker_id=worker,
                lease_token=token,
                error="big",
                exception_class="E",
                traceback="t" * 455,
            )
        assert refused.value.details == {"field": "traceback"}


def test_result_by_queue_and_idempotency_key(service: QueueService, leased_job: Factory) -> None:
    lease = leased_job(queue="mail", idempotency_key="order-17")
    service.ack(lease["job_id"], worker_id="w1", lease_token=lease["lease_token"], result=[1])
    out = service.result(queue="mail", idempotency_key="order-17")
    assert out["job"]["id"] == lease["job_id"] and out["return_value"] == [1]
    with pytest.raises(errors.JobNotFound):
        service.result(queue="default", idempotency_key="order-17")
    with pytest.raises(errors.InvalidArgument):
        service.result()
    with pytest.raises(errors.InvalidArgument):
        service.result(lease["job_id"], queue="mail", idempotency_key="order-17")
    with pytest.raises(errors.InvalidArgument) as half:
        service.result(queue="mail")
    assert half.value.details == {"field": "idempotency_key"}
    with pytest.raises(errors.JobNotFound):
        service.result("job_nope")


def test_purge_and_prune_delete_the_result_with_the_job(
    service: QueueService, clock: FakeClock, leased_job: Factory
) -> None:
    purged = leased_job()
    service.ack(purged["job_id"], worker_id="w1", lease_token=purged["lease_token"], result=1)
    pruned = leased_job()
    service.fail(
        pruned["job_id"],
        worker_id="w1",
        lease_token=pruned["lease_token"],
        error="x",
        retryable=False,
        exception_class="E",
    )
    kept = leased_job()
    service.ack(kept["job_id"], worker_id="w1", lease_token=kept["lease_token"], result=2)
    assert JobResult.objects.count() == 3
    service.purge(purged["job_id"])
    assert not JobResult.objects.filter(job_id=purged["job_id"]).exists()
    clock.advance(ms=DAY_MS + 1)
    assert service.prune({"succeeded": 0, "dead": DAY_MS}) == {
        "succeeded": 0,
        "dead": 1,
        "cancelled": 0,
    }
    assert not Job.objects.filter(id=pruned["job_id"]).exists()
    assert list(JobResult.objects.values_list("job_id", flat=True)) == [kept["job_id"]]
    assert orjson.loads(JobResult.objects.get().return_value or "null") == 2
