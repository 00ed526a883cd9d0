"""The write-ahead log scanner (``queue_core.storage.sqlite.wal``) against SQLite itself.

Each log here is written by SQLite: by a writer process killed with SIGKILL at a point its
own progress lines name (so the log ends wherever the kill found the next transaction), or
by a connection left open while the files are copied. The scanner must agree with what
SQLite's recovery keeps (``replayed``), never call a crash's torn tail lost, and find the
committed transactions a damaged frame makes recovery drop, which SQLite's own row count
then confirms.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_core.storage.sqlite import wal

pytestmark = [pytest.mark.slow, pytest.mark.crash]

# Transactions of mixed sizes with a tiny page cache, so large ones spill frames before they
# commit (and rewrite spilled frames in place), some rolled back, some deletes; each commit
# is followed by a line with the rows committed so far.
WRITER = r"""
import os, random, sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("PRAGMA journal_mode=WAL")
c.execute("PRAGMA synchronous=FULL")
c.execute("PRAGMA cache_size=8")
c.execute("PRAGMA wal_autocheckpoint=" + sys.argv[2])
c.execute("CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, v TEXT)")
c.execute("CREATE INDEX IF NOT EXISTS tv ON t(v)")
rng = random.Random(int(sys.argv[3]))
while True:
    c.execute("BEGIN IMMEDIATE")
    rows = [(os.urandom(40).hex(),) for _ in range(rng.choice([1, 5, 200, 800]))]
    c.executemany("INSERT INTO t(v) VALUES (?)", rows)
    c.execute("UPDATE t SET v = v || 'a' WHERE id IN (SELECT id FROM t ORDER BY random() LIMIT 20)")
    if rng.random() < 0.2:
        c.execute("ROLLBACK")
        continue
    if rng.random() < 0.05:
        c.execute("DELETE FROM t WHERE id % 3 = 0")
    c.execute("COMMIT")
    print(c.execute("SELECT count(*) FROM t").fetchone()[0], flush=True)
"""


def crashed_log(db: Path, commits: int, seed: int, autocheckpoint: int = 0) -> None:
    """Run the writer on ``db`` until it has printed ``commits`` lines, then SIGKILL it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db), str(autocheckpoint), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for _ in range(commits):
            assert proc.stdout.readline(), "the writer exited early"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


def rows(db: Path) -> int:
    """Rows SQLite sees in ``db`` (a copy: recovery must not touch the scanned files)."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(conn.execute("SELECT count(*) FROM t").fetchone()[0])


def copy(db: Path, to: Path) -> Path:
    shutil.copy(db, to)
    shutil.copy(f"{db}-wal", f"{to}-wal")
    return to


def flip(db: Path, at: int, mask: int = 0xFF) -> None:
    with open(f"{db}-wal", "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ mask]))


def frame_at(db: Path, index: int) -> int:
    """The offset of frame ``index`` (0-based) in ``db``'s log."""
    return wal.HEADER_BYTES + index * (wal.FRAME_HEADER_BYTES + 4096)


def commit_frames(db: Path, upto: int) -> list[int]:
    """Indexes of the commit frames among the first ``upto`` frames of ``db``'s log."""
    data = Path(f"{db}-wal").read_bytes()
    found = []
    for i in range(upto):
        at = frame_at(db, i)
        if int.from_bytes(data[at + 4 : at + 8], "big"):
            found.append(i)
    return found


@contextlib.contextmanager
def open_log(db: Path) -> Iterator[sqlite3.Connection]:
    """A connection writing ``db``'s log by hand: WAL, no automatic checkpoint, a small page
    cache (large transactions spill frames before they commit), a table ``t``."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("PRAGMA cache_size=8")
        conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT)")
        yield conn
    finally:
        conn.close()


def test_no_log_and_a_clean_log_have_nothing_lost(tmp_path: Path) -> None:
    db = tmp_path / "clean.db"
    assert wal.scan(str(db)) is None and wal.problems(str(db)) == []
    crashed_log(db, commits=30, seed=1)
    found = wal.scan(str(db))
    assert found is not None and found.frames > 30
    assert found.lost_commits == 0 and wal.problems(str(db)) == []


@pytest.mark.parametrize("seed", range(12))
def test_a_writer_killed_anywhere_leaves_no_lost_commit(tmp_path: Path, seed: int) -> None:
    """The torn tail of SIGKILL is never called damage, whatever the kill interrupted: a
    spilled transaction, a rollback's leftovers, a checkpoint's restart of the log."""
    db = tmp_path / f"k{seed}.db"
    rng = random.Random(seed)
    crashed_log(db, commits=rng.randrange(5, 60), seed=seed, autocheckpoint=rng.choice([0, 40]))
    found = wal.scan(str(db))
    assert found is not None
    assert found.lost_commits == 0, found
    assert wal.problems(str(db)) == []


@pytest.mark.parametrize("seed", range(6))
def test_a_damaged_frame_before_the_last_transaction_is_found(tmp_path: Path, seed: int) -> None:
    """One byte flipped in a frame of any transaction but the last: the scan reports lost
    commits, and SQLite's recovery indeed sees fewer rows than the undamaged log holds."""
    db = tmp_path / "base.db"
    crashed_log(db, commits=20, seed=100 + seed)  # no checkpoint: every commit is in the log
    found = wal.scan(str(db))
    assert found is not None and found.lost_commits == 0
    commits = commit_frames(db, found.replayed)
    assert len(commits) >= 3
    rng = random.Random(seed)
    frame = rng.randrange(0, commits[-2] + 1)  # at or before the second-to-last commit frame
    at = frame_at(db, frame) + rng.randrange(0, wal.FRAME_HEADER_BYTES + 4096)
    whole = rows(copy(db, tmp_path / "whole.db"))
    damaged = copy(db, tmp_path / "damaged.db")
    flip(damaged, at)
    after = wal.scan(str(damaged))
    assert after is not None and after.lost_commits >= 1, (frame, at, after)
    assert after.first_bad is not None and after.first_bad <= frame
    assert wal.problems(str(damaged))[0].startswith(f"write-ahead log {damaged}-wal is damaged")
    assert rows(copy(damaged, tmp_path / "seen.db")) < whole  # what SQLite drops is real


@pytest.mark.parametrize(
    ("at", "mask"),
    [(3, 0xFF), (3, 0x01), (10, 0xFF), (10, 0x30), (17, 0xFF), (26, 0xFF)],
    ids=[
        "magic",
        "magic turned into the other byte order",
        "page size",
        "page size turned into another valid one",
        "salt",
        "checksum",
    ],
)
def test_a_damaged_header_is_found(tmp_path: Path, at: int, mask: int) -> None:
    """SQLite replays nothing from a log whose header is damaged (the table it created is
    gone); the scan says so, in each of the header's fields."""
    db = tmp_path / "h.db"
    crashed_log(db, commits=10, seed=7)
    flip(db, at, mask)
    found = wal.scan(str(db))
    assert found is not None and found.first_bad == -1 and found.replayed == 0
    assert found.lost_commits >= 9
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        rows(copy(db, tmp_path / "seen.db"))


def test_damage_in_the_last_transaction_is_not_told_from_a_torn_write(tmp_path: Path) -> None:
    """The documented gap: nothing after the last commit proves it was complete."""
    db = tmp_path / "last.db"
    crashed_log(db, commits=10, seed=9)
    found = wal.scan(str(db))
    assert found is not None
    last = commit_frames(db, found.replayed)[-2] + 1  # the last transaction's first frame
    flip(db, frame_at(db, last) + 100)
    after = wal.scan(str(db))
    assert after is not None and after.first_bad == last and after.lost_commits == 0


def test_a_log_restarted_by_a_checkpoint_keeps_its_stale_frames_out(tmp_path: Path) -> None:
    """After a checkpoint restarts the log, frames of the earlier generation beyond the new
    end carry other salts: recovery stops there, and nothing is lost."""
    db = tmp_path / "restart.db"
    with open_log(db) as conn:
        for _ in range(20):
            conn.execute("INSERT INTO t(v) VALUES (?)", ("x" * 3000,))
        assert conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[0] == 0
        conn.execute("INSERT INTO t(v) VALUES ('new generation')")  # restarts the log
        copy(db, tmp_path / "copy.db")  # the files as a crash would leave them
    found = wal.scan(str(tmp_path / "copy.db"))
    assert found is not None and found.frames > found.replayed >= 1
    assert found.first_bad == found.replayed and found.lost_commits == 0
    assert rows(copy(tmp_path / "copy.db", tmp_path / "seen.db")) == 21


def test_a_partial_frame_at_the_end_is_not_counted(tmp_path: Path) -> None:
    db = tmp_path / "partial.db"
    crashed_log(db, commits=20, seed=3)
    size = Path(f"{db}-wal").stat().st_size
    whole = (size - wal.HEADER_BYTES) // (wal.FRAME_HEADER_BYTES + 4096)
    found = wal.scan(str(db))
    assert found is not None and found.frames == whole
    with open(f"{db}-wal", "r+b") as f:
        f.truncate(size - 100)  # a frame cut short, as by a full disk
    cut = wal.scan(str(db))
    assert cut is not None and cut.frames == whole - 1 and cut.lost_commits == 0


def test_written_since_boot_reads_the_logs_time_against_the_boot(tmp_path: Path) -> None:
    db = tmp_path / "boot.db"
    assert wal.written_since_boot(str(db)) is None  # no log
    crashed_log(db, commits=3, seed=5)
    assert wal.written_since_boot(str(db)) is True
    booted = next(
        int(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    os.utime(f"{db}-wal", (booted - 3600, booted - 3600))
    assert wal.written_since_boot(str(db)) is False


def test_leftovers_of_a_rolled_back_transaction_prove_nothing(tmp_path: Path) -> None:
    """A rolled-back transaction that spilled frames leaves them past the next commit, with
    the log's salts and chained among themselves, but not from that commit: damage in the
    last transaction before them is still not called a lost commit."""
    db = tmp_path / "rollback.db"
    with open_log(db) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO t(v) VALUES (?)", [("y" * 500,)] * 2000)  # spills
        conn.execute("ROLLBACK")
        conn.execute("INSERT INTO t(v) VALUES ('kept')")
        copy(db, tmp_path / "copy.db")
    db = tmp_path / "copy.db"
    found = wal.scan(str(db))
    assert found is not None and found.lost_commits == 0
    assert found.frames > found.replayed + 10  # the leftovers
    last = commit_frames(db, found.replayed)[-2] + 1  # the last transaction's first frame
    flip(db, frame_at(db, last) + 200)
    after = wal.scan(str(db))
    assert after is not None and after.first_bad == last and after.lost_commits == 0, after


def test_damage_is_reported_only_where_two_reads_place_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame another process was writing during the first read (a web process sharing the
    file) can look damaged once: the second read must find the same first bad frame."""
    reads = iter(
        [
            wal.WalScan(frames=9, replayed=3, first_bad=4, lost_commits=1),
            wal.WalScan(frames=12, replayed=7, first_bad=8, lost_commits=1),  # it moved
            wal.WalScan(frames=9, replayed=3, first_bad=4, lost_commits=2),
            wal.WalScan(frames=9, replayed=3, first_bad=4, lost_commits=2),  # it stayed
        ]
    )
    monkeypatch.setattr(wal, "scan", lambda path: next(reads))
    assert wal.problems(str(tmp_path / "x.db")) == []
    (found,) = wal.problems(str(tmp_path / "x.db"))
    assert "damaged at frame 4 of 9" in found and "at least 2 committed" in found
