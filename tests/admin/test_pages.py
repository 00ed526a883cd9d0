"""What the console shows: lists, filters, search, the read-only detail page, the overview
and the audit log."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from queue_core.clock import FakeClock
from queue_core.models import Job
from queue_core.service import QueueService
from tests.admin.conftest import DEAD_LIST, JOB_LIST, OVERVIEW, job_url, make_operator

pytestmark = pytest.mark.django_db(transaction=True)

Factory = Callable[..., dict[str, Any]]
DeadJobs = Callable[..., list[str]]


def listed(response: Any) -> list[str]:
    """Job ids on a changelist page, in order."""
    return [obj.pk for obj in response.context["cl"].result_list]


def test_job_list_filters_by_queue_state_and_priority(
    alice: Client, job_factory: Factory, leased_job: Factory, dead_jobs: DeadJobs
) -> None:
    a = job_factory(queue="email", priority="high")["id"]
    c = leased_job(queue="email", priority="critical")["job_id"]
    [d] = dead_jobs(1, queue="billing")
    b = job_factory(queue="billing")["id"]
    assert listed(alice.get(JOB_LIST)) == [b, d, c, a]  # newest first
    assert listed(alice.get(JOB_LIST, {"queue": "email"})) == [c, a]
    assert listed(alice.get(JOB_LIST, {"state": "leased"})) == [c]
    assert listed(alice.get(JOB_LIST, {"state": "dead", "queue": "billing"})) == [d]
    assert listed(alice.get(JOB_LIST, {"priority__exact": "2"})) == [a]
    filters = alice.get(JOB_LIST).content.decode()
    assert "?queue=billing" in filters and "?queue=email" in filters


def test_job_list_columns(
    alice: Client, leased_job: Factory, dead_jobs: DeadJobs, console_clock: FakeClock
) -> None:
    [dead] = dead_jobs(1, error="SMTPAuthenticationError: 535 " + "x" * 200)
    lease = leased_job(worker_id="worker-7", queue="thumbs")
    console_clock.advance(seconds=90)
    html = alice.get(JOB_LIST).content.decode()
    assert '<span class="relay-state relay-dead">dead</span>' in html
    assert "worker-7" in html
    assert "1m 30s" in html  # age
    assert "SMTPAuthenticationError: 535 xxx" in html and "x" * 200 not in html.split("title=")[0]
    assert lease["lease_token"] not in html
    assert dead in html


def test_a_hover_title_repeats_a_bounded_part_of_a_long_error(
    alice: Client, dead_jobs: DeadJobs
) -> None:
    # A review: 100 errors of 4 KiB full of '<"' made a dead-letter page of 2.17 MB, each
    # error whole in its row's title.
    dead_jobs(1, error='<"' * 2048)
    for page in (JOB_LIST, DEAD_LIST, OVERVIEW):
        html = alice.get(page).content.decode()
        assert "&lt;&quot;" * 149 in html and "&lt;&quot;" * 150 not in html, page


@pytest.mark.parametrize(
    "lookup",
    ["lease_token", "lease_token__gte", "lease_token__startswith", "attempts__lease_token"],
)
def test_no_lookup_on_a_lease_token_in_the_query_string(
    client: Client, leased_job: Factory, lookup: str
) -> None:
    # With only "view job", ?lease_token__gte=... read a live token a character at a time:
    # a review recovered one in 257 requests and acked the job with another worker key.
    client.force_login(make_operator("viewer", "view_job"))
    lease = leased_job()
    token = lease["lease_token"]
    response = client.get(JOB_LIST, {"id": lease["job_id"], lookup: token[:1]})
    assert response.status_code == 400
    assert token not in response.content.decode()
    assert listed(client.get(JOB_LIST, {"id": lease["job_id"]})) == [lease["job_id"]]


EVENT_LIST = "/admin/queue_core/jobevent/"
KEY_LIST = "/admin/queue_core/apikey/"


@pytest.mark.parametrize(
    ("path", "lookup", "value"),
    [
        # SQLite runs a regular expression in Python under its lock: (y+)+x on a payload of
        # 100 y's stalled every HTTP request for 60 s (a review); "(" answered 500.
        (JOB_LIST, "payload__regex", "(y+)+x"),
        (JOB_LIST, "id__regex", "("),
        (DEAD_LIST, "last_error__regex", "(y+)+x"),
        (DEAD_LIST, "meta__contains", "y"),
        (EVENT_LIST, "detail__regex", "(y+)+x"),
        (JOB_LIST, "priority__gte", "0"),
        # ?secret_sha256__startswith= read a key's stored hash in 511 requests.
        (KEY_LIST, "secret_sha256__startswith", "a"),
        (KEY_LIST, "name__regex", "("),
    ],
)
def test_only_the_declared_filters_are_lookups_in_the_query_string(
    client: Client, job_factory: Factory, path: str, lookup: str, value: str
) -> None:
    job_factory(payload={"pad": "y" * 16})  # short: before the fix this ran
    client.force_login(
        make_operator("viewer", "view_job", "view_deadletter", "view_jobevent", "view_apikey")
    )
    assert client.get(path, {lookup: value}).status_code == 400
    assert client.get(path).status_code == 200


def test_the_declared_filters_and_a_job_id_still_filter(
    alice: Client, job_factory: Factory
) -> None:
    job = job_factory(queue="mail")["id"]
    job_factory(queue="other")
    assert listed(alice.get(JOB_LIST, {"queue": "mail"})) == [job]
    assert listed(alice.get(JOB_LIST, {"queue": "mail", "state": "ready"})) == [job]
    assert listed(alice.get(JOB_LIST, {"queue": "mail", "priority__exact": "1"})) == [job]
    assert listed(alice.get(JOB_LIST, {"id": job})) == [job]


def test_a_search_of_too_many_terms_is_a_bad_request(alice: Client, job_factory: Factory) -> None:
    # 1,000 words answered 500 ("Expression tree is too large"); 31 words that matched every
    # job and one that matched none took 2 s a request at 200,000 jobs (reviews).
    from queue_admin.listing import MAX_SEARCH_TERMS

    job_factory()
    assert alice.get(JOB_LIST, {"q": " ".join(["a"] * 1000)}).status_code == 400
    assert alice.get(DEAD_LIST, {"q": " ".join(["a"] * (MAX_SEARCH_TERMS + 1))}).status_code == 400
    assert alice.get(JOB_LIST, {"q": " ".join(["a"] * MAX_SEARCH_TERMS)}).status_code == 200
    phrase = '"' + " ".join(["a"] * 40) + '"'  # one term, as Django splits a search
    assert alice.get(JOB_LIST, {"q": phrase}).status_code == 200


def test_an_unknown_state_lists_nothing_without_a_scan(alice: Client, job_factory: Factory) -> None:
    # ?state=bogus matched no partial index: a scan of every job (1.8 s at 200,000; a review).
    job_factory()
    with CaptureQueriesContext(connection) as ctx:
        assert listed(alice.get(JOB_LIST, {"state": "bogus"})) == []
    assert not [q["sql"] for q in ctx.captured_queries if "bogus" in q["sql"]]
    assert len(listed(alice.get(JOB_LIST, {"state": "ready"}))) == 1


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        # Django's own user admin ran ?date_joined__regex= in Python under SQLite's lock
        # (4.7 s a request; a nested pattern past gunicorn's timeout) and answered 500 to
        # ?username__regex=( and to 2,500 search words (a review).
        ("/admin/auth/user/", {"date_joined__regex": "^([0-9 :.-]+)*!"}, 400),
        ("/admin/auth/user/", {"username__regex": "("}, 400),
        ("/admin/auth/user/", {"q": " ".join(["a"] * 2500)}, 400),
        ("/admin/auth/group/", {"name__regex": "("}, 400),
        ("/admin/queue_core/apikey/", {"q": " ".join(["a"] * 2500)}, 400),
        # The declared filters still filter.
        ("/admin/auth/user/", {"is_staff__exact": "1"}, 200),
        ("/admin/auth/user/", {"is_superuser__exact": "0", "q": "alice"}, 200),
    ],
)
def test_the_consoles_users_groups_and_keys_take_only_their_filters(
    path: str, params: dict[str, str], status: int
) -> None:
    User.objects.create_superuser("root", "r@example.com", "pw")
    client = Client()
    client.force_login(User.objects.get(username="root"))
    assert client.get(path, params).status_code == status


def test_search_by_job_id_idempotency_key_and_error(
    alice: Client, job_factory: Factory, dead_jobs: DeadJobs
) -> None:
    keyed = job_factory(idempotency_key="signup-42")["id"]
    [smtp] = dead_jobs(1, error="SMTP timeout talking to mx1")
    [other] = dead_jobs(1, error="KeyError: 'user'")
    assert listed(alice.get(JOB_LIST, {"q": keyed})) == [keyed]
    assert listed(alice.get(JOB_LIST, {"q": "signup-42"})) == [keyed]
    assert listed(alice.get(JOB_LIST, {"q": "smtp"})) == [smtp]
    assert listed(alice.get(DEAD_LIST, {"q": "keyerror"})) == [other]
    assert listed(alice.get(DEAD_LIST, {"q": keyed})) == []  # not dead


def test_dead_letter_list_shows_only_dead_jobs(
    alice: Client, job_factory: Factory, dead_jobs: DeadJobs
) -> None:
    job_factory()
    dead = dead_jobs(2, error="boom")
    response = alice.get(DEAD_LIST)
    assert listed(response) == dead[::-1]
    html = response.content.decode()
    assert "non-retryable" in html or "boom" in html
    assert "2 dead letters" in html


def test_detail_page_is_read_only_and_complete(
    alice: Client,
    service: QueueService,
    leased_job: Factory,
    console_clock: FakeClock,
) -> None:
    lease = leased_job(
        payload={"to": "<script>alert(1)</script>", "n": [1, 2]},
        max_retries=2,
        idempotency_key="k-1",
    )
    job_id, token = lease["job_id"], lease["lease_token"]
    service.fail(job_id, worker_id="w1", lease_token=token, error="Traceback <b>bad</b>")
    console_clock.advance(seconds=600)
    second = service.claim(["default"], worker_id="w2", lease_ms=60_000)[0]
    html = alice.get(job_url(job_id)).content.decode()
    # Payload pretty-printed and escaped.
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "<script>alert(1)" not in html
    assert "&quot;n&quot;: [\n    1,\n    2\n  ]" in html
    # Retry policy, attempts with errors, timestamps.
    assert "up to 2 retries" in html and '<div class="readonly">1/2</div>' in html
    assert "Traceback &lt;b&gt;bad&lt;/b&gt;" in html
    assert "attempt 1" in html and "attempt 2" in html and "w2" in html
    assert "k-1 (bound until" in html
    # The token: status and last four characters only, never in full.
    assert f"live, ends …{second['lease_token'][-4:]}, expires in 1m" in html
    assert second["lease_token"] not in html and token not in html
    assert f"…{token[-4:]}" in html  # the old attempt's token tail in the history
    # No form to save.
    assert 'name="_save"' not in html and 'type="submit" value="Save"' not in html


def test_detail_page_shows_meta_and_unique_while_active(
    alice: Client, service: QueueService, console_clock: FakeClock
) -> None:
    """The job page shows the job's meta (escaped) and a unique-while-active key: bound while
    the job runs, freed once it finished (issue 16, items 6-7)."""
    meta = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "x": "<b>"}
    job_id = service.submit("q", 1, idempotency_key="k-1", unique="active", meta=meta)["job"]["id"]
    html = alice.get(job_url(job_id)).content.decode()
    assert "&quot;traceparent&quot;: &quot;00-4bf92f3577b34da6a3ce929d0e0e4736" in html
    assert "&quot;x&quot;: &quot;&lt;b&gt;&quot;" in html and '"<b>"' not in html
    assert "k-1 (unique while active: bound until the job finishes, at most until" in html
    lease = service.claim(["q"], worker_id="w1")[0]
    service.ack(job_id, worker_id="w1", lease_token=lease["lease_token"])
    html = alice.get(job_url(job_id)).content.decode()
    assert "— (unique while active: freed when the job finished)" in html
    plain = service.submit("q", 2)["job"]["id"]
    html = alice.get(job_url(plain)).content.decode()
    assert "traceparent" not in html and "unique while active" not in html


def test_detail_page_shows_operator_events(
    alice: Client, service: QueueService, dead_jobs: DeadJobs
) -> None:
    [job_id] = dead_jobs(1)
    service.replay(job_id, actor="carol")
    html = alice.get(job_url(job_id)).content.decode()
    assert "replayed" in html and "carol" in html and "dead → ready" in html


def test_overview_counts_ages_leases_and_failures(
    alice: Client,
    service: QueueService,
    job_factory: Factory,
    leased_job: Factory,
    dead_jobs: DeadJobs,
    console_clock: FakeClock,
) -> None:
    leased_job(queue="email", worker_id="worker-a", lease_ms=300_000)
    job_factory(queue="email")
    console_clock.advance(seconds=30)
    job_factory(queue="email")
    leased_job(queue="billing", worker_id="worker-b", lease_ms=300_000)
    dead_jobs(2, queue="billing", error="card declined")
    console_clock.advance(seconds=15)
    response = alice.get(OVERVIEW)
    assert response.status_code == 200
    data = response.context["overview"]
    rows = {q.name: q for q in data.queues}
    assert rows["email"].counts["ready"] == 2 and rows["email"].counts["leased"] == 1
    assert rows["email"].oldest_ready_age_ms == 45_000
    assert rows["billing"].counts["dead"] == 2
    assert [(lease["queue"], lease["leased_by"], lease["jobs"]) for lease in data.leases] == [
        ("billing", "worker-b", 1),
        ("email", "worker-a", 1),
    ]
    assert len(data.failures) == 2 and data.failures[0]["error"] == "card declined"
    html = response.content.decode()
    assert "45s" in html and "worker-a: 1" in html and "card declined" in html
    assert f'href="{DEAD_LIST}?queue=billing">2</a>' in html


def test_overview_lists_the_live_servers(
    alice: Client, service: QueueService, console_clock: FakeClock
) -> None:
    service.register_server("srv_a", address="10.0.0.7:7400", host="relay-a", pid=41)
    service.register_server("srv_b", address="10.0.0.8:7400", host="relay-b", pid=42)
    console_clock.advance(ms=3 * 5_000 + 1)  # srv_a stops beating: no longer live
    service.register_server("srv_b", address="10.0.0.8:7400", host="relay-b", pid=42)
    html = alice.get(OVERVIEW).content.decode()
    assert "Live servers" in html and 'id="relay-servers"' in html
    assert "10.0.0.8:7400" in html and "relay-b" in html
    assert "10.0.0.7:7400" not in html


def test_overview_is_linked_from_the_admin_home(alice: Client) -> None:
    assert f'href="{OVERVIEW}"' in alice.get("/admin/").content.decode()


def test_the_standalone_service_brands_its_admin_as_the_console(alice: Client) -> None:
    # relayproject's RelayAdminSite; a project of one's own keeps Django's header and
    # "View site" (tests/integration/test_own_project.py).
    page = alice.get("/admin/").content.decode()
    assert '<a href="/admin/">Relay operator console</a>' in page
    assert "<title>Operator console | Relay</title>" in page
    assert "View site" not in page


def test_audit_log_keeps_purges(alice: Client, service: QueueService, dead_jobs: DeadJobs) -> None:
    [job_id] = dead_jobs(1)
    service.purge(job_id, actor="dave")
    assert not Job.objects.filter(id=job_id).exists()
    response = alice.get("/admin/queue_core/jobevent/", {"q": job_id})
    html = response.content.decode()
    assert "purged" in html and "dave" in html and "dead → ∅" in html
    assert len(response.context["cl"].result_list) == 1
    by_actor = alice.get("/admin/queue_core/jobevent/", {"q": "dave"})
    assert len(by_actor.context["cl"].result_list) == 1


def test_overview_needs_the_job_view_permission(transactional_db: None) -> None:
    client = Client()
    client.force_login(make_operator("dl-only", "view_deadletter"))
    assert client.get(OVERVIEW).status_code == 403
    assert f'href="{OVERVIEW}"' not in client.get("/admin/").content.decode()


def test_the_overview_pages_its_queues_and_totals_count_them_all(
    alice: Client, service: QueueService
) -> None:
    # Every queue on one page: 30,000 queues made a 20.6 MB page in 3.8 s (a review).
    from queue_admin.overview import QUEUES_PER_PAGE

    names = [f"q{i:04d}" for i in range(QUEUES_PER_PAGE + 30)]
    service.submit_batch([{"queue": name, "payload": 1} for name in names])
    service.pause("zz-paused")  # a controlled queue with no jobs, on the last page
    first = alice.get(OVERVIEW)
    data = first.context["overview"]
    assert [q.name for q in data.queues] == names[:QUEUES_PER_PAGE]
    assert data.total_jobs == len(names)  # every queue's jobs
    assert data.next_after == names[QUEUES_PER_PAGE - 1]
    html = first.content.decode()
    assert f'href="?after={data.next_after}">next queues</a>' in html
    second = alice.get(OVERVIEW, {"after": data.next_after}).context["overview"]
    assert [q.name for q in second.queues] == [*names[QUEUES_PER_PAGE:], "zz-paused"]
    assert second.queues[-1].controls["paused"] and second.next_after is None
    # The paused queue of the last page is named on the first too (a review: out of sight).
    assert 'paused: <a href="/admin/queue_core/job/?queue=zz-paused">zz-paused</a>' in html
    past = alice.get(OVERVIEW, {"after": "zzz"}).content.decode()
    assert "No queue after zzz" in past and "on this page" not in past
    assert alice.get(OVERVIEW, {"after": "not a queue name"}).status_code == 400


def test_a_jobs_page_shows_its_latest_history_only(
    alice: Client, service: QueueService, dead_job: Factory
) -> None:
    # Replays reset the retry budget, so a job's history has no bound: 3,000 rounds of fail
    # and replay made a 13.6 MB page (a review).
    from queue_admin.admin import HISTORY_ROWS

    job_id = dead_job(error="round 0", queue="h")["id"]
    for n in range(1, HISTORY_ROWS + 5):
        service.replay(job_id, actor="op")
        (lease,) = service.claim(["h"], worker_id="w1")
        service.fail(
            job_id,
            worker_id="w1",
            lease_token=lease["lease_token"],
            error=f"round {n}",
            retryable=False,
        )
    html = alice.get(job_url(job_id)).content.decode()
    assert f"round {HISTORY_ROWS + 4}</pre>" in html and "round 3</pre>" not in html
    assert html.count('<td class="relay-nowrap">attempt ') == HISTORY_ROWS
    assert "Only the latest" in html and f"jobevent/?q={job_id}" in html
    assert "attempts 1 to 5 are not" in html  # 105 attempts, the latest 100 shown


def test_the_overview_lists_a_bounded_number_of_lease_holders(
    alice: Client, service: QueueService, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A review: a worker key leasing each job under a new worker id (100,500 groups) made a
    # 37 MB overview that took Chromium 37 s to load, on every page.
    from queue_admin import overview

    monkeypatch.setattr(overview, "LEASE_GROUPS", 12)
    monkeypatch.setattr(overview, "WORKERS_PER_QUEUE", 3)
    for queue, holders in (("a", 4), ("b", 10), ("c", 2)):
        service.submit_batch([{"queue": queue, "payload": n} for n in range(holders)])
        for n in range(holders):
            assert service.claim([queue], worker_id=f"{queue}-worker-{n:02d}")
    data = alice.get(OVERVIEW).context["overview"]
    assert len(data.leases) == 12 and data.leases_cut  # 4 of a, then 8 of b's 10
    rows = {q.name: q for q in data.queues}
    assert [lease["leased_by"] for lease in rows["a"].leases] == [
        f"a-worker-0{n}" for n in range(3)
    ]
    assert (rows["a"].more_workers, rows["a"].workers_cut) == (1, False)
    assert (len(rows["b"].leases), rows["b"].more_workers, rows["b"].workers_cut) == (3, 5, True)
    assert (rows["c"].leases, rows["c"].workers_cut) == ([], True)  # read none of c's
    html = alice.get(OVERVIEW).content.decode()
    assert "a-worker-03" in html  # listed in the table, not in a's line
    assert "b-worker-08" not in html and "c-worker" not in html
    assert ">and 1 more</a>" in html and ">and 5+ more</a>" in html
    assert ">workers not listed</a>" in html and 'id="relay-leases-cut"' in html
    # Another page's queues: their leases, not the first page's.
    later = alice.get(OVERVIEW, {"after": "b"}).context["overview"]
    assert [lease["leased_by"] for lease in later.leases] == ["c-worker-00", "c-worker-01"]
    assert not later.leases_cut


def test_a_payload_that_indents_to_many_times_its_size_is_shown_compact(
    alice: Client, job_factory: Factory
) -> None:
    # A review: a 256 KiB list 63 levels deep indented to a 16.9 MB page (20 s in Chromium).
    deep: Any = [0] * 60_000
    for _ in range(62):
        deep = [deep]
    job = job_factory(queue="q", payload=deep)
    page = alice.get(job_url(job["id"]))
    assert page.status_code == 200
    assert len(page.content) < 600_000
    assert "[[[[[[[[" in page.content.decode()  # the stored, compact text
    small = job_factory(queue="q", payload={"user": {"id": 42, "tags": ["a", "b"]}})
    html = alice.get(job_url(small["id"])).content.decode()
    assert "  &quot;user&quot;: {\n    &quot;id&quot;: 42," in html  # indented as before
