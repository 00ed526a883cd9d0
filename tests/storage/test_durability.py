"""Leases without their own fsync (docs/design-decisions.md), on both drivers.

A transaction of lease bookkeeping only (a claim, a sweep) commits without waiting for the
disk: SQLite at ``synchronous=NORMAL``, PostgreSQL with ``synchronous_commit = off``, each
seen from inside the transaction at its COMMIT (``commits``). Everything else (submit, ack,
fail, renew, operator actions) and any transaction that mixes the two commits durably, and
the relaxed level never outlives its transaction.

The last test simulates what an OS crash or power loss can take on SQLite: the database
file and its write-ahead log cut at the end of the last durable commit (everything after it
is what the operating system may not have written), read beside the uncut log (a crash of
the process alone: the operating system keeps every write).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.service import QueueService
from tests.groupcommit import run_group
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

RELAXED, DURABLE = "relaxed", "durable"


@pytest.fixture
def commits(backend: str, alias: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """How each COMMIT on ``alias`` ran, in order: ``"relaxed"`` (SQLite: ``PRAGMA
    synchronous`` is NORMAL at the COMMIT, and the driver synced no log after it; PostgreSQL:
    ``SHOW synchronous_commit`` is off just before it) or ``"durable"`` (FULL, or NORMAL and
    then the driver's own ``fdatasync``; on)."""
    seen: list[str] = []
    conn = connections[alias]
    if backend == "sqlite":
        fdatasync = os.fdatasync

        def synced(fd: int) -> None:  # the driver's sync after a relaxed COMMIT
            fdatasync(fd)
            if seen and seen[-1] == RELAXED:
                seen[-1] = DURABLE

        monkeypatch.setattr(os, "fdatasync", synced)

        def at_commit(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            if sql == "COMMIT":
                level = conn.connection.execute("PRAGMA synchronous").fetchone()[0]
                seen.append(RELAXED if level == 1 else DURABLE if level >= 2 else str(level))
            return execute(sql, params, many, context)

        with conn.execute_wrapper(at_commit):
            yield seen
        return
    original = conn._commit

    def commit() -> None:
        if conn.connection is not None:
            (value,) = conn.connection.execute("SHOW synchronous_commit").fetchone()
            seen.append(RELAXED if value == "off" else DURABLE if value == "on" else value)
        original()

    conn._commit = commit
    try:
        yield seen
    finally:
        del conn._commit


def level_now(backend: str, alias: str) -> str:
    """The connection's level outside any transaction (``"relaxed"`` or ``"durable"``)."""
    conn = connections[alias]
    conn.ensure_connection()
    if backend == "sqlite":
        level = conn.connection.execute("PRAGMA synchronous").fetchone()[0]
        return RELAXED if level == 1 else DURABLE
    with conn.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return RELAXED if cursor.fetchone()[0] == "off" else DURABLE


def taken(commits: list[str]) -> list[str]:
    """The commits seen since the last call (and forget them)."""
    out = list(commits)
    del commits[:]
    return out


def lease_one(service: QueueService, queue: str = "q") -> dict[str, Any]:
    (lease,) = service.claim([queue], worker_id="w")
    return lease


def ids(lease: dict[str, Any]) -> dict[str, str]:
    return {"worker_id": "w", "lease_token": lease["lease_token"]}


def test_a_claim_commits_relaxed_and_every_reply_that_promises_commits_durably(
    service: QueueService, clock: FakeClock, commits: list[str], backend: str, alias: str
) -> None:
    job = service.submit("q", {"n": 1})["job"]
    assert taken(commits) == [DURABLE]
    lease = lease_one(service)
    assert lease["job_id"] == job["id"]
    assert taken(commits) == [RELAXED]
    service.renew(lease["job_id"], **ids(lease))
    service.ack(lease["job_id"], **ids(lease))
    assert taken(commits) == [DURABLE, DURABLE]
    service.submit("q", {"n": 2}, max_retries=0)
    second = lease_one(service)
    service.fail(second["job_id"], **ids(second), error="boom")
    assert taken(commits) == [DURABLE, RELAXED, DURABLE]
    service.replay(second["job_id"])  # an operator action
    assert taken(commits) == [DURABLE]
    lease_one(service)
    clock.advance(seconds=3600)  # the lease expires: the sweep takes it back
    service.sweep()
    assert taken(commits) == [RELAXED, RELAXED]
    # The level never outlives the transaction.
    assert level_now(backend, alias) == DURABLE


def test_the_give_back_of_undelivered_leases_commits_relaxed_and_a_release_durably(
    service: QueueService, commits: list[str], backend: str, alias: str
) -> None:
    # release_batch is the server's own give-back (no reply promises it): lease bookkeeping,
    # whether each entry goes through the batch's statement or alone (a cancel requested, a
    # refusal). The release op answers its worker: durable.
    service.submit_batch([{"queue": "q", "payload": i} for i in range(4)])
    a, b, c, d = service.claim(["q"], worker_id="w", max_jobs=4)
    service.cancel(b["job_id"])
    del commits[:]
    out = service.release_batch(
        [
            {"job_id": a["job_id"], **ids(a)},
            {"job_id": b["job_id"], **ids(b)},
            {"job_id": c["job_id"], "worker_id": "w", "lease_token": "stale"},
        ]
    )
    assert [r["ok"] for r in out] == [True, True, False]
    assert taken(commits) == [RELAXED]
    service.release(d["job_id"], **ids(d))
    assert taken(commits) == [DURABLE]
    assert level_now(backend, alias) == DURABLE


def test_durable_leases_setting_makes_claims_durable_again(
    service: QueueService, commits: list[str], settings: Any
) -> None:
    settings.RELAY_DURABLE_LEASES = True
    service.submit("q", {"n": 1})
    lease_one(service)
    service.sweep()  # a sweep hands out no attempt number: still relaxed
    assert taken(commits) == [DURABLE, DURABLE, RELAXED]


def test_a_durable_call_in_a_relaxed_transaction_makes_it_durable(
    service: QueueService,
    commits: list[str],
    backend: str,
    alias: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service.submit_batch([{"queue": "q", "payload": i} for i in range(2)])
    first = lease_one(service)
    del commits[:]
    synced: list[int] = []
    fdatasync = os.fdatasync  # the fixture's, which marks the commit durable

    def counted(fd: int) -> None:
        synced.append(fd)
        fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", counted)
    with service.transaction(durable=False):
        lease_one(service)
        service.ack(first["job_id"], **ids(first))
    # SQLite chose NORMAL before BEGIN; the ack inside made the driver sync the log after
    # COMMIT, as FULL would have. PostgreSQL decides at COMMIT: it stayed on.
    assert taken(commits) == [DURABLE]
    assert len(synced) == (1 if backend == "sqlite" else 0)
    # A relaxed transaction of claims alone syncs nothing.
    del synced[:]
    with service.transaction(durable=False):
        service.claim(["q"], worker_id="w")
    assert taken(commits) == [RELAXED] and synced == []
    assert level_now(backend, alias) == DURABLE


def test_a_relaxed_transaction_that_fails_leaves_the_connection_durable(
    service: QueueService, commits: list[str], backend: str, alias: str
) -> None:
    service.submit("q", {"n": 1})
    with contextlib.suppress(RuntimeError), service.transaction(durable=False):
        lease_one(service)
        raise RuntimeError("rolled back")
    assert level_now(backend, alias) == DURABLE
    lease = lease_one(service)  # the rollback took the lease back
    service.ack(lease["job_id"], **ids(lease))
    assert commits[-2:] == [RELAXED, DURABLE]


def run_batch(service: QueueService, calls: list[tuple[Callable[[], Any], bool]]) -> None:
    """Run ``(fn, durable)`` calls as one group commit of the TCP server's writer (claims)."""
    outcomes, _ = run_group(
        service, [fn for fn, _ in calls], claims=True, durable=[d for _, d in calls]
    )
    for ok, value in outcomes:
        assert ok, value


def test_the_writer_commits_a_batch_of_claims_relaxed_and_a_mixed_batch_durably(
    service: QueueService, commits: list[str]
) -> None:
    service.submit_batch([{"queue": "q", "payload": i} for i in range(3)])
    del commits[:]
    leases: list[dict[str, Any]] = []

    def claim() -> None:
        leases.extend(service.claim(["q"], worker_id="w"))

    run_batch(service, [(claim, False), (claim, False)])
    assert commits == [RELAXED] and len(leases) == 2
    first = leases[0]
    run_batch(service, [(claim, False), (lambda: service.ack(first["job_id"], **ids(first)), True)])
    assert commits == [RELAXED, DURABLE] and len(leases) == 3


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_log_sync_that_fails_after_a_relaxed_commit_is_outcome_unknown_and_the_commit_stands(
    service: QueueService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A durable call that joined a relaxed transaction makes the driver sync the log after
    COMMIT; when that sync fails the transaction is committed (others see it) but may not
    be on disk: ``OUTCOME_UNKNOWN``, not ``STORAGE_IO``'s "nothing was written", and the
    after-commit callbacks (wake-ups, observers) still run for the change that is there."""
    service.submit_batch([{"queue": "q", "payload": i} for i in range(2)])
    first = lease_one(service)
    ran: list[str] = []

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    leased: list[dict[str, Any]] = []

    def lease_and_ack() -> None:
        with service.transaction(durable=False):
            leased.append(lease_one(service))
            service.ack(first["job_id"], **ids(first))
            service.driver.after_commit(lambda: ran.append("after commit"))

    monkeypatch.setattr(os, "fdatasync", broken)
    with pytest.raises(errors.OutcomeUnknown) as caught:
        lease_and_ack()
    assert "may not survive" in caught.value.message
    assert ran == ["after commit"]
    monkeypatch.undo()
    (second,) = leased
    assert service.get(first["job_id"])["state"] == "succeeded"
    assert service.get(second["job_id"])["state"] == "leased"
    service.ack(second["job_id"], **ids(second))  # and the next transaction commits


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_backup_is_reported_done_only_once_its_rename_is_synced(
    service: QueueService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy's own commit syncs its pages; the rename that puts it in place changes the
    folder, which an OS crash could undo after "done" unless the folder is synced too."""
    service.submit("q", {"n": 1})
    target = tmp_path / "copy.db"
    synced: list[tuple[str, bool]] = []  # (what was synced, whether the copy was in place)
    fsync = os.fsync

    def recorded(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), target.exists()))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    service.backup(str(target))
    assert (str(tmp_path), True) in synced, synced


@pytest.mark.parametrize("backend", ["sqlite"])
def test_an_os_crash_can_take_back_leases_after_the_last_durable_commit_and_nothing_else(
    service: QueueService, alias: str, tmp_path: Path
) -> None:
    conn = connections[alias]
    conn.ensure_connection()
    raw = conn.connection
    path = str(conn.settings_dict["NAME"])
    # The log only grows while this runs (no checkpoint): its size after a durable COMMIT
    # is then exactly what that COMMIT's fsync put on disk.
    raw.execute("PRAGMA wal_autocheckpoint=0")
    try:
        raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        service.submit_batch([{"queue": "q", "payload": i} for i in range(5)])
        done = [lease_one(service) for _ in range(2)]
        for lease in done:
            service.ack(lease["job_id"], **ids(lease))
        durable_bytes = os.path.getsize(f"{path}-wal")
        held = [lease_one(service) for _ in range(3)]  # relaxed: after the last fsync
        assert os.path.getsize(f"{path}-wal") > durable_bytes
        os_crash = copy_database(path, tmp_path / "os-crash.db", durable_bytes)
        killed = copy_database(path, tmp_path / "killed.db", None)
    finally:
        raw.execute("PRAGMA wal_autocheckpoint=1000")
    acked = {lease["job_id"] for lease in done}
    leased = {lease["job_id"] for lease in held}
    # A crash of the process: the operating system wrote everything, leases included.
    after_kill = jobs(killed)
    assert {j for j, (state, _) in after_kill.items() if state == "succeeded"} == acked
    assert {j: after_kill[j] for j in leased} == {j: ("leased", 1) for j in leased}
    assert attempt_rows(killed) == acked | leased
    # An OS crash: the leases are gone, their jobs READY with the attempt not counted (the
    # next delivery gets attempt 1 again) and no history row; the acks are all there.
    after_crash = jobs(os_crash)
    assert {j for j, (state, _) in after_crash.items() if state == "succeeded"} == acked
    assert {j: after_crash[j] for j in leased} == {j: ("ready", 0) for j in leased}
    assert attempt_rows(os_crash) == acked


def copy_database(path: str, target: Path, log_bytes: int | None) -> Path:
    """Copy the database file and its log (the first ``log_bytes`` of it; None: all)."""
    shutil.copyfile(path, target)
    with open(f"{path}-wal", "rb") as src, open(f"{target}-wal", "wb") as dst:
        dst.write(src.read() if log_bytes is None else src.read(log_bytes))
    return target


def jobs(db: Path) -> dict[str, tuple[str, int]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return {
            row[0]: (row[1], row[2])
            for row in conn.execute("SELECT id, state, attempt FROM relay_job")
        }


def attempt_rows(db: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return {row[0] for row in conn.execute("SELECT job_id FROM relay_attempt")}
