"""Pause, resume and limits from the console's queue overview: permissions, confirmation
pages, the service as the only writer, and the audit log."""

from __future__ import annotations

import pytest
from django.test import Client

from queue_core.models import JobEvent
from queue_core.service import QueueService
from tests.admin.conftest import OVERVIEW, make_operator, messages_of

pytestmark = pytest.mark.django_db(transaction=True)

CONTROL = "/admin/queue_core/job/overview/queue/{queue}/{action}/"


def login(*codenames: str, name: str = "carol") -> Client:
    client = Client()
    client.force_login(make_operator(name, "view_job", "view_jobevent", *codenames))
    return client


def test_pause_then_resume_from_the_overview_with_confirmation(service: QueueService) -> None:
    service.submit("mail", {"n": 1})
    carol = login("pause_queue")
    page = carol.get(OVERVIEW)
    assert CONTROL.format(queue="mail", action="pause") in page.content.decode()
    confirm = carol.get(CONTROL.format(queue="mail", action="pause"))
    assert confirm.status_code == 200
    assert "Pausing stops every server" in confirm.content.decode()
    assert service.queue_controls("mail")["queues"]["mail"]["paused"] is False  # not yet
    done = carol.post(CONTROL.format(queue="mail", action="pause"), {"post": "yes"}, follow=True)
    assert messages_of(done) == ["Queue mail paused: nothing new is leased."]
    assert service.claim(["mail"], worker_id="w") == []
    overview = carol.get(OVERVIEW).content.decode()
    assert 'class="relay-paused"' in overview
    assert CONTROL.format(queue="mail", action="resume") in overview
    carol.post(CONTROL.format(queue="mail", action="resume"), {"post": "yes"})
    assert len(service.claim(["mail"], worker_id="w")) == 1
    log = JobEvent.objects.filter(job_id="queue:mail").order_by("id")
    assert [(e.event, e.actor) for e in log] == [("paused", "carol"), ("resumed", "carol")]
    audit = carol.get("/admin/queue_core/jobevent/?q=queue:mail").content.decode()
    assert "queue=mail paused=True" in audit


def test_limits_page_sets_and_clears_the_cap_and_rate(service: QueueService) -> None:
    dave = login("limit_queue", name="dave")
    url = CONTROL.format(queue="bulk", action="limits")
    page = dave.get(url)
    assert page.status_code == 200 and 'name="max_leased"' in page.content.decode()
    bad = dave.post(url, {"post": "yes", "max_leased": "0"})
    assert bad.status_code == 200 and "errorlist" in bad.content.decode()  # shown again
    done = dave.post(
        url, {"post": "yes", "max_leased": "4", "rate_per_s": "2.5", "burst": "3"}, follow=True
    )
    assert messages_of(done) == ["Queue bulk: at most 4 leased, 2.5 started/s (burst 3)."]
    controls = service.queue_controls("bulk")["queues"]["bulk"]
    assert (controls["max_leased"], controls["rate_per_s"], controls["burst"]) == (4, 2.5, 3)
    assert "cap 4" in dave.get(OVERVIEW).content.decode()  # listed though it has no jobs
    dave.post(url, {"post": "yes", "max_leased": "", "rate_per_s": "", "burst": ""})
    assert service.queue_controls()["queues"] == {}
    assert JobEvent.objects.filter(job_id="queue:bulk", actor="dave").count() == 2


def test_controls_need_their_permissions() -> None:
    viewer = login(name="erin")
    assert "relay-pause" not in viewer.get(OVERVIEW).content.decode()
    for action in ("pause", "resume", "limits"):
        assert viewer.get(CONTROL.format(queue="q", action=action)).status_code == 403
        assert (
            viewer.post(CONTROL.format(queue="q", action=action), {"post": "yes"}).status_code
            == 403
        )
    pauser = login("pause_queue", name="frank")
    assert pauser.get(CONTROL.format(queue="q", action="limits")).status_code == 403
    assert pauser.get(CONTROL.format(queue="q", action="explode")).status_code == 404
    assert JobEvent.objects.count() == 0
