"""Task results on the console's job page: status, return value, errors with tracebacks and
attempts, read-only, under the console's permissions (view_job / view_deadletter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from queue_admin import display
from queue_core.service import QueueService
from tests.admin.conftest import job_url, make_operator

pytestmark = pytest.mark.django_db(transaction=True)

Factory = Callable[..., dict[str, Any]]
DEAD_URL = "/admin/queue_core/deadletter/{}/change/"
TASK = {"task": "tests.tasks_app.tasks.add", "args": [2, 3], "kwargs": {}, "backend": "default"}


def test_a_succeeded_task_shows_its_status_attempts_and_return_value(
    alice: Client, service: QueueService, leased_job: Factory
) -> None:
    lease = leased_job(payload=TASK)
    service.ack(
        lease["job_id"],
        worker_id="w1",
        lease_token=lease["lease_token"],
        result={"return_value": {"html": "<b>5</b>"}},
    )
    html = alice.get(job_url(lease["job_id"])).content.decode()
    assert "SUCCESSFUL (succeeded) (1 attempt, 0 failed)" in html
    assert "&quot;return_value&quot;: {\n    &quot;html&quot;: &quot;&lt;b&gt;5&lt;/b&gt;" in html
    assert "<b>5</b>" not in html  # escaped
    assert "No errors reported with a traceback." in html
    assert 'name="_save"' not in html  # read-only


def test_errors_show_class_and_traceback_escaped(
    alice: Client, service: QueueService, leased_job: Factory
) -> None:
    lease = leased_job(payload={"plain": True}, max_retries=0)
    service.fail(
        lease["job_id"],
        worker_id="w1",
        lease_token=lease["lease_token"],
        error="boom",
        exception_class="app.errors.Boom",
        traceback='Traceback:\n  File "<x>"\napp.errors.Boom: <i>boom</i>\n',
    )
    html = alice.get(job_url(lease["job_id"])).content.decode()
    assert "dead (1 attempt, 1 failed)" in html  # not a Django task: the state itself
    assert "app.errors.Boom" in html
    assert "app.errors.Boom: &lt;i&gt;boom&lt;/i&gt;" in html and "<i>boom</i>" not in html
    assert "Return value" in html


def test_the_result_is_shown_on_the_dead_letter_page_too_and_needs_the_view_permission(
    service: QueueService, leased_job: Factory
) -> None:
    lease = leased_job(payload=TASK, max_retries=0)
    service.fail(
        lease["job_id"],
        worker_id="w1",
        lease_token=lease["lease_token"],
        error="x",
        exception_class="builtins.ValueError",
        traceback="ValueError: x\n",
    )
    dead_only = Client()
    dead_only.force_login(make_operator("dl-only", "view_deadletter"))
    assert dead_only.get(job_url(lease["job_id"])).status_code == 403
    page = dead_only.get(DEAD_URL.format(lease["job_id"]))
    assert page.status_code == 200
    html = page.content.decode()
    assert "FAILED (dead)" in html and "builtins.ValueError" in html
    nobody = Client()
    nobody.force_login(make_operator("nobody"))
    assert nobody.get(job_url(lease["job_id"])).status_code == 403


def test_result_errors_display_is_defensive() -> None:
    assert display.result_errors(None) == []
    assert display.result_errors("not json") == []
    assert display.result_errors('{"a": 1}') == []
    rows = display.result_errors(
        '[{"attempt": 1, "exception_class": "A", "traceback": "t1"},'
        ' {"attempt": 2, "exception_class": "B", "traceback": "t2"}, 3]'
    )
    assert [r["attempt"] for r in rows] == [2, 1]
    assert display.result_status("leased", True) == "RUNNING (leased)"
    assert display.result_status("leased", False) == "leased"
