"""Queue controls over the HTTP API: pause, resume, limits and reading them; operator keys
only; the same errors as TCP."""

from __future__ import annotations

import threading
from collections.abc import Callable

import orjson
import pytest

from queue_core.models import JobEvent
from tests.http.conftest import Api, LongPoll, problem
from tests.http.test_metrics import samples

pytestmark = pytest.mark.django_db(transaction=True)


def put(api: Api, path: str, body: object, key: str | None = None) -> object:
    headers = api.headers(key, None)
    return api.client.put(
        path, orjson.dumps(body), content_type="application/json", headers=headers
    )


def test_pause_resume_and_limits_over_http(api: Api) -> None:
    api.post("/api/v1/queues/email/jobs", {"payload": 1})
    paused = api.post("/api/v1/queues/email/pause")
    assert paused.status_code == 200, paused.content
    assert paused.json()["paused"] is True
    leased = api.post("/api/v1/leases", {"queues": ["email"], "worker_id": "w"})
    assert leased.json()["jobs"] == []
    stats = api.get("/api/v1/stats").json()
    assert stats["controls"]["email"]["paused"] is True
    assert api.post("/api/v1/queues/email/resume").json()["paused"] is False
    limited = put(api, "/api/v1/queues/email/limits", {"max_leased": 2, "rate_per_s": 0.5})
    assert limited.status_code == 200, limited.content  # type: ignore[attr-defined]
    body = limited.json()  # type: ignore[attr-defined]
    assert (body["max_leased"], body["rate_per_s"], body["burst"]) == (2, 0.5, 1)
    one = api.get("/api/v1/queues/email/controls").json()
    assert one["max_leased"] == 2
    assert set(api.get("/api/v1/queues/controls").json()["queues"]) == {"email"}
    assert api.get("/api/v1/queues/other/controls").json()["paused"] is False
    events = JobEvent.objects.filter(job_id="queue:email").values_list("event", flat=True)
    assert list(events.order_by("id")) == ["paused", "resumed", "limits_set"]


def test_bad_limits_and_names_are_problems(api: Api) -> None:
    problem(put(api, "/api/v1/queues/email/limits", {"burst": 0}), 422, "INVALID_ARGUMENT")
    problem(put(api, "/api/v1/queues/email/limits", {"max_leased": -1}), 422, "INVALID_ARGUMENT")
    problem(api.post("/api/v1/queues/bad%20name/pause"), 422, "INVALID_ARGUMENT")


@pytest.mark.parametrize(
    "body",
    [
        {"max_leased": True},
        {"max_leased": "5"},
        {"rate_per_s": "2"},
        {"rate_per_s": True},
        {"burst": 1.0},
        {"bogus": 1},
        "x",
        5,
        [1],
        {"rate_per_s": 1e-310},  # too slow: its next token's due time would overflow
    ],
)
def test_limits_bodies_are_strict_json_as_on_tcp(api: Api, body: object) -> None:
    problem(put(api, "/api/v1/queues/email/limits", body), 422, "INVALID_ARGUMENT")
    assert api.get("/api/v1/queues/email/controls").json()["updated_at_ms"] is None


def test_only_operator_keys_change_controls(api: Api, make_key: Callable[..., str]) -> None:
    producer, operator = make_key("producer"), make_key("operator")
    problem(api.post("/api/v1/queues/q/pause", key=producer), 403, "PERMISSION_DENIED")
    problem(
        put(api, "/api/v1/queues/q/limits", {"max_leased": 1}, producer), 403, "PERMISSION_DENIED"
    )
    assert api.get("/api/v1/queues/q/controls", key=producer).status_code == 200
    assert api.post("/api/v1/queues/q/pause", key=operator).status_code == 200


def test_metrics_show_paused_and_limited_queues(api: Api) -> None:
    api.post("/api/v1/queues/m/pause")
    put(api, "/api/v1/queues/n/limits", {"max_leased": 3, "rate_per_s": 2})
    text = api.get("/metrics").content.decode()
    assert samples(text, "relay_queue_paused") == {
        (("queue", "m"),): 1.0,
        (("queue", "n"),): 0.0,
    }
    assert samples(text, "relay_queue_max_leased") == {(("queue", "n"),): 3.0}
    assert samples(text, "relay_queue_rate_per_second") == {(("queue", "n"),): 2.0}


def test_an_http_long_poll_on_a_paused_queue_waits_and_resume_wakes_it(
    api: Api, long_poll_waits: threading.Event
) -> None:
    api.post("/api/v1/queues/held/jobs", {"payload": 1})
    api.post("/api/v1/queues/held/pause")
    poll = LongPoll(["held"], wait_ms=15_000)
    # Resume only once the long-poll waits (it claimed nothing from the paused queue).
    assert long_poll_waits.wait(10)
    assert api.post("/api/v1/queues/held/resume").status_code == 200
    assert len(poll.join()) == 1
    assert poll.elapsed < 10  # woken by the resume, not by its deadline


def test_an_http_long_poll_on_a_throttled_queue_claims_when_its_next_token_comes(
    api: Api,
) -> None:
    # A claim that found the queue out of tokens tells the long-poll when the next one comes
    # (QueueService.next_due_ms): it looks again then, not at its deadline.
    assert (
        put(api, "/api/v1/queues/slow/limits", {"rate_per_s": 0.5, "burst": 1}).status_code == 200
    )
    for i in range(2):
        api.post("/api/v1/queues/slow/jobs", {"payload": i})
    first = api.post("/api/v1/leases", {"queues": ["slow"]}).json()["jobs"]
    assert len(first) == 1  # the one token
    poll = LongPoll(["slow"], wait_ms=15_000)
    assert len(poll.join()) == 1
    assert 0.5 < poll.elapsed < 5  # about 2 s: the next token, not the deadline


def test_http_long_polls_of_a_throttled_queue_claim_once_a_token_not_each_at_each(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each HTTP long-poll slept until its queue's next token and claimed then, every one of
    # them, and each that got the token woke two more: 8 long-polls of a queue at 4 jobs/s
    # made 13 claims a job, each a write transaction. Now the process's wake-ups wake one
    # long-poll a token (ProcessWakeups.due_at) and one that spent the queue wakes none.
    from queue_api.routers import workers

    claims: list[None] = []
    claim = workers._claim

    def counted(*args: object) -> object:
        claims.append(None)
        return claim(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(workers, "_claim", counted)
    polls = 6
    assert put(api, "/api/v1/queues/r/limits", {"rate_per_s": 10, "burst": 1}).status_code == 200
    for i in range(polls + 1):
        api.post("/api/v1/queues/r/jobs", {"payload": i})
    assert len(api.post("/api/v1/leases", {"queues": ["r"]}).json()["jobs"]) == 1
    claims.clear()
    waiting = [LongPoll(["r"], wait_ms=15_000) for _ in range(polls)]
    assert all(len(poll.join()) == 1 for poll in waiting)  # one a token, 100 ms apart
    # Each long-poll's first claim, one a token, and a few where a token came as a long-poll
    # claimed on its own; one timer a long-poll made 6 + 6 + 5 + ... + 1 + the hand-ons (33+).
    assert len(claims) <= 2 * polls + 4, len(claims)
