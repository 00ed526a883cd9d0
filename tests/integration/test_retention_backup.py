"""Retention and online backup end to end: ``relay prune`` and ``relay backup`` as commands,
and a real ``relay server`` pruning by itself while a worker goes on, and being backed up
while a producer writes."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import orjson
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test.utils import override_settings

from queue_core.clock import FakeClock, SystemClock
from queue_core.service import QueueService
from tests.integration.test_relay_server_command import Conn
from tests.procs import Spawner, spawner

DEADLINE_S = 30.0


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Spawner]:
    with spawner(str(tmp_path / "relay.db")) as s:
        yield s
    for proc in s.procs:
        proc.wait_exit()
        if proc.popen.stderr is not None:
            proc.popen.stderr.close()


def finish(service: QueueService, n: int, *, fail: bool = False) -> list[str]:
    ids = []
    for i in range(n):
        service.submit("q", {"i": i})
        lease = service.claim(["q"], worker_id="w", lease_ms=30_000)[0]
        args = {"worker_id": "w", "lease_token": lease["lease_token"]}
        if fail:
            service.fail(lease["job_id"], error="x", retryable=False, **args)
        else:
            service.ack(lease["job_id"], **args)
        ids.append(lease["job_id"])
    return ids


# ------------------------------------------------------------------ relay prune


@pytest.mark.django_db(transaction=True)
def test_prune_command_counts_then_deletes_old_finished_jobs() -> None:
    # Jobs finished on a fake clock a day and more before the real one: old enough.
    past = FakeClock(start_ms=SystemClock().now_ms() - 3 * 86_400_000)
    old = QueueService(clock=past)
    done, dead = finish(old, 3), finish(old, 2, fail=True)
    fresh = finish(QueueService(), 1)
    out = StringIO()
    call_command("relay_prune", "--older-than", "1d", "--dry-run", "--json", stdout=out)
    assert orjson.loads(out.getvalue()) == {
        "succeeded": 3,
        "dead": 2,
        "cancelled": 0,
        "dry_run": True,
    }
    out = StringIO()
    call_command("relay_prune", "--older-than", "1d", "--state", "dead", stdout=out)
    assert out.getvalue().strip() == (
        "pruned 2 jobs (0 succeeded, 2 dead, 0 cancelled) finished more than 1d ago"
    )
    out = StringIO()
    call_command("relay_prune", "--older-than", "1d", "--batch", "2", "--json", stdout=out)
    assert orjson.loads(out.getvalue())["succeeded"] == 3
    service = QueueService()
    assert [service.get(j)["id"] for j in fresh] == fresh
    for job_id in done + dead:
        with pytest.raises(Exception, match=r"NOT_FOUND|no job"):
            service.get(job_id)


@pytest.mark.parametrize("value", ["7", "0", "soon", "-1d"])
def test_prune_command_refuses_bad_durations(value: str) -> None:
    with pytest.raises(CommandError, match="INVALID_ARGUMENT: --older-than"):
        call_command("relay_prune", f"--older-than={value}")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_prune_command_refuses_an_age_past_a_century(dry_run: list[str]) -> None:
    with pytest.raises(CommandError, match=r"INVALID_ARGUMENT: prune: .* age must be"):
        call_command("relay_prune", "--older-than=99999999999999d", *dry_run)


# ------------------------------------------------------------------ relay backup


@pytest.mark.django_db(transaction=True)
def test_backup_command_copies_checks_and_refuses_to_overwrite(tmp_path: Path) -> None:
    ids = finish(QueueService(), 3)
    copy = tmp_path / "copy.db"
    out = StringIO()
    call_command("relay_backup", str(copy), "--json", stdout=out)
    result = orjson.loads(out.getvalue())
    assert result["path"] == str(copy) and result["bytes"] == copy.stat().st_size
    with contextlib.closing(sqlite3.connect(copy)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        got = {r[0] for r in db.execute("SELECT id FROM relay_job WHERE state = 'succeeded'")}
    assert got == set(ids)
    assert not list(tmp_path.glob(".copy.db.partial*"))
    assert copy.stat().st_mode & 0o777 == 0o600  # a review: 0644, every job readable by all
    with pytest.raises(CommandError, match=r"INVALID_ARGUMENT: .* exists"):
        call_command("relay_backup", str(copy))
    copy.write_bytes(b"old")
    call_command("relay_backup", str(copy), "--force", stdout=StringIO())
    assert copy.read_bytes()[:16] == b"SQLite format 3\x00"
    assert copy.stat().st_mode & 0o777 == 0o600


@pytest.mark.django_db(transaction=True, databases=["default", "postgresql"])
def test_backup_command_on_postgresql_points_to_pg_dump(tmp_path: Path) -> None:
    with (
        override_settings(RELAY_DATABASE="postgresql"),
        pytest.raises(CommandError, match="pg_dump") as caught,
    ):
        call_command("relay_backup", str(tmp_path / "x.db"))
    assert caught.value.returncode == 1
    assert not (tmp_path / "x.db").exists()


# ------------------------------------------------------------------ a real server


def count(db: Path, sql: str, *params: Any) -> int:
    with contextlib.closing(sqlite3.connect(db, timeout=10)) as conn:
        return int(conn.execute(sql, params).fetchone()[0])


def lease_ack(conn: Conn, n: int) -> list[str]:
    ids = []
    for i in range(n):
        assert conn("submit", queue="q", payload={"i": i})["ok"]
        job = conn("lease", queues=["q"], worker_id="w")["result"]["jobs"][0]
        acked = conn("ack", job_id=job["job_id"], worker_id="w", lease_token=job["lease_token"])
        assert acked["ok"], acked
        ids.append(job["job_id"])
    return ids


def test_server_prunes_finished_jobs_while_a_worker_goes_on(procs: Spawner, tmp_path: Path) -> None:
    db = tmp_path / "relay.db"
    _, port = procs.server(
        "--db", str(db), RELAY_RETENTION_SUCCEEDED="1s", RELAY_REAPER_INTERVAL_MS="100"
    )
    conn = Conn(port)
    try:
        first = lease_ack(conn, 20)
        marks = ",".join("?" * len(first))
        deadline = time.monotonic() + DEADLINE_S
        acked = 0
        while count(db, f"SELECT COUNT(*) FROM relay_job WHERE id IN ({marks})", *first):
            assert time.monotonic() < deadline, "the server did not prune finished jobs"
            acked += len(lease_ack(conn, 5))  # the worker goes on meanwhile
        assert acked > 0
        assert not count(
            db, f"SELECT COUNT(*) FROM relay_attempt WHERE job_id IN ({marks})", *first
        )
        assert lease_ack(conn, 1)  # still serving
    finally:
        conn.close()


def test_backup_while_the_server_takes_submits(procs: Spawner, tmp_path: Path) -> None:
    db = tmp_path / "relay.db"
    _, port = procs.server("--db", str(db))
    submitted: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        conn = Conn(port)
        try:
            for i in range(100_000):  # bounded; stopped long before
                if stop.is_set():
                    return
                reply = conn("submit", queue="p", payload={"i": i, "pad": "x" * 200})
                submitted.append(reply["result"]["job"]["id"])
        finally:
            conn.close()

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while len(submitted) < 200:
            assert time.monotonic() < deadline and producer.is_alive()
            time.sleep(0.01)  # polling the producer's progress, with a deadline
        before = len(submitted)
        copy = tmp_path / "backup.db"
        out = procs.run("relay_backup", str(copy), RELAY_DB=str(db))
        after = len(submitted)
        assert out.returncode == 0, out.stderr
        while len(submitted) < after + 50:  # the server went on taking submits
            assert time.monotonic() < deadline and producer.is_alive()
            time.sleep(0.01)
    finally:
        stop.set()
        producer.join(timeout=DEADLINE_S)
    assert after > before, "no submit committed while the backup ran"
    with contextlib.closing(sqlite3.connect(copy)) as backup:
        assert backup.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        ids = [r[0] for r in backup.execute("SELECT id FROM relay_job ORDER BY id")]
        counted = backup.execute("SELECT n FROM relay_job_count WHERE queue = 'p'").fetchone()
    # One instant's snapshot: every submit answered before the copy began, a prefix of the rest.
    assert before <= len(ids) <= after
    assert ids == submitted[: len(ids)]
    assert counted[0] == len(ids)


def test_prune_op_over_tcp_deletes_in_bounded_batches_and_says_when_more_remain(
    procs: Spawner, tmp_path: Path
) -> None:
    db = tmp_path / "relay.db"
    _, port = procs.server("--db", str(db), RELAY_RETENTION_SUCCEEDED="0")
    conn = Conn(port)
    try:
        done = lease_ack(conn, 5)
        # "older than 1 ms" must hold for the last ack too: wait for the clock to pass it
        # (on a quiet machine both prunes can run within 1 ms of that ack).
        newest = count(db, "SELECT MAX(finished_at_ms) FROM relay_job")
        while time.time() * 1000 <= newest + 2:
            time.sleep(0.001)
        args = {"older_than_ms": 1, "state": "succeeded", "limit": 3}
        first = conn("prune", **args)["result"]
        assert first == {"deleted": {"succeeded": 3, "dead": 0, "cancelled": 0}, "more": True}
        second = conn("prune", **args)["result"]
        assert second == {"deleted": {"succeeded": 2, "dead": 0, "cancelled": 0}, "more": False}
        marks = ",".join("?" * len(done))
        assert not count(db, f"SELECT COUNT(*) FROM relay_job WHERE id IN ({marks})", *done)
        events = count(db, "SELECT COUNT(*) FROM relay_event WHERE event = 'pruned'")
        assert events == 2  # one per operator call, each with who asked
        bad = conn("prune", older_than_ms=0)
        assert (bad["ok"], bad["error"]["code"]) == (False, "INVALID_ARGUMENT")
        bad = conn("prune", older_than_ms=5, state="leased")
        assert (bad["ok"], bad["error"]["code"]) == (False, "INVALID_ARGUMENT")
        bad = conn("prune", older_than_ms=2**64 - 1)  # now - age would leave SQLite's int64
        assert (bad["ok"], bad["error"]["code"]) == (False, "INVALID_ARGUMENT")
        assert lease_ack(conn, 1)  # still serving
    finally:
        conn.close()


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm", "-journal"])
def test_backup_refuses_the_live_database_and_its_files_even_with_force(
    procs: Spawner, tmp_path: Path, suffix: str
) -> None:
    db = tmp_path / "live.db"
    _, port = procs.server("--db", str(db))
    conn = Conn(port)
    try:
        done = lease_ack(conn, 5)
        before = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
        out = procs.run("relay_backup", f"{db}{suffix}", "--force", RELAY_DB=str(db))
        assert out.returncode == 1, out.stdout
        assert "INVALID_ARGUMENT" in out.stderr and "live database" in out.stderr
        assert {p.name for p in tmp_path.iterdir()} == set(before)  # nothing written
        assert lease_ack(conn, 1)  # the server still serves, its jobs intact
        marks = ",".join("?" * len(done))
        assert count(db, f"SELECT COUNT(*) FROM relay_job WHERE id IN ({marks})", *done) == 5
    finally:
        conn.close()


def test_backup_of_a_database_that_does_not_exist_is_refused(
    procs: Spawner, tmp_path: Path
) -> None:
    missing, copy = tmp_path / "typo.db", tmp_path / "copy.db"
    out = procs.run("relay_backup", str(copy), RELAY_DB=str(missing))
    assert out.returncode == 1, out.stdout
    assert "INVALID_ARGUMENT: there is no database at" in out.stderr
    assert not missing.exists() and not copy.exists()


def test_backup_into_a_folder_that_does_not_exist_names_the_folder(
    procs: Spawner, tmp_path: Path
) -> None:
    # A fresh clone's review: sqlite3's "unable to open database file" was reported as
    # STORAGE_IO, blaming the database, when the copy's folder was missing.
    db = tmp_path / "relay.db"
    procs.server("--db", str(db))  # a live server, as in the README's example
    out = procs.run("relay_backup", str(tmp_path / "nowhere" / "copy.db"), RELAY_DB=str(db))
    assert out.returncode == 1, out.stdout
    assert f"INVALID_ARGUMENT: no folder {tmp_path / 'nowhere'}" in out.stderr, out.stderr
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize(
    "command", [["relay_prune", "--older-than", "1d", "--dry-run"], ["relay_keys", "list"]]
)
def test_local_commands_on_a_database_that_is_not_there_or_not_migrated_say_so(
    procs: Spawner, tmp_path: Path, command: list[str]
) -> None:
    # A hostile review: `relay --db typo.db prune` made an empty file and printed a traceback
    # ending in "no such table: relay_job"; `relay keys list` too.
    missing = tmp_path / "typo.db"
    out = procs.run(*command, RELAY_DB=str(missing))
    assert out.returncode == 1, out.stdout
    assert out.stderr.strip() == f"INVALID_ARGUMENT: there is no database at {missing}"
    assert not missing.exists()
    empty = tmp_path / "empty.db"
    empty.touch()
    out = procs.run(*command, RELAY_DB=str(empty))
    assert out.returncode == 1, out.stdout
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"UNAVAILABLE: database {empty} has ") and "relay migrate" in line
