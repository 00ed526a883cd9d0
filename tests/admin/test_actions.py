"""Replay and purge from the console: confirmation pages, the service as the only writer,
who-did-it in the history, races between operators, permissions and CSRF."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from queue_admin import operations
from queue_admin.operations import BulkRunner, Op, describe
from queue_core.clock import FakeClock
from queue_core.errors import OutcomeUnknown, RelayError, StoreBusy, Unavailable
from queue_core.models import Job, JobAttempt, JobEvent
from queue_core.service import QueueService
from tests.admin.conftest import DEAD_LIST, JOB_LIST, job_url, make_operator, messages_of
from tests.stepclock import timed_transactions

pytestmark = pytest.mark.django_db(transaction=True)

Factory = Callable[..., dict[str, Any]]
DeadJobs = Callable[..., list[str]]


def ask(client: Client, url: str, action: str, ids: list[str], **extra: str) -> Any:
    """Pick an action on the list (the first POST): answers with the confirmation page."""
    data = {"action": action, "index": "0", "select_across": "0", "_selected_action": ids}
    data.update(extra)
    return client.post(url, data)


def confirm(client: Client, url: str, page: Any, *, follow: bool = True) -> Any:
    """Submit the confirmation page's form as a browser would, following the redirect."""
    html = page.content.decode()
    start = html.index('<form method="post">')
    form = html[start : html.index("</form>", start)]
    fields: dict[str, list[str]] = {}
    for name, value in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form):
        fields.setdefault(name, []).append(value)
    fields.pop("csrfmiddlewaretoken", None)
    return client.post(url, fields, follow=follow)


def states(ids: list[str]) -> dict[str, str]:
    return dict(Job.objects.filter(id__in=ids).values_list("id", "state"))


# ------------------------------------------------------------------ replay


def test_replay_selected_confirms_the_count_then_replays_through_the_service(
    alice: Client, dead_jobs: DeadJobs, console_clock: FakeClock
) -> None:
    ids = dead_jobs(3)
    page = ask(alice, DEAD_LIST, "replay_selected", ids[:2])
    assert page.status_code == 200
    assert page.templates[0].name == "queue_admin/confirm_action.html"
    assert page.context["will"] == 2
    assert 'id="relay-will">2</strong> dead letters' in page.content.decode()
    assert states(ids) == dict.fromkeys(ids, "dead")  # nothing changed before confirming

    console_clock.advance(seconds=5)
    done = confirm(alice, DEAD_LIST, page)
    assert done.redirect_chain[-1][0].startswith(DEAD_LIST)
    assert messages_of(done) == ["Replayed 2 dead letters."]
    assert states(ids) == {ids[0]: "ready", ids[1]: "ready", ids[2]: "dead"}
    event = JobEvent.objects.get(job_id=ids[0], event="replayed")
    assert (event.actor, event.from_state, event.to_state) == ("alice", "dead", "ready")
    assert event.at_ms == console_clock.now_ms()
    # History kept, retry budget fresh.
    job = Job.objects.get(id=ids[0])
    assert job.failures == 0 and job.attempt == 1
    assert JobAttempt.objects.filter(job_id=ids[0], outcome="failed").exists()


def test_replaying_a_job_that_is_not_dead_changes_nothing_and_says_so(
    alice: Client, job_factory: Factory, dead_jobs: DeadJobs
) -> None:
    ready = job_factory(queue="waiting")["id"]
    [dead] = dead_jobs(1)
    page = ask(alice, JOB_LIST, "replay_selected", [ready, dead])
    assert page.context["will"] == 1
    assert page.context["others"] == [("ready", 1)]
    done = confirm(alice, JOB_LIST, page)
    assert messages_of(done) == [
        "Replayed 1 job.",
        f"1 job is not dead or cancelled and is left alone: {ready} (it is ready).",
    ]
    assert states([ready, dead]) == {ready: "ready", dead: "ready"}
    assert not JobEvent.objects.filter(job_id=ready).exists()


def test_second_operator_replaying_the_same_job_is_told_who_did_it(
    alice: Client, bob: Client, dead_jobs: DeadJobs
) -> None:
    [job_id] = dead_jobs(1)
    alice_page = ask(alice, DEAD_LIST, "replay_selected", [job_id])
    bob_page = ask(bob, DEAD_LIST, "replay_selected", [job_id])
    assert messages_of(confirm(alice, DEAD_LIST, alice_page)) == ["Replayed 1 dead letter."]
    bob_messages = messages_of(confirm(bob, DEAD_LIST, bob_page))
    assert bob_messages[0] == "Nothing was replayed."
    assert bob_messages[1].startswith(
        f"1 dead letter was already replayed: {job_id} (replayed by alice at "
    )
    assert bob_messages[1].endswith("; it is ready now).")
    assert JobEvent.objects.filter(job_id=job_id, event="replayed").count() == 1


def test_simultaneous_replays_change_the_job_once(
    operator: User, transactional_db: None, dead_jobs: DeadJobs
) -> None:
    [job_id] = dead_jobs(1)
    users = [operator, make_operator("bob", "view_deadletter", "replay_job")]
    clients = []
    for user in users:
        client = Client()
        client.force_login(user)
        clients.append(client)
    pages = [ask(client, DEAD_LIST, "replay_selected", [job_id]) for client in clients]
    barrier = threading.Barrier(len(clients))
    codes: list[int] = [0 for _ in clients]

    def go(i: int) -> None:
        from django.db import connection

        try:
            barrier.wait()
            codes[i] = confirm(clients[i], DEAD_LIST, pages[i], follow=False).status_code
        finally:
            connection.close()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert codes == [302, 302]
    # Read each operator's messages afterwards: the test client's captured contexts are
    # not thread-safe.
    results = [messages_of(client.get(DEAD_LIST)) for client in clients]
    assert sorted(r[0] for r in results) == ["Nothing was replayed.", "Replayed 1 dead letter."]
    loser = next(r for r in results if r[0] == "Nothing was replayed.")
    assert "was already replayed" in loser[1]
    assert JobEvent.objects.filter(job_id=job_id, event="replayed").count() == 1
    assert Job.objects.get(id=job_id).state == "ready"


# ------------------------------------------------------------------- purge


def test_purge_selected_deletes_and_records_who(alice: Client, dead_jobs: DeadJobs) -> None:
    ids = dead_jobs(2)
    page = ask(alice, DEAD_LIST, "purge_selected", ids)
    assert page.context["will"] == 2
    assert 'value="Yes, purge 2 dead letters"' in page.content.decode()
    done = confirm(alice, DEAD_LIST, page)
    assert messages_of(done) == ["Purged 2 dead letters."]
    assert not Job.objects.filter(id__in=ids).exists()
    assert not JobAttempt.objects.filter(job_id__in=ids).exists()
    events = JobEvent.objects.filter(job_id__in=ids, event="purged")
    assert {(e.actor, e.from_state) for e in events} == {("alice", "dead")}


def test_purge_removes_only_terminal_jobs(
    alice: Client,
    service: QueueService,
    job_factory: Factory,
    leased_job: Factory,
    dead_jobs: DeadJobs,
) -> None:
    ready = job_factory()["id"]
    leased = leased_job(queue="other")["job_id"]
    ok = leased_job(queue="done")
    service.ack(ok["job_id"], worker_id="w1", lease_token=ok["lease_token"])
    [dead] = dead_jobs(1)
    page = ask(alice, JOB_LIST, "purge_selected", [ready, leased, ok["job_id"], dead])
    assert page.context["will"] == 2
    assert page.context["others"] == [("leased", 1), ("ready", 1)]
    done = confirm(alice, JOB_LIST, page)
    assert messages_of(done)[0] == "Purged 2 jobs."
    assert "2 jobs are not finished (or not dead) and are left alone" in messages_of(done)[1]
    assert states([ready, leased, ok["job_id"], dead]) == {ready: "ready", leased: "leased"}


def test_dead_letter_purge_refuses_a_job_that_succeeded_since(
    alice: Client, service: QueueService, dead_jobs: DeadJobs
) -> None:
    [job_id] = dead_jobs(1, queue="q")
    page = ask(alice, DEAD_LIST, "purge_selected", [job_id])
    # Meanwhile someone replays it and a worker finishes it.
    service.replay(job_id, actor="carol")
    lease = service.claim(["q"], worker_id="w2")[0]
    service.ack(job_id, worker_id="w2", lease_token=lease["lease_token"])
    done = confirm(alice, DEAD_LIST, page)
    assert messages_of(done) == [
        "Nothing was purged.",
        f"1 dead letter is not finished (or not dead) and is left alone: {job_id} "
        "(it is succeeded).",
    ]
    assert Job.objects.get(id=job_id).state == "succeeded"


def test_purging_a_purged_job_names_who_purged_it(
    alice: Client, bob: Client, dead_jobs: DeadJobs
) -> None:
    [job_id] = dead_jobs(1)
    alice_page = ask(alice, DEAD_LIST, "purge_selected", [job_id])
    bob_page = ask(bob, DEAD_LIST, "purge_selected", [job_id])
    confirm(alice, DEAD_LIST, alice_page)
    bob_messages = messages_of(confirm(bob, DEAD_LIST, bob_page))
    assert bob_messages[1].startswith(
        f"1 dead letter was already purged: {job_id} (purged by alice"
    )


# ------------------------------------------------- everything that matches


def test_replay_all_matching_applies_to_the_filtered_list_only(
    alice: Client, dead_jobs: DeadJobs
) -> None:
    email = dead_jobs(3, queue="email")
    billing = dead_jobs(2, queue="billing")
    listing = alice.get(DEAD_LIST, {"queue": "email"})
    html = listing.content.decode()
    assert 'id="relay-all-replay_selected"' in html and 'id="relay-all-purge_selected"' in html
    url = f"{DEAD_LIST}?queue=email"
    page = ask(alice, url, "replay_selected", email[:1], select_across="1")
    assert page.context["will"] == 3
    assert page.context["filters"] == [("queue", "email")]
    assert "every dead letter on this list that matches" in page.content.decode()
    done = confirm(alice, url, page)
    assert messages_of(done) == ["Replayed 3 dead letters."]
    assert set(states(email).values()) == {"ready"}
    assert set(states(billing).values()) == {"dead"}


def test_all_matching_spares_jobs_that_died_after_the_confirmation(
    alice: Client, dead_jobs: DeadJobs, console_clock: FakeClock
) -> None:
    before = dead_jobs(2)
    page = ask(alice, DEAD_LIST, "purge_selected", before[:1], select_across="1")
    assert page.context["will"] == 2
    console_clock.advance(seconds=1)
    later = dead_jobs(1)
    done = confirm(alice, DEAD_LIST, page)
    assert messages_of(done) == ["Purged 2 dead letters."]
    assert states(before + later) == {later[0]: "dead"}


def test_all_matching_walks_many_chunks(
    alice: Client, dead_jobs: DeadJobs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("queue_admin.admin.CHUNK", 4)
    ids = dead_jobs(10)
    page = ask(alice, DEAD_LIST, "replay_selected", ids[:1], select_across="1")
    assert page.context["will"] == 10
    done = confirm(alice, DEAD_LIST, page)
    assert messages_of(done) == ["Replayed 10 dead letters."]
    assert set(states(ids).values()) == {"ready"}


def test_search_narrows_all_matching(alice: Client, dead_jobs: DeadJobs) -> None:
    smtp = dead_jobs(2, error="SMTP 535 authentication failed")
    other = dead_jobs(1, error="KeyError: 'user'")
    url = f"{DEAD_LIST}?q=smtp"
    page = ask(alice, url, "purge_selected", smtp[:1], select_across="1")
    assert page.context["will"] == 2
    assert page.context["filters"] == [("search", "smtp")]
    confirm(alice, url, page)
    assert states(smtp + other) == {other[0]: "dead"}


# ------------------------------------------------------- detail page buttons


def test_detail_page_buttons_go_through_the_same_confirmation(
    alice: Client, dead_jobs: DeadJobs
) -> None:
    [job_id] = dead_jobs(1)
    detail = alice.get(f"/admin/queue_core/deadletter/{job_id}/change/")
    html = detail.content.decode()
    assert "Replay…" in html and "Purge…" in html
    assert html.count('name="_from_detail"') == 2
    page = ask(alice, DEAD_LIST, "replay_selected", [job_id], _from_detail="1")
    assert page.context["will"] == 1
    assert f'href="/admin/queue_core/deadletter/{job_id}/change/"' in page.content.decode()
    done = confirm(alice, DEAD_LIST, page)
    # The dead letter is READY now: the console shows it on the job page.
    assert done.redirect_chain[-1][0] == job_url(job_id)
    assert messages_of(done) == ["Replayed 1 dead letter."]
    after = done.content.decode()
    assert "Replay…" not in after and "Purge…" not in after


def test_detail_page_offers_only_what_the_state_allows(
    alice: Client, service: QueueService, job_factory: Factory, leased_job: Factory
) -> None:
    ready = job_factory()["id"]
    html = alice.get(job_url(ready)).content.decode()
    assert "Replay…" not in html and "Purge…" not in html
    lease = leased_job(queue="done")
    service.ack(lease["job_id"], worker_id="w1", lease_token=lease["lease_token"])
    html = alice.get(job_url(lease["job_id"])).content.decode()
    assert "Replay…" not in html and "Purge…" in html


def test_purge_from_the_detail_page_returns_to_the_list(alice: Client, dead_jobs: DeadJobs) -> None:
    [job_id] = dead_jobs(1)
    page = ask(alice, DEAD_LIST, "purge_selected", [job_id], _from_detail="1")
    done = confirm(alice, DEAD_LIST, page)
    assert done.redirect_chain[-1][0] == DEAD_LIST
    assert messages_of(done) == ["Purged 1 dead letter."]
    assert not Job.objects.filter(id=job_id).exists()


# --------------------------------------------------------------- permissions


def test_view_only_operator_sees_no_actions_and_cannot_post_them(
    transactional_db: None, dead_jobs: DeadJobs
) -> None:
    [job_id] = dead_jobs(1)
    client = Client()
    client.force_login(make_operator("viewer", "view_job", "view_deadletter"))
    listing = client.get(DEAD_LIST)
    assert listing.status_code == 200
    html = listing.content.decode()
    assert "replay_selected" not in html and "purge_selected" not in html
    assert "Replay…" not in client.get(job_url(job_id)).content.decode()
    for action in ("replay_selected", "purge_selected"):
        page = client.post(
            DEAD_LIST,
            {"action": action, "select_across": "0", "_selected_action": [job_id], "post": "yes"},
        )
        # With no action allowed, Django ignores the POST and shows the list again.
        assert page.status_code == 200 and "cl" in page.context
    assert Job.objects.get(id=job_id).state == "dead"


def test_replay_permission_does_not_grant_purge(
    transactional_db: None, dead_jobs: DeadJobs
) -> None:
    [job_id] = dead_jobs(1)
    client = Client()
    client.force_login(make_operator("replayer", "view_deadletter", "replay_job"))
    html = client.get(DEAD_LIST).content.decode()
    assert "replay_selected" in html and "purge_selected" not in html
    page = client.post(
        DEAD_LIST,
        {
            "action": "purge_selected",
            "select_across": "0",
            "_selected_action": [job_id],
            "post": "yes",
        },
        follow=True,
    )
    assert messages_of(page) == ["No action selected."]
    assert Job.objects.filter(id=job_id).exists()


def test_the_console_is_staff_only(transactional_db: None, dead_jobs: DeadJobs) -> None:
    [job_id] = dead_jobs(1)
    user = User.objects.create_user("mallory")  # not staff
    user.user_permissions.set(list(make_operator("tmp", "replay_job").user_permissions.all()))
    client = Client()
    client.force_login(user)
    for url in (DEAD_LIST, "/admin/queue_core/job/overview/", job_url(job_id)):
        response = client.get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]
    client.post(
        DEAD_LIST,
        {
            "action": "replay_selected",
            "select_across": "0",
            "_selected_action": [job_id],
            "post": "yes",
        },
    )
    assert Job.objects.get(id=job_id).state == "dead"


def test_no_add_change_or_delete_side_doors(alice: Client, dead_jobs: DeadJobs) -> None:
    [job_id] = dead_jobs(1)
    assert alice.get(f"{JOB_LIST}add/").status_code == 403
    assert alice.get(f"/admin/queue_core/job/{job_id}/delete/").status_code == 403
    assert alice.post(f"/admin/queue_core/job/{job_id}/delete/", {"post": "yes"}).status_code == 403
    # The change form is read-only: a POST to it changes nothing.
    alice.post(job_url(job_id), {"state": "ready", "queue": "x"})
    assert Job.objects.get(id=job_id).state == "dead"
    actions = alice.get(JOB_LIST).context["action_form"].fields["action"].choices
    assert [name for name, _ in actions] == ["", "replay_selected", "purge_selected"]


def test_actions_need_a_csrf_token(operator: User, dead_jobs: DeadJobs) -> None:
    [job_id] = dead_jobs(1)
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    data = {"action": "replay_selected", "select_across": "0", "_selected_action": [job_id]}
    forged = client.post(DEAD_LIST, {**data, "post": "yes"})
    assert forged.status_code == 403
    assert Job.objects.get(id=job_id).state == "dead"

    page = client.post(DEAD_LIST, {**data, "index": "0", "csrfmiddlewaretoken": _token(client)})
    assert page.status_code == 200 and "csrfmiddlewaretoken" in page.content.decode()
    client.post(DEAD_LIST, {**data, "post": "yes", "csrfmiddlewaretoken": _token(client)})
    assert Job.objects.get(id=job_id).state == "ready"


def _token(client: Client) -> str:
    client.get(DEAD_LIST)
    return str(client.cookies["csrftoken"].value)


# ---------------------------------------------------------- the bulk runner


def test_runner_stops_at_its_time_budget_and_reports_what_is_left(
    service: QueueService, dead_jobs: DeadJobs
) -> None:
    ids = dead_jobs(5)
    ticks = iter([0.0, 0.0, 0.0, 99.0, 99.0])
    runner = BulkRunner(service, actor="alice", time_budget_s=10, monotonic=lambda: next(ticks))
    outcome = runner.run(Op.REPLAY, operations.chunked(ids, 2), total=5)
    assert outcome.done == ids[:4] and outcome.remaining == 1
    assert describe(outcome)[-1] == (
        "warning",
        "Stopped after the time limit with about 1 left; run the action again to continue.",
    )
    assert states(ids)[ids[4]] == "dead"


def test_runner_rolls_back_a_chunk_the_database_refuses(
    service: QueueService, dead_jobs: DeadJobs, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids, more = dead_jobs(3), dead_jobs(3)
    real = service.transaction
    depth, chunks = 0, 0

    @contextlib.contextmanager
    def transaction(*args: Any, **kwargs: Any) -> Iterator[None]:
        nonlocal depth, chunks
        depth += 1
        chunks += depth == 1
        try:
            with real(*args, **kwargs):
                yield
                if depth == 1 and chunks == 2:
                    raise error  # as if COMMIT failed: the chunk rolls back
        finally:
            depth -= 1

    error: RelayError = StoreBusy()
    monkeypatch.setattr(service, "transaction", transaction)
    outcome = BulkRunner(service, actor="alice").run(Op.REPLAY, operations.chunked(ids, 2), total=3)
    assert outcome.done == ids[:2] and outcome.stopped is error and outcome.remaining == 1
    assert states(ids) == {ids[0]: "ready", ids[1]: "ready", ids[2]: "dead"}
    assert describe(outcome)[-1] == (
        "error",
        "The database stayed busy, so the last batch was not applied (1 left). "
        "Run the action again.",
    )
    # Any other error of a chunk stops the run the same way, and is named (it raised out of
    # ``run`` before: the console answered 500 and did not say what had been done).
    depth, chunks = 0, 0
    error = Unavailable("the database connection failed")
    outcome = BulkRunner(service, actor="alice").run(
        Op.REPLAY, operations.chunked(more, 2), total=3
    )
    assert outcome.done == more[:2] and outcome.stopped is error and outcome.remaining == 1
    assert describe(outcome)[-1] == (
        "error",
        "The database failed (UNAVAILABLE: the database connection failed), so the last "
        "batch was not applied (1 left). Run the action again.",
    )
    depth, chunks = 0, 0
    error = OutcomeUnknown()
    outcome = BulkRunner(service, actor="alice").run(Op.REPLAY, operations.chunked(more, 2))
    assert describe(outcome)[-1][1].startswith(
        "The database connection was lost while the last batch committed: it may or may not"
    )


def test_runner_leaves_a_locked_job_alone_and_goes_on(
    service: QueueService, dead_jobs: DeadJobs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A call refused BUSY (on PostgreSQL, its row stayed locked past RELAY_LOCK_TIMEOUT_MS or
    # a deadlock chose it) rolls back alone, as the HTTP API's bulk routes answer it; it
    # undid and stopped the whole run before (tests/postgresql/test_bulk_chunk_lost_session).
    ids = dead_jobs(3)
    real = service.replay

    def replay(job_id: str, **kw: Any) -> dict[str, Any]:
        with service.transaction():  # the call's savepoint, as the replay's own would be
            result = real(job_id, **kw)
            if job_id == ids[1]:
                raise StoreBusy()  # after its change: the savepoint must undo it
        return result

    monkeypatch.setattr(service, "replay", replay)
    outcome = BulkRunner(service, actor="alice").run(Op.REPLAY, operations.chunked(ids, 2), total=3)
    assert outcome.done == [ids[0], ids[2]] and not outcome.remaining and not outcome.stopped
    assert [s.job_id for s in outcome.locked] == [ids[1]]
    assert states(ids) == {ids[0]: "ready", ids[1]: "dead", ids[2]: "ready"}
    assert describe(outcome) == [
        ("success", "Replayed 2 jobs."),
        (
            "warning",
            f"1 job was locked by another transaction and left alone: {ids[1]} (held by "
            "another transaction). Run the action again.",
        ),
    ]


def test_runner_leaves_the_write_lock_between_chunks_as_long_as_each_held_it(
    service: QueueService,
    clock: FakeClock,
    dead_jobs: Callable[..., list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SQLite's lock is not fair: chunks back to back kept a waiting server's writes out (a
    # hostile review of the HTTP API's bulk replay, which shares this pacing).
    ids = dead_jobs(5)
    gaps = timed_transactions(monkeypatch, service, clock, work_ms=10)
    runner = BulkRunner(service, actor="alice", monotonic=clock.monotonic)
    assert runner.run(Op.REPLAY, operations.chunked(ids, 2), total=5).done == ids
    assert gaps == pytest.approx([0.01, 0.01])  # three chunks, each 10 ms


def test_runner_reports_unknown_and_malformed_ids(service: QueueService) -> None:
    outcome = BulkRunner(service, actor="alice").run(
        Op.PURGE, [["job_00000000000000000000000000", "not a job id"]], total=2
    )
    assert [s.job_id for s in outcome.missing] == ["job_00000000000000000000000000", "not a job id"]
    assert describe(outcome)[0] == ("warning", "Nothing was purged.")
