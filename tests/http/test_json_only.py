"""Hardening item 3 on the HTTP side: request bodies must be application/json (else 415), so a
page of another origin cannot submit without a CORS preflight."""

from __future__ import annotations

import orjson
import pytest

from queue_core.models import Job
from tests.http.conftest import Api, Gunicorn, problem

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = "/api/v1/queues/email/jobs"
BODY = orjson.dumps({"payload": {"n": 1}})


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
     "multipart/form-data; boundary=x", "application/jsonp", ""],
)  # fmt: skip
def test_a_body_that_is_not_declared_json_gets_415_and_creates_nothing(
    api: Api, content_type: str
) -> None:
    response = api.client.generic("POST", JOBS, BODY, content_type=content_type)
    body = problem(response, 415, "UNSUPPORTED_MEDIA_TYPE")
    assert "application/json" in body["detail"]
    assert Job.objects.count() == 0
    lease = api.client.generic("POST", "/api/v1/leases", b'{"queues": ["email"]}', content_type="")
    problem(lease, 415, "UNSUPPORTED_MEDIA_TYPE")


def test_json_with_parameters_is_accepted(api: Api) -> None:
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        response = api.client.generic("POST", JOBS, BODY, content_type=content_type)
        assert response.status_code == 201, response.content
    assert Job.objects.count() == 3


def test_a_bodyless_post_passes_unless_a_page_of_another_origin_sends_it(api: Api) -> None:
    path = "/api/v1/dead/job_01J00000000000000000000000/replay"
    problem(api.post(path), 404, "NOT_FOUND")  # curl -X POST: no body, no Content-Type
    same = api.post(path, headers={"Origin": "http://testserver"})
    problem(same, 404, "NOT_FOUND")
    other = api.post(path, headers={"Origin": "http://evil.example"})
    problem(other, 415, "UNSUPPORTED_MEDIA_TYPE")
    typed = api.client.generic("POST", path, b"", CONTENT_TYPE="text/plain")  # fetch(body: "")
    problem(typed, 415, "UNSUPPORTED_MEDIA_TYPE")


def test_gunicorn_refuses_a_cross_origin_text_plain_submit(gunicorn: Gunicorn) -> None:
    """What a page of another origin can send without a preflight, to the real server."""
    headers = {"Content-Type": "text/plain;charset=UTF-8", "Origin": "http://evil.example"}
    status, _, raw = gunicorn.request("POST", JOBS, BODY, headers=headers)
    assert status == 415, raw
    assert orjson.loads(raw)["code"] == "UNSUPPORTED_MEDIA_TYPE"
    status, _, raw = gunicorn.request("POST", JOBS, BODY)  # application/json
    assert status == 201, raw
    assert Job.objects.count() == 1
