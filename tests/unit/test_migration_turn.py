"""The SQLite migration turn (``queue_core.schema._one_migration``) inside one process: its
descriptor, kept for the process's life, is one per file however many turns it takes; where
open-file-description locks are missing it is the folder's ``flock``; a file it cannot open
for a reason other than being read-only stops the migration rather than run it unturned."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest

from queue_core import schema
from queue_core.errors import StorageIO


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_turns_on_one_file_keep_one_descriptor(tmp_path: Path) -> None:
    # A third review: 100 migrations in one process held 100 more descriptors (the 56th
    # failed with EMFILE under a limit of 64), and files deleted since stayed on disk.
    db = str(tmp_path / "relay.db")
    with schema._one_migration(db) as first:
        pass
    before = _open_fds()
    for _ in range(50):
        with schema._one_migration(db) as again:
            assert again == first
    assert _open_fds() == before
    assert Path(db).stat().st_mode & 0o777 == 0o600  # made here, its owner's alone


def test_a_deleted_files_descriptor_is_let_go_when_the_file_is_made_again(tmp_path: Path) -> None:
    # A fourth review: a process that migrated a database, deleted it and migrated a new one
    # at the same path, 20 times, held 20 more descriptors of deleted files.
    db = tmp_path / "relay.db"
    with schema._one_migration(str(db)):
        pass
    before = _open_fds()
    for _ in range(20):
        db.unlink()
        with schema._one_migration(str(db)) as fd:
            assert fd is not None and os.fstat(fd).st_nlink == 1
    assert _open_fds() == before


def test_without_open_file_description_locks_the_turn_is_the_folders_flock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A third review: F_OFD_SETLK exists on Linux only; elsewhere every migrate crashed.
    monkeypatch.setattr(schema, "_OFD", False)
    db = str(tmp_path / "relay.db")
    probe = os.open(tmp_path, os.O_RDONLY)
    try:
        with schema._one_migration(db) as fd:
            assert fd is not None
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go with the turn
    finally:
        os.close(probe)


def test_a_file_that_cannot_be_opened_for_a_turn_stops_the_migration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A third review: out of descriptors (EMFILE), the migration ran without a turn.
    def no_descriptors(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as patched:
        patched.setattr(schema.os, "open", no_descriptors)  # os's own: only inside this block
        with pytest.raises(StorageIO, match="Too many open"):
            schema._kept_fd(str(tmp_path / "relay.db"))
