"""Results over HTTP: ``POST /jobs/{id}/ack`` with a ``result``, ``POST /jobs/{id}/fail`` with
``exception_class``/``traceback``, and ``GET /jobs/{id}/result`` (or by queue and key), with
the same codes as over TCP."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from tests.http.conftest import Api, problem

pytestmark = pytest.mark.django_db(transaction=True)


def submit(api: Api, **options: Any) -> dict[str, Any]:
    response = api.post("/api/v1/queues/email/jobs", {"payload": {"n": 1}, **options})
    assert response.status_code == 201, response.content
    job: dict[str, Any] = response.json()["job"]
    return job


def lease(api: Api) -> dict[str, Any]:
    response = api.post("/api/v1/leases", {"queues": ["email"], "worker_id": "w1"})
    (held,) = response.json()["jobs"]
    return dict(held)


def test_ack_with_a_result_then_read_it(api: Api) -> None:
    job = submit(api, idempotency_key="order-9")
    held = lease(api)
    ids = {"worker_id": "w1", "lease_token": held["lease_token"]}
    path = f"/api/v1/jobs/{job['id']}"
    with override_settings(RELAY_MAX_RESULT_BYTES=20):
        problem(api.post(f"{path}/ack", {**ids, "result": "x" * 19}), 413, "FRAME_TOO_LARGE")
    assert api.post(f"{path}/ack", {**ids, "result": {"sent": 3}}).json()["state"] == "succeeded"
    body = api.get(f"{path}/result").json()
    assert body["return_value"] == {"sent": 3}
    assert body["errors"] == []
    assert body["job"]["id"] == job["id"] and body["job"]["state"] == "succeeded"
    assert [a["outcome"] for a in body["job"]["history"]] == ["succeeded"]
    by_key = api.get("/api/v1/queues/email/result?idempotency_key=order-9").json()
    assert by_key == body
    problem(api.get("/api/v1/queues/email/result?idempotency_key=nope"), 404, "NOT_FOUND")
    problem(api.get("/api/v1/jobs/job_nope/result"), 404, "NOT_FOUND")


def test_fail_with_an_exception_class_and_traceback(api: Api) -> None:
    job = submit(api, max_retries=0)
    held = lease(api)
    ids = {"worker_id": "w1", "lease_token": held["lease_token"]}
    failed = api.post(
        f"/api/v1/jobs/{job['id']}/fail",
        {**ids, "error": "boom", "exception_class": "app.Boom", "traceback": "app.Boom: boom\n"},
    )
    assert failed.json()["state"] == "dead"
    body = api.get(f"/api/v1/jobs/{job['id']}/result").json()
    assert body["return_value"] is None
    assert body["errors"] == [
        {"attempt": 1, "exception_class": "app.Boom", "traceback": "app.Boom: boom\n"}
    ]


def test_result_paths_are_in_the_openapi_schema(api: Api) -> None:
    paths = api.get("/api/v1/openapi.json").json()["paths"]
    assert "get" in paths["/api/v1/jobs/{job_id}/result"]
    assert "get" in paths["/api/v1/queues/{queue}/result"]
