"""The HTTP API answers storage faults with the codes TCP uses (docs/failure-model.md, item 7).

A database with no room left (SQLite's own ``SQLITE_FULL``, made to appear with ``PRAGMA
max_page_count`` on the connection the test client's requests use) is a 507 ``STORAGE_FULL``
problem with ``Retry-After``, not a 500 ``INTERNAL``; with room again the same request is
accepted. Real full disks and real server processes: ``tests/crash/test_storage_faults.py``.
"""

from __future__ import annotations

from django.db import connection

from tests.http.conftest import Api, problem


def test_a_full_database_is_a_507_storage_full_problem_then_accepted(api: Api) -> None:
    assert api.post("/api/v1/queues/q/jobs", {"payload": {"n": 0}}).status_code == 201
    with connection.cursor() as cursor:
        cursor.execute("VACUUM")  # free pages left by earlier tests would take the write
        cursor.execute("PRAGMA page_count")
        pages = int(cursor.fetchone()[0])
        cursor.execute(f"PRAGMA max_page_count={pages + 1}")
    big = {"payload": {"blob": "x" * 100_000}}
    try:
        body = problem(api.post("/api/v1/queues/q/jobs", big), 507, "STORAGE_FULL")
        assert body["retryable"] is True
        response = api.post("/api/v1/queues/q/jobs", big)
        assert response["Retry-After"] == "1"
    finally:
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA max_page_count=4294967294")
    assert api.post("/api/v1/queues/q/jobs", big).status_code == 201
    assert api.get("/api/v1/stats").json()["totals"]["ready"] == 2
