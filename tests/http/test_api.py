"""The HTTP API through Django's test client: every endpoint, its status codes and problems."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from django.http import HttpResponse
from django.test import Client, RequestFactory, override_settings
from django.test.utils import CaptureQueriesContext

from queue_api import calls
from queue_api.middleware import BodyLimitMiddleware
from queue_core import errors, metrics
from queue_core.clock import FakeClock, SystemClock
from queue_core.models import Job
from queue_core.service import QueueService
from tests.http.conftest import Api, LongPoll, problem
from tests.stepclock import timed_transactions

DAY_MS = 86_400_000

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = "/api/v1/queues/email/jobs"


def submit(api: Api, payload: Any = None, queue: str = "email", **options: Any) -> dict[str, Any]:
    response = api.post(f"/api/v1/queues/{queue}/jobs", {"payload": payload or {"n": 1}, **options})
    assert response.status_code in (200, 201), response.content
    job: dict[str, Any] = response.json()["job"]
    return job


def lease(api: Api, queue: str = "email", **args: Any) -> dict[str, Any]:
    response = api.post("/api/v1/leases", {"queues": [queue], "worker_id": "w1", **args})
    assert response.status_code == 200, response.content
    jobs: list[dict[str, Any]] = response.json()["jobs"]
    assert jobs, "nothing leased"
    return jobs[0]


# ---------------------------------------------------------------------- producers


def test_submit_answers_201_with_the_job_and_its_location(api: Api) -> None:
    response = api.post(JOBS, {"payload": {"user_id": 42}, "priority": "high", "max_retries": 5})
    assert response.status_code == 201
    body = response.json()
    assert body["deduplicated"] is False
    job = body["job"]
    assert (job["queue"], job["state"], job["priority"]) == ("email", "ready", "high")
    assert job["payload"] == {"user_id": 42}
    assert job["max_retries"] == 5
    assert response["Location"] == f"/api/v1/jobs/{job['id']}"
    assert job["created_at"].endswith("Z")
    assert "lease_token" not in job


def test_idempotency_key_header_answers_200_with_the_existing_job(api: Api) -> None:
    first = api.post(JOBS, {"payload": {"a": 1}}, headers={"Idempotency-Key": "signup-42"})
    again = api.post(JOBS, {"payload": {"a": 1}}, headers={"Idempotency-Key": "signup-42"})
    in_body = api.post(JOBS, {"payload": {"a": 1}, "idempotency_key": "signup-42"})
    assert (first.status_code, again.status_code, in_body.status_code) == (201, 200, 200)
    assert again.json()["deduplicated"] is True
    assert again.json()["job"]["id"] == first.json()["job"]["id"] == in_body.json()["job"]["id"]
    assert Job.objects.count() == 1


def test_idempotency_key_with_another_payload_is_a_409_problem(api: Api) -> None:
    api.post(JOBS, {"payload": {"a": 1}, "idempotency_key": "k"})
    body = problem(
        api.post(JOBS, {"payload": {"a": 2}, "idempotency_key": "k"}), 409, "IDEMPOTENCY_CONFLICT"
    )
    assert body["instance"] == JOBS
    assert body["details"]["job_id"].startswith("job_")


def test_a_utf8_idempotency_key_header_is_the_same_key_as_in_the_body(api: Api) -> None:
    """A server hands Django each header byte as a Latin-1 character (WSGI, and Django's
    ASGI handler): a UTF-8 key was stored as other text, and the same key in the body made a
    second job (hostile review). The header is sent here as a server passes it on."""
    key = "ключ-42"
    as_passed = key.encode("utf-8").decode("latin-1")
    first = api.post(JOBS, {"payload": 1}, headers={"Idempotency-Key": as_passed})
    in_body = api.post(JOBS, {"payload": 1, "idempotency_key": key})
    both = api.post(
        JOBS, {"payload": 1, "idempotency_key": key}, headers={"Idempotency-Key": as_passed}
    )
    assert (first.status_code, in_body.status_code, both.status_code) == (201, 200, 200)
    assert first.json()["job"]["idempotency_key"] == key
    assert in_body.json()["job"]["id"] == both.json()["job"]["id"] == first.json()["job"]["id"]
    not_utf8 = b"\xff\xfe".decode("latin-1")
    body = problem(
        api.post(JOBS, {"payload": 1}, headers={"Idempotency-Key": not_utf8}),
        422,
        "INVALID_ARGUMENT",
    )
    assert body["details"]["field"] == "Idempotency-Key"


def test_a_key_with_outer_spaces_in_the_body_agrees_with_the_header_that_lost_them(
    api: Api,
) -> None:
    # A header arrives without its outer spaces (RFC 9110 section 5.5; the test client strips
    # them as a server does): the same key in both got 422 "differ" (hostile review).
    both = api.post(
        JOBS, {"payload": 1, "idempotency_key": " k "}, headers={"Idempotency-Key": "k"}
    )
    in_body = api.post(JOBS, {"payload": 1, "idempotency_key": " k "})
    assert (both.status_code, in_body.status_code) == (201, 200)
    assert both.json()["job"]["idempotency_key"] == " k "
    assert in_body.json()["job"]["id"] == both.json()["job"]["id"]
    other = api.post(
        JOBS, {"payload": 1, "idempotency_key": " k "}, headers={"Idempotency-Key": "j"}
    )
    assert problem(other, 422, "INVALID_ARGUMENT")["details"]["field"] == "idempotency_key"


def test_an_api_request_to_a_host_not_allowed_gets_a_problem_not_html(api: Api) -> None:
    """Django answered a Host outside ALLOWED_HOSTS with its HTML "Bad Request (400)" page and
    a logged traceback, under /api/ too (hostile review)."""
    response = api.client.get("/api/v1/health", headers={"Host": "evil.example"})
    body = problem(response, 400, "BAD_FRAME")
    assert "evil.example" in body["detail"] and "RELAY_ALLOWED_HOSTS" in body["detail"]
    assert api.get("/api/v1/health").status_code == 200


def test_header_and_body_keys_must_agree(api: Api) -> None:
    response = api.post(
        JOBS, {"payload": 1, "idempotency_key": "a"}, headers={"Idempotency-Key": "b"}
    )
    problem(response, 422, "INVALID_ARGUMENT")


def test_meta_and_unique_active_over_http(api: Api) -> None:
    """``meta`` and ``unique`` in the submit body: the job and its lease carry the meta, the
    Idempotency-Key header works with ``unique: "active"``, and the key is free again once
    the job succeeded (issue 16, items 6-7)."""
    meta = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    body = {"payload": {"a": 1}, "unique": "active", "meta": meta}
    key = {"Idempotency-Key": "signup-42"}
    first = api.post(JOBS, body, headers=key)
    assert first.status_code == 201
    job = first.json()["job"]
    assert (job["meta"], job["unique"], job["idempotency_key"]) == (meta, "active", "signup-42")
    assert api.get(f"/api/v1/jobs/{job['id']}").json()["meta"] == meta
    again = api.post(JOBS, body, headers=key)
    assert again.status_code == 200 and again.json()["job"]["id"] == job["id"]
    held = lease(api)
    assert held["meta"] == meta
    ids = {"worker_id": "w1", "lease_token": held["lease_token"]}
    assert api.post(f"/api/v1/jobs/{job['id']}/ack", ids).status_code == 200
    after = api.post(JOBS, body, headers=key)
    assert after.status_code == 201 and after.json()["job"]["id"] != job["id"]
    batch = api.post(
        "/api/v1/jobs/batch",
        {
            "jobs": [
                {
                    "queue": "email",
                    "payload": {"a": 1},
                    "idempotency_key": "signup-42",
                    "unique": "active",
                    "meta": meta,
                }
            ]
        },
    )
    assert batch.status_code == 200 and batch.json()["results"][0]["deduplicated"] is True


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"payload": 1, "meta": {"a": 1}}, "meta.a"),
        ({"payload": 1, "meta": ["a"]}, "meta"),
        ({"payload": 1, "meta": {"a": "x" * 2000}}, "meta"),
        ({"payload": 1, "unique": "active"}, "unique"),
        ({"payload": 1, "unique": "forever", "idempotency_key": "k"}, "unique"),
    ],
)
def test_bad_meta_and_unique_are_422_problems(api: Api, body: dict[str, Any], field: str) -> None:
    found = problem(api.post(JOBS, body), 422, "INVALID_ARGUMENT")
    assert found["details"]["field"] == field
    assert Job.objects.count() == 0


def test_delayed_submit_is_pending(api: Api) -> None:
    job = submit(api, delay_ms=60_000)
    assert job["state"] == "pending"
    assert job["available_at_ms"] >= job["created_at_ms"] + 60_000


def test_batch_submit_creates_all_in_one_transaction(api: Api) -> None:
    jobs = [{"queue": "a", "payload": {"i": i}, "idempotency_key": f"k{i}"} for i in range(3)]
    first = api.post("/api/v1/jobs/batch", {"jobs": jobs})
    assert first.status_code == 201
    assert [r["deduplicated"] for r in first.json()["results"]] == [False] * 3
    again = api.post("/api/v1/jobs/batch", {"jobs": jobs})
    assert again.status_code == 200
    assert [r["deduplicated"] for r in again.json()["results"]] == [True] * 3
    assert [r["job_id"] for r in again.json()["results"]] == [
        r["job_id"] for r in first.json()["results"]
    ]


def test_batch_with_one_bad_job_creates_none(api: Api) -> None:
    jobs = [{"queue": "a", "payload": 1}, {"queue": "bad queue!", "payload": 2}]
    body = problem(api.post("/api/v1/jobs/batch", {"jobs": jobs}), 422, "INVALID_ARGUMENT")
    assert body["details"]["index"] == 1
    assert Job.objects.count() == 0


@override_settings(RELAY_MAX_BATCH_SUBMIT=2)
def test_batch_is_bounded(api: Api) -> None:
    jobs = [{"queue": "a", "payload": i} for i in range(3)]
    problem(api.post("/api/v1/jobs/batch", {"jobs": jobs}), 422, "INVALID_ARGUMENT")


def test_get_job_shows_attempts_history_errors_and_lease(api: Api) -> None:
    job = submit(api, max_retries=1, backoff="fixed", backoff_base_ms=0, jitter=False)
    held = lease(api)
    fetched = api.get(f"/api/v1/jobs/{job['id']}").json()
    assert (fetched["state"], fetched["leased_by"]) == ("leased", "w1")
    assert fetched["lease_expires_at_ms"] == held["lease_expires_at_ms"]
    api.post(
        f"/api/v1/jobs/{job['id']}/fail",
        {"worker_id": "w1", "lease_token": held["lease_token"], "error": "smtp timeout"},
    )
    fetched = api.get(f"/api/v1/jobs/{job['id']}").json()
    assert fetched["state"] in ("retrying", "ready")
    assert fetched["attempt"] == 1
    assert fetched["history"][0]["outcome"] == "failed"
    assert fetched["history"][0]["error"] == "smtp timeout"
    assert fetched["last_error"] == "smtp timeout"


def test_unknown_job_is_a_404_problem(api: Api) -> None:
    problem(api.get("/api/v1/jobs/job_nope"), 404, "NOT_FOUND")


def test_list_jobs_by_queue_and_state_with_keyset_pages(api: Api) -> None:
    ids = [submit(api, {"i": i})["id"] for i in range(5)]
    submit(api, {"other": 1}, queue="other")
    held = lease(api)  # the oldest becomes leased
    page1 = api.get("/api/v1/queues/email/jobs?state=ready&limit=2").json()
    assert [j["id"] for j in page1["jobs"]] == ids[1:3]
    page2 = api.get(f"/api/v1/queues/email/jobs?state=ready&limit=2&after={page1['next_after']}")
    assert [j["id"] for j in page2.json()["jobs"]] == ids[3:5]
    assert api.get(f"/api/v1/queues/email/jobs?state=ready&limit=2&after={ids[4]}").json() == {
        "jobs": [],
        "next_after": None,
    }
    every = api.get("/api/v1/queues/email/jobs?limit=10").json()
    assert [j["id"] for j in every["jobs"]] == ids
    assert every["next_after"] is None
    assert every["jobs"][0]["state"] == "leased" and held["job_id"] == ids[0]
    problem(api.get("/api/v1/queues/email/jobs?state=nope"), 422, "INVALID_ARGUMENT")
    problem(api.get("/api/v1/queues/email/jobs?limit=0"), 422, "INVALID_ARGUMENT")


@override_settings(RELAY_MAX_FRAME_BYTES=60_000, RELAY_MAX_PAYLOAD_BYTES=20_000)
def test_a_job_page_ends_at_one_frame_of_json(api: Api) -> None:
    """``?limit=500`` over big payloads answered every row (a 129 MB body for 500 dead jobs of
    250 KB); a page now ends before one frame of JSON and ``next_after`` goes on from there."""
    ids = [submit(api, {"blob": "x" * 15_000, "i": i})["id"] for i in range(10)]
    seen: list[str] = []
    after = ""
    while True:
        response = api.get(f"{JOBS}?limit=500{after}")
        assert response.status_code == 200 and len(response.content) <= 60_000
        page = response.json()
        assert 0 < len(page["jobs"]) < 4
        seen += [j["id"] for j in page["jobs"]]
        if page["next_after"] is None:
            break
        after = f"&after={page['next_after']}"
    assert seen == ids


def test_stats_counts_by_queue_and_state(api: Api) -> None:
    submit(api)
    submit(api, queue="other")
    lease(api, queue="other")
    stats = api.get("/api/v1/stats").json()
    assert stats["queues"]["email"]["ready"] == 1
    assert stats["queues"]["other"]["leased"] == 1
    assert stats["totals"]["ready"] == 1
    assert stats["queues"]["email"]["oldest_ready_age_ms"] >= 0
    only = api.get("/api/v1/stats?queue=other").json()
    assert list(only["queues"]) == ["other"]


# ---------------------------------------------------------------------- workers


def test_lease_renew_ack_with_fencing(api: Api) -> None:
    job = submit(api)
    held = lease(api, lease_ms=5_000)
    assert held["job_id"] == job["id"] and held["attempt"] == 1
    path = f"/api/v1/jobs/{job['id']}"
    ids = {"worker_id": "w1", "lease_token": held["lease_token"]}
    renewed = api.post(f"{path}/renew", {**ids, "lease_ms": 20_000}).json()
    assert renewed["lease_expires_at_ms"] > held["lease_expires_at_ms"]
    problem(api.post(f"{path}/ack", {**ids, "lease_token": "x" * 32}), 409, "STALE_TOKEN")
    problem(api.post(f"{path}/ack", {**ids, "worker_id": "w2"}), 409, "STALE_TOKEN")
    assert api.post(f"{path}/ack", ids).json() == {
        "job_id": job["id"],
        "state": "succeeded",
        "duplicate": False,
    }
    assert api.post(f"{path}/ack", ids).json()["duplicate"] is True
    problem(api.post(f"{path}/renew", ids), 409, "STALE_TOKEN")


def test_expired_lease_is_refused_and_the_job_comes_back(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    svc = QueueService(observer=metrics.observe, clock=clock)
    monkeypatch.setattr(calls, "service", lambda: svc)
    job = submit(api, max_retries=2)
    held = lease(api, lease_ms=1_000)
    clock.advance(seconds=2)
    ids = {"worker_id": "w1", "lease_token": held["lease_token"]}
    problem(api.post(f"/api/v1/jobs/{job['id']}/ack", ids), 409, "LEASE_EXPIRED")
    again = lease(api, lease_ms=1_000)
    assert (again["job_id"], again["attempt"]) == (job["id"], 2)
    problem(api.post(f"/api/v1/jobs/{job['id']}/ack", ids), 409, "STALE_TOKEN")


def test_fail_retries_then_dead_and_release(api: Api) -> None:
    job = submit(api, max_retries=0)
    held = lease(api)
    ids = {"worker_id": "w1", "lease_token": held["lease_token"]}
    out = api.post(f"/api/v1/jobs/{job['id']}/fail", {**ids, "error": "boom"}).json()
    assert (out["state"], out["retry_at_ms"]) == ("dead", None)
    assert out["dead_reason"]
    other = submit(api, {"x": 1})
    held = lease(api)
    assert held["job_id"] == other["id"]
    ids = {"worker_id": "w1", "lease_token": held["lease_token"]}
    assert api.post(f"/api/v1/jobs/{other['id']}/release", ids).json() == {
        "job_id": other["id"],
        "state": "ready",
    }


def test_lease_on_an_empty_queue_waits_at_most_wait_ms(api: Api) -> None:
    started = time.monotonic()
    response = api.post("/api/v1/leases", {"queues": ["empty"], "wait_ms": 200})
    elapsed = time.monotonic() - started
    assert response.json() == {"jobs": []}
    assert 0.2 <= elapsed < 5


@override_settings(RELAY_MAX_WAIT_MS=1000)
def test_lease_wait_is_bounded_by_relay_max_wait_ms(api: Api) -> None:
    response = api.post("/api/v1/leases", {"queues": ["q"], "wait_ms": 1001})
    problem(response, 422, "INVALID_ARGUMENT")


def test_long_poll_wakes_on_a_commit_from_another_connection(api: Api) -> None:
    poll = LongPoll(["wake"], wait_ms=15_000)
    job = submit(api, queue="wake")
    assert [j["job_id"] for j in poll.join()] == [job["id"]]
    assert poll.elapsed < 10


def test_a_long_poll_gets_a_job_delayed_since_it_began_when_it_falls_due(
    api: Api, long_poll_waits: threading.Event
) -> None:
    # With no relay server (no reaper), only the waiting long-polls look at due instants: a
    # commit elsewhere woke them all, and each claimed again and saw the new one. Waking only
    # queues with a READY job left a delayed job for the waits' end (15 s; a review).
    from queue_core.service import QueueService

    poll = LongPoll(["later"], wait_ms=15_000)
    assert long_poll_waits.wait(10)  # past its first claim
    job = QueueService().submit("later", {"n": 1}, delay_ms=300)["job"]  # another connection
    assert [j["job_id"] for j in poll.join()] == [job["id"]]
    assert poll.elapsed < 10


def test_wakeups_built_under_a_stand_in_service_follow_the_service_after_it(
    api: Api, long_poll_waits: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process's wake-ups, first built while a test stood a fake-clock service in for
    # calls.service, kept it: their due instants, read on a frozen clock, never came, and
    # the next long-polls of the process waited out their 15 s (three tests, in whichever
    # pytest-xdist worker ran test_expired_lease_is_refused_and_the_job_comes_back first).
    calls.wakeups().stop()  # its threads end; the next ones are built under the stand-in
    calls.wakeups.cache_clear()
    stand_in = QueueService(clock=FakeClock())
    with monkeypatch.context() as patch:
        patch.setattr(calls, "service", lambda: stand_in)
        assert api.post("/api/v1/leases", {"queues": ["later"]}).json()["jobs"] == []
    poll = LongPoll(["later"], wait_ms=15_000)
    assert long_poll_waits.wait(10)  # past its first claim
    job = QueueService().submit("later", {"n": 1}, delay_ms=300)["job"]  # another connection
    assert [j["job_id"] for j in poll.join()] == [job["id"]]
    assert poll.elapsed < 10


def test_lease_defaults_worker_id_to_the_client_address(api: Api) -> None:
    submit(api)
    response = api.post("/api/v1/leases", {"queues": ["email"]})
    job_id = response.json()["jobs"][0]["job_id"]
    assert api.get(f"/api/v1/jobs/{job_id}").json()["leased_by"].startswith("http:127.0.0.1")


# ---------------------------------------------------------------------- dead letters


def make_dead(api: Api, n: int, queue: str = "email", pad: int = 0) -> list[str]:
    ids = []
    for i in range(n):
        job = submit(api, {"dead": i, "pad": "x" * pad}, queue=queue, max_retries=0)
        held = lease(api, queue=queue)
        assert held["job_id"] == job["id"]
        api.post(
            f"/api/v1/jobs/{job['id']}/fail",
            {"worker_id": "w1", "lease_token": held["lease_token"], "error": "x"},
        )
        ids.append(job["id"])
    return ids


def test_dead_letters_list_replay_and_purge(api: Api) -> None:
    ids = make_dead(api, 3)
    make_dead(api, 1, queue="other")
    page = api.get("/api/v1/dead?queue=email&limit=2").json()
    assert [j["id"] for j in page["jobs"]] == ids[:2]
    rest = api.get(f"/api/v1/dead?queue=email&after={page['next_after']}").json()
    assert [j["id"] for j in rest["jobs"]] == ids[2:]
    assert len(api.get("/api/v1/dead").json()["jobs"]) == 4

    replayed = api.post(f"/api/v1/dead/{ids[0]}/replay").json()
    assert replayed["state"] == "ready"
    problem(api.post(f"/api/v1/dead/{ids[0]}/replay"), 409, "INVALID_STATE")

    assert api.delete(f"/api/v1/dead/{ids[1]}").json() == {"job_id": ids[1], "purged": True}
    problem(api.delete(f"/api/v1/dead/{ids[1]}"), 404, "NOT_FOUND")
    events = api.get(f"/api/v1/jobs/{ids[0]}").json()["events"]
    assert events[-1]["event"] == "replayed"
    assert events[-1]["actor"].startswith("http:")


@override_settings(RELAY_MAX_FRAME_BYTES=60_000, RELAY_MAX_PAYLOAD_BYTES=20_000)
def test_a_bulk_replay_answers_the_jobs_one_frame_holds(api: Api) -> None:
    # Every replayed job came whole: 1,000 jobs of 256 KiB made a 256 MB reply (a review).
    ids = make_dead(api, 5, pad=19_000)
    response = api.post("/api/v1/dead/replay", {"job_ids": ids})
    results = response.json()["results"]
    assert [r["ok"] for r in results] == [True] * 5
    assert [r["job"] is not None for r in results] == [True, True, True, False, False]
    assert len(response.content) < 60_000 + 1_000
    assert {api.get(f"/api/v1/jobs/{i}").json()["state"] for i in ids} == {"ready"}


def test_dead_letters_replay_and_purge_many(api: Api) -> None:
    ids = make_dead(api, 4)
    out = api.post("/api/v1/dead/replay", {"job_ids": [ids[0], ids[1], "job_missing"]}).json()
    assert [(r["job_id"], r["ok"]) for r in out["results"]] == [
        (ids[0], True),
        (ids[1], True),
        ("job_missing", False),
    ]
    assert out["results"][2]["error"]["code"] == "NOT_FOUND"
    assert out["results"][0]["job"]["state"] == "ready"
    purged = api.post("/api/v1/dead/purge", {"job_ids": [ids[2], ids[3], ids[0]]}).json()
    assert [(r["ok"], (r["error"] or {}).get("code")) for r in purged["results"]] == [
        (True, None),
        (True, None),
        (False, "INVALID_STATE"),
    ]
    problem(api.post("/api/v1/dead/purge", {"job_ids": []}), 422, "INVALID_ARGUMENT")


def test_a_bulk_replay_commits_a_chunk_at_a_time_and_a_failed_chunk_changes_none_of_its_jobs(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One transaction a job held SQLite's write lock back to back: 1,000 replays kept the TCP
    # server's writes waiting up to 3.8 s (a hostile review).
    ids = make_dead(api, 5)
    monkeypatch.setattr(calls, "BULK_CHUNK", 2)
    real = QueueService.transaction
    opened: list[int] = []

    @contextlib.contextmanager
    def transaction(self: QueueService, **kwargs: Any) -> Iterator[Any]:
        opened.append(len(opened) + 1)
        with real(self, **kwargs) as tx:
            yield tx
            if len(opened) == 2:  # the second chunk's commit fails
                raise errors.StoreBusy()

    monkeypatch.setattr(QueueService, "transaction", transaction)
    out = api.post("/api/v1/dead/replay", {"job_ids": [*ids, "job_missing"]}).json()
    assert opened == [1, 2, 3]  # six jobs, two to a transaction
    assert [(r["ok"], (r["error"] or {}).get("code")) for r in out["results"]] == [
        (True, None),
        (True, None),
        (False, "BUSY"),
        (False, "BUSY"),
        (True, None),
        (False, "NOT_FOUND"),
    ]
    states = [api.get(f"/api/v1/jobs/{i}").json()["state"] for i in ids]
    assert states == ["ready", "ready", "dead", "dead", "ready"]


def test_a_bulk_purge_leaves_the_write_lock_between_chunks_as_long_as_each_held_it(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = make_dead(api, 5)
    clock = FakeClock()
    stand_in = QueueService(clock=clock)
    gaps = timed_transactions(monkeypatch, stand_in, clock, work_ms=10)
    monkeypatch.setattr(calls, "service", lambda: stand_in)
    monkeypatch.setattr(calls, "BULK_CHUNK", 2)
    out = api.post("/api/v1/dead/purge", {"job_ids": ids}).json()
    assert [r["ok"] for r in out["results"]] == [True] * 5
    assert gaps == pytest.approx([0.01, 0.01])  # three chunks, each 10 ms


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "payload"),
        ({"payload": None}, "payload"),
        ({"payload": 1, "max_retries": "5"}, "max_retries"),
        ({"payload": 1, "jitter": 1}, "jitter"),
        ({"payload": 1, "surprise": True}, "surprise"),
        ({"payload": 1, "max_retries": 101}, "max_retries"),
        ({"payload": 1, "delay_ms": 1, "run_at_ms": 1}, "delay_ms"),
        ({"payload": 1, "priority": "urgent"}, "priority"),
    ],
)
def test_schema_and_argument_errors_are_422_invalid_argument(
    api: Api, body: dict[str, Any], field: str
) -> None:
    out = problem(api.post(JOBS, body), 422, "INVALID_ARGUMENT")
    assert out["details"]["field"] == field, out


def test_bad_queue_name_is_422(api: Api) -> None:
    problem(api.post("/api/v1/queues/no%20spaces/jobs", {"payload": 1}), 422, "INVALID_ARGUMENT")


@pytest.mark.parametrize("raw", [b"{not json", b'{"payload": NaN}', b"\xff\xfe", b'{"payload": 1'])
def test_malformed_json_is_400_bad_frame(api: Api, raw: bytes) -> None:
    response = api.client.post(JOBS, raw, content_type="application/json")
    problem(response, 400, "BAD_FRAME")


@override_settings(RELAY_MAX_FRAME_BYTES=1000, RELAY_MAX_PAYLOAD_BYTES=500)
def test_body_over_the_frame_limit_is_413(api: Api) -> None:
    body = problem(api.post(JOBS, {"payload": "x" * 2000}), 413, "FRAME_TOO_LARGE")
    assert body["details"]["limit_bytes"] == 1000
    payload = problem(api.post(JOBS, {"payload": "x" * 800}), 413, "FRAME_TOO_LARGE")
    assert payload["details"]["field"] == "payload"


class _Unreadable(io.RawIOBase):
    def read(self, size: int = -1) -> bytes:
        raise AssertionError("the body was read")


@override_settings(RELAY_MAX_FRAME_BYTES=1000)
def test_413_comes_from_content_length_without_reading_the_body() -> None:
    request = RequestFactory().post(JOBS, b"", content_type="application/json")
    request.META["CONTENT_LENGTH"] = str(10**9)
    request.META["wsgi.input"] = _Unreadable()
    request._stream = _Unreadable()  # type: ignore[attr-defined]
    middleware = BodyLimitMiddleware(lambda r: HttpResponse(r.body))
    response = middleware(request)
    assert response.status_code == 413
    assert orjson.loads(response.content)["code"] == "FRAME_TOO_LARGE"


@override_settings(RELAY_MAX_FRAME_BYTES=1000)
def test_chunked_body_is_bounded_too() -> None:
    def chunked(data: bytes) -> Any:
        request = RequestFactory().post(JOBS, b"", content_type="application/json")
        request.META.pop("CONTENT_LENGTH", None)
        request.META["HTTP_TRANSFER_ENCODING"] = "chunked"
        request.META["wsgi.input"] = io.BytesIO(data)
        return BodyLimitMiddleware(lambda r: HttpResponse(r.body))(request)

    assert chunked(b"x" * 1001).status_code == 413
    small = chunked(b'{"payload": 1}')
    assert (small.status_code, small.content) == (200, b'{"payload": 1}')


def test_unknown_api_path_and_wrong_method(api: Api) -> None:
    problem(api.get("/api/v1/nothing/here"), 404, "NOT_FOUND")
    problem(api.get("/api/v2/jobs"), 404, "NOT_FOUND")
    # A request line's "//api/v1/stats" (the test client would read "//api" as a host) was
    # Django's HTML 404 (a review).
    problem(Client().get("/", PATH_INFO="//api/v1/stats"), 404, "NOT_FOUND")
    for method in ("GET", "POST", "DELETE", "OPTIONS"):  # the root was an HTML 404 / CSRF 403
        response = Client(enforce_csrf_checks=True).generic(
            method, "/api/v1/", b"{}", "application/json"
        )
        problem(response, 404, "NOT_FOUND")
    # A method a path does not serve: 405 with Allow, as a problem (hostile review: it was
    # django-ninja's plain-text "Method not allowed").
    for method, path, allowed in [
        ("put", JOBS, "POST"),
        ("patch", "/api/v1/queues/hq/jobs", "POST"),
        ("get", "/api/v1/leases", "POST"),
        ("put", "/api/v1/jobs/batch", "POST"),
        ("options", "/api/v1/health", "GET, HEAD"),
    ]:
        response = api.client.generic(method.upper(), path, b"{}", "application/json")
        body = problem(response, 405, "UNKNOWN_OP")
        assert allowed in response["Allow"] and body["details"]["allowed"]
        assert method.upper() in body["detail"]
    # The schema and docs pages too, before Django's CSRF check (it answered an HTML 403).
    strict = Client(enforce_csrf_checks=True)
    for method in ("POST", "PUT", "DELETE", "OPTIONS"):
        for page in ("/api/v1/openapi.json", "/api/v1/docs"):
            response = strict.generic(method, page, b"{}", "application/json")
            assert "GET" in problem(response, 405, "UNKNOWN_OP")["details"]["allowed"]
    assert api.get("/api/v1/openapi.json").status_code == 200


def test_head_is_answered_wherever_get_is(api: Api, make_key: Callable[..., str]) -> None:
    """Hostile review: HEAD /api/v1/health (a load balancer's probe) got 405."""
    for page in ("/api/v1/health", "/api/v1/stats", "/api/v1/openapi.json", "/api/v1/docs"):
        got, head = api.get(page), api.client.head(page)
        assert (head.status_code, head.content) == (200, b""), page
        assert head["Content-Type"] == got["Content-Type"]
    key = make_key("producer")
    for page, status in (("/api/v1/stats", 401), ("/api/v1/leases", 405)):  # as GET, no body
        head = api.client.head(page)
        assert (head.status_code, head["Content-Type"]) == (status, "application/problem+json")
    keyed = api.client.head("/api/v1/stats", headers={"Authorization": f"Bearer {key}"})
    assert keyed.status_code == 200
    # Writes to a path no endpoint serves get the same 404, not a CSRF page (the API takes
    # keys, not cookies), as a browser-less client would send them.
    strict = Client(enforce_csrf_checks=True)
    for method, path in [
        ("post", "/api/v1/nope"),
        ("post", "/api/v1/queues//pause"),
        ("put", "/api/v1/queues//limits"),
        ("delete", "/api/v2/jobs"),
    ]:
        response = getattr(strict, method)(path, b"{}", content_type="application/json")
        problem(response, 404, "NOT_FOUND")


# ---------------------------------------------------------------------- schema and docs


def test_openapi_schema_and_docs_page_are_served(api: Api) -> None:
    schema = api.get("/api/v1/openapi.json").json()
    paths = schema["paths"]
    for path in (
        "/api/v1/queues/{queue}/jobs",
        "/api/v1/jobs/batch",
        "/api/v1/jobs/{job_id}",
        "/api/v1/stats",
        "/api/v1/leases",
        "/api/v1/jobs/{job_id}/ack",
        "/api/v1/dead",
        "/api/v1/dead/replay",
        "/api/v1/dead/purge",
    ):
        assert path in paths, path
    assert schema["components"]["securitySchemes"]["ApiKey"]["scheme"] == "bearer"
    assert "409" in paths["/api/v1/jobs/{job_id}/ack"]["post"]["responses"]
    page = api.get("/api/v1/docs")
    assert page.status_code == 200
    html = page.content.decode()
    assert "/api/v1/openapi.json" in html or "openapi.json" in html
    for asset in ("/static/ninja/swagger-ui-bundle.js", "/static/ninja/swagger-ui.css"):
        assert asset in html
        served = api.get(asset)
        served.close()  # a FileResponse: close its file
        assert served.status_code == 200, asset


def test_health_needs_no_key(api: Api) -> None:
    body = api.get("/api/v1/health").json()
    assert body["ok"] is True


def test_health_reads_the_database_once_and_no_job_or_count(api: Api) -> None:
    """It answered with ``stats()``: every queue's counts and oldest job, about 130 ms a
    probe among 20,000 queues, with no key needed (a hostile review)."""
    from django.db import connection

    api.post(JOBS, {"payload": 1})
    with CaptureQueriesContext(connection) as seen:
        body = api.get("/api/v1/health").json()
    assert body["ok"] is True and isinstance(body["server_time_ms"], int)
    sqls = [q["sql"] for q in seen.captured_queries]
    assert len(sqls) == 1 and "relay_job" not in sqls[0], sqls


# ------------------------------------------ NaN, ±Infinity and lone surrogates (#11, #12)


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        (JOBS, b'{"payload": {"x": 1e400}}'),
        (JOBS, b'{"payload": -Infinity}'),
        (JOBS, b'{"payload": 1, "delay_ms": NaN}'),
        (JOBS, b'{"payload": 1, "max_retries": Infinity}'),
        (JOBS, b'{"payload": "\\ud800"}'),
        (JOBS, b'{"payload": {"\\udcff": 1}}'),
        ("/api/v1/leases", b'{"queues": ["email"], "worker_id": "\\ud800"}'),
        ("/api/v1/leases", b'{"queues": ["email"], "lease_ms": NaN}'),
    ],
)
def test_nan_infinity_and_surrogates_are_refused_like_over_tcp(
    api: Api, path: str, raw: bytes
) -> None:
    # The body parser is orjson, as the TCP codec is: none of these is JSON it reads (NaN and
    # Infinity are not JSON, 1e400 holds in no double, "\ud800" has no UTF-8 form), so the
    # answer is BAD_FRAME on both surfaces, and nothing becomes null.
    response = api.client.post(path, raw, content_type="application/json")
    problem(response, 400, "BAD_FRAME")
    assert Job.objects.count() == 0


# ---------------------------------------------------------------------- maintenance


def test_prune_one_batch_at_a_time_with_an_operator_key(
    api: Api, make_key: Callable[..., str]
) -> None:
    past = QueueService(clock=FakeClock(start_ms=SystemClock().now_ms() - 3 * DAY_MS))
    for i in range(3):
        past.submit("old", {"i": i})
        held = past.claim(["old"], worker_id="w", lease_ms=30_000)[0]
        past.ack(held["job_id"], worker_id="w", lease_token=held["lease_token"])
    fresh = submit(api, {"new": 1}, queue="old")
    operator, producer = make_key("operator"), make_key("producer")
    body = {"older_than_ms": DAY_MS, "limit": 2}
    problem(api.with_key(producer).post("/api/v1/prune", body), 403, "PERMISSION_DENIED")
    ops = api.with_key(operator)
    assert ops.post("/api/v1/prune", body).json() == {
        "deleted": {"succeeded": 2, "dead": 0, "cancelled": 0},
        "more": True,
    }
    assert ops.post("/api/v1/prune", body).json() == {
        "deleted": {"succeeded": 1, "dead": 0, "cancelled": 0},
        "more": False,
    }
    assert Job.objects.filter(queue="old").values_list("id", flat=True).get() == fresh["id"]
    problem(ops.post("/api/v1/prune", {"older_than_ms": 0}), 422, "INVALID_ARGUMENT")
    problem(ops.post("/api/v1/prune", {"older_than_ms": 2**63 - 1}), 422, "INVALID_ARGUMENT")
    problem(ops.post("/api/v1/prune", {"older_than_ms": 5, "state": "x"}), 422, "INVALID_ARGUMENT")


def test_every_middleware_runs_in_async_mode_under_asgi() -> None:
    """One middleware without ``async_capable`` makes Django run the whole chain in sync mode,
    so each waiting lease long-poll would hold a thread (MethodProblemMiddleware had none)."""
    from django.conf import settings
    from django.utils.module_loading import import_string

    sync_only = [
        name
        for name in settings.MIDDLEWARE
        if not getattr(import_string(name), "async_capable", False)
    ]
    assert sync_only == []


# ---------------------------------------------------------------------- hostile bodies


def test_a_batch_over_its_bound_is_refused_by_its_length_before_its_jobs_are_read(
    api: Api,
) -> None:
    # A hostile review: 150,000 empty jobs were validated one by one (2.3 s) and every fault
    # listed (a 17 MB reply); TCP refuses the list by its length.
    response = api.post("/api/v1/jobs/batch", {"jobs": [{}] * 150_000})
    body = problem(response, 422, "INVALID_ARGUMENT")
    assert body["detail"] == "jobs: must be a list of 1 to 1000 jobs"
    assert body["details"]["field"] == "jobs"
    assert len(response.content) < 1000
    with override_settings(RELAY_MAX_BATCH_SUBMIT=2):
        body = problem(api.post("/api/v1/jobs/batch", {"jobs": [{}] * 3}), 422, "INVALID_ARGUMENT")
        assert body["detail"] == "jobs: must be a list of 1 to 2 jobs"
        jobs = [{"queue": "q", "payload": n} for n in range(2)]
        assert api.post("/api/v1/jobs/batch", {"jobs": jobs}).status_code == 201


def test_lease_queues_and_meta_over_their_bounds_are_refused_by_their_length(api: Api) -> None:
    body = problem(api.post("/api/v1/leases", {"queues": [1] * 350_000}), 422, "INVALID_ARGUMENT")
    assert body["detail"] == "queues: must name 1 to 16 queues, got 350000"
    assert len(body["details"]["errors"]) == 1
    meta = {f"k{n}": n for n in range(60_000)}
    response = api.post(JOBS, {"payload": 1, "meta": meta})
    body = problem(response, 422, "INVALID_ARGUMENT")
    assert body["detail"] == "meta: must have at most 16 keys, got 60000"
    assert len(response.content) < 1000
    job = submit(api)
    held = lease(api)
    ack = {
        "worker_id": "w1",
        "lease_token": held["lease_token"],
        "lease_next": {"queues": ["q"] * 17},
    }
    body = problem(api.post(f"/api/v1/jobs/{job['id']}/ack", ack), 422, "INVALID_ARGUMENT")
    assert body["details"]["field"] == "lease_next.queues"
    assert api.get(f"/api/v1/jobs/{job['id']}").json()["state"] == "leased"


def test_a_reply_lists_at_most_twenty_schema_faults_and_counts_the_rest(api: Api) -> None:
    bad = {f"k{n:02d}": n for n in range(16)}  # 16 non-string meta values
    body = problem(
        api.post(
            JOBS,
            {
                "payload": 1,
                "meta": bad,
                "max_retries": "1",
                "jitter": 1,
                "delay_ms": "1",
                "backoff_base_ms": "1",
                "backoff_cap_ms": "1",
                "unique": 1,
            },
        ),
        422,
        "INVALID_ARGUMENT",
    )
    assert len(body["details"]["errors"]) == 20
    assert body["details"]["errors_omitted"] == 22 - 20
    one = problem(api.post(JOBS, {"payload": 1, "priority": 9}), 422, "INVALID_ARGUMENT")
    assert "errors_omitted" not in one["details"]


def test_a_batch_is_refused_at_its_first_bad_job(api: Api) -> None:
    # A review: 1,000 jobs of 16 non-string meta values each made 16,000 faults, 72-307 ms a
    # request; TCP stops at the first bad spec, and so does HTTP now.
    jobs = [{"queue": "q", "payload": 1, "meta": {f"k{n:02d}": n for n in range(16)}}] * 999
    jobs = [{"queue": "q", "payload": 1}, *jobs]
    body = problem(api.post("/api/v1/jobs/batch", {"jobs": jobs}), 422, "INVALID_ARGUMENT")
    assert body["details"]["field"] == "jobs[1].meta.k00"
    assert len(body["details"]["errors"]) == 16 and "errors_omitted" not in body["details"]
    assert {e["field"] for e in body["details"]["errors"]} == {
        f"jobs[1].meta.k{n:02d}" for n in range(16)
    }
    names = [{"queue": n, "payload": 1} for n in range(1000)]  # a bad queue name each
    body = problem(api.post("/api/v1/jobs/batch", {"jobs": names}), 422, "INVALID_ARGUMENT")
    assert [e["field"] for e in body["details"]["errors"]] == ["jobs[0].queue"]
    assert body["details"]["errors"][0]["message"] == "Input should be a valid string"
    fine = [{"queue": "q", "payload": n} for n in range(3)]
    assert api.post("/api/v1/jobs/batch", {"jobs": fine}).status_code == 201


def test_only_the_first_unknown_field_is_reported_however_many_there_are(api: Api) -> None:
    # A second review: each of 120,000 unknown fields became a fault object (0.4-0.5 s and
    # 185 MB a request) before the reply kept 20; TCP stops at the first unknown argument.
    body = {"payload": 1, **{f"k{n}": 0 for n in range(80_000)}}  # about 1 MB
    problem_body = problem(api.post(JOBS, body), 422, "INVALID_ARGUMENT")
    assert problem_body["details"]["errors"] == [
        {"field": "k0", "message": "Extra inputs are not permitted"}
    ]
    both = problem(api.post(JOBS, {"max_retries": "5", "zz": 1, "yy": 2}), 422, "INVALID_ARGUMENT")
    fields = sorted(e["field"] for e in both["details"]["errors"])
    assert fields == ["max_retries", "payload", "zz"]
    jobs = [{"queue": "q", "payload": 1, "a": 1, "b": 2}, {"queue": "q", "payload": 1, "c": 3}]
    batch = problem(api.post("/api/v1/jobs/batch", {"jobs": jobs}), 422, "INVALID_ARGUMENT")
    assert [e["field"] for e in batch["details"]["errors"]] == ["jobs[0].a"]  # the first job
    lease_body = {"queues": ["q"], **{f"k{n}": n for n in range(1000)}}
    leased = problem(api.post("/api/v1/leases", lease_body), 422, "INVALID_ARGUMENT")
    assert [e["field"] for e in leased["details"]["errors"]] == ["k0"]


def test_too_many_query_parameters_are_an_invalid_argument_not_an_internal_error(
    api: Api,
) -> None:
    # A hostile review: Django's TooManyFieldsSent answered 500 INTERNAL, retryable.
    response = api.get("/api/v1/stats?" + "&".join(["a"] * 1001))
    body = problem(response, 422, "INVALID_ARGUMENT")
    assert body["retryable"] is False
    assert body["detail"] == "more than 1000 query parameters"
    assert api.get("/api/v1/stats?" + "&".join(["limit=5"] * 3)).status_code == 200


def test_the_openapi_document_is_built_once_per_process(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A hostile review: ninja built it per request (155-200 ms of CPU), for keyless clients.
    from ninja import NinjaAPI

    from queue_api.api import api as relay_api

    first = api.get("/api/v1/openapi.json").json()
    built = []
    original = NinjaAPI.get_openapi_schema

    def counted(self: NinjaAPI, **kwargs: Any) -> Any:
        built.append(kwargs)
        return original(self, **kwargs)

    monkeypatch.setattr(NinjaAPI, "get_openapi_schema", counted)
    relay_api._schemas.clear()
    for _ in range(3):
        assert api.get("/api/v1/openapi.json").json() == first
    assert len(built) == 1
