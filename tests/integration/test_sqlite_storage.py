"""The SQLite driver against its storage, in process (docs/failure-model.md, items 6-8).

* ``stats`` reads the per-(queue, state) rows ``relay_job_count``'s triggers keep, and one index
  seek per queue and class for the oldest READY job: its plans never scan ``relay_job``, and its
  counts equal a ``GROUP BY`` after every kind of transition.
* A full database (SQLite's own ``SQLITE_FULL``, made to appear with ``PRAGMA
  max_page_count``) is ``STORAGE_FULL``: nothing is written, a group commit's other calls go
  through, one log line stands for many faults, and writes resume once there is room.
* A database file removed or replaced under an open connection refuses writes
  (``STORAGE_LOST``) instead of acknowledging them into a file nobody will read again.
* The write-ahead log: a checkpoint that a reader holds up waits a bounded time, says so and
  backs off; once the reader is gone the log restarts and is cut back to the limit.

Real failures on a real file system (a full tmpfs, a read-only mount, unlinked files) through
real server processes are in ``tests/crash/test_storage_faults.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections
from django.db.backends.signals import connection_created
from django.test.utils import override_settings

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.errors import JobNotFound, StorageFull, StorageLost
from queue_core.models import ApiKey, Job
from queue_core.service import QueueService
from queue_core.storage.base import load_queries
from queue_core.storage.sqlite import driver as sqlite_driver
from queue_core.storage.sqlite.driver import SqliteDriver
from relay_bench import floor
from tests.groupcommit import run_group
from tests.relay_db import put_a_copy_in_place

pytestmark = pytest.mark.django_db(transaction=True)

QUERIES = load_queries("queue_core.storage.sqlite")
STATE_QUERIES = ("counts", "counts_live", "oldest_ready")


def raw_counts() -> dict[tuple[str, str], int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT queue, state, COUNT(*) FROM relay_job GROUP BY queue, state")
        return {(q, s): n for q, s, n in cursor.fetchall()}


def stats_counts(service: QueueService) -> dict[tuple[str, str], int]:
    stats = service.stats()
    return {
        (q, state): n
        for q, row in stats["queues"].items()
        for state, n in row.items()
        if state != "oldest_ready_age_ms" and n
    }


@contextlib.contextmanager
def page_limit(extra_pages: int) -> Iterator[None]:
    """Cap this connection's database at its current size plus ``extra_pages`` pages (SQLite
    then fails writes with SQLITE_FULL, "database or disk is full"), then lift the cap. The
    file is vacuumed first: free pages left by earlier tests would take the writes."""
    with connection.cursor() as cursor:
        cursor.execute("VACUUM")
        cursor.execute("PRAGMA page_count")
        pages = int(cursor.fetchone()[0])
        cursor.execute(f"PRAGMA max_page_count={pages + extra_pages}")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA max_page_count=4294967294")


# ------------------------------------------------------------------ item 6: stats


def test_stats_statements_never_scan_the_job_table() -> None:
    with connection.cursor() as cursor:
        for name in STATE_QUERIES:
            cursor.execute("EXPLAIN QUERY PLAN " + QUERIES[name])
            plan = [str(row[3]) for row in cursor.fetchall()]
            # relay_job is read by seeks only ("SEARCH"; "j" is its alias in oldest_ready).
            assert not [step for step in plan if re.match(r"SCAN (relay_job|j)( |$)", step)], (
                name,
                plan,
            )
            assert [step for step in plan if "relay_job_count" in step or "SEARCH" in step]


def test_the_claims_queue_control_reads_are_seeks() -> None:
    # What a claim adds when queues are paused, capped or rate-limited: one seek per named
    # queue on relay_queue's primary key, and one relay_job_count row per capped queue.
    params = {"queues": '["a", "b"]', "queue": "a"}
    with connection.cursor() as cursor:
        for name, table in (
            ("queue_controls_for_claim", "relay_queue"),
            ("queue_has_controls", "relay_queue"),
            ("queue_leased", ""),
        ):
            cursor.execute("EXPLAIN QUERY PLAN " + QUERIES[name], params)
            plan = [str(row[3]) for row in cursor.fetchall()]
            assert not [step for step in plan if re.match(r"SCAN (relay_\w+)( |$)", step)], plan
            assert [step for step in plan if step.startswith("SEARCH")], plan
            assert table in " ".join(plan)


def test_the_one_statement_claim_is_index_seeks() -> None:
    # claim_one: the head of each base class on relay_job_ready, the job by primary key and
    # the queue's controls by relay_queue's: seeks whatever the backlog, never a scan.
    params = {"queue": "q", "token": "t", "worker_id": "w", "now_ms": 1, "expires_ms": 2}
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + QUERIES["claim_one"], params)
        plan = [str(row[3]) for row in cursor.fetchall()]
    assert not [step for step in plan if re.match(r"SCAN (relay_\w+)( |$)", step)], plan
    seeks = [step for step in plan if step.startswith("SEARCH")]
    assert sum("relay_job_ready (queue=? AND priority=?)" in step for step in seeks) == 4, plan
    assert [step for step in seeks if "relay_queue" in step], plan


def test_reads_of_a_jobs_attempts_use_the_unique_index() -> None:
    # Migration 0014 dropped the attempt's own job_id index: every statement that finds
    # attempts by job seeks relay_attempt_unique (job_id, attempt) instead, never a scan.
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM sqlite_master WHERE tbl_name = 'relay_attempt'")
        names = {row[0] for row in cursor.fetchall()}
        assert "relay_attempt_job_id_785bc873" not in names
        for name in ("attempts_of", "end_attempt", "delete_attempts", "recover_attempts"):
            params = dict.fromkeys(re.findall(r"%\((\w+)\)s", QUERIES[name]), 1)
            cursor.execute("EXPLAIN QUERY PLAN " + QUERIES[name], params)
            plan = [str(row[3]) for row in cursor.fetchall() if "relay_attempt" in str(row[3])]
            assert plan, name
            assert all(
                step.startswith("SEARCH") and "sqlite_autoindex_relay_attempt_1" in step
                for step in plan
            ), (name, plan)


def test_counts_follow_every_transition(service: QueueService, clock: FakeClock) -> None:
    rnd = random.Random(7)
    for i in range(60):
        service.submit(f"q{i % 3}", {"i": i}, max_retries=1, delay_ms=rnd.choice([0, 0, 500]))
    # Batches mixing queues, delays and idempotency keys, some of them already bound or
    # repeated within the batch (deduplicated: nothing inserted, nothing counted).
    for b in range(4):
        service.submit_batch(
            [
                {
                    "queue": f"q{i % 3}",
                    "payload": {"key": i % 4} if i % 5 == 0 else {"b": b, "i": i},
                    "max_retries": 1,
                    "delay_ms": rnd.choice([0, 0, 500]),
                    **({"idempotency_key": f"k{i % 4}"} if i % 5 == 0 else {}),
                }
                for i in range(25)
            ]
        )
        service.submit("q1", {"key": 2}, idempotency_key="k2")
    assert stats_counts(service) == raw_counts()
    # Inserts rolled back, by a whole transaction and by a savepoint inside one that commits.
    now = clock.now_ms()
    # insert_job's parameters as the bench's schema floor binds them (every column).
    rows = [
        floor.job_row(i, now, "{}", queue="q0") | {"id": f"job_rolledback{i:012d}"}
        for i in range(3)
    ]

    def insert_and_roll_back() -> None:
        with service.driver.write() as tx:
            tx.many("insert_job", rows)
            raise RuntimeError("roll back")

    with pytest.raises(RuntimeError):
        insert_and_roll_back()  # a whole transaction
    with service.driver.write() as outer:
        with pytest.raises(RuntimeError):
            insert_and_roll_back()  # a savepoint
        outer.run("insert_job", rows[0])
    assert stats_counts(service) == raw_counts()
    clock.advance(ms=600)
    service.sweep()
    for _ in range(3):
        for lease in service.claim(["q0", "q1", "q2"], worker_id="w", max_jobs=10, lease_ms=1000):
            verb = rnd.choice(["ack", "fail", "release", "keep"])
            guard = {"worker_id": "w", "lease_token": lease["lease_token"]}
            if verb == "ack":
                service.ack(lease["job_id"], **guard)
            elif verb == "fail":
                service.fail(lease["job_id"], error="e", retryable=rnd.random() < 0.5, **guard)
            elif verb == "release":
                service.release(lease["job_id"], **guard)
        assert stats_counts(service) == raw_counts()
    clock.advance(ms=5_000)  # the kept leases expire; retries come due
    service.sweep()
    assert stats_counts(service) == raw_counts()
    dead = service.dead_list()["jobs"]
    assert dead, "some jobs should have been dead-lettered"
    service.replay(dead[0]["id"])
    for job in service.dead_list()["jobs"]:
        service.purge(job["id"])
    assert stats_counts(service) == raw_counts()
    oldest = {q: row["oldest_ready_age_ms"] for q, row in service.stats()["queues"].items()}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT queue, MIN(ready_since_ms) FROM relay_job WHERE state = 'ready' GROUP BY queue"
        )
        now = service.stats()["server_time_ms"]
        expected = {q: now - since for q, since in cursor.fetchall()}
    assert {q: age for q, age in oldest.items() if age is not None} == expected
    assert expected, "some queues should have READY jobs"


# ------------------------------------------------------------------ item 7: disk full


def test_a_full_database_is_storage_full_and_writes_resume_with_room(
    service: QueueService, caplog: pytest.LogCaptureFixture
) -> None:
    kept = service.submit("q", {"n": 0})["job"]["id"]
    big = {"blob": "x" * 200_000}  # needs ~50 new pages
    with caplog.at_level(logging.INFO, logger="relay.store"), page_limit(2):
        for _ in range(5):
            with pytest.raises(StorageFull) as err:
                service.submit("q", big)
            assert err.value.code == "STORAGE_FULL" and err.value.http_status == 507
        # In a group commit, the one-row INSERT that does not fit keeps no statement journal,
        # so SQLite rolls the whole transaction back: every call of it is STORAGE_FULL, the
        # one before included, and nothing of it is stored.
        results: list[str] = []

        def group_commit() -> None:
            with service.transaction():
                for payload in ({"small": 1}, big, {"small": 2}):
                    try:
                        with service.transaction():
                            results.append(service.submit("q", payload)["job"]["id"])
                    except StorageFull:
                        results.append("full")

        with pytest.raises(StorageFull):
            group_commit()
        assert results[1:] == ["full", "full"]
        with pytest.raises(JobNotFound):
            service.get(results[0], history=False)
        # A commit that changed nothing (an idle sweep) appends nothing to the log, so it
        # proves nothing about the disk: no recovery is logged for it.
        service.sweep()
        assert not [r for r in caplog.records if getattr(r, "event", None) == "storage_recovered"]
    faults = [r for r in caplog.records if getattr(r, "event", None) == "storage_fault"]
    assert len(faults) == 1 and faults[0].code == "STORAGE_FULL"  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if r.exc_info]
    recovered = service.submit("q", big)["job"]["id"]  # room again: no restart needed
    ids = {kept, recovered}
    assert {service.get(j, history=False)["id"] for j in ids} == ids
    assert service.stats()["totals"]["ready"] == 2
    assert [r for r in caplog.records if getattr(r, "event", None) == "storage_recovered"]


def test_after_sqlite_rolled_the_whole_transaction_back_nothing_in_the_batch_commits(
    service: QueueService,
) -> None:
    """SQLite may answer SQLITE_FULL or SQLITE_IOERR by rolling back the whole transaction,
    not just the statement. That is what happens here, forced: the later calls of the batch
    must not run outside it (a SAVEPOINT in autocommit opens a transaction of its own, and
    its RELEASE would commit it), and the batch must fail as a whole."""
    service.submit("q", {"n": 0})

    def full_and_rolled_back() -> None:
        connection.connection.execute("ROLLBACK")  # what SQLite did
        exc = sqlite3.OperationalError("database or disk is full")
        exc.sqlite_errorcode = sqlite3.SQLITE_FULL
        raise exc

    outcomes: list[str] = []

    def batch() -> None:  # as the server's group commit runs its calls
        with service.transaction():
            for step in ("submit", "fault", "submit"):
                try:
                    with service.transaction():
                        if step == "fault":
                            full_and_rolled_back()
                        service.submit("q", {"step": step})
                    outcomes.append("ok")
                except StorageFull:
                    outcomes.append("STORAGE_FULL")

    with pytest.raises(StorageFull):
        batch()
    assert outcomes == ["ok", "STORAGE_FULL", "STORAGE_FULL"]
    assert service.stats()["totals"]["ready"] == 1  # nothing of the batch committed
    assert service.submit("q", {"n": 1})["job"]["state"] == "ready"  # the connection is fine


# ------------------------------------------------------------------ item 8: file identity


def test_writes_to_a_removed_or_replaced_file_are_refused(
    service: QueueService, tmp_path: Path
) -> None:
    service.submit("q", {"n": 1})
    path = str(connection.settings_dict["NAME"])
    moved = tmp_path / "moved.db"
    os.link(path, moved)  # keep the inode: the test database is put back afterwards
    try:
        os.unlink(path)
        with pytest.raises(StorageLost):
            service.submit("q", {"n": 2})
        open(path, "wb").close()  # another, empty file at the path: still not ours
        with pytest.raises(StorageLost):
            service.submit("q", {"n": 3})
    finally:
        os.replace(moved, path)
    assert service.submit("q", {"n": 4})["job"]["state"] == "ready"  # the same file again
    assert service.stats()["totals"]["ready"] == 2


def test_a_server_opens_no_connection_onto_a_file_put_in_place_of_the_one_it_serves(
    service: QueueService, tmp_path: Path
) -> None:
    """A new connection would read the new file and take its ``-shm``, which is the served
    file's: in one process SQLite's locks do not see each other, so it truncates that
    ``-shm`` under the mapping of the server's open connections (a thread reading through
    one then dies of SIGBUS, seen once in tests/crash/test_storage_faults.py) and later
    writes the served file's log into the new one (``ServedFile``)."""
    driver = service.driver
    assert isinstance(driver, SqliteDriver)
    handle = driver.server_lock()
    path = str(connection.settings_dict["NAME"])
    moved, copy = tmp_path / "moved.db", tmp_path / "copy.db"
    opened: list[str] = []

    def count(sender: Any, connection: Any, **kwargs: Any) -> None:
        opened.append(connection.alias)

    try:
        service.submit("q", {"n": 1})  # this thread's connection maps the -shm
        shm = os.stat(f"{path}-shm").st_size
        os.link(path, moved)  # keep the inode: the test database is put back afterwards
        put_a_copy_in_place(path, str(copy))
        refused: list[BaseException] = []

        def touch() -> None:  # the ORM, not the driver: an API key's touch after a hello
            ApiKey.objects.filter(prefix="nope").update(last_used_at_ms=1)

        def on_a_new_thread() -> None:  # a reader thread's first read, say
            for first in (service.stats, driver.changes().token, service.sweep, touch):
                try:
                    first()
                except BaseException as exc:
                    refused.append(exc)
            connections.close_all()

        connection_created.connect(count)
        try:
            reader = threading.Thread(target=on_a_new_thread)
            reader.start()
            reader.join()
        finally:
            connection_created.disconnect(count)
        assert [type(e) for e in refused] == [StorageLost] * 4
        assert opened == []
        assert os.stat(f"{path}-shm").st_size == shm
    finally:
        os.replace(moved, path)
        handle.close()
        # What server_lock installed for this process: later tests are no server.
        connections.settings[driver.alias]["OPTIONS"].pop("factory", None)
        sqlite_driver._SERVED.pop(path, None)
    assert service.submit("q", {"n": 2})["job"]["state"] == "ready"


# ------------------------------------------------------------------ item 6: checkpoints


@pytest.fixture
def small_wal(transactional_db: None) -> Iterator[int]:
    """A 256 KiB log limit, on connections opened after it is set."""
    limit = 256 * 1024
    with override_settings(RELAY_SQLITE_WAL_LIMIT_BYTES=limit, RELAY_SQLITE_CHECKPOINT_WAIT_MS=50):
        connections.close_all()
        yield limit
    connections.close_all()


def wal_bytes() -> int:
    return os.path.getsize(f"{connection.settings_dict['NAME']}-wal")


def test_a_checkpoint_held_up_by_a_reader_backs_off_then_restarts_the_log(
    small_wal: int, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    service = QueueService(driver=SqliteDriver(), clock=clock)  # its own pacing state
    service.submit("q", {"n": 0})
    reader = sqlite3.connect(str(connection.settings_dict["NAME"]), isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM relay_job").fetchone()  # pins this snapshot
        for i in range(20):
            service.submit_batch([{"queue": "q", "payload": {"i": i, "t": "x" * 500}}] * 50)
        assert wal_bytes() > 2 * small_wal
        with caplog.at_level(logging.INFO, logger="relay.store"):
            started = time.monotonic()
            service.sweep()  # the reaper's pass: maintain() after its commit
            waited = time.monotonic() - started
        blocked = [
            r for r in caplog.records if getattr(r, "event", None) == "wal_checkpoint_blocked"
        ]
        assert len(blocked) == 1 and waited < 2.0
        caplog.clear()
        clock.advance(ms=500)  # within the 1 s back-off: not tried again
        with caplog.at_level(logging.INFO, logger="relay.store"):
            service.sweep()
        assert not [r for r in caplog.records if "wal_checkpoint" in r.getMessage()]
        reader.execute("COMMIT")
        # The reader is gone: the next pass restarts the log (SQLite's own checkpoint after
        # a commit only copies it), and the next commit cuts the file back to the limit.
        clock.advance(ms=1_000)
        service.sweep()
        service.submit("q", {"n": 1})  # the first commit after the restart cuts the file
        assert wal_bytes() <= small_wal
    finally:
        reader.close()


def test_every_relay_connection_bounds_its_log(small_wal: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_size_limit")
        assert cursor.fetchone()[0] == small_wal


def test_maintain_looks_at_most_every_quarter_second(
    small_wal: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    service = QueueService(driver=SqliteDriver(), clock=clock)
    looks: list[str] = []
    real_stat = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).endswith("-wal"):
            looks.append(str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(sqlite_driver.os, "stat", counting_stat)
    for _ in range(10):
        service.sweep()
    clock.advance(seconds=sqlite_driver.MAINTAIN_EVERY_S)
    service.sweep()
    assert len(looks) == 2


def _group(service: QueueService, fns: list[Any]) -> tuple[list[tuple[bool, Any]], int]:
    """Run ``fns`` as one group commit (flat first, as the server does); return each call's
    ``(ok, result or exception)`` and the commits it made."""
    outcomes, group = run_group(service, fns)
    return outcomes, group.commits


def test_a_call_set_apart_in_a_flat_group_commit_leaves_no_after_commit_callback() -> None:
    # Flat (no SAVEPOINT per call), a call that fails before changing a row is forgiven:
    # what it registered to run after the COMMIT goes with it, as a savepoint's rollback
    # would take it; the other call's callback runs once the batch commits.
    service = QueueService()
    ran: list[str] = []

    def refused() -> None:
        service.driver.after_commit(lambda: ran.append("refused"))
        raise errors.InvalidArgument("no")

    def accepted() -> Any:
        job = service.submit("g", 1)
        service.driver.after_commit(lambda: ran.append("accepted"))
        return job

    outcomes, commits = _group(service, [refused, accepted])
    assert isinstance(outcomes[0][1], errors.InvalidArgument)
    assert outcomes[1][1]["job"]["state"] == "ready"
    assert (commits, ran) == (1, ["accepted"])


def _payloads(queue: str) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT payload FROM relay_job WHERE queue = %s ORDER BY id", [queue])
        return [row[0] for row in cursor.fetchall()]


def test_a_full_disk_caught_inside_a_call_leaves_nothing_of_its_flat_batch() -> None:
    # Found by a hostile run: ack_batch catches each ack's error (here SQLITE_FULL storing a
    # result that does not fit, after which SQLite has rolled the whole transaction back);
    # the next call of the flat batch must not write outside the transaction (each statement
    # would commit on its own while its request is answered STORAGE_FULL).
    service = QueueService()
    service.submit("q", {"n": 0})
    lease = service.claim(["q"], worker_id="w")[0]
    ack = {"job_id": lease["job_id"], "worker_id": "w", "lease_token": lease["lease_token"]}
    with page_limit(1):
        outcomes, _ = _group(
            service,
            [
                lambda: service.ack_batch([{**ack, "result": {"blob": "x" * 60_000}}]),
                lambda: service.submit("other", {"after": "abort"}),
            ],
        )
    assert [(ok, type(value)) for ok, value in outcomes] == [(False, StorageFull)] * 2
    assert _payloads("other") == []
    assert Job.objects.get(pk=lease["job_id"]).state == "leased"


def test_a_rollback_caught_once_inside_a_call_commits_the_batch_once() -> None:
    # The same fault, once (a disk that frees up): the flat round stops at the next write and
    # the batch runs again with savepoints; the submit answered ok is in the file once.
    service = QueueService()
    service.submit("w", {"n": 0})
    lease = service.claim(["w"], worker_id="w")[0]
    service.submit("w", {"n": 1})
    fired: list[int] = []

    def catches_a_full_disk() -> str:
        with service.transaction():
            try:
                with service.transaction():  # a savepoint
                    if not fired:
                        fired.append(1)
                        connection.connection.execute("ROLLBACK")  # what SQLite does
                        exc = sqlite3.OperationalError("database or disk is full")
                        exc.sqlite_errorcode = sqlite3.SQLITE_FULL  # type: ignore[attr-defined]
                        raise exc
            except StorageFull:
                return "caught"
        return "fine"

    outcomes, _ = _group(
        service,
        [
            catches_a_full_disk,
            lambda: service.submit("other", {"after": "once"}),
            lambda: service.ack(
                lease["job_id"],
                worker_id="w",
                lease_token=lease["lease_token"],
                lease_next={"queues": ["w"]},
            ),
        ],
    )
    assert [ok for ok, _ in outcomes] == [True, True, True]
    assert outcomes[0][1] == "fine"  # the second round, with savepoints
    assert _payloads("other") == ['{"after":"once"}']
    assert raw_counts()[("other", "ready")] == 1
    with connection.cursor() as cursor:  # the count table counted it once too
        cursor.execute("SELECT n FROM relay_job_count WHERE queue = 'other' AND state = 'ready'")
        assert cursor.fetchone()[0] == 1
