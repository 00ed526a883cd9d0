"""The console's maintenance page against a real ``relay server`` on the same database: prune
by age (permission, confirmation, the audit log) and back up while the server serves."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.test.utils import override_settings

from queue_core.models import Job, JobEvent
from tests.admin.conftest import make_operator, messages_of
from tests.integration.test_relay_server_command import Conn
from tests.procs import Spawner

pytestmark = pytest.mark.django_db(transaction=True)

MAINTENANCE = "/admin/queue_core/job/maintenance/"


def finish(conn: Conn, n: int, *, fail: bool = False) -> list[str]:
    """Submit, lease and ack (or fail for good) ``n`` jobs through the server."""
    ids = []
    for i in range(n):
        assert conn("submit", queue="m", payload={"i": i}, max_retries=0)["ok"]
        job = conn("lease", queues=["m"], worker_id="w")["result"]["jobs"][0]
        ids_args = {"job_id": job["job_id"], "worker_id": "w", "lease_token": job["lease_token"]}
        reply = conn("fail", error="x", **ids_args) if fail else conn("ack", **ids_args)
        assert reply["ok"], reply
        ids.append(job["job_id"])
    return ids


def test_prune_confirms_the_count_then_deletes_and_records_who(
    spawn: Spawner, alice: Client
) -> None:
    _, port = spawn.server()
    conn = Conn(port)
    try:
        done, dead = finish(conn, 4), finish(conn, 2, fail=True)
        form = alice.get(MAINTENANCE)
        assert form.status_code == 200 and b'id="relay-prune"' in form.content
        asked = alice.post(
            MAINTENANCE, {"action": "prune", "older_than": "1ms", "state": "succeeded"}
        )
        assert asked.status_code == 200
        assert b'<strong id="relay-will">4</strong>' in asked.content
        assert Job.objects.filter(id__in=done).count() == 4  # nothing yet
        page = alice.post(
            MAINTENANCE,
            {"action": "prune", "older_than": "1ms", "state": "succeeded", "post": "yes"},
            follow=True,
        )
        assert messages_of(page) == ["Pruned 4 succeeded, 0 dead, 0 cancelled jobs."]
        assert not Job.objects.filter(id__in=done).exists()
        assert Job.objects.filter(id__in=dead).count() == 2  # not asked for
        (event,) = JobEvent.objects.filter(event="pruned")
        assert (event.job_id, event.actor, event.detail) == (
            "",
            "alice",
            "succeeded=4 dead=0 cancelled=0",
        )
        audit = alice.get("/admin/queue_core/jobevent/")
        assert audit.status_code == 200 and b"succeeded=4 dead=0 cancelled=0" in audit.content
        assert finish(conn, 1)  # the server went on serving
    finally:
        conn.close()


@pytest.mark.parametrize("older_than", ["", "0", "soon", "7"])
def test_prune_refuses_what_is_not_an_age(alice: Client, older_than: str) -> None:
    page = alice.post(MAINTENANCE, {"action": "prune", "older_than": older_than}, follow=True)
    assert page.status_code == 200
    (message,) = messages_of(page)
    assert message.startswith("older than:")
    assert not JobEvent.objects.exists()


def test_prune_needs_the_purge_permission(transactional_db: None) -> None:
    viewer = Client()
    viewer.force_login(make_operator("carol", "view_job"))
    page = viewer.get(MAINTENANCE)
    assert page.status_code == 200 and b'id="relay-prune"' not in page.content
    refused = viewer.post(MAINTENANCE, {"action": "prune", "older_than": "1d", "post": "yes"})
    assert refused.status_code == 403


def test_backup_now_copies_the_live_database_for_a_superuser(
    spawn: Spawner, alice: Client, tmp_path: Path
) -> None:
    _, port = spawn.server()
    conn = Conn(port)
    root = Client()
    root.force_login(User.objects.create_superuser("root"))
    try:
        ids = finish(conn, 3)
        assert alice.post(MAINTENANCE, {"action": "backup"}).status_code == 403  # not superuser
        unset = root.post(MAINTENANCE, {"action": "backup"}, follow=True)
        assert messages_of(unset) == ["Set RELAY_BACKUP_DIR to back up from the console."]
        with override_settings(RELAY_BACKUP_DIR=str(tmp_path)):
            assert b'id="relay-backup"' in root.get(MAINTENANCE).content
            page = root.post(MAINTENANCE, {"action": "backup"}, follow=True)
        (message,) = messages_of(page)
        assert message.startswith(f"Backed up to {tmp_path}/relay-"), message
        (copy,) = tmp_path.glob("relay-*.db")
        with contextlib.closing(sqlite3.connect(copy)) as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            got = {r[0] for r in db.execute("SELECT id FROM relay_job WHERE state='succeeded'")}
        assert got == set(ids)
        (event,) = JobEvent.objects.filter(event="backed_up")
        assert event.actor == "root" and event.detail.startswith(f"path={copy} bytes=")
        assert finish(conn, 1)  # the server went on serving
    finally:
        conn.close()
