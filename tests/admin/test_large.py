"""The console on a large table: 200,000 jobs, 100,000 of them DEAD.

Rows are inserted with one raw ``executemany`` per table (a test-only shortcut, seconds
instead of minutes through the service) and shared by the module's tests, which only read
(``django_db`` without ``transaction``: each test's own rows, like the admin user, roll back).

Each page must render with a fixed number of queries (no query per row), without counting
the whole table, and with every query on ``relay_job`` / ``relay_attempt`` served by an index
walk that stops early or by a partial index (checked with ``EXPLAIN QUERY PLAN``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from queue_core.states import JobState
from queue_core.storage.base import load_queries
from tests.admin.conftest import DEAD_LIST, JOB_LIST, OVERVIEW, job_url

pytestmark = pytest.mark.django_db

JOBS = 200_000
NOW_MS = 1_767_225_600_000
QUEUES = ("email", "billing", "thumbnails", "reports")
LEASED = 40
WORKERS = ("worker-a", "worker-b", "worker-c")

JOB_COLUMNS = (
    "id, queue, state, priority, payload, idempotency_key, idempotency_expires_at_ms, attempt, "
    "failures, max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter, created_at_ms, "
    "available_at_ms, ready_since_ms, lease_token, leased_by, leased_at_ms, "
    "lease_expires_at_ms, finished_at_ms, updated_at_ms, last_error, dead_reason"
)


def job_id(i: int) -> str:
    """Ids sort like ULIDs: by creation."""
    return f"job_{i:026d}"


def state_of(i: int) -> str:
    """Half DEAD; the rest mostly SUCCEEDED and READY, some PENDING, RETRYING and LEASED."""
    if i % 2 == 0:
        return JobState.DEAD
    if i < 2 * LEASED:
        return JobState.LEASED
    return {1: "succeeded", 3: "succeeded", 5: "succeeded", 7: "ready", 9: "pending"}[i % 10]


def job_row(i: int) -> tuple[Any, ...]:
    state = state_of(i)
    created = NOW_MS - (JOBS - i) * 10
    finished = created + 5 if state in ("dead", "succeeded") else None
    leased = state == "leased"
    return (
        job_id(i),
        QUEUES[i % len(QUEUES)],
        state,
        i % 4,
        f'{{"n":{i}}}',
        f"key-{i}" if i % 3 == 0 else None,
        NOW_MS + 86_400_000 if i % 3 == 0 else None,
        1 if state in ("dead", "succeeded", "leased") else 0,
        1 if state == "dead" else 0,
        3,
        "exponential",
        1000,
        300_000,
        1,
        created,
        NOW_MS + 60_000 if state == "pending" else None,
        created if state == "ready" else None,
        f"secret-token-{i:08d}" if leased else None,
        WORKERS[i % len(WORKERS)] if leased else None,
        NOW_MS - 1000 if leased else None,
        NOW_MS + 30_000 if leased else None,
        finished,
        finished or created,
        f"RuntimeError: boom {i}" if state == "dead" else None,
        "non-retryable error" if state == "dead" else None,
    )


@pytest.fixture(scope="module")
def big_table(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """Insert 200,000 jobs and 100,000 failed attempts once for the module."""
    jobs = [job_row(i) for i in range(JOBS)]
    attempts = [
        (row[0], 1, "worker-a", f"t{i}", row[14], row[21], "failed", row[23])
        for i, row in enumerate(jobs)
        if row[2] == "dead"
    ]
    marks = ", ".join(["%s"] * 25)
    with django_db_blocker.unblock():
        with connection.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.executemany(f"INSERT INTO relay_job ({JOB_COLUMNS}) VALUES ({marks})", jobs)
            cursor.executemany(
                "INSERT INTO relay_attempt (job_id, attempt, worker_id, lease_token, "
                "started_at_ms, ended_at_ms, outcome, error) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                attempts,
            )
            for name in ("recount_clear", "recount"):  # rows inserted by hand (migration 0008)
                cursor.execute(load_queries("queue_core.storage.sqlite")[name])
            cursor.execute("COMMIT")
        yield
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM relay_attempt")
            cursor.execute("DELETE FROM relay_job")


@pytest.fixture
def staff(big_table: None, admin_user: User) -> Client:
    client = Client()
    client.force_login(admin_user)
    return client


def render(client: Client, url: str, **params: str) -> tuple[Any, list[str], float]:
    """GET a page; return the response, its SQL and the seconds it took."""
    with CaptureQueriesContext(connection) as ctx:
        start = time.perf_counter()
        response = client.get(url, params)
        took = time.perf_counter() - start
    assert response.status_code == 200, response.content[:500]
    return response, [q["sql"] for q in ctx.captured_queries], took


def job_queries(sql: list[str]) -> list[str]:
    return [q for q in sql if "relay_job" in q or "relay_attempt" in q]


def plan(query: str) -> str:
    """SQLite's plan for a captured (already interpolated) query."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + query)
        return " | ".join(str(row[-1]) for row in cursor.fetchall())


def assert_no_full_count(sql: list[str]) -> None:
    """No COUNT over the whole job table: every count is bounded by a LIMIT or a filter."""
    for query in sql:
        if "COUNT(" not in query.upper() or "relay_job" not in query:
            continue
        assert "LIMIT" in query.upper() or "WHERE" in query.upper(), query
        assert not re.fullmatch(
            r'SELECT COUNT\(\*\) AS "__count" FROM "relay_job"', query.strip()
        ), query


PARTIAL = ("relay_job_dead", "relay_job_leased", "relay_job_ready", "relay_attempt_failed")


def assert_indexed(query: str, *, whole_index: str | None = None) -> str:
    """Check that a query cannot cost a walk over every job (or attempt).

    SEARCH steps (index seeks) are fine. A SCAN step is fine when the query stops early
    (LIMIT) or scans a partial index (one state's rows). ``whole_index`` names the one
    covering index a query may read whole (the per-state counts of the overview).
    """
    p = plan(query)
    early = "LIMIT" in query.upper()
    for step in p.split(" | "):
        if not step.startswith("SCAN relay_") or step == "SCAN relay_job_count":
            continue  # relay_job_count: one row per queue and state (migration 0007)
        if whole_index is not None and step.endswith(f"USING COVERING INDEX {whole_index}"):
            continue
        assert early or any(i in step for i in PARTIAL), (query, p)
    return p


def test_the_fixture_has_the_promised_shape(big_table: None) -> None:
    from queue_core.models import Job

    assert Job.objects.count() == JOBS
    assert Job.objects.filter(state="dead").count() == JOBS // 2


@pytest.mark.parametrize(
    ("url", "params", "queries"),
    [
        # session, user, capped count, one page, queue names
        (JOB_LIST, {}, 5),
        (JOB_LIST, {"queue": "email"}, 5),
        (JOB_LIST, {"state": "leased"}, 5),
        (JOB_LIST, {"queue": "billing", "state": "ready"}, 5),
        (JOB_LIST, {"priority__exact": "3"}, 5),
        (JOB_LIST, {"q": job_id(4242)}, 5),
        (DEAD_LIST, {}, 5),
        (DEAD_LIST, {"queue": "thumbnails"}, 5),
        (DEAD_LIST, {"p": "50"}, 5),
    ],
)
def test_changelists_use_fixed_queries_and_no_full_counts(
    staff: Client, url: str, params: dict[str, str], queries: int
) -> None:
    response, sql, took = render(staff, url, **params)
    assert len(sql) == queries, "\n".join(sql)
    assert_no_full_count(sql)
    for query in job_queries(sql):
        p = assert_indexed(query)
        page = 'ORDER BY "relay_job"."id" DESC' in query and "COUNT" not in query.upper()
        if page and params.get("state") != "leased":
            # The page itself: an index walk in id order that stops after a page, never a
            # sort of every matching job (the queue filter sorted 50,000 rows without
            # relay_job_queue_id, which SQLite lost from migration 0011 to 0015). Leased
            # jobs are sorted: as many as the workers' slots, read from their partial index.
            assert "TEMP B-TREE" not in p, (query, p)
    cl = response.context["cl"]
    if not params or params == {"p": "50"}:
        assert cl.paginator.capped and cl.result_count == 10_000
        assert "more than 10,000" in response.content.decode()
        assert len(cl.result_list) == 100
    print(f"{url} {params}: {len(sql)} queries, {took * 1000:.0f} ms")


def test_queue_names_are_cached_between_renders(staff: Client) -> None:
    _, first, _ = render(staff, JOB_LIST)
    _, second, _ = render(staff, JOB_LIST)
    assert len(second) == len(first) - 1
    assert not any("DISTINCT" in q for q in second)


def test_the_page_of_rows_is_one_index_walk(staff: Client) -> None:
    _, sql, _ = render(staff, DEAD_LIST)
    page = next(q for q in sql if 'ORDER BY "relay_job"."id" DESC' in q and "COUNT" not in q)
    p = assert_indexed(page)
    assert "relay_job_dead" in p and "TEMP B-TREE" not in p, p
    assert '"payload"' not in page.split("FROM")[0]  # payloads stay on disk


def test_detail_page_is_a_fixed_handful_of_queries(staff: Client) -> None:
    _, sql, took = render(staff, job_url(job_id(4242)))
    # session, user, the job, its stored result, its attempts, its events, the content type
    assert len(sql) <= 7, "\n".join(sql)
    print(f"detail: {len(sql)} queries, {took * 1000:.0f} ms")


def test_overview_reads_through_indexes(staff: Client) -> None:
    response, sql, took = render(staff, OVERVIEW)
    # session, user, counts, oldest ready, live servers, queue controls, leases, recent
    # failures, and every queue's controls again (paused queues on other pages are named)
    assert len(sql) == 9, "\n".join(sql)
    # The counts by queue and state are the rows relay_job_count keeps: no O(jobs) read left.
    plans = [assert_indexed(q) for q in job_queries(sql)]
    joined = " || ".join(plans)
    assert "relay_job_count" in joined  # counts
    assert "SCAN relay_job USING COVERING INDEX relay_job_queue_state" not in joined
    assert "relay_job_ready" in joined  # oldest ready
    # Leases now, of the page's queues: a seek per queue into its leased rows.
    assert "SEARCH relay_job USING INDEX relay_job_queue_state (queue=? AND state=?)" in joined
    assert "relay_attempt_failed" in joined  # recent failures
    data = response.context["overview"]
    assert data.total_jobs == JOBS and data.totals["dead"] == JOBS // 2
    assert sum(lease["jobs"] for lease in data.leases) == LEASED
    assert {lease["leased_by"] for lease in data.leases} == set(WORKERS)
    assert len(data.failures) == 25
    assert data.failures[0]["job_id"] == job_id(JOBS - 2)  # the newest failure first
    print(f"overview: {len(sql)} queries, {took * 1000:.0f} ms")


def test_confirming_replay_of_every_dead_letter_counts_them_exactly(staff: Client) -> None:
    with CaptureQueriesContext(connection) as ctx:
        start = time.perf_counter()
        page = staff.post(
            DEAD_LIST,
            {
                "action": "replay_selected",
                "index": "0",
                "select_across": "1",
                "_selected_action": [job_id(0)],
            },
        )
        took = time.perf_counter() - start
    assert page.context["will"] == JOBS // 2
    assert "100,000" in page.content.decode()
    assert len(page.context["sample"]) == 20
    assert_no_full_count([q["sql"] for q in ctx.captured_queries])
    print(f"confirm replay of 100,000: {len(ctx.captured_queries)} queries, {took * 1000:.0f} ms")
