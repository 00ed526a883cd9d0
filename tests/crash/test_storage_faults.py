"""Storage faults under real ``relay_server`` processes (docs/failure-model.md, items 7, 8, 14).

* A full disk (a small tmpfs filled up) is ``STORAGE_FULL`` for every write, logged once, never
  ``INTERNAL`` with a traceback; once space is freed the same server takes writes again, and
  nothing acknowledged is lost. At start, a full disk exits 7 with one ``STORAGE_FULL`` line,
  not 3 ``CORRUPT`` for a healthy file; a migration that fills the disk is rolled back, and
  ``relay migrate`` and ``relay server`` exit 7 too.
* A read-only file system, database file or folder at start exits 8 with one ``STORAGE_IO``
  line, not a traceback.
* Database files removed or replaced under a running server: every write after it is refused
  with ``STORAGE_LOST`` (before, 50 of 50 submits were acknowledged into the unlinked file).
* A commit whose write-ahead log cannot be synced (``failsync.c``, an ``LD_PRELOAD`` shim
  that fails ``fsync`` and ``fdatasync`` with EIO) is ``OUTCOME_UNKNOWN``, not ``STORAGE_IO``:
  its frames are in the file, and a restart before the next write recovers them (before,
  a submit answered "nothing was written" was there after a kill -9 and a restart).

Mounting a tmpfs needs root (CAP_SYS_ADMIN); those tests skip without it. As root, the
read-only file and folder cases run the server without CAP_DAC_OVERRIDE (``setpriv``), so
the permission bits bind it as they bind any other user.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_core.client import RelayClient
from queue_core.errors import OutcomeUnknown, RelayError, StorageFull, StorageLost
from relay_bench.procs import fill_backlog
from tests.audit import audit
from tests.procs import ROOT, Spawner, command_env, spawner
from tests.relay_db import put_a_copy_in_place

pytestmark = [pytest.mark.slow]

NO_DAC = ["--bounding-set", "-dac_override,-dac_read_search"]
FAILSYNC_C = Path(__file__).with_name("failsync.c")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted for the test (skips where mounting is not allowed)."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0777", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` to its last byte; return the filler file."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for size in (1 << 20, 4096, 512, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return filler


def start(db: Path, *prefix: str) -> subprocess.CompletedProcess[str]:
    """Run ``relay_server`` on ``db`` until it exits (it must not get to serve)."""
    return subprocess.run(
        [
            *prefix,
            sys.executable,
            str(ROOT / "manage.py"),
            "relay_server",
            "--address",
            "127.0.0.1:0",
        ],
        cwd=ROOT,
        env=command_env(str(db)),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def migrated(spawn: Spawner) -> None:
    done = spawn.run("migrate", "-v0")
    assert done.returncode == 0, done.stderr


def last_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ------------------------------------------------------------------ item 7: full disk


def test_a_full_disk_is_storage_full_for_every_write_then_writes_resume(tmpfs: Path) -> None:
    db = tmpfs / "relay.db"
    with spawner(str(db)) as spawn:
        server, port = spawn.server()
        with RelayClient(f"127.0.0.1:{port}") as client:
            acked = [client.submit("q", {"i": i})["job"]["id"] for i in range(20)]
            filler = fill(tmpfs)
            refused: list[RelayError] = []
            for i in range(30):
                with pytest.raises(RelayError) as err:
                    client.submit("q", {"i": i, "pad": "x" * 4000})
                refused.append(err.value)
            with pytest.raises(RelayError) as lease_err:
                client.lease(["q"], worker_id="w", max_jobs=5)
            refused.append(lease_err.value)
            assert {type(e) for e in refused} == {StorageFull}, {e.code for e in refused}
            assert all(e.retryable for e in refused)
            assert client.ping()["pong"]  # reads still answer
            filler.unlink()  # space is back: the same server writes again
            later = [client.submit("q", {"i": i})["job"]["id"] for i in range(10)]
            leases = client.lease(["q"], worker_id="w", max_jobs=5)
            for lease in leases:
                client.ack(lease["job_id"], worker_id="w", lease_token=lease["lease_token"])
            stats = client.stats()["totals"]
            assert stats["ready"] + stats["succeeded"] == len(acked) + len(later)
        server.signal(signal.SIGTERM)
        assert server.wait_exit(30) == 0
        faults = [r for r in server.records if r.get("event") == "storage_fault"]
        assert len(faults) == 1 and faults[0]["code"] == "STORAGE_FULL", faults
        assert [r for r in server.records if r.get("event") == "storage_recovered"]
        answered = [r for r in server.records if "internal_error" in str(r.get("message"))]
        assert not answered, "a request was answered INTERNAL (with a traceback in the log)"
        # 31 refused writes (and reaper passes) give at most one line per failing step,
        # without a traceback: the storage fault is an expected condition.
        failed = [r for r in server.records if str(r.get("event", "")).endswith("_failed")]
        steps = [r["event"] for r in failed]
        assert len(steps) == len(set(steps)), steps
        assert "Traceback" not in server.stderr_text()
    audit(db)


def test_start_on_a_full_disk_exits_7_storage_full_not_corrupt(tmpfs: Path) -> None:
    db = tmpfs / "relay.db"
    with spawner(str(db)) as spawn:
        migrated(spawn)
        filler = fill(tmpfs)
        done = start(db)
        assert done.returncode == 7, done.stderr[-2000:]
        assert last_line(done).startswith(f"STORAGE_FULL: database {db}: "), done.stderr
        assert "CORRUPT" not in done.stderr and "Traceback" not in done.stderr
        filler.unlink()
        server, _ = spawn.server()  # the same file serves once there is room
        server.signal(signal.SIGTERM)
        assert server.wait_exit(30) == 0
    audit(db)


def test_a_migration_that_fills_the_disk_exits_7_and_changes_nothing(tmpfs: Path) -> None:
    # An upgrade review: migration 0017 rebuilds relay_job on SQLite, and its write-ahead log
    # grew to about 1.5 times the file meanwhile. On a disk with room for the result but not
    # for that, `relay migrate` and `relay server` exited 1 (UNAVAILABLE): exit 7 is what a
    # full disk at start exits (and what a unit's restart policy can tell apart).
    db = tmpfs / "relay.db"
    with spawner(str(db)) as spawn:
        spawn.migrate("queue_core", "0016_postgresql_like_indexes")
        fill_backlog(db, 6_000, queue="q")  # READY jobs, counted, the log checkpointed
        with open(tmpfs / "filler", "wb") as filler:  # room for the file once more, no more
            filler.write(b"\0" * (shutil.disk_usage(tmpfs).free - db.stat().st_size))
        cli = [sys.executable, "-c", "from queue_core.cli import main; main()"]
        migrate = subprocess.run(
            [*cli, "--db", str(db), "migrate"], capture_output=True, text=True, timeout=120
        )
        assert migrate.returncode == 7, migrate.stderr[-2000:]
        assert last_line(migrate).startswith(
            "STORAGE_FULL: the migration was rolled back (one that rebuilds a table needs up "
            "to about three times the file's size free while it runs): the database's disk is "
            "full"
        ), migrate.stderr
        served = start(db)
        assert served.returncode == 7, served.stderr[-2000:]
        assert last_line(served).startswith(
            f"STORAGE_FULL: database {db}: the migration was rolled back"
        ), served.stderr
        assert "Traceback" not in migrate.stderr + served.stderr
        with contextlib.closing(sqlite3.connect(db)) as conn:
            applied = {name for (name,) in conn.execute("SELECT name FROM django_migrations")}
        assert "0016_postgresql_like_indexes" in applied
        assert "0017_state_check_without_in_list" not in applied
        audit(db)  # the counts, triggers' work and file as they were
        (tmpfs / "filler").unlink()
        spawn.migrate()
    audit(db)


# ------------------------------------------------------------------ item 14: read-only


@pytest.mark.parametrize("what", ["file system", "file", "folder"])
def test_start_on_read_only_storage_exits_8_with_one_line(
    what: str, tmpfs: Path, tmp_path: Path
) -> None:
    folder = tmpfs if what == "file system" else tmp_path / "ro"
    folder.mkdir(exist_ok=True)
    db = folder / "relay.db"
    prefix: list[str] = []
    with spawner(str(db)) as spawn:
        migrated(spawn)
        if what == "file system":
            subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
        else:
            os.chmod(db if what == "file" else folder, 0o444 if what == "file" else 0o555)
            if os.geteuid() == 0:  # root ignores permission bits unless it drops the power
                if shutil.which("setpriv") is None:
                    pytest.skip("setpriv is needed to run the server as root without DAC override")
                prefix = ["setpriv", *NO_DAC]
        try:
            done = start(db, *prefix)
        finally:
            if what == "file system":
                subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
            else:
                os.chmod(folder, 0o755)
                os.chmod(db, 0o644)
    assert done.returncode == 8, done.stderr[-2000:]
    assert last_line(done).startswith(f"STORAGE_IO: database {db}: "), done.stderr
    assert "Traceback" not in done.stderr and "CORRUPT" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


# ------------------------------------------------------------------ item 8: file identity


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_writes_after_the_database_was_removed_or_replaced_are_refused(
    how: str, tmp_path: Path
) -> None:
    db = tmp_path / "relay.db"
    with spawner(str(db)) as spawn:
        server, port = spawn.server()
        with RelayClient(f"127.0.0.1:{port}") as client:
            for i in range(5):
                client.submit("q", {"i": i})
            if how == "removed":
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{db}{suffix}")
            else:
                put_a_copy_in_place(str(db), str(tmp_path / "copy.db"))
            outcomes: list[str] = []
            refusals: list[RelayError] = []
            for i in range(50):
                try:
                    client.submit("q", {"late": i})
                    outcomes.append("acknowledged")
                except RelayError as exc:
                    refusals.append(exc)
                    outcomes.append(exc.code)
            assert outcomes == ["STORAGE_LOST"] * 50
            assert all(e.retryable and "restart the server" in e.message for e in refusals)
            with pytest.raises(StorageLost):
                client.lease(["q"], worker_id="w")
            assert client.ping()["pong"]
        server.signal(signal.SIGTERM)
        assert server.wait_exit(30) == 0
        faults = [r for r in server.records if r.get("event") == "storage_fault"]
        assert [f["code"] for f in faults] == ["STORAGE_LOST"], faults


# ------------------------------------------------------------------ a sync that fails


@pytest.fixture(scope="module")
def failsync(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``failsync.c`` built as a shared object (needs a C compiler: .ci/run installs gcc)."""
    out = tmp_path_factory.mktemp("failsync") / "failsync.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "a C compiler (cc or gcc) is needed to build tests/crash/failsync.c"
    done = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(FAILSYNC_C), "-ldl"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out


def test_a_commit_whose_log_sync_fails_is_outcome_unknown_then_writes_resume(
    tmp_path: Path, failsync: Path
) -> None:
    db = tmp_path / "relay.db"
    failing = tmp_path / "fail-syncs"  # while it exists, the server's log syncs fail
    with spawner(str(db)) as spawn:
        server, port = spawn.server(LD_PRELOAD=str(failsync), RELAY_TEST_FAIL_SYNC=str(failing))
        with RelayClient(f"127.0.0.1:{port}") as client:
            acked = [client.submit("q", {"i": i})["job"]["id"] for i in range(5)]
            lease = client.lease(["q"], worker_id="w")[0]
            failing.touch()
            unknown: list[RelayError] = []
            for i in range(5):
                with pytest.raises(RelayError) as err:
                    client.submit("q", {"unknown": i})
                unknown.append(err.value)
            with pytest.raises(RelayError) as ack_err:
                client.ack(lease["job_id"], worker_id="w", lease_token=lease["lease_token"])
            unknown.append(ack_err.value)
            assert {type(e) for e in unknown} == {OutcomeUnknown}, {e.code for e in unknown}
            assert all(e.retryable for e in unknown)
            # A lease alone commits without a sync (docs/design-decisions.md): still answered.
            second = client.lease(["q"], worker_id="w")[0]
            assert client.ping()["pong"]
            failing.unlink()  # the disk syncs again: the same server takes writes
            acked += [client.submit("q", {"later": i})["job"]["id"] for i in range(5)]
            # The ack whose outcome was unknown is safe to repeat, as OUTCOME_UNKNOWN says.
            client.ack(lease["job_id"], worker_id="w", lease_token=lease["lease_token"])
            client.ack(second["job_id"], worker_id="w", lease_token=second["lease_token"])
        faults = [r for r in server.records if r.get("event") == "storage_fault"]
        assert faults and {f["code"] for f in faults} == {"OUTCOME_UNKNOWN"}, faults
        assert [r for r in server.records if r.get("event") == "storage_recovered"]
        assert "Traceback" not in server.stderr_text()
        server.kill()  # kill -9: whatever the log holds is what a restart recovers
        server.wait_exit(30)
        server, port = spawn.server()
        with RelayClient(f"127.0.0.1:{port}") as client:
            states = {job_id: client.inspect(job_id)["job"]["state"] for job_id in acked}
        assert states[lease["job_id"]] == states[second["job_id"]] == "succeeded", states
        assert set(states.values()) <= {"ready", "succeeded"}, states
        server.signal(signal.SIGTERM)
        assert server.wait_exit(30) == 0
    audit(db)
