"""Fewer round trips per job (issue 15, item 3) at the service layer, once per storage driver,
with the fake clock: ``ack``/``fail`` with ``lease_next`` lease the worker's next jobs in the
same transaction, and ``ack_batch`` acks several jobs, each fenced by its own token.

The rules under test: the next jobs are leased only when the ack or fail is accepted, in its
commit, through ``claim`` (queue pauses, caps and cancels apply); nothing ready means
``next: []`` at once; a bad ``lease_next`` changes nothing; a stale token in a batch refuses
that ack only.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from django.test import override_settings

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import Job, JobAttempt
from queue_core.service import QueueService
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

W1 = "w1"


def submit(service: QueueService, queue: str = "q", n: int = 1, **kw: Any) -> list[str]:
    return [str(service.submit(queue, {"i": i}, **kw)["job"]["id"]) for i in range(n)]


def lease(service: QueueService, queue: str = "q", n: int = 1, **kw: Any) -> list[Any]:
    return service.claim([queue], worker_id=W1, max_jobs=n, **kw)


def ids(held: dict[str, Any], worker_id: str = W1) -> dict[str, Any]:
    return {"worker_id": worker_id, "lease_token": held["lease_token"]}


def state(job_id: str) -> str:
    return str(Job.objects.get(pk=job_id).state)


def test_an_ack_with_lease_next_leases_the_next_jobs_in_its_commit(
    service: QueueService, clock: FakeClock
) -> None:
    submit(service, n=4)
    (held,) = lease(service)
    clock.advance(seconds=1)
    out = service.ack(
        held["job_id"], **ids(held), result={"r": 1}, lease_next={"queues": ["q"], "max_jobs": 2}
    )
    assert out["state"] == "succeeded" and out["duplicate"] is False
    nxt = out["next"]
    assert len(nxt) == 2 and held["job_id"] not in {j["job_id"] for j in nxt}
    for job in nxt:
        assert state(job["job_id"]) == "leased"
        assert job["lease_expires_at_ms"] == clock.now_ms() + service.settings.visibility_timeout_ms
        # Leased to the ack's worker (the default): its own ack is accepted.
        assert service.ack(job["job_id"], **ids(job))["duplicate"] is False
    assert service.stats()["queues"]["q"]["ready"] == 1


def test_nothing_ready_answers_an_empty_next_at_once(service: QueueService) -> None:
    submit(service)
    (held,) = lease(service)
    out = service.ack(held["job_id"], **ids(held), lease_next={"queues": ["q", "other"]})
    assert out["next"] == [] and out["state"] == "succeeded"
    # Without lease_next the result has no "next" at all.
    submit(service)
    (held,) = lease(service)
    assert "next" not in service.ack(held["job_id"], **ids(held))


def test_lease_next_takes_its_own_worker_id_and_lease_length(
    service: QueueService, clock: FakeClock
) -> None:
    submit(service, n=2)
    (held,) = lease(service)
    spec = {"queues": ["q"], "worker_id": "w2", "lease_ms": 5_000}
    (job,) = service.ack(held["job_id"], **ids(held), lease_next=spec)["next"]
    assert job["lease_expires_at_ms"] == clock.now_ms() + 5_000
    with pytest.raises(errors.StaleToken):
        service.ack(job["job_id"], **ids(job, W1))
    assert service.ack(job["job_id"], **ids(job, "w2"))["state"] == "succeeded"


def test_a_refused_ack_leases_nothing_and_fencing_stays_per_job(
    service: QueueService, clock: FakeClock
) -> None:
    submit(service, n=3)
    (held,) = lease(service)
    spec = {"queues": ["q"], "max_jobs": 2}
    with pytest.raises(errors.StaleToken):
        service.ack(held["job_id"], worker_id=W1, lease_token="not-it", lease_next=spec)
    with pytest.raises(errors.StaleToken):
        service.ack(
            held["job_id"], worker_id="w2", lease_token=held["lease_token"], lease_next=spec
        )
    assert service.stats()["queues"]["q"]["ready"] == 2  # nothing leased
    # Expired exactly at its instant: refused, nothing leased (the claim's sweep would have
    # given the expired job back).
    clock.advance(seconds=service.settings.visibility_timeout_ms / 1000)
    with pytest.raises(errors.LeaseExpired):
        service.ack(held["job_id"], **ids(held), lease_next=spec)
    assert state(held["job_id"]) == "leased"
    assert service.stats()["queues"]["q"]["leased"] == 1


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"queues": []}, "lease_next.queues"),
        ({"queues": ["q"], "max_jobs": 0}, "lease_next.max_jobs"),
        ({"queues": ["q"], "max_jobs": 101}, "lease_next.max_jobs"),
        ({"queues": ["q"], "lease_ms": "x"}, "lease_next.lease_ms"),
        ({"queues": ["q"], "wait_ms": 10}, "lease_next.wait_ms"),
        ({}, "lease_next.queues"),
        # "" was taken for the ack's worker id, where the server's give-back of an unsent
        # reply's jobs released them as "" (refused): they waited out their lease (a review).
        ({"queues": ["q"], "worker_id": ""}, "lease_next.worker_id"),
    ],
)
def test_a_bad_lease_next_changes_nothing(
    service: QueueService, spec: dict[str, Any], field: str
) -> None:
    submit(service, n=2)
    (held,) = lease(service)
    with pytest.raises(errors.InvalidArgument) as caught:
        service.ack(held["job_id"], **ids(held), lease_next=spec)
    assert caught.value.details["field"] == field
    assert state(held["job_id"]) == "leased"  # the ack did not happen either


def test_a_repeated_ack_still_leases(service: QueueService) -> None:
    submit(service, n=2)
    (held,) = lease(service)
    service.ack(held["job_id"], **ids(held))
    out = service.ack(held["job_id"], **ids(held), lease_next={"queues": ["q"]})
    assert out["duplicate"] is True and len(out["next"]) == 1


def test_queue_controls_apply_to_lease_next(service: QueueService) -> None:
    submit(service, "capped", 5)
    submit(service, "paused", 2)
    held = lease(service, "capped", 2)
    service.set_queue_limits("capped", max_leased=2)
    service.pause("paused")
    spec = {"queues": ["paused", "capped"], "max_jobs": 10}
    out = service.ack(held[0]["job_id"], **ids(held[0]), lease_next=spec)
    # The ack freed one slot under the cap, in the same transaction; the paused queue gives none.
    assert [j["queue"] for j in out["next"]] == ["capped"]
    assert service.stats()["queues"]["capped"]["leased"] == 2
    out = service.ack(held[1]["job_id"], **ids(held[1]), lease_next={"queues": ["paused"]})
    assert out["next"] == [] and out["state"] == "succeeded"


def test_a_cancelled_job_is_never_leased_next_and_a_cancel_requested_one_acks(
    service: QueueService,
) -> None:
    first, second, third = submit(service, n=3)
    held = lease(service)[0]
    assert held["job_id"] == first
    service.cancel(first)  # leased: marked, its worker told at the next renew
    service.cancel(second)  # ready: cancelled at once
    out = service.ack(held["job_id"], **ids(held), lease_next={"queues": ["q"], "max_jobs": 5})
    assert out["state"] == "succeeded"  # the handler finished first: the work ran
    assert [j["job_id"] for j in out["next"]] == [third]
    assert state(second) == "cancelled"


def test_a_fail_with_lease_next_may_lease_its_own_retry_when_due_at_once(
    service: QueueService,
) -> None:
    (job_id,) = submit(service, backoff="fixed", backoff_base_ms=0, backoff_cap_ms=0, jitter=False)
    (held,) = lease(service)
    out = service.fail(held["job_id"], **ids(held), error="boom", lease_next={"queues": ["q"]})
    assert out["state"] == "retrying" and out["retry_at_ms"] is not None
    (again,) = out["next"]  # promoted by the claim's sweep, in the same transaction
    assert again["job_id"] == job_id and again["attempt"] == 2
    assert again["lease_token"] != held["lease_token"]
    with pytest.raises(errors.StaleToken):
        service.ack(job_id, **ids(held))
    assert service.ack(job_id, **ids(again))["state"] == "succeeded"


# ---------------------------------------------------------------------------- ack_batch


def test_ack_batch_acks_each_job_and_a_stale_token_refuses_only_its_own(
    service: QueueService, clock: FakeClock
) -> None:
    submit(service, n=6)
    a, b, c = lease(service, n=3)
    (d,) = lease(service, lease_ms=1_000)
    service.ack(c["job_id"], **ids(c))  # acked before: the batch's ack is a duplicate
    clock.advance(seconds=1)  # d's lease expires exactly now
    out = service.ack_batch(
        [
            {**ids(a), "job_id": a["job_id"], "result": {"n": 1}},
            {"job_id": b["job_id"], "worker_id": W1, "lease_token": "stale"},
            {**ids(c), "job_id": c["job_id"]},
            {**ids(d), "job_id": d["job_id"]},
            {"job_id": "nope", "worker_id": W1, "lease_token": "t"},
        ],
        lease_next={"queues": ["q"], "max_jobs": 3},
    )
    results = out["results"]
    assert [(r["job_id"], r["ok"]) for r in results] == [
        (a["job_id"], True),
        (b["job_id"], False),
        (c["job_id"], True),
        (d["job_id"], False),
        ("nope", False),
    ]
    assert results[0]["state"] == "succeeded" and results[0]["duplicate"] is False
    assert results[2]["duplicate"] is True
    assert [r["error"]["code"] for r in results if not r["ok"]] == [
        "STALE_TOKEN",
        "LEASE_EXPIRED",
        "NOT_FOUND",
    ]
    assert results[1]["state"] is None and results[1]["error"]["retryable"] is False
    assert state(a["job_id"]) == "succeeded" and state(b["job_id"]) == "leased"
    assert service.result(a["job_id"])["return_value"] == {"n": 1}
    # The claim's sweep gave d back (expired), so it may be among the next jobs.
    assert len(out["next"]) == 3
    assert JobAttempt.objects.filter(outcome="succeeded").count() == 2


def test_ack_batch_echoes_no_id_that_could_not_be_one(service: QueueService) -> None:
    # 99 ids of 10,000 characters echoed back made a reply past the frame limit, answered
    # FRAME_TOO_LARGE after the valid ack had committed (a review).
    submit(service, n=1)
    (a,) = lease(service)
    long_id = "j" * 10_000
    out = service.ack_batch(
        [
            {**ids(a), "job_id": a["job_id"]},
            {"job_id": long_id, "worker_id": W1, "lease_token": "t"},
            {"job_id": "nope", "worker_id": W1, "lease_token": "t"},
        ]
    )
    assert [(r["job_id"], r["ok"]) for r in out["results"]] == [
        (a["job_id"], True),
        (None, False),
        ("nope", False),
    ]
    codes = [r["error"]["code"] for r in out["results"][1:]]
    assert codes == ["INVALID_ARGUMENT", "NOT_FOUND"]
    assert len(orjson.dumps(out)) < 1_000


def test_ack_batch_names_a_job_twice_and_the_entry_holding_its_lease_acks_it(
    service: QueueService,
) -> None:
    # The acks run in one guarded statement (ack_many) where no job repeats; a repeat runs
    # alone after it, as a single ack would, so each entry is judged on its own token in order.
    submit(service, n=2)
    a, b = lease(service, n=2)
    stale_a = {"job_id": a["job_id"], "worker_id": W1, "lease_token": "stale"}
    out = service.ack_batch(
        [
            stale_a,
            {**ids(a), "job_id": a["job_id"]},
            {**ids(b), "job_id": b["job_id"]},
            {**ids(b), "job_id": b["job_id"]},
            {**ids(b, "w2"), "job_id": b["job_id"]},
        ]
    )
    got = [(r["ok"], r["duplicate"], r["error"] and r["error"]["code"]) for r in out["results"]]
    assert got == [
        (False, None, "STALE_TOKEN"),
        (True, False, None),
        (True, False, None),
        (True, True, None),
        (False, None, "STALE_TOKEN"),
    ]
    assert state(a["job_id"]) == state(b["job_id"]) == "succeeded"
    ended = JobAttempt.objects.filter(outcome="succeeded").values_list("job_id", flat=True)
    assert sorted(ended) == sorted([a["job_id"], b["job_id"]])


def test_ack_batch_frees_an_active_key_and_stores_each_result(service: QueueService) -> None:
    keyed = service.submit("q", {"n": 1}, idempotency_key="k", unique="active")["job"]["id"]
    other = submit(service)[0]
    leases = {held["job_id"]: held for held in lease(service, n=2)}
    out = service.ack_batch(
        [
            {**ids(leases[keyed]), "job_id": keyed, "result": {"r": "keyed"}},
            {**ids(leases[other]), "job_id": other},
        ]
    )
    assert [r["queue"] for r in out["results"]] == ["q", "q"]
    assert service.get(keyed)["idempotency_key"] is None  # freed in the batch's commit
    again = service.submit("q", {"n": 1}, idempotency_key="k", unique="active")
    assert again["deduplicated"] is False and again["job"]["id"] != keyed
    assert service.result(keyed)["return_value"] == {"r": "keyed"}
    assert service.result(other)["return_value"] is None


@override_settings(RELAY_MAX_FRAME_BYTES=65_536, RELAY_MAX_PAYLOAD_BYTES=16_000)
def test_ack_batch_leases_next_only_what_fits_beside_its_results(service: QueueService) -> None:
    # 62 results take about 8 KB of the 64 KiB frame: the next jobs (15 KB each) get the rest,
    # so three fit where the room of a lone ack would take four (found in review: the reply
    # was refused FRAME_TOO_LARGE after its acks and leases had committed).
    small = lease(service, n=62) if submit(service, n=62) else []
    big = [service.submit("q", {"blob": "x" * 15_000, "i": i})["job"]["id"] for i in range(4)]
    out = service.ack_batch(
        [{**ids(x), "job_id": x["job_id"]} for x in small],
        lease_next={"queues": ["q"], "max_jobs": 4},
    )
    assert all(r["ok"] for r in out["results"])
    assert [job["job_id"] for job in out["next"]] == big[:3]
    frame = orjson.dumps({"id": 1, "ok": True, "result": out})
    assert len(frame) <= 65_536
    assert state(big[3]) == "ready"


@override_settings(RELAY_MAX_FRAME_BYTES=65_536, RELAY_MAX_PAYLOAD_BYTES=55_000)
def test_ack_batch_leases_nothing_next_when_its_results_leave_no_room_for_a_job(
    service: QueueService,
) -> None:
    submit(service, n=101)
    held = lease(service, n=100)
    held += lease(service, n=100 - len(held))  # a lease's reply holds 62 of these at most
    out = service.ack_batch(
        [{**ids(x), "job_id": x["job_id"]} for x in held],
        lease_next={"queues": ["q"], "max_jobs": 1},
    )
    # 64,512 bytes of room less ~11 KB of results cannot promise a 55,000-byte payload, a meta
    # and the overhead: nothing is leased (the worker leases it with its next request).
    assert all(r["ok"] for r in out["results"]) and out["next"] == []
    assert not JobAttempt.objects.filter(ended_at_ms__isnull=True).exists()
    assert Job.objects.filter(state="ready").count() == 1


def test_ack_batch_without_lease_next_and_its_limits(service: QueueService) -> None:
    submit(service, n=2)
    a, b = lease(service, n=2)
    out = service.ack_batch([{**ids(x), "job_id": x["job_id"]} for x in (a, b)])
    assert out["next"] == [] and all(r["ok"] for r in out["results"])
    for bad, field in [
        ([], "acks"),
        ([{"job_id": "j"}] * 101, "acks"),
        ([{"job_id": "j", "worker_id": W1, "lease_token": "t", "x": 1}], "acks[0].x"),
    ]:
        with pytest.raises(errors.InvalidArgument) as caught:
            service.ack_batch(bad)
        assert caught.value.details.get("field") == field


def test_ack_batch_lease_next_defaults_to_the_first_acks_worker(service: QueueService) -> None:
    submit(service, n=2)
    (a,) = lease(service)
    out = service.ack_batch([{**ids(a), "job_id": a["job_id"]}], lease_next={"queues": ["q"]})
    (job,) = out["next"]
    assert service.ack(job["job_id"], **ids(job, W1))["state"] == "succeeded"
