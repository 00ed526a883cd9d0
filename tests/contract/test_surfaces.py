"""The same cases over in-process, TCP and HTTP (``surface``, tests/contract/conftest.py):
the same result shapes, and the same error codes with the same ``details.field``."""

from __future__ import annotations

from typing import Any

import pytest
from django.test.utils import override_settings

from queue_core import errors
from queue_core.clock import FakeClock
from tests.contract.conftest import Surface

pytestmark = pytest.mark.django_db(transaction=True)

JOB_KEYS = {
    "id",
    "queue",
    "state",
    "priority",
    "payload",
    "attempt",
    "failures",
    "max_retries",
    "retry_policy",
    "idempotency_key",
    "created_at_ms",
    "available_at_ms",
    "ready_since_ms",
    "leased_by",
    "lease_expires_at_ms",
    "finished_at_ms",
    "last_error",
    "dead_reason",
    "unique",
    "meta",
    "cancel_requested_at_ms",
    "time_limit_ms",
}
UNKNOWN_JOB = "job_00000000000000000000000000"
_ACK = {"job_id": UNKNOWN_JOB, "worker_id": "w1", "lease_token": "t"}


def lease(surface: Surface, queue: str = "q", **kw: Any) -> dict[str, Any]:
    jobs: list[dict[str, Any]] = surface.call("lease", queues=[queue], worker_id="w1", **kw)["jobs"]
    assert len(jobs) == 1
    return jobs[0]


def held(job: dict[str, Any], worker_id: str = "w1") -> dict[str, Any]:
    return {"job_id": job["job_id"], "worker_id": worker_id, "lease_token": job["lease_token"]}


def refused(surface: Surface, code: str, op: str, **args: Any) -> errors.RelayError:
    with pytest.raises(errors.RelayError) as caught:
        surface.call(op, **args)
    assert caught.value.code == code, (surface.name, caught.value.message)
    return caught.value


def test_submit_then_inspect(surface: Surface) -> None:
    made = surface.call("submit", queue="q", payload={"n": 1}, priority="high", max_retries=2)
    assert set(made) == {"job", "deduplicated"} and made["deduplicated"] is False
    job = made["job"]
    assert set(job) == JOB_KEYS | surface.job_extras
    assert (job["state"], job["priority"], job["max_retries"]) == ("ready", "high", 2)
    seen = surface.call("inspect", job_id=job["id"])["job"]
    assert set(seen) == JOB_KEYS | surface.job_extras | {"history", "events", "history_omitted"}
    assert {k: seen[k] for k in JOB_KEYS} == {k: job[k] for k in JOB_KEYS}
    assert (seen["history"], seen["events"], seen["history_omitted"]) == ([], [], 0)


def test_priority_names_are_taken_in_any_case_and_spacing(surface: Surface) -> None:
    """Hostile review: ``"HIGH"`` was a job over TCP and a 422 over HTTP."""
    for name, stored in (("HIGH", "high"), (" High ", "high"), ("Critical", "critical")):
        job = surface.call("submit", queue="q", payload=1, priority=name)["job"]
        assert job["priority"] == stored
    for name in ("h\u0131gh", "\u00a0high"):  # dotless i upper-cases to I; a no-break space
        refused(surface, "INVALID_ARGUMENT", "submit", queue="q", payload=1, priority=name)
    batch = surface.call("submit_batch", jobs=[{"queue": "q", "payload": 1, "priority": "LOW"}])
    job_id = batch["results"][0]["job_id"]
    assert surface.call("inspect", job_id=job_id)["job"]["priority"] == "low"


def test_idempotent_submit(surface: Surface) -> None:
    first = surface.call("submit", queue="q", payload=[1], idempotency_key="k")
    again = surface.call("submit", queue="q", payload=[1], idempotency_key="k")
    assert again == {"job": first["job"], "deduplicated": True}
    err = refused(
        surface, "IDEMPOTENCY_CONFLICT", "submit", queue="q", payload=[2], idempotency_key="k"
    )
    assert err.details["job_id"] == first["job"]["id"]


def test_lease_renew_ack_and_stale_tokens(surface: Surface, clock: FakeClock) -> None:
    job_id = surface.call("submit", queue="q", payload=1)["job"]["id"]
    got = lease(surface, lease_ms=10_000)
    assert got["job_id"] == job_id and got["attempt"] == 1
    assert surface.call("lease", queues=["q"], worker_id="w1") == {"jobs": []}
    wrong = {**held(got), "lease_token": "not-the-token"}
    refused(surface, "STALE_TOKEN", "ack", **wrong)
    refused(surface, "STALE_TOKEN", "ack", **{**held(got), "worker_id": "w2"})
    clock.advance(ms=1_000)
    renewed = surface.call("renew", **held(got), lease_ms=20_000)
    assert renewed == {
        "job_id": job_id,
        "lease_expires_at_ms": clock.now_ms() + 20_000,
        "stop": None,
    }
    acked = surface.call("ack", **held(got))
    assert acked == {"job_id": job_id, "state": "succeeded", "duplicate": False}
    assert surface.call("ack", **held(got))["duplicate"] is True
    refused(surface, "STALE_TOKEN", "renew", **held(got))
    refused(surface, "STALE_TOKEN", "release", **held(got))


def test_meta_and_unique_while_active(surface: Surface) -> None:
    """``meta`` goes in with submit and comes back with the job and its lease; a key submitted
    with ``unique: "active"`` is free again once its job succeeded (issue 16, items 6-7)."""
    meta = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    args = {"queue": "q", "payload": 1, "idempotency_key": "k", "unique": "active"}
    made = surface.call("submit", **args, meta=meta)["job"]
    assert (made["meta"], made["unique"]) == (meta, "active")
    assert surface.call("inspect", job_id=made["id"])["job"]["meta"] == meta
    assert surface.call("submit", **args)["deduplicated"] is True
    got = lease(surface)
    assert got["meta"] == meta
    surface.call("ack", **held(got))
    again = surface.call("submit", **args)
    assert again["deduplicated"] is False and again["job"]["id"] != made["id"]
    assert again["job"]["meta"] == {}
    bad = refused(surface, "INVALID_ARGUMENT", "submit", queue="q", payload=1, meta={"a": 1})
    assert bad.details["field"] == "meta.a"
    bad = refused(surface, "INVALID_ARGUMENT", "submit", queue="q", payload=1, unique="active")
    assert bad.details["field"] == "unique"


def test_expired_lease_is_refused(surface: Surface, clock: FakeClock) -> None:
    surface.call("submit", queue="q", payload=1)
    got = lease(surface, lease_ms=1_000)
    clock.advance(ms=1_000)
    refused(surface, "LEASE_EXPIRED", "ack", **held(got))
    refused(surface, "LEASE_EXPIRED", "fail", **held(got), error="late")


def test_fail_then_release(surface: Surface, clock: FakeClock) -> None:
    job_id = surface.call(
        "submit", queue="q", payload=1, backoff="fixed", backoff_base_ms=5_000, jitter=False
    )["job"]["id"]
    got = lease(surface)
    failed = surface.call("fail", **held(got), error="boom")
    assert failed == {
        "job_id": job_id,
        "state": "retrying",
        "retry_at_ms": clock.now_ms() + 5_000,
        "dead_reason": None,
        "duplicate": False,
    }
    refused(surface, "STALE_TOKEN", "release", **held(got))
    clock.advance(ms=5_000)
    again = lease(surface)
    assert again["attempt"] == 2
    assert surface.call("release", **held(again)) == {"job_id": job_id, "state": "ready"}
    refused(surface, "STALE_TOKEN", "fail", **held(again), error="late")


def test_results_sent_with_ack_and_fail_are_read_back(surface: Surface) -> None:
    done = surface.call("submit", queue="q", payload=1, idempotency_key="k-1")["job"]["id"]
    got = lease(surface)
    assert surface.call("ack", **held(got), result={"rows": [1, 2], "ok": True})["state"] == (
        "succeeded"
    )
    failed = surface.call("submit", queue="q", payload=2, max_retries=0)["job"]["id"]
    got = lease(surface)
    surface.call(
        "fail", **held(got), error="boom", exception_class="app.Boom", traceback="app.Boom\n"
    )
    by_id = surface.call("result", job_id=done)
    assert by_id["return_value"] == {"rows": [1, 2], "ok": True} and by_id["errors"] == []
    assert (by_id["job"]["id"], by_id["job"]["state"]) == (done, "succeeded")
    by_key = surface.call("result", queue="q", idempotency_key="k-1")
    assert by_key["job"]["id"] == done and by_key["return_value"] == by_id["return_value"]
    dead = surface.call("result", job_id=failed)
    assert dead["return_value"] is None
    assert dead["errors"] == [
        {"attempt": 1, "exception_class": "app.Boom", "traceback": "app.Boom\n"}
    ]
    refused(surface, "NOT_FOUND", "result", queue="q", idempotency_key="nope")


def test_dead_list_pages(surface: Surface) -> None:
    dead = []
    for n in range(3):
        surface.call("submit", queue="d", payload=n)
        got = lease(surface, "d")
        out = surface.call("fail", **held(got), error=f"e{n}", retryable=False)
        assert (out["state"], out["dead_reason"]) == ("dead", f"non-retryable: e{n}")
        dead.append(got["job_id"])
    first = surface.call("dead_list", limit=2)
    assert [j["id"] for j in first["jobs"]] == dead[:2] and first["next_after"] == dead[1]
    assert all(set(j) == JOB_KEYS | surface.job_extras for j in first["jobs"])
    assert all(j["state"] == "dead" for j in first["jobs"])
    rest = surface.call("dead_list", limit=2, after=first["next_after"])
    assert [j["id"] for j in rest["jobs"]] == dead[2:] and rest["next_after"] is None
    assert surface.call("dead_list", queue="other") == {"jobs": [], "next_after": None}
    replayed = surface.call("dead_retry", job_id=dead[0])["job"]
    assert (replayed["state"], replayed["failures"]) == ("ready", 0)
    assert surface.call("dead_purge", job_id=dead[1]) == {"job_id": dead[1], "purged": True}
    refused(surface, "INVALID_STATE", "dead_purge", job_id=dead[0])
    refused(surface, "INVALID_STATE", "dead_retry", job_id=dead[0])


def test_stats_shape(surface: Surface, clock: FakeClock) -> None:
    surface.call("submit", queue="a", payload=1)
    surface.call("submit", queue="b", payload=1, delay_ms=60_000)
    clock.advance(ms=2_500)
    stats = surface.call("stats")
    assert set(stats) == {"queues", "totals", "server_time_ms", "servers", "next_after", "controls"}
    states = {"pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled"}
    assert stats["totals"] == dict.fromkeys(states, 0) | {"pending": 1, "ready": 1}
    assert stats["queues"]["a"] == dict.fromkeys(states, 0) | {
        "ready": 1,
        "oldest_ready_age_ms": 2_500,
    }
    assert stats["queues"]["b"]["oldest_ready_age_ms"] is None
    assert stats["server_time_ms"] == clock.now_ms() and stats["next_after"] is None
    page = surface.call("stats", limit=1)
    assert list(page["queues"]) == ["a"] and page["next_after"] == "a"
    assert stats["controls"] == {}


def test_pause_resume_and_a_cap_behave_alike_on_every_surface(surface: Surface) -> None:
    for i in range(3):
        surface.call("submit", queue="ctl", payload=i)
    paused = surface.call("pause", queue="ctl")
    assert paused["paused"] is True and paused["queue"] == "ctl"
    assert surface.call("lease", queues=["ctl"], worker_id="w")["jobs"] == []
    assert surface.call("stats")["controls"]["ctl"]["paused"] is True
    assert surface.call("resume", queue="ctl")["paused"] is False
    limited = surface.call("set_queue_limits", queue="ctl", max_leased=2)
    assert (limited["max_leased"], limited["rate_per_s"], limited["burst"]) == (2, None, 1)
    got = surface.call("lease", queues=["ctl"], worker_id="w", max_jobs=3)["jobs"]
    assert len(got) == 2
    with pytest.raises(errors.InvalidArgument):
        surface.call("set_queue_limits", queue="ctl", burst=0)


@pytest.mark.parametrize(
    ("op", "args", "field"),
    [
        ("submit", {"queue": "q", "payload": 1, "priority": "urgent"}, "priority"),
        ("submit", {"queue": "q", "payload": 1, "max_retries": "3"}, "max_retries"),
        ("submit", {"queue": "q", "payload": 1, "delay_ms": -1}, "delay_ms"),
        ("submit", {"queue": "bad queue", "payload": 1}, "queue"),
        ("submit", {"queue": "q", "payload": 1, "time_limit_ms": 0}, "time_limit_ms"),
        (
            "submit_batch",
            {"jobs": [{"queue": "q", "payload": 1}, {"queue": 1, "payload": 1}]},
            "jobs[1].queue",
        ),
        (
            "submit_batch",
            {"jobs": [{"queue": "q", "payload": 1, "priority": 9}]},
            "jobs[0].priority",
        ),
        (  # hostile review: TCP acked the good entry, HTTP refused the request
            "ack_batch",
            {"acks": [_ACK, {"job_id": UNKNOWN_JOB, "worker_id": "w1"}]},
            "acks[1].lease_token",
        ),
        ("ack_batch", {"acks": [{**_ACK, "job_id": 5}]}, "acks[0].job_id"),
        ("renew_batch", {"renews": [_ACK, {**_ACK, "lease_token": None}]}, "renews[1].lease_token"),
        ("renew_batch", {"renews": [{**_ACK, "result": 1}]}, "renews[0].result"),
        # A lease_ms of another type: refused whole on every surface (HTTP's schema did, TCP
        # refused the entry alone: a review).
        ("renew_batch", {"renews": [_ACK, {**_ACK, "lease_ms": "600000"}]}, "renews[1].lease_ms"),
        ("renew_batch", {"renews": [_ACK, {**_ACK, "lease_ms": 30000.5}]}, "renews[1].lease_ms"),
        ("renew_batch", {"renews": [_ACK, {**_ACK, "lease_ms": True}]}, "renews[1].lease_ms"),
        ("renew_batch", {"renews": []}, "renews"),
        ("renew_batch", {"renews": [_ACK] * 101}, "renews"),
        ("renew_batch", {"renews": [_ACK, 5]}, "renews[1]"),
        ("ack_batch", {"acks": [_ACK, {**_ACK, "worker_id": ["w"]}]}, "acks[1].worker_id"),
        # Lists and maps past their bounds, refused by their length on every surface (a
        # hostile review: HTTP validated 150,000 jobs one by one first).
        ("submit_batch", {"jobs": [{}] * 1001}, "jobs"),
        ("lease", {"queues": [1] * 17}, "queues"),
        ("submit", {"queue": "q", "payload": 1, "meta": {f"k{n}": n for n in range(17)}}, "meta"),
        ("lease", {"queues": ["q"], "max_jobs": 0}, "max_jobs"),
        ("lease", {"queues": ["q"], "lease_ms": 10}, "lease_ms"),
        ("ack", {"job_id": UNKNOWN_JOB, "worker_id": "w1"}, "lease_token"),
        ("fail", {"job_id": UNKNOWN_JOB, "worker_id": "w1", "lease_token": "t"}, "error"),
        ("dead_list", {"limit": 0}, "limit"),
        ("stats", {"after": "bad queue"}, "after"),
    ],
)
def test_invalid_arguments_name_the_field(
    surface: Surface, op: str, args: dict[str, Any], field: str
) -> None:
    err = refused(surface, "INVALID_ARGUMENT", op, **args)
    assert err.details["field"] == field


@pytest.mark.parametrize(
    ("op", "args", "message"),
    [
        ("submit_batch", {"jobs": [{}] * 1001}, "jobs: must be a list of 1 to 1000 jobs"),
        ("submit_batch", {"jobs": []}, "jobs: must be a list of 1 to 1000 jobs"),
        ("lease", {"queues": ["q"] * 17}, "queues: must name 1 to 16 queues, got 17"),
        ("lease", {"queues": []}, "queues: must name 1 to 16 queues, got 0"),
        (
            "submit",
            {"queue": "q", "payload": 1, "meta": {f"k{n}": "v" for n in range(17)}},
            "meta: must have at most 16 keys, got 17",
        ),
    ],
)
def test_a_list_or_map_past_its_bound_is_refused_in_the_same_words(
    surface: Surface, op: str, args: dict[str, Any], message: str
) -> None:
    # One check per bound (queue_core.validation), which HTTP runs before its schema reads
    # the items (a hostile review: 150,000 jobs validated one by one first).
    assert refused(surface, "INVALID_ARGUMENT", op, **args).message == message


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"priority": [1]}, "jobs[2].priority"),  # a schema fault over HTTP
        ({"max_retries": 10_000}, "jobs[2].max_retries"),  # out of range: the service's
        ({"meta": {"k": 1}}, "jobs[2].meta.k"),
    ],
)
def test_a_bad_job_of_a_batch_is_named_by_its_index(
    surface: Surface, bad: dict[str, Any], field: str
) -> None:
    # A review: HTTP named the field of a schema fault but not its index, which TCP gives.
    jobs = [{"queue": "q", "payload": 1}] * 2 + [{"queue": "q", "payload": 1, **bad}]
    err = refused(surface, "INVALID_ARGUMENT", "submit_batch", jobs=jobs)
    assert (err.details["field"], err.details["index"]) == (field, 2)


@override_settings(RELAY_MAX_QUEUES=2)
def test_a_queue_past_the_cap_is_refused_alike_on_every_surface(surface: Surface) -> None:
    surface.call("submit", queue="a", payload=1)
    surface.call("submit_batch", jobs=[{"queue": "b", "payload": 1}])
    for op, args in (
        ("submit", {"queue": "c", "payload": 1}),
        ("submit_batch", {"jobs": [{"queue": "a", "payload": 1}, {"queue": "c", "payload": 1}]}),
    ):
        err = refused(surface, "TOO_MANY_QUEUES", op, **args)
        assert (err.details, err.retryable) == ({"limit": 2, "queue": "c"}, False)
    assert surface.call("submit", queue="a", payload=2)["job"]["queue"] == "a"


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("inspect", {}),
        ("result", {}),
        ("ack", {"worker_id": "w1", "lease_token": "t"}),
        ("renew", {"worker_id": "w1", "lease_token": "t"}),
        ("fail", {"worker_id": "w1", "lease_token": "t", "error": "x"}),
        ("release", {"worker_id": "w1", "lease_token": "t"}),
        ("dead_retry", {}),
        ("dead_purge", {}),
        ("cancel", {}),
    ],
)
def test_unknown_job(surface: Surface, op: str, args: dict[str, Any]) -> None:
    err = refused(surface, "NOT_FOUND", op, job_id=UNKNOWN_JOB, **args)
    assert err.details["job_id"] == UNKNOWN_JOB


def test_cancel_and_time_limit(surface: Surface, clock: FakeClock) -> None:
    waiting = surface.call("submit", queue="w", payload=1)["job"]["id"]
    out = surface.call("cancel", job_id=waiting)
    assert set(out) == {"job", "cancelled"} and out["cancelled"] is True
    assert set(out["job"]) == JOB_KEYS | surface.job_extras
    assert out["job"]["state"] == "cancelled"
    err = refused(surface, "JOB_FINISHED", "cancel", job_id=waiting)
    assert err.details == {"job_id": waiting, "state": "cancelled"}
    # A leased job: marked; the renew says stop; the release ends it cancelled.
    running = surface.call("submit", queue="q", payload=1)["job"]["id"]
    got = lease(surface, lease_ms=10_000)
    out = surface.call("cancel", job_id=running)
    assert out["cancelled"] is False and out["job"]["state"] == "leased"
    assert out["job"]["cancel_requested_at_ms"] == clock.now_ms()
    assert surface.call("renew", **held(got))["stop"] == "cancelled"
    assert surface.call("release", **held(got)) == {"job_id": running, "state": "cancelled"}
    # dead_retry replays a cancelled job.
    assert surface.call("dead_retry", job_id=running)["job"]["state"] == "ready"
    # A time limit: the lease carries it; a renew at the limit fails the attempt.
    timed = surface.call("submit", queue="t", payload=1, time_limit_ms=2_000, max_retries=0)
    assert timed["job"]["time_limit_ms"] == 2_000
    got = lease(surface, queue="t", lease_ms=10_000)
    assert got["time_limit_ms"] == 2_000
    clock.advance(ms=2_000)
    stopped = surface.call("renew", **held(got))
    assert stopped == {"job_id": got["job_id"], "lease_expires_at_ms": None, "stop": "timeout"}
    err = refused(surface, "LEASE_EXPIRED", "ack", **held(got))
    assert err.details["reason"] == "timeout"
    job = surface.call("inspect", job_id=got["job_id"])["job"]
    assert (job["state"], job["last_error"]) == ("dead", "timeout")


def test_ack_and_fail_lease_the_next_jobs_and_ack_batch_fences_each_ack(
    surface: Surface,
) -> None:
    """Issue 15, item 3: ``lease_next`` on ack and fail, ``ack_batch`` (``POST /acks``)."""
    for n in range(5):
        surface.call("submit", queue="q", payload=n, backoff="fixed", backoff_base_ms=60_000)
    first = lease(surface)
    acked = surface.call("ack", **held(first), lease_next={"queues": ["q"], "max_jobs": 2})
    assert set(acked) == {"job_id", "state", "duplicate", "next"}
    assert acked["state"] == "succeeded" and len(acked["next"]) == 2
    assert all(set(job) == set(first) for job in acked["next"])  # leases, as lease gives
    one, two = acked["next"]
    failed = surface.call("fail", **held(one), error="boom", lease_next={"queues": ["q"]})
    assert failed["state"] == "retrying" and len(failed["next"]) == 1
    (three,) = failed["next"]
    out = surface.call(
        "ack_batch",
        acks=[held(two), {**held(three), "lease_token": "stale"}, {**held(three), "result": 7}],
        lease_next={"queues": ["q"], "max_jobs": 5},
    )
    assert [(r["job_id"], r["ok"], r["state"]) for r in out["results"]] == [
        (two["job_id"], True, "succeeded"),
        (three["job_id"], False, None),
        (three["job_id"], True, "succeeded"),
    ]
    error = out["results"][1]["error"]
    assert (error["code"], error["retryable"]) == ("STALE_TOKEN", False)
    assert len(out["next"]) == 1  # the last ready job; the failed one waits for its retry
    (four,) = out["next"]
    last = surface.call("ack", **held(four), lease_next={"queues": ["q"]})
    assert last["next"] == []  # nothing ready: answered at once
    assert surface.call("result", job_id=three["job_id"])["return_value"] == 7
    bad = refused(
        surface,
        "INVALID_ARGUMENT",
        "ack",
        **held(four),
        lease_next={"queues": ["q"], "max_jobs": 0},
    )
    assert bad.details["field"] == "lease_next.max_jobs"


def test_renew_batch_fences_and_answers_each_renew(surface: Surface, clock: FakeClock) -> None:
    """``renew_batch`` (``POST /renewals``): one commit, each renew fenced and answered as
    ``renew`` answers it; a refused entry changes nothing and leaves the others."""
    for n in range(3):
        surface.call("submit", queue="q", payload=n)
    leases = surface.call("lease", queues=["q"], worker_id="w1", max_jobs=3, lease_ms=10_000)
    a, b, c = leases["jobs"]
    surface.call("cancel", job_id=c["job_id"])
    clock.advance(ms=1_000)
    before = surface.call("inspect", job_id=b["job_id"])["job"]["lease_expires_at_ms"]
    out = surface.call(
        "renew_batch",
        renews=[
            {**held(a), "lease_ms": 20_000},
            {**held(b), "lease_token": "stale"},
            {**held(c), "lease_ms": 10_000},
            {**held(a), "job_id": UNKNOWN_JOB},
            {**held(a), "job_id": "j" * 41},  # no job id is so long: not echoed
            {**held(b), "lease_ms": 10},
        ],
    )
    assert set(out) == {"results"}
    now = clock.now_ms()
    answers = [(r["job_id"], r["ok"], r["lease_expires_at_ms"], r["stop"]) for r in out["results"]]
    assert answers == [
        (a["job_id"], True, now + 20_000, None),
        (b["job_id"], False, None, None),
        (c["job_id"], True, now + 10_000, "cancelled"),
        (UNKNOWN_JOB, False, None, None),
        (None, False, None, None),
        (b["job_id"], False, None, None),
    ]
    codes = [r["error"] and r["error"]["code"] for r in out["results"]]
    assert codes == [
        None,
        "STALE_TOKEN",
        None,
        "NOT_FOUND",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
    ]
    assert all(
        set(r) == {"job_id", "ok", "lease_expires_at_ms", "stop", "error"} for r in out["results"]
    )
    # The refused entries changed nothing: b's lease is as it was, and still b's.
    job = surface.call("inspect", job_id=b["job_id"])["job"]
    assert (job["state"], job["lease_expires_at_ms"]) == ("leased", before)
    # Past its expiry a lease is not revived; a renew past the time limit fails the attempt.
    timed = surface.call("submit", queue="t", payload=1, time_limit_ms=2_000, max_retries=0)
    got = lease(surface, queue="t", lease_ms=10_000)
    clock.advance(ms=9_000)  # b expires at 11 s; a (renewed to 21 s) and t (10 s) still held
    renews = [held(b), held(got), {**held(a), "lease_ms": 10_000}]
    out = surface.call("renew_batch", renews=renews)
    b_out, t_out, a_out = out["results"]
    assert (b_out["ok"], b_out["error"]["code"]) == (False, "LEASE_EXPIRED")
    assert (t_out["ok"], t_out["lease_expires_at_ms"], t_out["stop"]) == (True, None, "timeout")
    assert (a_out["ok"], a_out["lease_expires_at_ms"]) == (True, clock.now_ms() + 10_000)
    job = surface.call("inspect", job_id=timed["job"]["id"])["job"]
    assert (job["state"], job["last_error"]) == ("dead", "timeout")
    refused(surface, "LEASE_EXPIRED", "ack", **held(got))
    assert surface.call("ack", **held(a))["state"] == "succeeded"


def test_an_error_naming_a_huge_argument_stays_small(surface: Surface) -> None:
    """An unknown argument's name is echoed in the message and the field: one of 200,000
    characters made an error reply twice the request (a review); both are cut."""
    name = "x" * 200_000
    err = refused(surface, "INVALID_ARGUMENT", "renew_batch", renews=[{**_ACK, name: 1}])
    assert len(err.message) <= 1024 and len(err.details["field"]) <= 256
    assert err.details["field"].startswith("renews[0].xxx")
