"""Find committed transactions that SQLite's recovery of a damaged write-ahead log would drop.

SQLite replays a ``-wal`` file frame by frame and stops at the first frame whose salts or
checksum do not match (https://sqlite.org/fileformat2.html#walformat): a bad frame reads
as the torn end of a crash, so every transaction committed after it is dropped without an
error, and ``PRAGMA integrity_check`` then finds a consistent, older database. That is right
for a torn tail and wrong for damage in the middle of the log: there it loses jobs whose
submit or ack was answered.

``scan`` tells them apart by what follows the first bad frame. Each frame's checksum
continues the one stored in the frame before it, so a frame after the damage can still be
checked against its stored predecessor. When the frame right after a commit frame (at or
after the damage) is sound against that commit frame, a later transaction had begun, so
the one that commit frame ends had been written whole before the crash: a process crash
keeps every byte written (an OS crash may not; see ``written_since_boot``). The last
transaction has no such witness, and a crash can leave it with a frame that fails its
checksum (cut mid-write, or killed while its commit rewrote the checksums of frames it had
spilled earlier), so damage inside it is not told from a crash and goes unreported; so is
damage that runs to the end of the log (zeroed or cut-off last frames), which leaves no later
frame to prove anything.

Read the file only while no connection of this process has it open (before the server's
first query: SQLite's recovery runs then).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

MAGIC_LITTLE = 0x377F0682  # checksums over little-endian words
MAGIC_BIG = 0x377F0683  # checksums over big-endian words
VERSION = 3007000
HEADER_BYTES = 32
FRAME_HEADER_BYTES = 24
_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class WalScan:
    """What one read of a ``-wal`` file found.

    Attributes:
        frames: complete frames in the file (stale ones from an earlier checkpoint included).
        replayed: frames SQLite's recovery keeps: through the last commit frame before the
            first bad frame (0 when the header is bad).
        first_bad: 0-based index of the first frame recovery rejects, or None when it reads
            to the end (``-1``: the log's header itself is bad).
        lost_commits: commit frames at or after ``first_bad`` whose transaction a later
            transaction's sound frame proves was complete; recovery drops each of them.
    """

    frames: int
    replayed: int
    first_bad: int | None
    lost_commits: int


def checksum(data: bytes, seed: tuple[int, int], big_endian: bool) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (a multiple of 8 bytes), continuing ``seed``.

    The Fletcher-like sum of https://sqlite.org/fileformat2.html#walformat, over 32-bit
    words in the byte order the log's magic number names.
    """
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    s0, s1 = seed
    for a, b in zip(words[0::2], words[1::2], strict=True):
        s0 = (s0 + a + s1) & _MASK
        s1 = (s1 + b + s0) & _MASK
    return s0, s1


def _page_size(db_path: str) -> int | None:
    """The database's page size from its header (bytes 16 and 17; 1 means 65,536), or None."""
    try:
        with open(db_path, "rb") as f:
            head = f.read(100)
    except OSError:
        return None
    if len(head) < 100 or not head.startswith(b"SQLite format 3\x00"):
        return None
    (size,) = struct.unpack(">H", head[16:18])
    return 65536 if size == 1 else size


def _sane_page_size(size: int) -> bool:
    return 512 <= size <= 65536 and size & (size - 1) == 0


def scan(db_path: str) -> WalScan | None:
    """Read ``<db_path>-wal`` as SQLite's recovery would; None when there is no log to read.

    Args:
        db_path: the database file's path; its log is the same path with ``-wal``.

    Returns:
        None when the log is absent, empty or shorter than its header, or when its page size
        cannot be told (from its header, else from the database's).

    Raises:
        OSError: the log exists but cannot be read.
    """
    try:
        f = open(f"{db_path}-wal", "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return None
    with f:
        return _read(db_path, f.fileno())


def _read(db_path: str, fd: int) -> WalScan | None:
    """``scan`` of the open log ``fd``, read frame by frame (a log that readers kept from
    being checkpointed can be large; one that shrinks meanwhile ends where it ends)."""
    head = os.pread(fd, HEADER_BYTES, 0)
    if len(head) < HEADER_BYTES:
        return None
    magic, version, page_size, _seq, salt1, salt2, c0, c1 = struct.unpack(">8I", head)
    known = magic in (MAGIC_LITTLE, MAGIC_BIG)
    header_ok = (
        known and version == VERSION and checksum(head[:24], (0, 0), magic == MAGIC_BIG) == (c0, c1)
    )
    if not header_ok or not _sane_page_size(page_size):
        # The database's own page size, unless it cannot be read (one flipped bit turns a
        # page size into another valid one).
        page_size = _page_size(db_path) or page_size
        if not _sane_page_size(page_size):
            return None
    size = FRAME_HEADER_BYTES + page_size
    frames = (os.fstat(fd).st_size - HEADER_BYTES) // size
    # A bad header: recovery replays nothing, and the frames that still chain from the
    # header's stored checksum are what it drops: in either byte order (one flipped bit turns
    # one valid magic number into the other), with frame 0's salts if the header's were.
    orders = [magic == MAGIC_BIG] if header_ok else [False, True]
    salts = {(salt1, salt2)}
    first = os.pread(fd, FRAME_HEADER_BYTES, HEADER_BYTES)
    if not header_ok and len(first) == FRAME_HEADER_BYTES:
        salts.add(struct.unpack(">2I", first[8:16]))
    return max(
        (
            _scan(fd, frames, size, pair, (c0, c1), big, header_bad=not header_ok)
            for big in orders
            for pair in sorted(salts)
        ),
        key=lambda s: s.lost_commits,
    )


def _scan(
    fd: int,
    frames: int,
    size: int,
    salts: tuple[int, int],
    seed: tuple[int, int],
    big_endian: bool,
    *,
    header_bad: bool,
) -> WalScan:
    """Walk the frames once: the prefix recovery keeps, then what follows its end.

    After the first bad frame, a transaction counts as lost when the frame right after its
    commit frame is sound against that commit frame: the next transaction's first frame
    chains from it, where a leftover of a rolled-back transaction does not.
    """
    replayed = 0
    first_bad: int | None = -1 if header_bad else None
    prev = seed  # the checksum stored in the frame before (the header's for frame 0)
    after_commit = False  # the frame before ended a transaction at or after the damage
    lost = 0
    for i in range(frames):
        frame = os.pread(fd, size, HEADER_BYTES + i * size)
        if len(frame) < size:
            frames = i  # the log shrank while it was read
            break
        page, commit, s1, s2, k0, k1 = struct.unpack(">6I", frame[:FRAME_HEADER_BYTES])
        ours = (s1, s2) == salts
        body = frame[:8] + frame[FRAME_HEADER_BYTES:]
        sound = ours and page != 0 and checksum(body, prev, big_endian) == (k0, k1)
        if first_bad is None:
            if sound:
                replayed = i + 1 if commit else replayed
            else:
                first_bad = i
        elif sound and after_commit:
            lost += 1
        after_commit = first_bad is not None and commit != 0 and (ours or i == first_bad)
        prev = (k0, k1)
    return WalScan(frames=frames, replayed=replayed, first_bad=first_bad, lost_commits=lost)


def problems(db_path: str) -> list[str]:
    """The start-up check's findings about ``<db_path>-wal`` (``[]`` when nothing is lost).

    A damage found is read a second time, and reported only where both reads place it, so a
    frame another process was writing at the first read (a Django project's web process
    sharing the file) is not taken for damage.

    Raises:
        OSError: the log cannot be read.
    """
    first = scan(db_path)
    if first is None or not first.lost_commits:
        return []
    again = scan(db_path)
    if again is None or not again.lost_commits or again.first_bad != first.first_bad:
        return []
    where = "its header" if again.first_bad == -1 else f"frame {again.first_bad} of {again.frames}"
    return [
        f"write-ahead log {db_path}-wal is damaged at {where}: SQLite's recovery would drop "
        f"at least {again.lost_commits} committed transaction(s) after it without an error "
        f"(to accept the loss: keep a copy of the log, then run sqlite3 {db_path} "
        '"PRAGMA wal_checkpoint(TRUNCATE)")'
    ]


def written_since_boot(db_path: str) -> bool | None:
    """Whether ``<db_path>-wal`` was last written after this machine booted (Linux's
    ``btime`` in ``/proc/stat``); None when either cannot be read.

    A log last written before the boot may have lost writes that were never synced (an OS
    crash or power loss), which can tear frames in its unsynced tail; one written since
    cannot (a process crash leaves every written byte in the page cache).
    """
    try:
        mtime = os.stat(f"{db_path}-wal").st_mtime
        with open("/proc/stat", encoding="ascii") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return mtime >= btime
