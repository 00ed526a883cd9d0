"""Corruption detection: a database file with damaged pages is refused at start.

A real database with data is built once through a real server (1,000 jobs over three queues,
some leased and acked, so every table and index spans many pages), and stopped cleanly. Each
test damages a copy in one way, at the pages ``dbstat`` says hold a given table or index, and
starts ``relay_server`` on it: it must exit with code 3 and a ``CORRUPT: database <path> failed
integrity check`` message, never log ``ready``, and leave the file as it found it.

The server's start-up check is ``PRAGMA integrity_check`` by default, which also finds an index
entry that no longer matches its row. Damage it cannot see is kept as strict xfails, so the gap
stays visible (and the mark must go once the server catches it): that index damage under
``RELAY_STARTUP_CHECK=quick`` (``quick_check`` skips the comparison) and bytes changed inside a
stored value (SQLite keeps no page checksums).

A damaged frame in the write-ahead log after a crash, which SQLite's recovery takes for the
log's end (dropping every later committed transaction without an error), is refused by the
server's own read of the log (``queue_core/storage/sqlite/wal.py``); a log last written before
the machine booted is logged instead (frames never synced may be torn by an OS crash).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import signal
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from queue_core.client import RelayClient
from relay_bench.child import LogWaitError
from tests.procs import Spawner, spawner

pytestmark = [pytest.mark.slow, pytest.mark.crash]

PAGE = 4096


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cleanly closed database with data in every table, built by a real server."""
    db = Path(tmp_path_factory.mktemp("corruption")) / "base.db"
    with spawner(str(db)) as spawn:
        server, port = spawn.server()
        with RelayClient(f"127.0.0.1:{port}") as client:
            for batch in range(10):
                client.submit_batch(
                    [
                        {
                            "queue": f"q{i % 3}",
                            "payload": {"i": i, "text": "x" * 200},
                            "idempotency_key": f"k{batch}-{i}",
                        }
                        for i in range(100)
                    ]
                )
            for _ in range(3):
                for lease in client.lease(["q0", "q1", "q2"], worker_id="w", max_jobs=100)[:60]:
                    client.ack(lease["job_id"], worker_id="w", lease_token=lease["lease_token"])
        server.signal(signal.SIGTERM)
        assert server.wait_exit(30) == 0, server.stderr_text()[-2000:]
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA page_size").fetchone()[0] == PAGE
        assert conn.execute("PRAGMA quick_check").fetchall() == [("ok",)]
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page into the main file
    assert not Path(f"{db}-wal").exists()  # the last connection closed: no log left
    return db


def pages(db: Path, name: str, kind: str) -> list[int]:
    """Page numbers of table or index ``name`` of type ``kind`` (``leaf``/``internal``)."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        found = [
            p
            for (p,) in conn.execute(
                "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = ? ORDER BY pageno",
                (name, kind),
            )
        ]
    assert found, f"no {kind} pages of {name}"
    return found


def write(db: Path, page: int, offset: int, data: bytes) -> None:
    with db.open("r+b") as f:
        f.seek((page - 1) * PAGE + offset)
        f.write(data)


def read(db: Path, page: int) -> bytes:
    with db.open("rb") as f:
        f.seek((page - 1) * PAGE)
        return f.read(PAGE)


def noise(n: int, seed: int = 7) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(n))


def zero_table_leaf(db: Path) -> None:
    leaves = pages(db, "relay_job", "leaf")
    write(db, leaves[len(leaves) // 2], 0, b"\0" * PAGE)


def zero_table_interior(db: Path) -> None:
    write(db, pages(db, "relay_job", "internal")[0], 0, b"\0" * PAGE)


def garbage_index_page(db: Path) -> None:
    leaves = pages(db, "relay_job_queue_state", "leaf")
    write(db, leaves[len(leaves) // 2], 0, noise(PAGE))


def garbage_attempt_page(db: Path) -> None:
    write(db, pages(db, "relay_attempt", "leaf")[0], 0, noise(PAGE, seed=11))


def garbage_cell_area(db: Path) -> None:
    write(db, pages(db, "relay_job", "leaf")[3], PAGE // 2, noise(PAGE // 2))


def lost_tail(db: Path) -> None:
    with db.open("r+b") as f:
        f.truncate(db.stat().st_size - 20 * PAGE)


def wrong_page_count(db: Path) -> None:
    write(db, 1, 28, (999_999).to_bytes(4, "big"))  # the header's "database size in pages"


def broken_freelist(db: Path) -> None:
    write(db, 1, 32, (150).to_bytes(4, "big"))  # first freelist trunk page: a table page
    write(db, 1, 36, (5).to_bytes(4, "big"))


DETECTED: dict[str, Callable[[Path], None]] = {
    "zeroed table leaf page": zero_table_leaf,
    "zeroed table interior page": zero_table_interior,
    "garbage over an index page": garbage_index_page,
    "garbage over an attempt-history page": garbage_attempt_page,
    "garbage over half a table page": garbage_cell_area,
    "lost last pages": lost_tail,
    "wrong page count in the header": wrong_page_count,
    "broken freelist": broken_freelist,
}


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Spawner]:
    with spawner(str(tmp_path / "decoy.db")) as s:
        yield s


def assert_refused(procs: Spawner, db: Path, **env: str) -> None:
    """``relay_server`` on ``db`` exits 3 with a clear message, serves nothing, changes nothing."""
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    server = procs("relay_server", "--db", str(db), "--address", "127.0.0.1:0", **env)
    try:  # whichever comes first: a line showing it started, or its exit
        started = server.wait_for(lambda r: r.get("event") in ("recovered", "ready"), 120)
    except LogWaitError:  # stderr ended without such a line: it exited
        started = None
    assert started is None, f"the server started on the damaged file: {started}"
    code = server.wait_exit(60)
    stderr = server.stderr_text()
    assert code == 3, stderr[-2000:]
    assert f"CORRUPT: database {db}" in stderr
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before  # not migrated or repaired


@pytest.mark.parametrize("damage", list(DETECTED.values()), ids=list(DETECTED))
def test_damaged_pages_make_the_server_refuse_to_start(
    base: Path, tmp_path: Path, procs: Spawner, damage: Callable[[Path], None]
) -> None:
    db = tmp_path / "damaged.db"
    shutil.copy(base, db)
    damage(db)
    assert_refused(procs, db)


def damage_index_entry(db: Path, state: bytes) -> None:
    """Re-file one (q1, ``state``) entry of the (queue, state, id) index under queue q9."""
    key = b"q1" + state
    page = next(p for p in pages(db, "relay_job_queue_state", "leaf") if key in read(db, p))
    write(db, page, read(db, page).find(key), b"q9")
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA quick_check").fetchall() == [("ok",)]  # the gap
        assert "missing from index" in conn.execute("PRAGMA integrity_check").fetchone()[0]


@pytest.mark.parametrize(
    "startup_check",
    [
        "integrity",  # the default: PRAGMA integrity_check compares index entries and rows
        pytest.param(
            "quick",
            marks=pytest.mark.xfail(
                strict=True,
                reason="GAP (RELAY_STARTUP_CHECK=quick): PRAGMA quick_check does not compare "
                "index entries with their table rows; a damaged entry of a finished job passes "
                "it, and the server starts and serves from the damaged file",
            ),
        ),
    ],
)
def test_index_entry_that_no_longer_matches_its_row_is_refused(
    base: Path, tmp_path: Path, procs: Spawner, startup_check: str
) -> None:
    db = tmp_path / "index.db"
    shutil.copy(base, db)
    damage_index_entry(db, b"succeeded")
    assert_refused(procs, db, RELAY_STARTUP_CHECK=startup_check)


def test_index_damage_found_during_recovery_is_reported_as_corruption(
    base: Path, tmp_path: Path, procs: Spawner
) -> None:
    db = tmp_path / "index-leased.db"
    shutil.copy(base, db)
    damage_index_entry(db, b"leased")
    assert_refused(procs, db)


@pytest.mark.xfail(
    strict=True,
    reason="LIMITATION: SQLite keeps no page checksums, so bytes changed inside a stored value "
    "(here a payload) pass quick_check and integrity_check alike; detecting it needs a "
    "checksumming VFS (cksumvfs) or a per-row checksum column",
)
def test_bytes_changed_inside_a_stored_payload_are_refused(
    base: Path, tmp_path: Path, procs: Spawner
) -> None:
    db = tmp_path / "payload.db"
    shutil.copy(base, db)
    page = pages(db, "relay_job", "leaf")[5]
    at = read(db, page).find(b"x" * 50)
    assert at > 0
    write(db, page, at, b"y" * 50)
    assert_refused(procs, db)


def test_damaged_wal_after_a_crash_is_refused_not_silently_truncated(
    tmp_path: Path, procs: Spawner
) -> None:
    db = tmp_path / "crashed.db"
    server, port = procs.server("--db", str(db))
    with RelayClient(f"127.0.0.1:{port}") as client:
        for _ in range(5):
            client.submit_batch([{"queue": "q", "payload": {"i": i}} for i in range(50)])
    server.kill()  # SIGKILL: the 250 committed jobs are in the WAL, not yet in the main file
    wal = Path(f"{db}-wal")
    size = wal.stat().st_size
    assert size > 32 + 24 + PAGE
    with wal.open("r+b") as f:  # flip one byte in the middle of the log
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert_refused(procs, db)


def test_damaged_wal_last_written_before_the_boot_is_logged_and_served(
    tmp_path: Path, procs: Spawner
) -> None:
    """After an OS crash or power loss, frames never synced (leases commit without a sync)
    may be torn: recovery dropping them is what it is for, so the server starts and says
    what was dropped (``wal_tail_dropped``) instead of refusing."""
    db = tmp_path / "rebooted.db"
    server, port = procs.server("--db", str(db))
    with RelayClient(f"127.0.0.1:{port}") as client:
        for _ in range(5):
            client.submit_batch([{"queue": "q", "payload": {"i": i}} for i in range(50)])
    server.kill()
    wal = Path(f"{db}-wal")
    size = wal.stat().st_size
    with wal.open("r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    booted = next(
        int(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    os.utime(wal, (booted - 60, booted - 60))
    again = procs("relay_server", "--db", str(db), "--address", "127.0.0.1:0")
    dropped = again.wait_for(lambda r: r.get("event") == "wal_tail_dropped", 60)
    assert "committed transaction(s)" in dropped["detail"], dropped
    again.wait_for(lambda r: r.get("event") == "ready", 60)
