"""Cancel from the console: the job page's button and the list action go through a
confirmation page, then ``QueueService.cancel``; the audit log names the operator; the
``cancel_job`` permission gates it; finished jobs are left alone and said so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from queue_core.clock import FakeClock
from queue_core.models import Job, JobEvent
from queue_core.service import QueueService
from tests.admin.conftest import JOB_LIST, OPERATOR_PERMS, job_url, make_operator, messages_of
from tests.admin.test_actions import ask, confirm, states

pytestmark = pytest.mark.django_db(transaction=True)

Factory = Callable[..., dict[str, Any]]
AUDIT_LOG = "/admin/queue_core/jobevent/"


@pytest.fixture
def carol(transactional_db: None) -> Client:
    """An operator who may cancel jobs."""
    client = Client()
    client.force_login(make_operator("carol", *OPERATOR_PERMS, "cancel_job"))
    return client


def test_cancel_from_the_job_page_confirms_then_cancels_and_is_audited(
    carol: Client, job_factory: Factory, console_clock: FakeClock
) -> None:
    job_id = job_factory(queue="email")["id"]
    detail = carol.get(job_url(job_id)).content.decode()
    assert "Cancel…" in detail
    page = ask(carol, JOB_LIST, "cancel_selected", [job_id], _from_detail="1")
    assert page.status_code == 200
    assert page.templates[0].name == "queue_admin/confirm_action.html"
    assert page.context["will"] == 1
    html = page.content.decode()
    assert "is cancelled at once and never runs" in html
    assert "Yes, cancel 1 job" in html
    assert states([job_id]) == {job_id: "ready"}  # nothing changed before confirming
    console_clock.advance(seconds=2)
    done = confirm(carol, JOB_LIST, page)
    assert done.redirect_chain[-1][0] == job_url(job_id)
    assert messages_of(done) == ["Cancelled 1 job."]
    assert states([job_id]) == {job_id: "cancelled"}
    event = JobEvent.objects.get(job_id=job_id)
    assert (event.event, event.actor, event.from_state, event.to_state, event.at_ms) == (
        "cancelled",
        "carol",
        "ready",
        "cancelled",
        console_clock.now_ms(),
    )
    # The job page now offers replay (a cancelled job is replayable), not cancel.
    after = done.content.decode()
    assert "Cancel…" not in after and "Replay…" in after
    # The audit log lists it, and filters by it.
    audit = carol.get(AUDIT_LOG, {"event": "cancelled"}).content.decode()
    assert job_id in audit and "carol" in audit


def test_cancel_of_a_running_job_marks_it_and_says_the_worker_stops_it(
    carol: Client, service: QueueService, leased_job: Factory
) -> None:
    lease = leased_job(queue="email")
    job_id = lease["job_id"]
    page = ask(carol, JOB_LIST, "cancel_selected", [job_id])
    assert page.context["will"] == 1
    done = confirm(carol, JOB_LIST, page)
    [message] = messages_of(done)
    assert message.startswith("Asked the workers of 1 job to stop")
    job = Job.objects.get(id=job_id)
    assert job.state == "leased" and job.cancel_requested_at_ms is not None
    assert JobEvent.objects.get(job_id=job_id).event == "cancel_requested"
    detail = carol.get(job_url(job_id)).content.decode()
    assert "the worker stops it at its next renew" in detail
    assert "Cancel…" not in detail  # asked once already
    renewed = service.renew(job_id, worker_id="w1", lease_token=lease["lease_token"])
    assert renewed["stop"] == "cancelled"


def test_finished_jobs_are_left_alone_and_named(
    carol: Client, service: QueueService, job_factory: Factory, leased_job: Factory
) -> None:
    waiting = job_factory(queue="email")["id"]
    lease = leased_job(queue="done")
    service.ack(lease["job_id"], worker_id="w1", lease_token=lease["lease_token"])
    done_id = lease["job_id"]
    page = ask(carol, JOB_LIST, "cancel_selected", [waiting, done_id])
    assert page.context["will"] == 1
    assert page.context["others"] == [("succeeded", 1)]
    # The job finishes between the page and the confirmation: refused, and said so.
    service.cancel(waiting)
    done = confirm(carol, JOB_LIST, page)
    assert messages_of(done) == [
        "Nothing was cancelled.",
        f"2 jobs are finished already and are left alone: {waiting} (it is cancelled); "
        f"{done_id} (it is succeeded).",
    ]
    assert states([waiting, done_id]) == {waiting: "cancelled", done_id: "succeeded"}


def test_cancel_needs_the_cancel_permission(alice: Client, job_factory: Factory) -> None:
    job_id = job_factory()["id"]
    assert "Cancel…" not in alice.get(job_url(job_id)).content.decode()
    assert "cancel_selected" not in alice.get(JOB_LIST).content.decode()
    page = alice.post(
        JOB_LIST,
        {
            "action": "cancel_selected",
            "select_across": "0",
            "_selected_action": [job_id],
            "post": "yes",
        },
    )
    # Not among this operator's actions: Django refuses the choice and shows the list again.
    assert page.status_code == 302 and page["Location"] == JOB_LIST
    assert Job.objects.get(id=job_id).state == "ready"
    assert not JobEvent.objects.filter(job_id=job_id).exists()
