"""``manage.py relay_server`` as a real process: integrity check, --db, recovery, SIGTERM."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import socket
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from queue_core import schema
from tests.procs import Spawner, record_future_migration, spawner


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Spawner]:
    """Processes on a database of their own (given with --db, so RELAY_DB is a decoy)."""
    with spawner(str(tmp_path / "decoy.db")) as s:
        yield s
    for proc in s.procs:  # the spawner kills them; close their stderr pipes too
        proc.wait_exit()
        if proc.popen.stderr is not None:
            proc.popen.stderr.close()


class Conn:
    """One persistent NDJSON connection."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.file = self.sock.makefile("rb")

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        self.sock.sendall(orjson.dumps({"op": op, "args": args}) + b"\n")
        reply: dict[str, Any] = orjson.loads(self.file.readline())
        return reply

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def call(port: int, op: str, **args: Any) -> dict[str, Any]:
    conn = Conn(port)
    try:
        return conn(op, **args)
    finally:
        conn.close()


def test_corrupt_database_exits_3_without_serving(procs: Spawner, tmp_path: Path) -> None:
    db = tmp_path / "garbage.db"
    db.write_bytes(b"this is not a database file at all" * 200)
    out = procs.run("relay_server", "--db", str(db), "--address", "127.0.0.1:0")
    assert out.returncode == 3, out.stderr
    assert f"CORRUPT: database {db} failed integrity check" in out.stderr
    assert "event=ready" not in out.stderr
    assert db.read_bytes().startswith(b"this is not")  # untouched, not migrated over


def test_db_option_migrates_serves_and_stops_on_sigterm(procs: Spawner, tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    proc, port = procs.server("--db", str(db), "--shutdown-grace-ms", "30000")
    assert proc.wait_event("recovered")["leases"] == 0
    conn = Conn(port)
    try:
        job = conn("submit", queue="q", payload={"n": 1})["result"]["job"]
        lease = conn("lease", queues=["q"], worker_id="w")["result"]["jobs"][0]
        proc.signal(signal.SIGTERM)
        proc.wait_event("draining")
        with pytest.raises(ConnectionRefusedError):
            Conn(port)  # no new connections
        assert conn("submit", queue="q", payload=2)["error"]["code"] == "UNAVAILABLE"
        acked = conn("ack", job_id=job["id"], worker_id="w", lease_token=lease["lease_token"])
        assert acked["ok"], acked
        assert proc.wait_exit(timeout=15) == 0  # the grace ended early: nothing leased
    finally:
        conn.close()
    with contextlib.closing(sqlite3.connect(db)) as sql:
        assert sql.execute("SELECT state FROM relay_job").fetchall() == [("succeeded",)]
    assert not (tmp_path / "decoy.db").exists()


@pytest.mark.crash
def test_restart_recovers_leases_and_fences_old_tokens(procs: Spawner, tmp_path: Path) -> None:
    db = str(tmp_path / "relay.db")
    first, port = procs.server("--db", db)
    job = call(port, "submit", queue="q", payload=1)["result"]["job"]
    old = call(port, "lease", queues=["q"], worker_id="w")["result"]["jobs"][0]
    first.kill()  # SIGKILL: no graceful anything
    second, port = procs.server("--db", db)
    assert second.wait_event("recovered")["leases"] == 1
    stale = call(port, "ack", job_id=job["id"], worker_id="w", lease_token=old["lease_token"])
    assert stale["error"]["code"] == "STALE_TOKEN"
    again = call(port, "lease", queues=["q"], worker_id="w")["result"]["jobs"]
    assert [j["job_id"] for j in again] == [job["id"]] and again[0]["attempt"] == 2
    assert second.stop(timeout_s=15) == 0


def test_second_server_on_the_same_database_is_refused_and_steals_nothing(
    procs: Spawner, tmp_path: Path
) -> None:
    db = str(tmp_path / "relay.db")
    first, port = procs.server("--db", db)
    job = call(port, "submit", queue="q", payload=1)["result"]["job"]
    lease = call(port, "lease", queues=["q"], worker_id="w", lease_ms=60_000)["result"]["jobs"][0]
    out = procs.run("relay_server", "--db", db, "--address", "127.0.0.1:0")
    assert out.returncode == 4, out.stderr
    assert "ALREADY_SERVED" in out.stderr
    # The first server's lease is untouched: its holder can still ack.
    acked = call(port, "ack", job_id=job["id"], worker_id="w", lease_token=lease["lease_token"])
    assert acked["ok"], acked
    assert first.stop(timeout_s=15) == 0


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_second_server_through_another_path_to_the_file_is_refused(
    procs: Spawner, tmp_path: Path, link: str
) -> None:
    # The lock holds the file (its inode), not the path: another name for the same file
    # must not start a second server that would release the first one's leases.
    db = tmp_path / "relay.db"
    first, port = procs.server("--db", str(db))
    job = call(port, "submit", queue="q", payload=1)["result"]["job"]
    lease = call(port, "lease", queues=["q"], worker_id="w", lease_ms=60_000)["result"]["jobs"][0]
    other = tmp_path / "other-name.db"
    if link == "symlink":
        other.symlink_to(db)
    else:
        os.link(db, other)
    out = procs.run("relay_server", "--db", str(other), "--address", "127.0.0.1:0")
    assert out.returncode == 4, out.stderr  # the lock first, then the names (a review)
    assert "ALREADY_SERVED" in out.stderr
    acked = call(port, "ack", job_id=job["id"], worker_id="w", lease_token=lease["lease_token"])
    assert acked["ok"], acked
    assert first.stop(timeout_s=15) == 0


def test_database_in_a_missing_folder_is_a_usage_error(procs: Spawner, tmp_path: Path) -> None:
    out = procs.run("relay_server", "--db", str(tmp_path / "nope" / "relay.db"))
    assert out.returncode == 1, out.stderr
    assert "INVALID_ARGUMENT" in out.stderr and "CORRUPT" not in out.stderr


@contextlib.contextmanager
def _turn(db: str | Path) -> Iterator[int]:
    """Hold the migration turn of the SQLite file ``db`` (a write lock on its
    ``schema.TURN_BYTE``; the file is made empty if it is not there), as a migrate does;
    yield the descriptor, whose ``_unlock`` ends the turn."""
    held = os.open(db, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        schema._turn_lock(held, fcntl.F_WRLCK, wait=False)
        yield held
    finally:
        os.close(held)


def _unlock(held: int) -> None:
    """End the turn ``_turn`` took (before its block ends)."""
    schema._turn_lock(held, fcntl.F_UNLCK, wait=False)


def _applied(db: str) -> list[str]:
    """``app.name`` of every row of the file's ``django_migrations`` (twice if recorded twice)."""
    with contextlib.closing(sqlite3.connect(db)) as sql:
        return [
            f"{app}.{name}" for app, name in sql.execute("SELECT app, name FROM django_migrations")
        ]


def test_relay_migrate_is_refused_while_a_server_serves_the_file(
    procs: Spawner, tmp_path: Path
) -> None:
    # An upgrade review migrated a file under a live older server, whose inserts then went
    # uncounted. While anything holds the server lock, Relay's own migrations are refused;
    # with none of them left to apply (a project's own, or nothing), migrate runs.
    db = str(tmp_path / "relay.db")
    procs.migrate("queue_core", "0015_console_indexes_in_state", RELAY_DB=db)
    with open(db, "rb") as held:  # as a server of an older Relay holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out = procs.run("migrate", RELAY_DB=db)
        assert out.returncode == 4, out.stderr
        assert f"ALREADY_SERVED: a relay server is serving {db}" in out.stderr
        assert "queue_core.0016_postgresql_like_indexes" not in _applied(db)  # nothing ran
    server, port = procs.server("--db", db)  # it migrates the file itself
    out = procs.run("migrate", RELAY_DB=db)  # nothing of Relay's left: allowed beside it
    assert out.returncode == 0, out.stderr
    assert procs.run("migrate", "--plan", RELAY_DB=db).returncode == 0  # changes nothing
    # Backwards is a change too (a review unapplied 0016 to 0011 under a live server, and
    # every submit answered INTERNAL after).
    out = procs.run("migrate", "queue_core", "0015_console_indexes_in_state", RELAY_DB=db)
    assert out.returncode == 4, out.stderr
    assert call(port, "ping")["ok"]
    assert server.stop(timeout_s=15) == 0


def test_two_migrations_of_one_file_take_turns(procs: Spawner, tmp_path: Path) -> None:
    # Both took the file's lock shared and ran their plans: the second failed on what the
    # first had just applied. The second now waits for the first and finds nothing to do.
    db = str(tmp_path / "relay.db")
    procs.migrate("queue_core", "0015_console_indexes_in_state", RELAY_DB=db)
    with _turn(db):  # as another `relay migrate` holds it
        waiting = procs("migrate", RELAY_DB=db)
        waiting.wait_line(re.escape(f"waiting for another migration of {db} to end"))
        assert waiting.popen.poll() is None
        assert "queue_core.0016_postgresql_like_indexes" not in _applied(db)  # waits first
    assert waiting.wait_exit(timeout=60) == 0
    # Two at once from 0010 (one of them exited 1 in 4 of 4 tries before the lock file).
    db = str(tmp_path / "older.db")
    procs.migrate("queue_core", "0010_queue_controls", RELAY_DB=db)
    runs = [procs("migrate", RELAY_DB=db) for _ in range(3)]
    assert [run.wait_exit(timeout=120) for run in runs] == [0] * 3, [r.stderr_text() for r in runs]
    applied = _applied(db)
    assert (
        len(set(applied)) == len(applied) and "queue_core.0016_postgresql_like_indexes" in applied
    )
    db = str(tmp_path / "new.db")  # and a file not made yet (one exited 1 in 3 of 3 before)
    runs = [procs("migrate", RELAY_DB=db) for _ in range(3)]
    assert [run.wait_exit(timeout=120) for run in runs] == [0] * 3, [r.stderr_text() for r in runs]
    (tmp_path / "data").mkdir()  # one file by two names: one lock file, beside the file
    db = str(tmp_path / "data" / "real.db")
    os.symlink(db, tmp_path / "link.db")
    runs = [procs("migrate", RELAY_DB=name) for name in (db, str(tmp_path / "link.db"))]
    assert [run.wait_exit(timeout=120) for run in runs] == [0, 0], [r.stderr_text() for r in runs]


def test_a_migration_with_nothing_of_relays_to_do_still_takes_its_turn(
    procs: Spawner, tmp_path: Path
) -> None:
    # A review: with Relay's migrations applied and Django's own not, migrate took no lock,
    # and three of four at once failed on duplicate rows (auth, content types).
    db = str(tmp_path / "relay.db")
    for app in ("queue_core", "relay_tasks"):
        procs.migrate(app, RELAY_DB=db)
    with _turn(db):  # as another `relay migrate` holds it
        waiting = procs("migrate", RELAY_DB=db)
        waiting.wait_line(re.escape(f"waiting for another migration of {db} to end"))
        # A server migrating at its start takes its turn too (a second review: one started
        # beside such a migrate applied Django's migrations with it, 8 of 9 times).
        server = procs("relay_server", "--db", db, "--address", "127.0.0.1:0")
        server.wait_event("waiting_for_migration")
        assert server.popen.poll() is None and waiting.popen.poll() is None
    assert waiting.wait_exit(timeout=60) == 0
    port = int(server.wait_event("ready", timeout=60)["port"])
    assert call(port, "ping")["ok"]
    assert server.stop(timeout_s=15) == 0
    applied = _applied(db)
    assert len(set(applied)) == len(applied)  # none recorded twice


def test_a_server_started_with_a_migration_of_a_new_file_waits_for_it(
    procs: Spawner, tmp_path: Path
) -> None:
    # A review: the migration of a file not made yet held only the lock file, so a server
    # started with it migrated at the same time (4 of 7 servers died, "table relay_job
    # already exists"). Both now wait for the turn, and whichever takes it first migrates.
    db = str(tmp_path / "new.db")
    with _turn(db):  # as another `relay migrate` holds it
        waiting = procs("migrate", RELAY_DB=db)
        waiting.wait_line(re.escape(f"waiting for another migration of {db} to end"))
        proc = procs("relay_server", "--db", db, "--address", "127.0.0.1:0")
        proc.wait_event("waiting_for_migration")
        assert proc.popen.poll() is None
    assert waiting.wait_exit(timeout=60) == 0
    proc.wait_event("ready", timeout=60)
    assert proc.stop(timeout_s=15) == 0


def _last_two_migrations() -> tuple[str, str]:
    """The names of queue_core's last migration and the one before it."""
    from django.db.migrations.loader import MigrationLoader

    graph = MigrationLoader(None, ignore_no_migrations=True).graph
    (last,) = [name for app, name in graph.leaf_nodes() if app == "queue_core"]
    (parent,) = [name for app, name in graph.node_map[("queue_core", last)].parents]
    return last, parent


def test_a_migrate_refused_by_a_starting_server_waits_for_its_migration(
    procs: Spawner, tmp_path: Path
) -> None:
    # A second review: `relay server` and `bin/http` (which migrates first) started together
    # on a new file; when the server took the file first, bin/http's migrate exited 4
    # (3 of 5 tries). A starting server holds the migration turn until its own migration has
    # ended; a migrate refused by the file's lock waits for that turn and looks again.
    db = str(tmp_path / "relay.db")
    last, before_last = _last_two_migrations()
    for target in (("queue_core", before_last), ("relay_tasks",)):
        procs.migrate(*target, RELAY_DB=db)
    with _turn(db) as turn, open(db, "rb") as file:  # as a server starting holds them
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        waiting = procs("migrate", RELAY_DB=db)
        waiting.wait_line(re.escape(f"waiting for another migration of {db} to end"))
        with contextlib.closing(sqlite3.connect(db)) as sql:  # the server migrates the last
            sql.execute(  # recorded, not applied: what is under test is the turn
                "INSERT INTO django_migrations (app, name, applied) "
                "VALUES ('queue_core', ?, datetime('now'))",
                [last],
            )
            sql.commit()
        _unlock(turn)  # its turn ends
        assert waiting.wait_exit(timeout=60) == 0  # nothing of Relay's left: it ran beside
        assert "ALREADY_SERVED" not in waiting.stderr_text()


def test_a_server_starting_during_a_migration_waits_for_it(procs: Spawner, tmp_path: Path) -> None:
    # A review started the server while `relay migrate` held the file (13 s at a million
    # jobs): it exited 4, "another relay server is serving", which its unit does not restart.
    db = str(tmp_path / "relay.db")
    procs.migrate(RELAY_DB=db)
    held = open(db, "rb")  # noqa: SIM115 - released below, as migrate's lock is
    fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)  # as `relay migrate` holds it
    try:
        proc = procs("relay_server", "--db", db, "--address", "127.0.0.1:0")
        proc.wait_event("waiting_for_migration")
        assert proc.popen.poll() is None
    finally:
        fcntl.flock(held, fcntl.LOCK_UN)
    proc.wait_event("ready")
    assert proc.stop(timeout_s=15) == 0
    held.close()


def test_a_starting_server_takes_its_turn_before_its_file(procs: Spawner, tmp_path: Path) -> None:
    # A third review: a migrate that looked between a starting server taking its file and
    # taking its turn found the file held and no turn held, and exited 4 (seen with a delay
    # injected there by strace). The server now takes the turn first, as a migrate does, so
    # while another holds the turn the server does not hold the file.
    db = str(tmp_path / "relay.db")
    procs.migrate(RELAY_DB=db)
    with _turn(db):  # as another `relay migrate` holds it
        proc = procs("relay_server", "--db", db, "--address", "127.0.0.1:0")
        proc.wait_event("waiting_for_migration")
        with open(db, "rb") as probe:  # BlockingIOError: the server took the file first
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(probe, fcntl.LOCK_UN)
        assert proc.popen.poll() is None
    port = int(proc.wait_event("ready", timeout=60)["port"])
    assert call(port, "ping")["ok"]
    out = procs.run("migrate", "queue_core", "0015_console_indexes_in_state", RELAY_DB=db)
    assert out.returncode == 4, out.stderr  # then it holds the file: refused
    assert proc.stop(timeout_s=15) == 0


def test_a_file_with_two_names_is_refused(procs: Spawner, tmp_path: Path) -> None:
    # A hostile review: SQLite keeps a write-ahead log per name, so two hard links of one
    # file opened at once are two databases over one file (two migrates, one per link, both
    # applied every migration, and one overwrote the other's pages); each name also had a
    # migration turn of its own. A symlink is one name: SQLite resolves it.
    db = tmp_path / "relay.db"
    procs.migrate(RELAY_DB=str(db))
    os.link(db, tmp_path / "other.db")
    said = "has 2 names (hard links): SQLite keeps a write-ahead log per name"
    out = procs.run("relay_server", "--db", str(db), "--address", "127.0.0.1:0")
    assert out.returncode == 8, out.stderr
    assert f"STORAGE_IO: database {db}: " in out.stderr and said in out.stderr
    for name in (db, tmp_path / "other.db"):
        out = procs.run("migrate", RELAY_DB=str(name))
        assert out.returncode == 1, out.stderr
        assert "STORAGE_IO: " in out.stderr and said in out.stderr
    out = procs.run("relay_prune", "--older-than", "1d", RELAY_DB=str(db))  # any connection
    assert out.returncode == 1, out.stderr
    assert f"STORAGE_IO: database {db}: the file {said}" in out.stderr
    # A third review: a backup through a link made while a server served copied 162 of 300
    # acknowledged jobs (the server's log is its name's) and said "integrity_check ok".
    out = procs.run("relay_backup", str(tmp_path / "copy.db"), RELAY_DB=str(tmp_path / "other.db"))
    assert out.returncode == 1, out.stderr
    assert "STORAGE_IO: " in out.stderr and said in out.stderr
    assert not (tmp_path / "copy.db").exists()
    os.unlink(tmp_path / "other.db")
    server, port = procs.server("--db", str(db))  # one name again: served
    assert call(port, "ping")["ok"]
    assert server.stop(timeout_s=15) == 0


def test_the_turn_needs_no_file_beside_the_database(procs: Spawner, tmp_path: Path) -> None:
    # A hostile review: the turn was a lock file beside the database, and where it could not
    # be made (a name 243 characters long: its -wal fits the file system's 255, its
    # "-migrate.lock" does not; a read-only folder) the migration ran without one: two at
    # once left duplicate django_migrations rows in 4 of 5 rounds. A second review: a lock on
    # the folder instead held up every database in it, and any user who could read the
    # folder could hold it. The turn is a lock on a byte of the database file itself.
    db = str(tmp_path / ("r" * 240 + ".db"))
    with _turn(db):  # as another `relay migrate` holds it
        waiting = procs("migrate", RELAY_DB=db)
        waiting.wait_line(re.escape(f"waiting for another migration of {db} to end"))
        assert waiting.popen.poll() is None
        assert os.path.getsize(db) == 0  # nothing ran
        other = str(tmp_path / "other.db")  # another file of the folder takes its own turn
        assert procs("migrate", RELAY_DB=other).wait_exit(timeout=60) == 0
        server, port = procs.server("--db", other)
        assert call(port, "ping")["ok"]
        assert server.stop(timeout_s=15) == 0
        assert waiting.popen.poll() is None
    assert waiting.wait_exit(timeout=60) == 0
    # Nothing beside the databases but their own -wal and -shm (a stopped server's may stay).
    made = {p.name.removesuffix("-wal").removesuffix("-shm") for p in tmp_path.iterdir()}
    assert made == {os.path.basename(db), "other.db"}


def test_a_database_relay_makes_is_its_owners_alone(procs: Spawner, tmp_path: Path) -> None:
    # A third review: a file made 0644 let any local user hold a read lock on the migration
    # turn's byte (every start waited for good) or the file's flock (a server exited 4).
    made = tmp_path / "migrated.db"
    procs.migrate(RELAY_DB=str(made))
    assert made.stat().st_mode & 0o777 == 0o600
    served = tmp_path / "served.db"
    server, port = procs.server("--db", str(served))
    assert call(port, "submit", queue="q", payload=1)["ok"]
    assert {p.stat().st_mode & 0o777 for p in tmp_path.glob("served.db*")} == {0o600}
    assert server.stop(timeout_s=15) == 0


def test_a_file_others_may_read_is_served_with_a_warning(procs: Spawner, tmp_path: Path) -> None:
    # An older file keeps its mode (0644 from before Relay made them 0600): any local user
    # can read its jobs and keys, and hold a lock that stops every later start.
    db = tmp_path / "old.db"
    procs.migrate(RELAY_DB=str(db))
    for mode, warned in ((0o644, True), (0o600, False), (0o660, True)):
        db.chmod(mode)
        server, port = procs.server("--db", str(db))
        server.wait_event("recovered")  # logged after the file is claimed
        shared = [r for r in server.records if r.get("event") == "database_file_shared"]
        found = [(r["db"], r["mode"]) for r in shared]
        assert found == ([(str(db), f"{mode:04o}")] if warned else []), mode
        assert call(port, "submit", queue="q", payload=1)["ok"]
        assert server.stop(timeout_s=15) == 0


def test_a_file_a_newer_relay_migrated_is_not_served(procs: Spawner, tmp_path: Path) -> None:
    db = str(tmp_path / "relay.db")
    procs.migrate(RELAY_DB=db)
    record_future_migration(db)
    out = procs.run("relay_server", "--db", db, "--address", "127.0.0.1:0")
    assert out.returncode == 9, out.stderr
    assert f"NEWER_SCHEMA: database {db} was migrated by a newer Relay" in out.stderr
    assert "event=ready" not in out.stderr


def test_counts_an_older_relay_left_wrong_are_rebuilt_at_start(
    procs: Spawner, tmp_path: Path
) -> None:
    # A Relay older than migration 0008 inserted jobs without counting them (relay_job_count
    # is kept by the driver since): stats then showed 12 ready of 22, and 0 of 5 after a
    # drain. Here such an insert is made by hand between two servers.
    db = str(tmp_path / "relay.db")
    first, port = procs.server("--db", db)
    job = call(port, "submit", queue="q", payload=1)["result"]["job"]
    assert first.stop(timeout_s=15) == 0
    with contextlib.closing(sqlite3.connect(db)) as sql, sql:
        columns = [row[1] for row in sql.execute("PRAGMA table_info(relay_job)")]
        copy = ", ".join("'job_old_server'" if c == "id" else c for c in columns)
        sql.execute(
            f"INSERT INTO relay_job ({', '.join(columns)}) "
            f"SELECT {copy} FROM relay_job WHERE id = ?",
            (job["id"],),
        )
    second, port = procs.server("--db", db)
    repaired = second.wait_event("counts_repaired")
    assert repaired["pairs"] == [{"queue": "q", "state": "ready", "kept": 1, "jobs": 2}]
    assert call(port, "stats")["result"]["queues"]["q"]["ready"] == 2
    assert second.stop(timeout_s=15) == 0
    third, _ = procs.server("--db", db)
    third.wait_event("ready")
    assert "counts_repaired" not in third.stderr_text()
