"""The op table without sockets: validation, result shapes and the wake-up effects."""

from __future__ import annotations

from typing import Any

import pytest

from queue_core import errors, metrics
from queue_core.clock import FakeClock
from queue_core.protocol import dispatch
from queue_core.protocol.codec import Request
from queue_core.service import QueueService

CTX = dispatch.Context(peer="127.0.0.1:5000", actor="tcp:127.0.0.1:5000")


def run(service: QueueService, op: str, **args: Any) -> dispatch.Outcome:
    verb = dispatch.lookup(op)
    return verb.handler(service, dispatch.validate(verb, args), CTX)


def test_every_documented_op_is_in_the_table() -> None:
    assert set(dispatch.VERBS) == {
        "ping", "hello", "submit", "submit_batch", "lease", "renew", "renew_batch", "ack",
        "ack_batch", "fail", "release",
        "inspect", "result", "stats", "dead_list", "dead_retry", "dead_purge", "prune",
        "cancel", "pause", "resume", "set_queue_limits", "queue_controls",
    }  # fmt: skip
    reads = {op for op, v in dispatch.VERBS.items() if v.kind is dispatch.Kind.READ}
    assert reads == {"ping", "hello", "inspect", "result", "stats", "dead_list", "queue_controls"}


def test_unknown_op() -> None:
    with pytest.raises(errors.UnknownOp):
        dispatch.lookup("claim")


def test_null_optional_arguments_take_the_service_defaults(service: QueueService) -> None:
    out = run(service, "submit", queue="q", payload=1, priority=None, delay_ms=None)
    assert out.result["job"]["priority"] == "normal"


def test_null_required_argument_is_missing() -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        dispatch.validate(dispatch.lookup("inspect"), {"job_id": None})
    assert info.value.details == {"field": "job_id"}


def test_submit_wakes_its_queue_and_a_delayed_submit_reports_when_due(
    service: QueueService, clock: FakeClock
) -> None:
    now = run(service, "submit", queue="a", payload=1)
    assert now.ready_queues == {"a"} and now.due_at_ms is None
    later = run(service, "submit", queue="b", payload=1, delay_ms=5000)
    assert later.ready_queues == frozenset()
    assert later.due_at_ms == clock.now_ms() + 5000
    batch = run(
        service,
        "submit_batch",
        jobs=[{"queue": "c", "payload": 1}, {"queue": "d", "payload": 2, "delay_ms": 10}],
    )
    assert batch.ready_queues == {"c"} and batch.due_at_ms == clock.now_ms() + 10


def test_fail_with_retry_reports_when_due_and_release_wakes_the_queue(
    service: QueueService,
) -> None:
    ids = [run(service, "submit", queue="q", payload=n).result["job"]["id"] for n in range(2)]
    leases = run(service, "lease", queues=["q"], max_jobs=2).result["jobs"]
    assert {x["job_id"] for x in leases} == set(ids)
    assert all(x.get("lease_token") for x in leases)
    first, second = leases
    ids_of = {"worker_id": CTX.peer}  # lease's worker_id defaulted to the peer
    failed = run(
        service, "fail", job_id=first["job_id"], lease_token=first["lease_token"], error="e",
        **ids_of,
    )  # fmt: skip
    assert failed.result["state"] == "retrying"
    assert failed.due_at_ms == failed.result["retry_at_ms"]
    released = run(
        service, "release", job_id=second["job_id"], lease_token=second["lease_token"], **ids_of
    )
    assert released.result == {"job_id": second["job_id"], "state": "ready"}
    assert released.ready_queues == {"q"}


def test_dead_retry_wakes_the_queue_and_records_the_actor(service: QueueService) -> None:
    job_id = run(service, "submit", queue="q", payload=1).result["job"]["id"]
    lease = run(service, "lease", queues=["q"], worker_id="w").result["jobs"][0]
    run(
        service, "fail", job_id=job_id, worker_id="w", lease_token=lease["lease_token"],
        error="e", retryable=False,
    )  # fmt: skip
    replayed = run(service, "dead_retry", job_id=job_id)
    assert replayed.result["job"]["state"] == "ready" and replayed.ready_queues == {"q"}
    events = service.get(job_id)["events"]
    assert any(e["event"] == "replayed" and e["actor"] == CTX.actor for e in events)


def test_handle_runs_a_request(service: QueueService) -> None:
    result = dispatch.handle(service, Request(1, "submit", {"queue": "q", "payload": [1]}))
    assert result["job"]["payload"] == [1] and result["deduplicated"] is False
    assert dispatch.handle(service, Request(None, "ping", {}))["pong"] is True


def test_jobs_leased_by_an_ack_or_a_batch_are_counted_as_leases_too(
    service: QueueService,
) -> None:
    for n in range(4):
        service.submit("q", n)
    (held,) = service.claim(["q"], worker_id="w")
    ids = {"worker_id": "w", "lease_token": held["lease_token"]}
    out = run(service, "ack", job_id=held["job_id"], **ids, lease_next={"queues": ["q"]})
    (nxt,) = out.result["next"]
    assert [(e.name, e.queue) for e in out.events if e.name != "start_delay"] == [
        ("acked", "q"),
        ("leased", "q"),
        ("leased_next", "q"),
    ]
    acks = [{"job_id": nxt["job_id"], "worker_id": "w", "lease_token": nxt["lease_token"]}]
    out = run(service, "ack_batch", acks=acks, lease_next={"queues": ["q"], "max_jobs": 5})
    assert set(out.result) == {"results", "next"} and len(out.result["next"]) == 2
    names = [e.name for e in out.events if e.name != "start_delay"]
    assert names == ["acked", "leased", "leased_next", "leased", "leased_next"]


@pytest.mark.parametrize(
    ("options", "ready", "delayed"),
    [
        ({}, True, False),
        ({"delay_ms": 5_000}, False, True),
        ({"idempotency_key": "k"}, True, False),
    ],
)
def test_a_submit_wakes_its_queue_or_names_its_due_time_and_counts_once(
    service: QueueService, clock: FakeClock, options: dict[str, Any], ready: bool, delayed: bool
) -> None:
    for n in range(2):  # the second time an idempotency key finds its job (deduplicated)
        out = run(service, "submit", queue="q", payload={"n": 1}, **options)
        assert out.ready_queues == ({"q"} if ready else set())
        assert out.due_at_ms == (clock.now_ms() + 5_000 if delayed else None)
        deduplicated = n == 1 and "idempotency_key" in options
        assert out.result["deduplicated"] is deduplicated
        kind = "deduplicated" if deduplicated else "submitted"
        assert out.events == (metrics.Event(kind, "q", 1),)
