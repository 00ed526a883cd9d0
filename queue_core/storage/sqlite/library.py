"""Process-wide configuration of the SQLite library that Python's ``sqlite3`` module runs on.

No Django here: ``relay_bench.ceiling`` calls it too, so the ceiling server runs on the same
library configuration as Relay.
"""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger("relay.storage")

SQLITE_OK = 0
SQLITE_CONFIG_MEMSTATUS = 9  # sqlite3.h

_lock = threading.Lock()
_state: bool | None = None  # what memory_statistics_off returned the first time


def _library() -> ctypes.PyDLL:
    """The SQLite library ``_sqlite3`` is linked with: symbols looked up through the extension
    module's own handle resolve in its dependencies (a system ``libsqlite3.so``), so this is
    the copy its connections use, not another one on the library path. A ``PyDLL``: its calls
    keep the GIL, so no other Python thread can open a connection between the check that
    none is open and the shutdown (a ``CDLL`` releases it around each call: a review)."""
    import _sqlite3

    lib = ctypes.PyDLL(_sqlite3.__file__)
    lib.sqlite3_memory_used.restype = ctypes.c_int64
    lib.sqlite3_compileoption_used.argtypes = [ctypes.c_char_p]
    return lib


def memory_statistics_off() -> bool:
    """Turn SQLite's memory statistics off for this process (once; later calls return the
    first call's answer).

    SQLite counts each of its allocations in process-wide statistics (``sqlite3_status``)
    under a global mutex: about 500 allocations per lease+ack in Relay's server, two mutex
    operations each. SQLite lists ``SQLITE_DEFAULT_MEMSTATUS=0`` first among its recommended
    compile-time options, as making ``sqlite3_malloc`` and so the whole library faster
    (https://sqlite.org/compile.html#recommended_compile_time_options); Debian's build (and
    others) leave it on. Nothing in Relay reads the statistics; they also drive
    ``sqlite3_soft_heap_limit64``, which Relay does not set. Measured with
    ``python -m relay_bench.instructions`` (docs/benchmarking.md, round 12): 4-5% fewer
    instructions per lease+ack.

    The setting can change only while the library is shut down (``sqlite3_config``, and
    ``import sqlite3`` initializes it). So this shuts SQLite down and initializes it again,
    and only while it holds no memory at all (``sqlite3_memory_used()`` is 0 while the
    statistics are on: no connection or statement is open, which a shutdown would break).
    Call it before the process opens its first connection (``QueueCoreConfig.ready``).

    Returns:
        True when the statistics are off (turned off here, or built off); False when they
        were left on: SQLite already held memory, or a call failed (logged).
    """
    global _state
    with _lock:
        if _state is None:
            _state = _turn_off()
        return _state


def _turn_off() -> bool:
    try:
        lib = _library()
        if lib.sqlite3_compileoption_used(b"DEFAULT_MEMSTATUS=0"):
            return True
        if int(lib.sqlite3_memory_used()) != 0:
            log.info(
                "event=sqlite_memstatus_kept reason=%s",
                "connections_open",
                extra={"event": "sqlite_memstatus_kept", "reason": "connections_open"},
            )
            return False
        if lib.sqlite3_shutdown() != SQLITE_OK:
            return False
        configured = bool(lib.sqlite3_config(SQLITE_CONFIG_MEMSTATUS, ctypes.c_int(0)) == SQLITE_OK)
        if lib.sqlite3_initialize() != SQLITE_OK:  # connections initialize it again anyway
            return False
        return configured
    except (OSError, AttributeError) as exc:  # no such library or symbol (a static build)
        log.info(
            "event=sqlite_memstatus_kept reason=%s",
            type(exc).__name__,
            extra={"event": "sqlite_memstatus_kept", "reason": repr(exc)},
        )
        return False


def memory_statistics_on() -> bool:
    """Whether SQLite keeps memory statistics in this process: it reports memory in use
    while a connection is open (open one first)."""
    return bool(_library().sqlite3_memory_used())
