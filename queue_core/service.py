"""QueueService: the one place where job state changes.

The TCP server, the HTTP API, the admin actions, the CLI and the django.tasks backend all call
this class; none of them writes job state itself, and none reaches storage: this is the only
caller of a storage driver (``queue_core.storage``; SQLite or PostgreSQL). Every method runs in
one ``driver.write()`` transaction (a SAVEPOINT when the caller already holds one, which is how
the server commits many requests at once: ``transaction()``), guards each UPDATE with the
state it expects (compare-and-set, as River's queries do), and on a guard miss re-reads the
job to explain the rejection with a stable error code. Each state change is checked against
the transition table first (``states.check``: a move the table does not list raises
``IllegalTransition``, a bug, and what the call wrote rolls back).

Results are plain JSON-ready dicts in the shapes ``docs/protocol.md`` documents.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import math
import os
import random
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import orjson
from django.apps import apps

from queue_core import validation as v
from queue_core.clock import (
    AnchoredClock,
    Clock,
    Reading,
    StepGuard,
    clock_from_path,
    database_clock,
    outside,
)
from queue_core.conf import RelaySettings, relay_settings
from queue_core.errors import (
    IdempotencyConflict,
    InvalidArgument,
    InvalidState,
    JobFinished,
    JobNotFound,
    LeaseExpired,
    RelayError,
    StaleToken,
    StoreBusy,
    TooManyQueues,
)
from queue_core.jobs import batch_entry, job_view, lease_view, new_job_view
from queue_core.protocol import ops
from queue_core.retry import RetryPolicy, decide
from queue_core.states import (
    TERMINAL_STATES,
    WAITING_STATES,
    JobState,
    Transition,
    check,
    is_terminal,
)
from queue_core.storage import Capabilities, ChangeFeed, ClaimRequest, Driver, Tx, driver_for
from queue_core.storage.base import REPLY_OVERHEAD_BYTES

log = logging.getLogger("relay.service")

# The names a job's options may have (the op catalogue declares them with their wire types).
SUBMIT_OPTIONS = frozenset(ops.SUBMIT_OPTIONS)
# The fields of an ack's (or fail's) lease_next, and of one entry of an ack_batch (an ack's
# arguments but lease_next): the op catalogue declares both as plain objects, and
# tests/unit/test_ops.py holds these to it and to the HTTP schemas.
LEASE_NEXT_FIELDS = frozenset({"queues", "max_jobs", "lease_ms", "worker_id"})
ACK_ENTRY_FIELDS = frozenset({"job_id", "worker_id", "lease_token", "result"})
# The fields of one entry of a renew_batch (a renew's arguments).
RENEW_ENTRY_FIELDS = frozenset({"job_id", "worker_id", "lease_token", "lease_ms"})
# What a refused entry of a batch holds as None: an ack's (or release's) fields, a renew's.
ACK_BLANKS = ("state", "duplicate")
RENEW_BLANKS = ("lease_expires_at_ms", "stop")
# Acks in one ack_batch: the most jobs one lease may hand out (relay.E013 keeps
# RELAY_MAX_JOBS_PER_LEASE at or under it).
MAX_BATCH_ACKS = 100
SWEEP_LIMIT = 500
# Inserts of a keyed job tried while other transactions bind and free its key (unique: "active").
KEYED_INSERT_TRIES = 3
# Jobs one prune transaction deletes at most, with their attempts, events and task results:
# about 30 ms of write lock on a 1M-job SQLite file (docs/failure-model.md, "Retention").
PRUNE_BATCH = 100
PRUNE_LIMIT_MAX = 10_000  # the most jobs one prune call may delete
# The oldest age a prune takes, in ms (100 years): beyond it now - age leaves int64 on SQLite.
PRUNE_MAX_AGE_MS = 100 * 365 * 86_400_000
PRUNABLE_STATES = ("succeeded", "dead", "cancelled")
# From this many queue names on, ``ready_queues`` lists the queues holding READY jobs in one
# statement rather than asking of each name (both cost about a seek a queue).
READY_SCAN_MIN = 8
# Operator bulk actions (the console's, the HTTP API's replay and purge of many jobs): jobs a
# transaction, and how long they then leave SQLite's write lock to other writers, as a
# multiple of the time the transaction took (``QueueService.leave_lock``).
BULK_CHUNK = 50
BULK_YIELD_FACTOR = 1.0
# One bulk chunk and its pause at a time in a process (``QueueService.bulk_chunk``).
_BULK_TURN = threading.Lock()
# After a count of the queues refuses a submit, how long new queue names that would not have
# fitted it are refused without counting again, in ms (``_new_queues``).
QUEUE_CAP_RECHECK_MS = 1_000
SERVER_FORGET_MS = 3_600_000  # a dead server's registry row is deleted after an hour unseen
# 192 random bits: a stale worker cannot guess the next token.
TOKEN_BYTES = 24
_TOKEN_CHARS = TOKEN_BYTES * 4 // 3  # base64 of whole 3-byte groups: no padding
assert TOKEN_BYTES % 3 == 0
# The failure text (and dead reason) of an attempt that ran past its time limit.
TIMEOUT_REASON = "timeout"
LEASE_EXPIRED_REASON = "lease expired"
# How often cancel re-reads a job that changed state between its read and its guarded UPDATE
# (another server's claim or sweep) before answering BUSY.
CANCEL_TRIES = 5
# Queue controls (``pause``, ``set_queue_limits``): the bounds of their values.
MAX_LEASED_MAX = 1_000_000
RATE_PER_S_MAX = 1_000_000.0
# The slowest rate: one job every 10^4 s (2.8 h). Far slower ones overflow the next token's due
# time (a float of ms), and at 10^-6/s one ms refills only TOKEN_EPSILON of a token.
RATE_PER_S_MIN = 1e-4
BURST_MAX = 1_000_000
# Tokens a float sum may miss by (a refill of exactly one token must count as one).
TOKEN_EPSILON = 1e-9


class _MonotonicUlid:
    """ULIDs that sort in creation order within one process, even inside one millisecond.

    Within one millisecond the 80 random bits are incremented, as the ULID spec's monotonic
    generator does (https://github.com/ulid/spec#monotonicity); the 10-character time part is
    spelled once per millisecond.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = -1
        self._last_rand = 0
        self._time_part = ""

    def new(self, now_ms: int) -> str:
        """Return the next id for ``now_ms`` (epoch ms; an earlier instant reuses the last)."""
        with self._lock:
            if now_ms <= self._last_ms:
                self._last_rand += 1
            else:
                # 79 random bits (headroom to increment) from the OS, as secrets.randbits
                # takes them, without its Python layer.
                self._last_rand = int.from_bytes(os.urandom(10)) >> 1
                self._last_ms = now_ms
                self._time_part = _spell(now_ms, 5)
            return self._time_part + _spell(self._last_rand, 8)


# Crockford's base32, as ULIDs spell it (https://github.com/ulid/spec), two characters (10
# bits) per lookup: a 26-character ULID is 13 lookups, ~5x faster than base64.b32encode (pure
# Python in CPython), which profiling found on the batch-submit path.
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_PAIRS = tuple(a + b for a in _CROCKFORD for b in _CROCKFORD)


def _spell(value: int, pairs: int) -> str:
    """The last ``2 * pairs`` base32 characters of ``value`` (most significant first)."""
    if pairs == 5:  # an id's time part, once per millisecond: unrolled
        p = _PAIRS
        return (
            p[value >> 40 & 1023]
            + p[value >> 30 & 1023]
            + p[value >> 20 & 1023]
            + p[value >> 10 & 1023]
            + p[value & 1023]
        )
    if pairs == 8:  # an id's random part, once per id: its top 5 pairs, then the last 3
        p = _PAIRS
        return (
            _spell(value >> 30, 5) + p[value >> 20 & 1023] + p[value >> 10 & 1023] + p[value & 1023]
        )
    return "".join([_PAIRS[(value >> shift) & 1023] for shift in range(10 * pairs - 10, -1, -10)])


def encode_ulid(value: int) -> str:
    """Spell a 128-bit ULID as its 26 characters (130 bits; the top two are zero).

    ``tests/unit/test_ids.py`` checks it against python-ulid.
    """
    return _spell(value, 13)


_ULIDS = _MonotonicUlid()
# A reading of the database's clock that took longer moves the clock only as far as it
# proves it wrong (QueueService._reanchor, AnchoredClock.bound): a midpoint's error is up to
# half the round trip.
CLOCK_READING_MAX_MS = 5

# Job listings (dead_list, list_jobs): the largest page, and the rows read per fetch while a
# page fills (a page also ends at one frame of JSON: with 256 KiB payloads, four jobs).
PAGE_MAX_JOBS = 1000
PAGE_FETCH_ROWS = 16
# Fewer bytes than any attempt or event row of ``get`` encodes to (the smallest is ~90).
HISTORY_ROW_MIN_BYTES = 64


def _encoded_len(value: Any) -> int:
    return len(orjson.dumps(value))


def name_before(page: dict[str, Any]) -> str:
    """The last key of a page (the cursor of the next one)."""
    return next(reversed(page))


def _newest_that_fit(rows: list[dict[str, Any]], budget: int) -> tuple[list[dict[str, Any]], int]:
    """Return the newest rows (kept oldest first) whose JSON fits ``budget`` bytes, and how
    many older rows were left out."""
    kept = 0
    for row in reversed(rows):
        budget -= _encoded_len(row)
        if budget < 0:
            break
        kept += 1
    return rows[len(rows) - kept :], len(rows) - kept


def new_server_id() -> str:
    """Return a fresh id for the server registry (``srv_`` and 16 hex digits)."""
    return f"srv_{secrets.token_hex(8)}"


def queue_event_id(queue: str) -> str:
    """The audit log's ``job_id`` for a change of ``queue``'s controls: ``queue:<name>``,
    cut to the column's 40 characters (the event's detail names the queue in full)."""
    return f"queue:{queue}"[:40]


def _controls_view(row: Mapping[str, Any]) -> dict[str, Any]:
    """A ``QueueControls`` dict from a ``relay_queue`` row (or the defaults: ``{"name"}``)."""
    rate = row.get("rate_per_s")
    return {
        "queue": row["name"],
        "paused": bool(row.get("paused", False)),
        "max_leased": row.get("max_leased"),
        "rate_per_s": float(rate) if rate is not None else None,
        "burst": int(row.get("burst") or 1),
        "updated_at_ms": row.get("updated_at_ms"),
        "updated_by": row.get("updated_by"),
    }


def _loosened(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether claims may take more under ``new`` than under ``old``: resumed, a cap raised
    or removed, a rate or burst raised or removed (then the queue's long-polls look again)."""
    if old["paused"] and not new["paused"]:
        return True

    def more(a: Any, b: Any) -> bool:  # None is no limit
        return a is not None and (b is None or b > a)

    return (
        more(old["max_leased"], new["max_leased"])
        or more(old["rate_per_s"], new["rate_per_s"])
        or new["burst"] > old["burst"]
    )


def _refill(control: Mapping[str, Any], now: int) -> float:
    """The tokens in a queue's bucket at ``now`` (epoch ms): what it held at
    ``tokens_at_ms`` plus ``rate_per_s`` per second since, at most ``burst`` (a clock read
    before ``tokens_at_ms`` refills nothing)."""
    elapsed_ms = max(0, now - int(control["tokens_at_ms"]))
    earned = float(control["tokens"]) + elapsed_ms * float(control["rate_per_s"]) / 1000
    return min(float(control["burst"]), earned)


def new_tokens(n: int) -> list[str]:
    """``n`` fencing tokens, each as ``secrets.token_urlsafe(TOKEN_BYTES)`` makes one
    (``TOKEN_BYTES`` random bytes, url-safe base64 without padding), from one ``os.urandom``
    call: a claim of many jobs in one statement draws them all before it, and one call for 16
    tokens costs a quarter of 16 calls."""
    text = base64.urlsafe_b64encode(secrets.token_bytes(TOKEN_BYTES * n)).decode()
    return [text[i : i + _TOKEN_CHARS] for i in range(0, _TOKEN_CHARS * n, _TOKEN_CHARS)]


def _name_entry(exc: IdempotencyConflict, index: int, ids: Sequence[str] = ()) -> None:
    """Make an ``IdempotencyConflict`` of a batch's entry ``index`` name it
    (``details["index"]``, ``field``, as an ``InvalidArgument`` of a batch does), and, when
    the key was bound by an earlier entry of the same batch (``ids``: the batch's job ids),
    that entry, not its job id: the batch is rolled back, so that job never exists (a review
    found the message naming it)."""
    bound = str(exc.details.get("job_id"))
    field = f"jobs[{index}].idempotency_key"
    if bound in ids:
        other = list(ids).index(bound)
        exc.message = (
            f"{field}: the key is bound by jobs[{other}] of this batch, with a different payload"
        )
        exc.details = {"index": index, "field": field, "bound_index": other}
    else:
        exc.message = f"jobs[{index}]: {exc.message}"
        exc.details.update(index=index, field=field)
    exc.args = (exc.message,)


def _refused_entry(
    item: Mapping[str, Any], exc: RelayError, blanks: Sequence[str] = ACK_BLANKS
) -> dict[str, Any]:
    """One refused entry of an ``ack_batch``, ``release_batch`` or ``renew_batch``: its
    entry, with the error's code and message, and ``blanks`` (the fields an accepted entry
    fills) None. Its ``job_id`` as sent when it could be one (``validation.plausible_job_id``),
    else None: echoing 99 ids of 10,000 characters made a reply past the frame limit, answered
    ``FRAME_TOO_LARGE`` after the batch's valid acks had committed, and a NUL or a lone
    surrogate has no place in a reply (reviews)."""
    job_id = item.get("job_id")
    return {
        "job_id": v.plausible_job_id(job_id),
        "ok": False,
        **dict.fromkeys(blanks),
        "error": {"code": exc.code, "message": exc.message, "retryable": exc.retryable},
    }


def _check_entries(name: str, entries: Sequence[Any], fields: frozenset[str]) -> None:
    """The shape of a batch's entries (``acks``, ``renews``), as the HTTP schemas check it:
    each an object with no field outside ``fields``, a string ``job_id``, ``worker_id`` and
    ``lease_token``, and, when given, an integer ``lease_ms`` (its range is the entry's own
    to refuse). A ``lease_ms`` of another type was refused whole over HTTP but entry by entry
    over TCP (a review).

    Raises:
        InvalidArgument: naming the first fault (``acks[2].job_id``) and its ``index``.
    """
    for index, item in enumerate(entries):
        if not isinstance(item, Mapping):
            field = f"{name}[{index}]"
            raise InvalidArgument(f"{field}: must be an object", field=field, index=index)
        unknown = sorted(set(item) - fields)
        if unknown:
            field = f"{name}[{index}].{unknown[0]}"
            raise InvalidArgument(f"{field}: unknown argument", field=field, index=index)
        for key in ("job_id", "worker_id", "lease_token"):
            value = item.get(key)
            if not isinstance(value, str):
                field = f"{name}[{index}].{key}"
                why = "is required" if value is None else "must be a string"
                raise InvalidArgument(f"{field}: {why}", field=field, index=index)
        if item.get("lease_ms") is not None:
            try:
                v.integer(f"{name}[{index}].lease_ms", item["lease_ms"])
            except InvalidArgument as exc:
                exc.details["index"] = index
                raise


def default_clock(driver: Driver) -> Clock:
    """The clock a ``QueueService`` on ``driver`` keeps when given none: the class
    ``RELAY_CLOCK`` names (``SystemClock``), kept to the database's time on a database that
    several processes write (PostgreSQL: the process's ``AnchoredClock`` of that database,
    ``database_clock``; docs/design-decisions.md). The console reads its instants from it too.
    """
    clock = clock_from_path(relay_settings().clock)
    if not driver.capabilities.single_writer:
        every_s = relay_settings().server_heartbeat_ms / 1000
        clock = database_clock(driver.alias, clock, every_s)
    return clock


def _queue_count(tx: Tx, limit: int) -> int:
    """How many queues hold jobs, counted no further than ``limit`` (``queue_count``)."""
    row = tx.one("queue_count", {"limit": limit})
    return int(row["n"]) if row else 0


def _queues_full(cap: int) -> str:
    return (
        f"RELAY_MAX_QUEUES ({cap}) queues hold jobs; a job for another queue is refused until "
        "one of them holds none"
    )


class QueueService:
    """Submit, lease, renew, ack, fail, release, cancel, replay, purge, prune, expire and recover
    jobs.

    Args:
        driver: the storage driver (default: the process's driver for ``RELAY_DATABASE``,
            ``driver_for(alias)``).
        clock: source of time (default: ``default_clock(driver)``: the class ``RELAY_CLOCK``
            names, ``SystemClock``, kept to the database's time on PostgreSQL); inject
            ``FakeClock`` in tests. The service reads it through a ``StepGuard``, so a
            step of its wall clock does not expire healthy leases early.
        rng: source of retry jitter (default an unseeded ``random.Random``). Lease tokens
            always come from ``secrets``, never from ``rng``.
        observer: called as ``observer(event, queue)`` after the commit of a transition that
            no caller sees happen: ``"lease_expired"`` and ``"dead"`` for each lease the sweeps
            expire, ``"pruned"`` for each job retention deletes (metrics use it; the surfaces
            count what their own calls return).
    """

    def __init__(
        self,
        driver: Driver | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        observer: Callable[[str, str], None] | None = None,
    ) -> None:
        self.driver: Driver = driver or driver_for(relay_settings().database)
        self.clock: Clock = default_clock(self.driver) if clock is None else clock
        # Read the database's clock again before an instant when it says it is due.
        self._anchored = self.clock if isinstance(self.clock, AnchoredClock) else None
        self._guard = StepGuard(self.clock)
        self._read: Callable[[], Reading] = (
            self._read_clock if self._anchored is None else self._read_database_time
        )
        self.rng = rng or random.Random()
        self.observer = observer
        self._defaults: tuple[RelaySettings, dict[str, Any]] | None = None
        self._limits: tuple[RelaySettings, dict[str, int]] | None = None
        # Queues a claim left jobs in because of their cap (an ack or fail there frees a slot:
        # ``held_back``), and queues out of tokens with when the next one comes (epoch ms;
        # ``sweep`` hands them to the reaper then, ``next_due_ms`` says when). In-process
        # hints for waking long-polls only: the claim itself always reads relay_queue.
        self._capped: set[str] = set()
        self._throttled: dict[str, int] = {}
        self._controlled: set[str] = set()  # queues the last claim naming them found controlled
        # Queues the last claim naming them found with a cap (``max_leased``): an ended lease
        # there tells other servers' long-polls (``_slot_freed``).
        self._slotted: set[str] = set()
        self._hints = threading.Lock()
        # The queue cap (``_new_queues``): names this service has seen hold jobs, at most
        # RELAY_MAX_QUEUES of them, and the last count that refused a submit: when (service
        # clock, epoch ms) and how many queues it found.
        self._queues_seen: set[str] = set()
        self._queues_refused: tuple[int, int] | None = None

    @property
    def settings(self) -> RelaySettings:
        """The current Relay settings."""
        return relay_settings()

    def _read_clock(self) -> Reading:
        """Read the clock through the step guard: every instant this service stores comes
        from ``_read``, which is this, or ``_read_database_time`` on a shared database."""
        s = self.settings
        return self._guard.read(tolerance_ms=s.clock_step_tolerance_ms, horizon_ms=s.max_lease_ms)

    def _read_database_time(self) -> Reading:
        """``_read_clock``, after a reading of the database's clock when one is due (by one
        thread at a time: the others read the clock as it is meanwhile)."""
        anchored = self._anchored
        if anchored is not None and anchored.due() and anchored.reading.acquire(blocking=False):
            try:
                if anchored.due():
                    self._reanchor(anchored)
            finally:
                anchored.reading.release()
        return self._read_clock()

    def _reanchor(self, clock: AnchoredClock) -> None:
        """Set ``clock`` to the database's time: one ``database_now`` (inside the caller's
        transaction when there is one), once per ``RELAY_SERVER_HEARTBEAT_MS`` per process.

        A reading is good to half its round trip: one that took at most
        ``CLOCK_READING_MAX_MS`` sets the clock at its midpoint; a slower one (a busy process
        or database, a network stall) moves it only as far as it proves it wrong
        (``AnchoredClock.bound``). A failed reading keeps the old one; the caller's own
        statements then meet the fault themselves.
        """
        try:
            with self.driver.read() as tx:
                before = clock.monotonic()
                row = tx.one("database_now")
                after = clock.monotonic()
        except Exception:  # the call's own statements report it
            log.debug("event=clock_reading_failed", exc_info=True)
            clock.checked()
            return
        if row is None:
            clock.checked()
        elif (after - before) * 1000 > CLOCK_READING_MAX_MS:
            clock.bound(int(row["now_ms"]), before, after)
        else:
            clock.set(int(row["now_ms"]), (before + after) / 2)

    def _now(self) -> int:
        """The wall clock, epoch ms, read through the step guard."""
        return self._read().now_ms

    @staticmethod
    def _judging(at: Reading) -> dict[str, int]:
        """The parameters a lease-expiry test takes: ``now_ms``, ``judge_ms``, ``mark_ms``
        (see ``Reading``): a lease is expired when ``lease_expires_at_ms <= now_ms`` and,
        if its expiry was set at or before ``mark_ms``, ``lease_expires_at_ms <= judge_ms``."""
        return {"now_ms": at.now_ms, "judge_ms": at.judge_ms, "mark_ms": at.mark_ms}

    # ------------------------------------------------------------ storage doors

    @property
    def capabilities(self) -> Capabilities:
        """What the storage under this service can do (``single_writer``, ...)."""
        return self.driver.capabilities

    def transaction(
        self, *, savepoints: bool = True, durable: bool = True, wait: bool = True
    ) -> contextlib.AbstractContextManager[Any]:
        """Group several service calls into one commit: each call inside becomes a SAVEPOINT
        and rolls back alone (the TCP server's group commit, the admin's bulk chunks).

        Args:
            savepoints: False: the calls inside take no SAVEPOINT where one costs round
                trips (PostgreSQL); the caller sets a failed call apart with ``mark()`` and
                ``forgive(mark)``, or lets the whole transaction roll back and runs the calls
                again with savepoints (``Driver.write``).
            durable: False: the calls inside are lease bookkeeping only (``claim``,
                ``sweep``), so the COMMIT need not wait for the disk; any other call inside
                makes the transaction durable all the same (``Driver.write``). On SQLite
                the outermost transaction decides the level before BEGIN: pass False only
                when every call inside is a claim or a sweep.
            wait: False: raise ``WriteLocked`` at once, nothing run, when another connection
                holds the write lock (``Driver.write``; the server's event loop).
        Raises:
            StoreBusy: the transaction could not start or commit within the retry budget.
            WriteLocked: ``wait=False`` and the write lock was taken.
        """
        return self.driver.write(savepoints=savepoints, durable=durable, wait=wait)

    def leave_lock(self, started: float, factor: float) -> None:
        """After a transaction begun at ``started`` (this service's ``clock.monotonic()``, s),
        sleep ``factor`` times as long as it took, on this service's clock, so that other
        writers get that share of the write lock before the caller's next transaction.

        SQLite's lock is not fair: a writer waiting for it polls with growing sleeps (SQLite's
        busy handler: 1 ms, then up to 100 ms apart) and misses the gap between another
        connection's back-to-back transactions. A bulk replay of 1,000 dead jobs over HTTP, one
        transaction after another, kept the TCP server's writes waiting up to 3.8 s (a hostile
        review). No sleep for ``factor`` 0, or where the storage takes concurrent writers
        (PostgreSQL: ``capabilities.single_writer`` False), whose row locks leave other
        jobs' writers alone.

        Args:
            started: when the transaction began, in s on ``clock.monotonic``.
            factor: the multiple (0: no wait).
        """
        if factor > 0 and self.driver.capabilities.single_writer:
            self.clock.sleep(factor * (self.clock.monotonic() - started))

    @contextlib.contextmanager
    def bulk_chunk(self) -> Iterator[None]:
        """Hold one chunk of an operator's bulk action (the console's, the HTTP API's replay
        and purge of many jobs; the caller opens its ``transaction()`` inside), then leave the
        write lock to other writers as long as the chunk took (``leave_lock``,
        ``BULK_YIELD_FACTOR``). One chunk and its pause at a time in this process: several
        bulk requests at once filled each other's pauses (8 at once kept a TCP server's writes
        out for 3 s, a hostile review); and, where writers take turns at one lock (SQLite),
        one at a time across processes too (``Driver.bulk_turn``).
        """
        with _BULK_TURN, self.driver.bulk_turn():
            began = self.clock.monotonic()
            yield  # a chunk that raised (BUSY after waiting its budget) is not paused after
            self.leave_lock(began, BULK_YIELD_FACTOR)

    def mark(self) -> int:
        """The position ``forgive`` compares with (``Driver.mark``)."""
        return self.driver.mark()

    def forgive(self, mark: int) -> bool:
        """Inside ``transaction(savepoints=False)``, after a call failed: True when the
        transaction is intact and the call changed nothing, so it may go on
        (``Driver.forgive``)."""
        return self.driver.forgive(mark)

    def changes(self) -> ChangeFeed:
        """The change feed of commits made elsewhere, for long-poll wake-ups (see
        ``queue_core.storage.base.ChangeFeed``)."""
        return self.driver.changes()

    def check_storage(self, *, full: bool = True) -> list[str]:
        """The storage's start-up health check; return the problems (``[]`` when healthy)."""
        return self.driver.check(full=full)

    def backup(
        self, path: str, *, overwrite: bool = False, actor: str | None = None
    ) -> dict[str, Any]:
        """Copy the database to ``path`` while it serves, and check the copy
        (``Driver.backup``: its arguments, result and errors). With ``actor`` (the console),
        a ``backed_up`` event with no job id records who made which copy."""
        copy = self.driver.backup(path, overwrite=overwrite)
        if actor is not None:
            detail = f"path={copy['path']} bytes={copy['bytes']}"
            with self.driver.write() as tx:
                self._operator_event(tx, "backed_up", self._now(), actor, detail)
        return copy

    def close(self) -> None:
        """Close this thread's database connection (threads that used the service, on exit)."""
        self.driver.close()

    def heal(self) -> None:
        """After a failed call: drop this thread's connection if the failure broke it, so the
        next call reconnects (``Driver.heal``; the server's threads call it)."""
        self.driver.heal()

    def claim_storage(self) -> Any:
        """Claim the database for this server (``Driver.server_lock``); keep the handle.

        Raises:
            AlreadyServed: another server serves it.
        """
        return self.driver.server_lock()

    # ----------------------------------------------------------------- submit

    def submit(self, queue: str, payload: Any, **options: Any) -> dict[str, Any]:
        """Create a job (∅ -> READY, or ∅ -> PENDING when delayed).

        Args:
            queue: queue name (``[A-Za-z0-9][A-Za-z0-9_.:-]*``, at most 128 characters).
            payload: any JSON value but None (null), at most ``RELAY_MAX_PAYLOAD_BYTES``
                encoded.
            **options: ``priority`` (``low|normal|high|critical`` or 0-3), ``max_retries``
                (0..RELAY_MAX_RETRIES), ``backoff`` (``fixed|exponential``), ``backoff_base_ms``,
                ``backoff_cap_ms`` (ms), ``jitter`` (bool), ``delay_ms`` (ms from now, >= 0)
                or ``run_at_ms`` (epoch ms; a past instant is due at once),
                ``idempotency_key`` (1..255 characters), ``unique`` (``"window"``, the
                default, or ``"active"``; see below), ``meta`` (an object of strings:
                at most ``RELAY_MAX_META_KEYS`` keys of 1..``RELAY_MAX_META_KEY_BYTES``
                bytes, ``RELAY_MAX_META_BYTES`` encoded; stored with the job, returned in
                its view and its lease, e.g. a W3C ``traceparent``) and ``time_limit_ms`` (1..
                RELAY_MAX_DELAY_MS: the most one attempt may run, from its lease; default the
                queue's ``RELAY_QUEUE_TIME_LIMITS`` entry, else none).
        Returns:
            ``{"job": Job, "deduplicated": bool}``; a key already bound in this queue returns
            its job with ``deduplicated: true``. A key is bound to its job for
            ``RELAY_IDEMPOTENCY_WINDOW_MS``; with ``unique: "active"`` it is freed sooner,
            in the transaction that moves the job to a terminal state (``states.is_terminal``:
            SUCCEEDED, DEAD, CANCELLED), so a submit after that makes a new job (unique
            while active: Sidekiq Enterprise's ``unique_until: :success``, Solid Queue's
            concurrency keys, PgQueuer's dedupe keys). A job's ``unique`` is its own: the job
            holding the key decides when the key is freed.
        Raises:
            InvalidArgument, FrameTooLarge, IdempotencyConflict (same key, other payload),
            TooManyQueues (``queue`` holds no jobs while ``RELAY_MAX_QUEUES`` others do:
            ``_new_queues``), StoreBusy.
        """
        s = self.settings
        row = self._prepare(queue, payload, options, s)
        with self.driver.write() as tx:
            at = self._read()
            if row["queue"] in self._queues_seen:
                return self._insert(tx, row, at, s)
            new = self._new_queues(tx, (row["queue"],), at.now_ms, s)
            made = self._insert(tx, row, at, s)
            if new:
                self._admit_new_queues(tx, new, at.now_ms, s)
            return made

    def submit_batch(self, specs: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Create several jobs in one transaction: all are created or none.

        Args:
            specs: up to ``RELAY_MAX_BATCH_SUBMIT`` mappings with ``queue``, ``payload`` and the
                options ``submit`` takes.
        Returns:
            One ``{"job_id", "queue", "state", "available_at_ms", "deduplicated"}`` per spec,
            in order: what a producer needs to track its jobs, not their whole views (the
            producer has the payloads and options, and 1,000 views would cost more to build,
            send and parse than to insert; SQS's ``SendMessageBatch`` answers ids too).
            ``state`` is the job's state now (``ready`` or ``pending`` for a new job).
        Raises:
            InvalidArgument (``details["index"]`` names the bad spec), FrameTooLarge,
            IdempotencyConflict, TooManyQueues (the batch's new queues would pass
            ``RELAY_MAX_QUEUES``), StoreBusy.
        """
        s = self.settings
        v.batch_count(specs, s)
        rows = []
        for index, spec in enumerate(specs):
            if not isinstance(spec, Mapping):
                raise InvalidArgument(f"jobs[{index}]: must be an object", index=index)
            options = {k: val for k, val in spec.items() if k not in ("queue", "payload")}
            try:
                rows.append(self._prepare(spec.get("queue"), spec.get("payload"), options, s))
            except InvalidArgument as exc:
                field = f"jobs[{index}].{exc.details.get('field', '')}".rstrip(".")
                exc.details.update(index=index, field=field)
                exc.message = f"jobs[{index}].{exc.message}"
                exc.args = (exc.message,)
                raise
        with self.driver.write() as tx:
            at = self._read()  # one instant for the whole batch
            new = self._new_queues(tx, {row["queue"] for row in rows}, at.now_ms, s)
            made = self._insert_batch(tx, rows, at, s)
            if new:
                self._admit_new_queues(tx, new, at.now_ms, s)
            return made

    def _insert_batch(
        self, tx: Tx, rows: list[dict[str, Any]], at: Reading, s: RelaySettings
    ) -> list[dict[str, Any]]:
        """Insert a batch's prepared jobs at the instant ``at`` (``submit_batch``)."""
        pending: list[dict[str, Any]] = []
        keyed = [i for i, row in enumerate(rows) if row["idempotency_key"] is not None]
        if len(keyed) < 2:
            results = []
            try:
                for row in rows:
                    results.append(self._insert(tx, row, at, s, pending))
            except IdempotencyConflict as exc:
                _name_entry(exc, len(results))
                raise
            self._flush(tx, pending)
            return results
        # Keyed jobs bind their keys in one order, (queue, key), whatever the batch's: two
        # batches naming the same keys in other orders through two PostgreSQL servers
        # otherwise each waited on a key the other had bound (deadlocks and lock
        # timeouts, answered BUSY). Ids are drawn in the batch's order first, so FIFO
        # follows the batch, not the keys.
        ids = [f"job_{_ULIDS.new(at.now_ms)}" for _ in rows]
        out: list[dict[str, Any] | None] = [None] * len(rows)
        keyed.sort(key=lambda i: (rows[i]["queue"], rows[i]["idempotency_key"], i))
        for i in keyed:
            try:
                out[i] = self._insert(tx, rows[i], at, s, pending, ids[i])
            except IdempotencyConflict as exc:
                _name_entry(exc, i, ids)
                raise
        for i, row in enumerate(rows):
            if out[i] is None:
                out[i] = self._insert(tx, row, at, s, pending, ids[i])
        self._flush(tx, pending)
        return cast(list[dict[str, Any]], out)

    def _new_queues(self, tx: Tx, names: Iterable[str], now_ms: int, s: RelaySettings) -> list[str]:
        """The queue cap, before a submit's inserts: of ``names``, those no queue holding
        jobs has, which ``_admit_new_queues`` counts once the jobs are in.

        ``RELAY_MAX_QUEUES`` bounds the queues holding jobs. A name this service has seen
        hold jobs costs nothing; the others cost one statement for them all
        (``queues_known``: a seek each). A name no queue has is counted after the inserts, so
        a submit that fails on its own (an idempotency conflict) costs no count; and for
        ``QUEUE_CAP_RECHECK_MS`` after a count refused, new names that would not have fitted
        it are refused here, uncounted (a producer trying name after name, or batch after
        batch, costs one ``queues_known`` a request).

        The cap is soft in two ways, by design. A name seen stays admitted after its queue
        empties, until the set of them reaches the cap and is cleared, so the queues can
        outnumber the cap by the names each process with a service remembers (at most
        ``RELAY_MAX_QUEUES`` each: the TCP server, each HTTP worker, each process enqueueing
        through ``RelayBackend`` on the database). And where several writers share the
        database (PostgreSQL), a queue emptied (purge, prune) while a submit to it is under
        way is started again uncounted: one queue over the cap per such coincidence.

        Args:
            tx: the submit's write transaction.
            names: the queue names the submit uses.
            now_ms: the submit's instant (epoch ms).
        Raises:
            TooManyQueues: within a second of a refusing count, new names that would not
                have fitted it (``details.limit``; ``details.queue``, one of them).
        """
        unseen = [name for name in names if name not in self._queues_seen]
        if not unseen:
            return []
        known = self._known_queues(tx, unseen)
        new = [name for name in unseen if name not in known]
        cap = s.max_queues
        refused = self._queues_refused
        # Before that count (the wall clock stepped back) it is counted again, so a step
        # cannot stretch the second.
        if new and refused is not None:
            at, held = refused
            if at <= now_ms < at + QUEUE_CAP_RECHECK_MS and held + len(new) > cap:
                raise TooManyQueues(_queues_full(cap), limit=cap, queue=min(new))
        self.driver.after_commit(functools.partial(self._seen_queues, unseen, cap))
        return new

    def _admit_new_queues(self, tx: Tx, new: list[str], now_ms: int, s: RelaySettings) -> None:
        """The queue cap, after a submit's inserts: refuse it (rolling it back) when more
        than ``RELAY_MAX_QUEUES`` queues now hold jobs, ``new`` (``_new_queues``) among them.

        Where several writers share the database (PostgreSQL) the count runs under a lock
        (``hold_queue_cap``), taken last, so transactions starting queues count one after the
        other, each seeing the queues the others started: the cap holds across threads and
        servers. SQLite's one writer does so by itself. The TCP server runs such a submit in a
        transaction of its own (``may_start_queues``), so the lock's holder waits for nothing
        else; a submit inside a caller's own transaction (``RelayBackend`` on the database,
        in ``atomic()``) holds it until that transaction ends.

        Raises:
            TooManyQueues: ``details.limit``; ``details.queue``, one of ``new``.
        """
        cap = s.max_queues
        if not self.capabilities.single_writer:
            tx.all("hold_queue_cap")
        held = _queue_count(tx, cap + len(new))
        if held > cap:
            self._queues_refused = (now_ms, held - len(new))
            raise TooManyQueues(_queues_full(cap), limit=cap, queue=min(new))

    def may_start_queues(self, names: Iterable[Any]) -> bool:
        """Whether a submit to ``names`` may start a queue: one of them is a name this
        service has not seen hold jobs (a hint for the TCP server's group commit, read
        without a lock; values that are not names are the handler's to refuse)."""
        seen = self._queues_seen
        return any(isinstance(name, str) and name not in seen for name in names)

    @staticmethod
    def _known_queues(tx: Tx, names: list[str]) -> set[str]:
        """Those of ``names`` that are queues holding jobs (``queues_known``)."""
        rows = tx.all("queues_known", {"queues": orjson.dumps(names).decode()})
        return {r["queue"] for r in rows}

    def _seen_queues(self, names: list[str], cap: int) -> None:
        """Remember ``names`` as holding jobs (after the commit that made them so), keeping
        at most ``cap`` names."""
        with self._hints:
            if len(self._queues_seen) + len(names) > cap:
                self._queues_seen.clear()
            self._queues_seen.update(names)

    def _prepare(
        self,
        queue: Any,
        payload: Any,
        options: Mapping[str, Any],
        s: RelaySettings | None = None,
    ) -> dict[str, Any]:
        """Validate one job; return its ``insert_job`` columns plus ``_delay_ms``,
        ``_run_at_ms`` and ``_payload`` (the decoded payload, for the reply)."""
        s = self.settings if s is None else s
        if options:
            unknown = options.keys() - SUBMIT_OPTIONS
            if unknown:
                name = sorted(unknown)[0]
                raise InvalidArgument(f"{name}: unknown submit option", field=name)
            opt = {k: val for k, val in options.items() if val is not None}
        else:
            opt = {}
        row = self._default_options(s) if not opt else self._options(opt, s, self._now())
        row["queue"] = v.queue_name(queue, s)
        if row["time_limit_ms"] is None:
            row["time_limit_ms"] = self._queue_limits(s).get(row["queue"])
        row["payload"] = v.payload(payload, s)
        row["_payload"] = payload
        return row

    def _default_options(self, s: RelaySettings) -> dict[str, Any]:
        """``_options({}, s)``, computed once per settings object (a fresh copy each call)."""
        cached = self._defaults
        if cached is None or cached[0] is not s:
            cached = self._defaults = (s, self._options({}, s))
        return dict(cached[1])

    def _queue_limits(self, s: RelaySettings) -> dict[str, int]:
        """``s.time_limits_ms()`` (``RELAY_QUEUE_TIME_LIMITS``), parsed once per settings
        object; a malformed setting (system check ``relay.E011``) counts as none."""
        cached = self._limits
        if cached is None or cached[0] is not s:
            try:
                limits = s.time_limits_ms()
            except ValueError:
                limits = {}
            cached = self._limits = (s, limits)
        return cached[1]

    @staticmethod
    def _options(opt: Mapping[str, Any], s: RelaySettings, now_ms: int = 0) -> dict[str, Any]:
        """Validate submit options against ``s``; ``now_ms`` bounds ``run_at_ms`` (epoch ms)."""
        backoff = opt.get("backoff", s.default_backoff)
        if backoff not in ("fixed", "exponential"):
            raise InvalidArgument("backoff: must be 'fixed' or 'exponential'", field="backoff")
        base_ms = v.integer(
            "backoff_base_ms",
            opt.get("backoff_base_ms", s.default_backoff_base_ms),
            lo=0,
            hi=s.max_delay_ms,
        )
        cap_ms = v.integer(
            "backoff_cap_ms",
            opt.get("backoff_cap_ms", max(s.default_backoff_cap_ms, base_ms)),
            lo=base_ms,
            hi=s.max_delay_ms,
        )
        if "delay_ms" in opt and "run_at_ms" in opt:
            raise InvalidArgument("give delay_ms or run_at_ms, not both", field="delay_ms")
        delay_ms = v.integer("delay_ms", opt.get("delay_ms", 0), lo=0, hi=s.max_delay_ms)
        run_at_ms = opt.get("run_at_ms")
        if run_at_ms is not None:
            v.integer("run_at_ms", run_at_ms, lo=0)
            if run_at_ms - now_ms > s.max_delay_ms:
                raise InvalidArgument(
                    f"run_at_ms: more than RELAY_MAX_DELAY_MS ({s.max_delay_ms} ms) ahead",
                    field="run_at_ms",
                )
        key = v.idempotency_key(opt.get("idempotency_key"))
        return {
            "priority": v.priority(opt.get("priority", "normal")),
            "max_retries": v.integer(
                "max_retries",
                opt.get("max_retries", s.default_max_retries),
                lo=0,
                hi=s.max_retries,
            ),
            "backoff": backoff,
            "backoff_base_ms": base_ms,
            "backoff_cap_ms": cap_ms,
            "jitter": v.boolean("jitter", opt.get("jitter", s.default_jitter)),
            "idempotency_key": key,
            "unique_scope": v.unique_scope(opt.get("unique"), key),
            "meta": v.meta(opt.get("meta"), s),
            "time_limit_ms": (
                None
                if opt.get("time_limit_ms") is None
                else v.integer("time_limit_ms", opt["time_limit_ms"], lo=1, hi=s.max_delay_ms)
            ),
            "_delay_ms": delay_ms,
            "_run_at_ms": run_at_ms,
        }

    @staticmethod
    def _flush(tx: Tx, pending: list[dict[str, Any]]) -> None:
        if pending:
            tx.many("insert_job", pending)
            pending.clear()

    def _insert(
        self,
        tx: Tx,
        row: dict[str, Any],
        at: Reading,
        s: RelaySettings,
        pending: list[dict[str, Any]] | None = None,
        job_id: str | None = None,
    ) -> dict[str, Any]:
        """Insert one prepared job (``row``, consumed), or queue it on ``pending`` for one
        ``executemany`` (a batch), at the instant ``at``, with id ``job_id`` (None: a new
        one; ``submit_batch`` draws its keyed jobs' ids in the batch's order).

        A job with an idempotency key flushes ``pending`` first, so a key repeated within one
        batch finds the earlier job. A READY job's ``ready_since_ms`` is ``at.ready_ms``: after
        a backward clock step it ties with the jobs before the step, and the id keeps FIFO.
        """
        now = at.now_ms
        payload = row.pop("_payload")
        delay_ms, run_at_ms = row.pop("_delay_ms"), row.pop("_run_at_ms")
        due = run_at_ms if run_at_ms is not None else now + delay_ms
        key = row["idempotency_key"]
        if key is not None:
            if pending:
                self._flush(tx, pending)
            found = self._bound_job(tx, row, key, now, pending)
            if found is not None:
                return found
        delayed = due > now
        if job_id is None:
            job_id = f"job_{_ULIDS.new(now)}"
        entered = JobState.PENDING if delayed else JobState.READY
        check(Transition.SUBMIT, None, entered)
        state = entered.value
        available_at_ms = due if delayed else None
        ready_since_ms = None if delayed else at.ready_ms
        row["id"] = job_id
        row["state"] = state
        row["idempotency_expires_at_ms"] = now + s.idempotency_window_ms if key else None
        row["available_at_ms"] = available_at_ms
        row["ready_since_ms"] = ready_since_ms
        row["now_ms"] = now
        if key is not None:
            for _ in range(KEYED_INSERT_TRIES):
                if tx.one("insert_job_keyed", row) is not None:
                    break
                # Another transaction (another server) bound the key since we looked: answer
                # with its job, as if it had been there first. That job may have freed the
                # key since (unique: "active", terminal): then insert again.
                found = self._bound_job(tx, row, key, now, pending)
                if found is not None:
                    return found
            else:  # pragma: no cover - a key taken and freed again at every try
                raise StoreBusy("idempotency key in flux; try again")
        elif pending is None:
            tx.run("insert_job", row)
        else:
            pending.append(row)
        if not delayed:
            tx.made_ready(row["queue"])
        if pending is not None:
            return cast(
                dict[str, Any], batch_entry(job_id, row["queue"], state, available_at_ms, False)
            )
        view = new_job_view(row, created_at_ms=now, payload=payload)
        return {"job": view, "deduplicated": False}

    def _bound_job(
        self,
        tx: Tx,
        row: Mapping[str, Any],
        key: str,
        now: int,
        pending: list[dict[str, Any]] | None,
    ) -> dict[str, Any] | None:
        """The answer for a key already bound in this queue within its window (the job, with
        ``deduplicated: true``), or None when the key is free (a bound key past its window is
        freed here).

        Raises:
            IdempotencyConflict: the key is bound to a job with another payload.
        """
        bound = tx.one("find_idempotent", {"queue": row["queue"], "key": key})
        if bound is None:
            return None
        if bound["idempotency_expires_at_ms"] <= now:
            tx.run("unbind_idempotency_key", {"job_id": bound["id"], "now_ms": now})
            return None
        if bound["payload"] != row["payload"]:
            raise IdempotencyConflict(
                f"idempotency key {key!r} is bound to {bound['id']} with a different payload",
                job_id=bound["id"],
            )
        job = self._job(tx, bound["id"])
        if pending is not None:
            entry = batch_entry(job["id"], job["queue"], job["state"], job["available_at_ms"], True)
            return cast(dict[str, Any], entry)
        return {"job": job, "deduplicated": True}

    # ------------------------------------------------------------------ reads

    def get(self, job_id: str, *, history: bool = True) -> dict[str, Any]:
        """Return one job, with its delivery ``history`` and ``events`` when asked.

        Raises:
            JobNotFound.
        """
        job_id = v.job_id(job_id)
        with self.driver.read() as tx:
            view = self._job(tx, job_id)
            if not history:
                return view
            # The reply must fit one frame: keep the newest history that fits in half of it.
            # No row encodes to fewer than HISTORY_ROW_MIN_BYTES, so no more are ever read.
            budget = (self.settings.max_frame_bytes // 2 - _encoded_len(view)) // 2
            omitted = 0
            for key, name in (("history", "attempts"), ("events", "events")):
                rows, total = self._newest(tx, name, job_id, budget // HISTORY_ROW_MIN_BYTES + 1)
                view[key], left_out = _newest_that_fit(rows, budget)
                omitted += left_out + total - len(rows)
        view["history_omitted"] = omitted
        return view

    def result(
        self,
        job_id: str | None = None,
        *,
        queue: str | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Return a job (as ``get``, with history and events) and what its worker reported:
        the result sent with its ack and the structured errors sent with its fails.

        Name the job by ``job_id``, or by ``queue`` and ``idempotency_key`` (the key it was
        submitted with, while it stays bound: a producer that picked the key before submitting,
        such as ``RelayBackend`` enqueueing on commit, finds the job without knowing its id).

        Returns:
            ``{"job": Job (with history, events, history_omitted), "return_value": any JSON
            value or None (none stored), "errors": [{"attempt", "exception_class",
            "traceback"}, ...] oldest first}``. The reply fits one frame: the job takes at
            most half (``get``), the return value and the errors at most
            ``RELAY_MAX_RESULT_BYTES`` each (never more than an eighth of a frame:
            ``RelaySettings.result_limit_bytes``).
        Raises:
            InvalidArgument (neither or both ways of naming the job), JobNotFound.
        """
        if (job_id is None) == (queue is None and idempotency_key is None):
            raise InvalidArgument(
                "result: give job_id, or queue and idempotency_key", field="job_id"
            )
        if job_id is None:
            if queue is None or idempotency_key is None:
                field = "queue" if queue is None else "idempotency_key"
                raise InvalidArgument(f"{field}: is required with the other", field=field)
            queue = v.queue_name(queue, self.settings)
            key = v.idempotency_key(idempotency_key)
            with self.driver.read() as tx:
                bound = tx.one("find_idempotent", {"queue": queue, "key": key})
            if bound is None:
                raise JobNotFound(f"no job in {queue} has idempotency key {key!r}")
            job_id = str(bound["id"])
        job = self.get(job_id, history=True)
        # Read after the job: an ack stores its result in the transaction that made the job
        # succeeded, so a succeeded job read here always finds its result.
        with self.driver.read() as tx:
            row = tx.one("result_of", {"job_id": job["id"]})
        return {
            "job": job,
            "return_value": (
                orjson.loads(row["return_value"])
                if row and row["return_value"] is not None
                else None
            ),
            "errors": orjson.loads(row["errors"]) if row else [],
        }

    @staticmethod
    def _newest(tx: Tx, name: str, job_id: str, limit: int) -> tuple[list[dict[str, Any]], int]:
        """The newest ``limit`` rows of a job's ``attempts`` or ``events``, oldest first, and
        how many there are in all."""
        rows = tx.all(f"{name}_of", {"job_id": job_id, "limit": max(limit, 1)})
        rows.reverse()
        if len(rows) < limit:
            return rows, len(rows)
        counted = tx.one(f"{name}_count", {"job_id": job_id})
        return rows, int(counted["n"]) if counted else len(rows)

    def _job(self, tx: Tx, job_id: str) -> dict[str, Any]:
        row = tx.one("get_job", {"job_id": job_id})
        if row is None:
            raise JobNotFound(f"no job {job_id}", job_id=job_id)
        return cast(dict[str, Any], job_view(row))

    def stats(
        self,
        queue: str | None = None,
        *,
        finished: bool = True,
        limit: int | None = None,
        after: str | None = None,
    ) -> dict[str, Any]:
        """Count jobs by queue and state, with each queue's oldest READY age and the live
        servers.

        Args:
            queue: only this queue (None for all).
            finished: count SUCCEEDED jobs too. False (the metrics gauges) reads only the
                partial indexes of the live states, so finished jobs piling up cost a scrape
                nothing; the ``succeeded`` keys are then absent.
            limit: at most this many queues (1..1000), in name order after ``after``, and
                no more than fit one frame (keyset paging, as ``dead_list``); None for all.
            after: the previous page's ``next_after``.
        Returns:
            ``{"queues": {name: {state: n, ..., "oldest_ready_age_ms": int | None}},
            "totals": {state: n}, "server_time_ms": int, "servers": [Server, ...],
            "next_after": str | None, "controls": {name: QueueControls}}``: totals always
            count every queue; ``next_after`` names the page's last queue when more follow.
            The servers are as ``servers()`` gives them. ``controls`` holds the paused,
            capped or rate-limited queues' controls (``queue_controls``): all of them
            without ``limit``; with it, those of the page's queues, where a controlled queue
            with no jobs has a row of zero counts (so 6,000 controlled queues page too).
        Raises:
            InvalidArgument: a bad queue name, limit or cursor.
        """
        if queue is not None:
            queue = v.queue_name(queue, self.settings)
        if limit is not None:
            limit = v.integer("limit", limit, lo=1, hi=1000)
        if after is not None:
            after = v.queue_name(after, self.settings, field="after")
        now = self._now()
        with self.driver.read() as tx:
            if queue is None:
                counts = tx.all("counts" if finished else "counts_live")
                oldest = {r["queue"]: r["oldest"] for r in tx.all("oldest_ready")}
                controls = {r["name"]: _controls_view(r) for r in tx.all("queue_controls_all")}
            else:  # one queue's rows only: its cost does not grow with the other queues
                counts = tx.all("counts_of_queue", {"queue": queue})
                row = tx.one("oldest_ready_of_queue", {"queue": queue})
                oldest = {queue: row["oldest"]} if row and row["oldest"] is not None else {}
                row = tx.one("queue_get", {"name": queue})
                controls = {queue: _controls_view(row)} if row else {}
            servers = self._live_servers(tx, now)
        blank = {s.value: 0 for s in JobState if finished or s is not JobState.SUCCEEDED}
        queues: dict[str, dict[str, Any]] = {}
        totals = dict(blank)
        for r in counts:
            if r["state"] not in blank:  # SUCCEEDED, read by counts_of_queue: not asked for
                continue
            q = queues.setdefault(r["queue"], dict(blank))
            q[r["state"]] = r["n"]
            totals[r["state"]] += r["n"]
        next_after = None
        if limit is not None:
            for name in controls:
                queues.setdefault(name, dict(blank))
            queues, next_after = self._stats_page(queues, limit, after, servers, controls)
            controls = {name: controls[name] for name in queues if name in controls}
        for name, q in queues.items():
            since = oldest.get(name)
            q["oldest_ready_age_ms"] = max(0, now - since) if since is not None else None
        return {
            "queues": queues,
            "totals": totals,
            "server_time_ms": now,
            "servers": servers,
            "next_after": next_after,
            "controls": controls,
        }

    def count_queues(self) -> int:
        """How many queues hold jobs, in any state: what ``RELAY_MAX_QUEUES`` caps (the
        ``relay_queues`` gauge). On SQLite a read of ``relay_job_count`` (a row per queue and
        state); on PostgreSQL a loose index scan, a seek per queue (55 ms for 10,000)."""
        with self.driver.read() as tx:
            return _queue_count(tx, 2**31 - 1)

    def _stats_page(
        self,
        queues: dict[str, dict[str, Any]],
        limit: int,
        after: str | None,
        servers: list[dict[str, Any]],
        controls: Mapping[str, Any],
    ) -> tuple[dict[str, dict[str, Any]], str | None]:
        """The queues after ``after`` in name order, at most ``limit`` and one frame's worth
        with their ``controls``; with the cursor of the next page (None at the end)."""
        names = sorted(name for name in queues if after is None or name > after)
        room = self.settings.max_frame_bytes - REPLY_OVERHEAD_BYTES - _encoded_len(servers)
        page: dict[str, dict[str, Any]] = {}
        for name in names[:limit]:
            room -= _encoded_len({name: queues[name]}) + 24  # the age key it gets
            if name in controls:
                room -= _encoded_len({name: controls[name]})
            if room < 0 and page:
                return page, name_before(page)
            page[name] = queues[name]
        more = len(names) > len(page)
        return page, (name_before(page) if more and page else None)

    # ------------------------------------------------------------ server registry

    def register_server(self, server_id: str, *, address: str, host: str, pid: int) -> int:
        """Enter a server in the registry (or renew its row: the heartbeat); forget servers
        unseen for ``SERVER_FORGET_MS``. Return this server's clock skew.

        Several servers judge lease expiry and due times by the clocks their services keep
        (on PostgreSQL the database's, ``AnchoredClock``), and each machine's own clock should
        stay within ``RELAY_MAX_CLOCK_SKEW_MS`` of the database's (docs/design-decisions.md);
        the caller decides what an excess means (``relay server`` logs ``event=clock_skew``
        at each heartbeat past it).

        Args:
            server_id: the server's id (``new_server_id()``), the same at each heartbeat.
            address: where its clients connect, ``HOST:PORT``.
            host: the machine's name; pid: the process id.
        Returns:
            This server's clock minus the database's, in ms: as much as one reading proves
            (``_skew``: 0 when the database's clock falls inside what this clock read over the
            round trip, else the distance to the nearer end).
        """
        with self.driver.write() as tx:
            skew, after = self._skew(tx)
            tx.run(
                "register_server",
                {
                    "id": server_id,
                    "address": address,
                    "host": host,
                    "pid": pid,
                    "now_ms": after,
                    "clock_skew_ms": skew,
                },
            )
            tx.run("forget_servers", {"before_ms": after - SERVER_FORGET_MS})
        return skew

    def health(self) -> dict[str, Any]:
        """Read the database once (its clock: the cheapest statement that needs it to answer)
        and return ``{"server_time_ms": int}``, this process's time in epoch ms: what a
        liveness probe asks, at a cost that does not grow with the queues or the jobs.

        Raises:
            Unavailable, StoreBusy, StorageIO: the database cannot be read (mapped by the
                driver).
        """
        with self.driver.read() as tx:
            tx.one("database_now")
        return {"server_time_ms": self._now()}

    def clock_skew_ms(self) -> int:
        """Return this process's clock minus the database's, in ms: as much as one reading of
        the database's clock proves (``_skew``; on SQLite, whose clock is this machine's, 0)."""
        with self.driver.read() as tx:
            return self._skew(tx)[0]

    def _skew(self, tx: Tx) -> tuple[int, int]:
        """``(skew_ms, after_ms)``: how far this process's clock is off the database's at
        least, by one reading (0 when the database's clock falls inside what this clock read
        over the round trip; the distance to the nearer end when not), and this clock after
        it. A midpoint is good to half the round trip only: after a 25 s network stall
        servers logged ``clock_skew`` of -11.7 s with nothing wrong (a hostile review)."""
        before = self.clock.now_ms()
        row = tx.one("database_now")
        after = self.clock.now_ms()
        database = int(row["now_ms"]) if row else after
        return -int(outside(database, before, after)), after

    def deregister_server(self, server_id: str) -> None:
        """Take a server that stops cleanly out of the registry (a dead one ages out)."""
        with self.driver.write() as tx:
            tx.run("deregister_server", {"id": server_id})

    def servers(self) -> list[dict[str, Any]]:
        """Return the live servers: those seen within three ``RELAY_SERVER_HEARTBEAT_MS``.

        Returns:
            ``[{"id", "address", "host", "pid", "started_at_ms", "seen_at_ms",
            "clock_skew_ms"}, ...]``, the oldest first.
        """
        with self.driver.read() as tx:
            return self._live_servers(tx, self._now())

    def _live_servers(self, tx: Tx, now: int) -> list[dict[str, Any]]:
        since = now - 3 * self.settings.server_heartbeat_ms
        return [dict(r) for r in tx.all("live_servers", {"since_ms": since})]

    def dead_list(
        self, queue: str | None = None, *, limit: int = 100, after: str | None = None
    ) -> dict[str, Any]:
        """Page through DEAD jobs in id order (keyset pagination).

        Args:
            queue: only this queue (None for all).
            limit: page size, 1..``PAGE_MAX_JOBS`` (1000); a page also stops before its JSON
                would pass one frame (``RELAY_MAX_FRAME_BYTES``), so it may hold fewer.
            after: the ``next_after`` of the previous page.
        Returns:
            ``{"jobs": [Job, ...], "next_after": str | None}``.
        Raises:
            InvalidArgument.
        """
        if queue is None:
            return self._page(lambda tx, p: tx.all("dead_page", p), limit, after)
        return self.list_jobs(queue, JobState.DEAD.value, limit=limit, after=after)

    def list_jobs(
        self, queue: str, state: str | None = None, *, limit: int = 50, after: str | None = None
    ) -> dict[str, Any]:
        """Page through one queue's jobs, in one state or all, in id order (keyset pagination;
        ids are ULIDs, so id order is creation order).

        Each fetch is one seek on ``relay_job_queue_state`` (queue, state, id) per state asked
        for, the states merged by id, whatever the table's size.

        Args:
            queue: the queue.
            state: ``pending|ready|leased|retrying|succeeded|dead|cancelled``, or None for
                every state.
            limit: page size, 1..``PAGE_MAX_JOBS`` (1000); a page also stops before its JSON
                would pass one frame (``RELAY_MAX_FRAME_BYTES``).
            after: the previous page's ``next_after`` (a job id), or None for the first page.
        Returns:
            ``{"jobs": [Job, ...], "next_after": str | None}`` (None on the last page).
        Raises:
            InvalidArgument.
        """
        queue = v.queue_name(queue, self.settings)
        states = [s.value for s in JobState]
        if state is not None:
            if state not in states:
                raise InvalidArgument(f"state: must be one of {', '.join(states)}", field="state")
            states = [state]

        def fetch(tx: Tx, params: dict[str, Any]) -> list[dict[str, Any]]:
            rows = [
                row
                for name in states
                for row in tx.all("jobs_page", {**params, "queue": queue, "state": name})
            ]
            rows.sort(key=lambda row: row["id"])
            return rows[: params["limit"]]

        return self._page(fetch, limit, after)

    def _page(
        self,
        fetch: Callable[[Tx, dict[str, Any]], list[dict[str, Any]]],
        limit: int,
        after: str | None,
    ) -> dict[str, Any]:
        """Fill one page of jobs from ``fetch(tx, {"after", "limit"})`` (rows after a job id,
        in id order), ``PAGE_FETCH_ROWS`` rows at a time, until ``limit`` jobs or one frame of
        JSON: at most that many rows (each at most ``RELAY_MAX_PAYLOAD_BYTES`` plus its error
        text) are held beyond the page itself, however large ``limit`` is.
        """
        limit = v.integer("limit", limit, lo=1, hi=PAGE_MAX_JOBS)
        cursor = "" if after is None else v.job_id(after, field="after")
        jobs: list[dict[str, Any]] = []
        room = self.settings.max_frame_bytes - REPLY_OVERHEAD_BYTES
        with self.driver.read() as tx:
            while len(jobs) < limit:
                want = min(limit - len(jobs), PAGE_FETCH_ROWS)
                rows = fetch(tx, {"after": cursor, "limit": want})
                for row in rows:
                    view = cast(dict[str, Any], job_view(row))
                    room -= _encoded_len(view)
                    if room < 0 and jobs:  # the page must fit one frame; the cursor resumes here
                        return {"jobs": jobs, "next_after": jobs[-1]["id"]}
                    jobs.append(view)
                if len(rows) < want:
                    return {"jobs": jobs, "next_after": None}
                cursor = rows[-1]["id"]
        return {"jobs": jobs, "next_after": jobs[-1]["id"]}

    def ready_queues(self, queues: Iterable[str]) -> list[str]:
        """Return those of ``queues`` that have a READY job a claim could take now: not
        paused, under their cap (``max_leased``), with a rate token (one index seek each, and
        one more for a capped queue; the wake-up after a commit elsewhere, and the TCP
        server's fallback poll, so that they wake only long-polls with something to claim).

        A rated queue left out for want of a token is remembered with the instant of its
        next one (``next_token_ms``): the caller wakes a long-poll then. It is read here,
        not taken from this process's hints, which a change made elsewhere leaves behind (a
        review: a rate removed over HTTP left a TCP long-poll to wait out its wait_ms; and a
        token taken elsewhere, with no hint here, was never waited for).

        For ``READY_SCAN_MIN`` names or more, the queues holding READY jobs are listed first
        (``ready_queue_names``: a seek a queue that has any, not a seek a name), unless there
        are more of them than names: 250 connections' long-polls on 256,000 names, a seek each
        for every commit another process made, kept the TCP server's core busy (a hostile
        review). So a call costs about as many seeks as the fewer of its names and the queues
        with READY jobs (at most ``RELAY_MAX_QUEUES``).

        Args:
            queues: queue names (already valid: the names long-polls wait on).
        """
        now = self.clock.now_ms()
        names = queues if isinstance(queues, list) else list(queues)
        ready: list[str] = []
        with self.driver.read() as tx:
            controls = {r["name"]: r for r in tx.all("queue_controls_all")}
            held: set[str] | None = None  # every queue with READY jobs, when listed
            if len(names) >= READY_SCAN_MIN:
                rows = tx.all("ready_queue_names", {"limit": len(names) + 1})
                if len(rows) <= len(names):
                    held = {str(r["queue"]) for r in rows}
            for q in names:
                c = controls.get(q)
                if c is not None and c["paused"]:
                    continue
                if held is not None:
                    if q not in held:
                        continue
                else:
                    row = tx.one("queue_has_ready", {"queue": q})
                    if not (row and row["ready"]):
                        continue
                if c is not None and c["max_leased"] is not None:
                    # At its cap, a commit elsewhere woke a claim for nothing (a review: 21
                    # a second while another process worked); the freed slot wakes it.
                    leased = tx.one("queue_leased", {"queue": q})
                    if int(leased["n"] if leased else 0) >= c["max_leased"]:
                        continue
                if c is not None and c["rate_per_s"] is not None:
                    tokens = _refill(c, now)
                    if tokens + TOKEN_EPSILON < 1:
                        self._hint_throttled(q, tokens, float(c["rate_per_s"]), now)
                        continue
                ready.append(q)
        return ready

    def next_due_ms(self, queues: Iterable[str] | None = None) -> int | None:
        """Return the earliest instant (epoch ms) a job becomes due, a lease expires, or a
        rate-limited queue that a claim here found without a token gets its next one (when
        still to come: a passed one, which a sweep here has not taken, would say "now" for
        good where no reaper sweeps); it may be past already (a job due that no sweep has
        promoted yet): the reaper then sweeps at once. None when nothing is scheduled.

        Args:
            queues: only these queues' next tokens count (a long-poll's own), None: every
                queue's (the reaper's).
        """
        with self.driver.read() as tx:
            due = [tx.one("next_scheduled"), tx.one("next_expiry")]
        times = [r["at_ms"] for r in due if r and r["at_ms"] is not None]
        now = self.clock.now_ms()
        with self._hints:
            hints = self._throttled
            tokens = hints.values() if queues is None else [hints.get(q, 0) for q in queues]
            times.extend(at for at in tokens if at > now)
        return min(times) if times else None

    # ------------------------------------------------------------------ lease

    def claim(
        self,
        queues: list[str],
        *,
        worker_id: str,
        max_jobs: int = 1,
        lease_ms: int | None = None,
    ) -> list[dict[str, Any]]:
        """Lease up to ``max_jobs`` READY jobs (READY -> LEASED, attempt + 1).

        Chooses by effective priority (base class + one class per whole minute since the job
        became READY, capped at CRITICAL), then FIFO by ready time and id. Due PENDING/RETRYING
        jobs are promoted and expired leases reclaimed first, in the same transaction, whose
        COMMIT does not wait for the disk (``Driver.write``'s ``durable``; an OS crash may take
        back the leases since the last durable commit, with their attempt numbers:
        docs/design-decisions.md, "Leases without their own fsync"), unless
        ``RELAY_DURABLE_LEASES`` is set or another call in the transaction is durable.

        Args:
            queues: 1..``RELAY_MAX_QUEUES_PER_LEASE`` queue names.
            worker_id: the claiming worker's id (1..128 characters).
            max_jobs: 1..``RELAY_MAX_JOBS_PER_LEASE``; fewer are leased when their payloads
                would not fit in one ``RELAY_MAX_FRAME_BYTES`` reply (at least one always is).
            lease_ms: visibility timeout in ms (default ``RELAY_VISIBILITY_TIMEOUT_MS``).
        Returns:
            Lease dicts (``job_id``, ``lease_token``, ``lease_expires_at_ms``, ``payload``, ...);
            an empty list when nothing is ready.
        Raises:
            InvalidArgument, StoreBusy.
        """
        s = self.settings
        names = v.queue_list(queues, s)
        worker_id = v.worker_id(worker_id)
        max_jobs = v.integer("max_jobs", max_jobs, lo=1, hi=s.max_jobs_per_lease)
        length = v.lease_ms(lease_ms, s)
        # Lease bookkeeping: a lease an OS crash takes back is a READY job again, which
        # recovery makes of every lease anyway, so this COMMIT does not wait for the disk
        # (docs/design-decisions.md, "Leases without their own fsync"), unless
        # RELAY_DURABLE_LEASES asks for it.
        with self.driver.write(durable=s.durable_leases) as tx:
            return self._claim_in(
                tx, queues=names, worker_id=worker_id, max_jobs=max_jobs, lease_ms=length
            )

    def _claim_in(
        self,
        tx: Tx,
        *,
        queues: list[str],
        worker_id: str,
        max_jobs: int,
        lease_ms: int,
        reserved_bytes: int = 0,
    ) -> list[dict[str, Any]]:
        """READY -> LEASED on ``tx`` (a write transaction ``claim`` or ``_then_lease``
        opened), with arguments already checked (``lease_ms``: the lease's length in ms);
        see ``claim``. ``reserved_bytes``: what the reply holds beside the jobs (an
        ``ack_batch``'s results); when the rest could not hold one job whatever its size, it
        leases nothing."""
        s = self.settings
        room = s.max_frame_bytes - REPLY_OVERHEAD_BYTES - reserved_bytes
        if reserved_bytes and room < s.max_payload_bytes + s.max_meta_bytes + REPLY_OVERHEAD_BYTES:
            return []
        at = self._read()
        now = at.now_ms
        self._sweep(tx, at)
        check(Transition.CLAIM, JobState.READY, JobState.LEASED)
        request = ClaimRequest(
            queues=queues,
            worker_id=worker_id,
            now_ms=now,
            expires_ms=now + lease_ms,
            limit=max_jobs,
            new_token=functools.partial(secrets.token_urlsafe, TOKEN_BYTES),
            new_tokens=new_tokens,
            room_bytes=room,
            payload_cap_bytes=s.max_payload_bytes + s.max_meta_bytes,
        )
        planned = now
        buckets: dict[str, tuple[float, float]] = {}
        slots: dict[str, int] = {}
        # Queues a claim here last found controlled go straight to their controls (the
        # guarded claim would lease nothing and cost two round trips on PostgreSQL).
        found = None if self.controlled(queues) else tx.claim_unless_controlled(request)
        if found is not None:
            rows = found
        else:
            # A queue it queues is paused, capped or rate-limited: read the controls and
            # claim from the queues they leave open, each at most its room.
            open_names, limits, buckets, slots = self._claim_plan(tx, queues, max_jobs, now)
            if not self.capabilities.single_writer:
                # The controls' row locks may have waited for other servers' claims and
                # the acks they saw: the lease starts now, after them.
                now = max(now, self._now())
            request = request._replace(
                queues=open_names,
                now_ms=now,
                expires_ms=now + lease_ms,
                queue_limits=limits,
            )
            rows = tx.claim(request) if open_names else []
        if buckets or slots:
            self._spend(tx, buckets, slots, rows, planned)
        if rows:
            tx.many(
                "insert_attempt",
                [
                    {
                        "job_id": row["id"],
                        "attempt": row["attempt"],
                        "worker_id": worker_id,
                        "token": row["lease_token"],
                        # PostgreSQL: never before the job's last change (queries.sql)
                        "now_ms": row.get("leased_at_ms", now),
                    }
                    for row in rows
                ],
            )
        expires_at_ms = now + lease_ms
        return [cast(dict[str, Any], lease_view(row, expires_at_ms)) for row in rows]

    def hold_queue_controls(self, queues: list[str], inserting: list[str] | None = None) -> None:
        """Lock the controls rows (``relay_queue``) of ``queues`` until the transaction ends,
        in name order, where several writers run at once (PostgreSQL; nothing on SQLite);
        first, an advisory lock for each of ``inserting``, the queues of controls ops, which
        insert a row where none is (a pause of a queue nobody controlled).

        A group commit of several calls that lock these rows (claims, controls ops) calls it
        first (``GroupCommit``): each claim locks its own queues' rows in name order, a
        controls op its queue's, but one transaction that holds two calls' locks took them in
        two steps, and another could take them the other way round: deadlocks, each answered
        ``BUSY`` after a second (reviews: 4-5 in 20 s from eight connections; 6-10 in 25-30 s
        with limits changing beside the claims; 14-26 with pauses of queues without a row,
        whose rows cannot be locked before they exist). Claims insert no row, so their queues
        take no advisory lock: two batches claiming from one uncontrolled queue still run at
        once.

        Args:
            queues: names, sorted (a name without a row locks nothing).
            inserting: names, sorted, a subset of ``queues``.
        """
        if self.capabilities.single_writer or not queues:
            return
        with self.driver.write(durable=False) as tx:
            if inserting:
                tx.all("hold_queue_names", {"queues": inserting})
            tx.all("queue_controls_for_claim", {"queues": orjson.dumps(queues).decode()})

    def controlled(self, queues: Sequence[str]) -> bool:
        """Whether one of ``queues`` was paused, capped or rate-limited when a claim here last
        named it: a hint (in-process, maybe stale) that the claim (``_claim_in``) and a group
        commit's lock order (``writer._ordered_locks``) follow."""
        with self._hints:
            return not self._controlled.isdisjoint(queues)

    def hold_jobs(self, job_ids: list[str]) -> None:
        """Lock the rows of ``job_ids`` until the transaction ends, in id order, where several
        writers run at once (PostgreSQL; nothing on SQLite): a group commit of several calls
        that all update named jobs (renew, ack, fail, release, cancel, ...) calls it first,
        after ``hold_queue_controls`` (``GroupCommit``, ``writer._ordered_jobs``).

        Each call locks its own job's row as it runs, so one batch renewing ``a`` then ``b``
        and another, on another server, cancelling ``b`` then ``a`` deadlocked, one call
        answered ``BUSY`` after a second (a review: 1 in most 15 s runs of renews and cancels
        of the same 40 jobs through two servers). Rows are locked as an UPDATE locks them
        (``FOR NO KEY UPDATE``), so a foreign key check on the job still passes.

        Args:
            job_ids: ids, sorted (an id without a row locks nothing).
        """
        if self.capabilities.single_writer or not job_ids:
            return
        with self.driver.write(durable=False) as tx:
            tx.all("hold_jobs", {"job_ids": job_ids})

    def _claim_plan(
        self, tx: Tx, names: list[str], max_jobs: int, now: int
    ) -> tuple[list[str], list[int] | None, dict[str, tuple[float, float]], dict[str, int]]:
        """Filter a claim's queues by their controls (``relay_queue``), inside the claim's
        transaction: paused queues, queues at their cap and queues without a token are left
        out (the claim takes from the others: a held queue never starves them, as a paused
        Oban or Sidekiq queue only stops its own fetch).

        Returns:
            ``(names, limits, buckets, slots)``: the queues to claim from, each one's most
            jobs (None: ``max_jobs`` for all, no queue has controls), for each rated queue
            ``(tokens now, rate_per_s)``, and for each capped queue claimed from its free
            slots (jobs).
        """
        controls = {
            r["name"]: r
            for r in tx.all("queue_controls_for_claim", {"queues": orjson.dumps(names).decode()})
        }
        with self._hints:
            self._controlled.difference_update(names)
            self._controlled.update(controls)
            self._slotted.difference_update(names)
            self._slotted.update(n for n, c in controls.items() if c["max_leased"] is not None)
            for name in names:
                # A cap or a rate another process removed: its hint goes (a review: a cap
                # removed over HTTP kept the TCP server's long-polls from handing on).
                c = controls.get(name)
                if c is None or c["max_leased"] is None:
                    self._capped.discard(name)
                if c is None or c["rate_per_s"] is None:
                    self._throttled.pop(name, None)
        if not controls:
            return names, None, {}, {}
        kept: list[str] = []
        limits: list[int] = []
        buckets: dict[str, tuple[float, float]] = {}
        slots: dict[str, int] = {}
        for name in names:
            c = controls.get(name)
            room = max_jobs
            if c is not None:
                if c["paused"]:
                    continue
                if c["max_leased"] is not None:
                    row = tx.one("queue_leased", {"queue": name})
                    free = c["max_leased"] - int(row["n"] if row else 0)
                    slots[name] = free
                    room = min(room, free)
                    self._hint_capped(name, room <= 0)
                if c["rate_per_s"] is not None and room > 0:
                    tokens = _refill(c, now)
                    buckets[name] = (tokens, float(c["rate_per_s"]))
                    room = min(room, math.floor(tokens + TOKEN_EPSILON))
                    if room <= 0:
                        self._hint_throttled(name, tokens, float(c["rate_per_s"]), now)
                    else:  # a token now, whatever a hint said (a rate raised elsewhere)
                        with self._hints:
                            self._throttled.pop(name, None)
            if room > 0:
                kept.append(name)
                limits.append(room)
        return kept, limits, buckets, slots

    def _spend(
        self,
        tx: Tx,
        buckets: Mapping[str, tuple[float, float]],
        slots: Mapping[str, int],
        rows: list[dict[str, Any]],
        now: int,
    ) -> None:
        """Take one token per job started from each rated queue's bucket (a claim that
        started none leaves the row alone: its refill is computed from the older instant),
        and remember the capped queues whose free slots it took (``exhausted``)."""
        started: dict[str, int] = {}
        for row in rows:
            started[row["queue"]] = started.get(row["queue"], 0) + 1
        for name, free in slots.items():
            if 0 < free <= started.get(name, 0):
                self._hint_capped(name, True)
        for name, (tokens, rate) in buckets.items():
            taken = started.get(name, 0)
            if not taken:
                continue
            left = max(0.0, tokens - taken)
            tx.run("queue_take_tokens", {"name": name, "tokens": left, "at_ms": now})
            if left + TOKEN_EPSILON < 1:
                self._hint_throttled(name, left, rate, now)

    def _hint_capped(self, queue: str, capped: bool) -> None:
        with self._hints:
            if capped:
                self._capped.add(queue)
            else:
                self._capped.discard(queue)

    def _hint_throttled(self, queue: str, tokens: float, rate: float, now: int) -> None:
        """Remember when ``queue``'s next token comes (``tokens`` held at ``now``)."""
        at = now + max(1, math.ceil((1 - tokens - TOKEN_EPSILON) * 1000 / rate))
        with self._hints:
            old = self._throttled.get(queue)
            # A passed instant is no bound on the next (without a sweep it stayed for good).
            self._throttled[queue] = at if old is None or old <= now else min(at, old)

    def next_token_ms(self, queues: Iterable[str]) -> int | None:
        """When the first of ``queues`` that a claim here found or left out of rate tokens
        gets its next one (epoch ms), or None: the instant a long-poll on them may claim
        again."""
        if not self._throttled:  # no rated queue ran dry here (most claims): no lock
            return None
        with self._hints:
            times = [self._throttled[q] for q in queues if q in self._throttled]
        return min(times, default=None)

    def _slot_freed(self, tx: Tx, queue: str) -> bool:
        """A lease of ``queue`` ended in ``tx``: when a claim here found the queue capped
        (``max_leased``), the freed slot may let a long-poll claim, so those of other servers
        on the database are told once ``tx`` commits (``made_ready``: a NOTIFY on PostgreSQL,
        nothing on SQLite, whose other processes see every commit). Return whether this
        server's own long-polls of it should look again (``held_back``: the dispatch wakes
        them after an ack, fail or release, the reaper after a sweep). A hint: a process that
        never claimed from the queue sends nothing, and the others' fallback poll finds the
        slot."""
        if queue in self._slotted:
            tx.made_ready(queue)
        return self.held_back(queue)

    def exhausted(self, queues: Iterable[str]) -> frozenset[str]:
        """Those of ``queues`` a claim here found or left at their cap (``max_leased``) or
        without a rate token whose next is still to come: a long-poll that got jobs wakes no
        other long-poll of these (``Wakeups.leave``), which would claim nothing; a freed slot
        (``held_back``) or the next token (``next_token_ms``) wakes them. A hint only: the
        claim before it read the queues' controls, and dropped what another process lifted
        (``_claim_plan``)."""
        if not self._capped and not self._throttled:  # most claims: no lock, no clock
            return frozenset()
        now = self.clock.now_ms()
        with self._hints:
            return frozenset(
                q for q in queues if q in self._capped or self._throttled.get(q, 0) > now
            )

    def held_back(self, queue: str) -> bool:
        """Whether a claim in this process left READY jobs of ``queue`` because of its cap:
        an ack, fail or release there frees a slot, so its long-polls should look again (the
        dispatch wakes them). A hint only; a long-poll woken for nothing claims nothing."""
        return queue in self._capped

    def renew(
        self, job_id: str, *, worker_id: str, lease_token: str, lease_ms: int | None = None
    ) -> dict[str, Any]:
        """Extend a live lease to now + ``lease_ms`` (LEASED -> LEASED), and tell the worker
        whether to stop.

        The new expiry is never more than ``RELAY_MAX_LEASE_MS`` ahead (``lease_ms`` is
        bounded by it).

        * A cancel was requested (``cancel``): the lease is renewed as usual, so the handler
          has time to stop cleanly, and the reply says ``stop: "cancelled"``; the worker then
          fails or releases the job, which ends it CANCELLED (an ack still succeeds it).
        * The attempt reached its time limit (``now >= leased_at + time_limit_ms``: at the
          limit exactly, the lease is no longer extended): nothing is renewed, the attempt is
          failed with the reason ``"timeout"`` as ``fail`` would (the retry policy applies:
          RETRYING, or DEAD once the budget is spent; CANCELLED when a cancel was requested),
          and the reply says ``stop: "timeout"`` with ``lease_expires_at_ms: None``. The
          token is spent: the worker's later ack or fail gets ``LEASE_EXPIRED``. Celery's
          ``time_limit`` and Oban's ``timeout/1`` end a run the same way, counted as a failed
          attempt; here the server can only refuse to extend, so the worker abandons the
          handler itself (it knows the limit from the lease).

        Fencing is unchanged: the renew is guarded by the job id, worker id and token, and an
        expired lease is not revived.

        Returns:
            ``{"job_id", "lease_expires_at_ms", "stop"}``; ``stop`` is None,
            ``"cancelled"`` or ``"timeout"`` (then with the job's ``queue`` and its new
            ``state`` too, for the surfaces' metrics).
        Raises:
            InvalidArgument, JobNotFound, StaleToken, LeaseExpired, StoreBusy.
        """
        guard = self._lease_guard(job_id, worker_id, lease_token)
        length = v.lease_ms(lease_ms, self.settings)
        with self.driver.write() as tx:
            return self._renew_in(tx, guard, length)

    def _renew_in(self, tx: Tx, guard: Mapping[str, Any], length: int) -> dict[str, Any]:
        """``renew`` in ``tx``: ``guard`` is a checked ``_lease_guard``, ``length`` the
        checked lease length in ms. Returns and raises what ``renew`` does."""
        job_id = guard["job_id"]
        at = self._read()
        now = at.now_ms
        params = dict(guard) | self._judging(at) | {"expires_ms": now + length}
        check(Transition.RENEW, JobState.LEASED, JobState.LEASED)
        row = tx.one("renew", params)
        if row is None:
            # The guard missed: a lost lease, or a live one past its time limit.
            lease = tx.one("live_lease", params)
            if lease is None or not self._timed_out(lease, now):
                raise self._rejection(tx, params, "renew")
            ended = self._end_lease(tx, params, lease, TIMEOUT_REASON, True, now, "timeout")
            return {
                "job_id": job_id,
                "lease_expires_at_ms": None,
                "stop": "timeout",
                "queue": lease["queue"],
                "state": ended["state"],
            }
        stop = "cancelled" if row["cancel_requested_at_ms"] is not None else None
        return {"job_id": job_id, "lease_expires_at_ms": row["lease_expires_at_ms"], "stop": stop}

    def renew_batch(self, renews: list[Mapping[str, Any]]) -> dict[str, Any]:
        """Renew several leases in one transaction, each fenced by its own job id, worker id
        and token as ``renew`` fences one (LEASED -> LEASED each).

        For a worker holding many leases: one request and one commit for every renew due,
        so a slow link bounds how long its renewals take, not how many leases it may hold
        (renewed one request at a time, 16 leases of 6 s with replies 400 ms late lost 7:
        docs/failure-model.md). Each entry runs as ``renew`` runs, in job id order (two
        batches naming the same jobs lock them in one order); one refused before it changed
        a row (a stale token, an expired lease) is set apart with ``mark``/``forgive`` and the
        others go on, as ``ack_batch``'s acks (SQS's ``ChangeMessageVisibilityBatch`` answers
        per entry too). An entry past its time limit fails its attempt, as ``renew`` does,
        and says ``stop: "timeout"``; a storage fault fails the whole batch: nothing commits.
        Durable, as ``renew`` is (docs/design-decisions.md, decision 3).

        Args:
            renews: 1..100 ``{"job_id", "worker_id", "lease_token", "lease_ms"?}``
                (``renew``'s arguments; ``lease_ms`` in ms, each entry its own).
        Returns:
            ``{"results": [{"job_id", "ok", "lease_expires_at_ms", "stop", "error"}, ...]}``
            in input order: ``ok`` with ``renew``'s ``lease_expires_at_ms`` and ``stop``
            (and, with ``stop: "timeout"``, the job's ``queue`` and new ``state``, for the
            surfaces' metrics), or not ``ok`` with ``error`` ``{"code", "message",
            "retryable"}``.
        Raises:
            InvalidArgument: ``renews`` is not a list of 1..100 objects, or an entry has an
                unknown field, lacks a string ``job_id``, ``worker_id`` or ``lease_token``, or
                has a ``lease_ms`` that is no integer (the whole request is refused, as
                ``ack_batch`` refuses one). A value out of
                range (a malformed job id, a lease length past ``RELAY_MAX_LEASE_MS``)
                refuses that entry only.
            StoreBusy: nothing changed.
        """
        if not isinstance(renews, list) or not 1 <= len(renews) <= MAX_BATCH_ACKS:
            raise InvalidArgument(
                f"renews: must be a list of 1 to {MAX_BATCH_ACKS} renews", field="renews"
            )
        _check_entries("renews", renews, RENEW_ENTRY_FIELDS)
        results: list[dict[str, Any] | None] = [None] * len(renews)
        plans: dict[int, tuple[dict[str, Any], int]] = {}
        for index, item in enumerate(renews):
            try:
                plans[index] = (
                    self._lease_guard(
                        item.get("job_id"), item.get("worker_id"), item.get("lease_token")
                    ),
                    v.lease_ms(item.get("lease_ms"), self.settings),
                )
            except RelayError as exc:
                results[index] = _refused_entry(item, exc, RENEW_BLANKS)
        order = sorted(plans, key=lambda index: plans[index][0]["job_id"])
        with self.driver.write() as tx:
            self._each_alone(
                order,
                renews,
                results,
                lambda index: self._renew_in(tx, *plans[index]),
                RENEW_BLANKS,
            )
        return {"results": results}

    @staticmethod
    def _timed_out(lease: Mapping[str, Any], now: int) -> bool:
        """Whether a lease row (``leased_at_ms``, ``time_limit_ms``) is at or past its
        attempt's time limit at ``now`` (epoch ms)."""
        limit = lease["time_limit_ms"]
        return limit is not None and now >= lease["leased_at_ms"] + limit

    def _next_claim(self, lease_next: Any, worker_id: str) -> dict[str, Any] | None:
        """Check a ``lease_next`` object before anything changes; return ``_claim_in``'s
        kwargs, or None when there is none (lease nothing).

        Args:
            lease_next: ``{"queues": [...], "max_jobs": 1..RELAY_MAX_JOBS_PER_LEASE (1),
                "lease_ms": ms (the visibility timeout), "worker_id": str (the ack's)}``.
            worker_id: the ack's worker id (the default).
        Raises:
            InvalidArgument: a bad field, named ``lease_next.<field>``.
        """
        if lease_next is None:
            return None
        if not isinstance(lease_next, Mapping):
            raise InvalidArgument("lease_next: must be an object", field="lease_next")
        lease_next = {k: val for k, val in lease_next.items() if val is not None}
        unknown = sorted(set(lease_next) - LEASE_NEXT_FIELDS)
        if unknown:
            field = f"lease_next.{unknown[0]}"
            raise InvalidArgument(f"{field}: unknown argument", field=field)
        s = self.settings
        try:
            return {
                "queues": v.queue_list(lease_next.get("queues"), s),
                "worker_id": v.worker_id(lease_next.get("worker_id", worker_id)),
                "max_jobs": v.integer(
                    "max_jobs", lease_next.get("max_jobs", 1), lo=1, hi=s.max_jobs_per_lease
                ),
                "lease_ms": v.lease_ms(lease_next.get("lease_ms"), s),
            }
        except InvalidArgument as exc:
            field = f"lease_next.{exc.details.get('field', '')}".rstrip(".")
            exc.details["field"] = field
            exc.message = f"lease_next.{exc.message}"
            exc.args = (exc.message,)
            raise

    def _then_lease(
        self, end: Callable[[Tx], dict[str, Any]], spec: dict[str, Any] | None
    ) -> dict[str, Any]:
        """An ack's or fail's transaction, its arguments and ``lease_next`` (``spec``, from
        ``_next_claim``; None: lease nothing) already checked: in ONE write transaction,
        ``end`` and the claim ``spec`` asks for, both on its ``tx`` (no savepoint of their
        own: neither is caught apart, so either failing rolls back both). With ``spec`` the
        reply carries ``next`` (the leases; empty when nothing is ready: no long-poll). A
        refused ack or fail leases nothing."""
        with self.driver.write() as tx:
            out = end(tx)
            if spec is not None:
                out["next"] = self._claim_in(tx, **spec)
        return out

    def ack(
        self,
        job_id: str,
        *,
        worker_id: str,
        lease_token: str,
        result: Any = None,
        lease_next: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Mark a leased job done (LEASED -> SUCCEEDED), and optionally lease the worker's next
        jobs in the same transaction (``lease_next``).

        Repeating an ack with the token of an attempt that already succeeded answers success
        again with ``duplicate: true`` (a worker whose reply was lost may retry); a repeat
        stores nothing.

        Args:
            result: the handler's result, any JSON value of at most ``RELAY_MAX_RESULT_BYTES``
                as compact JSON, stored with the job in the same transaction (``relay_result``;
                read by ``result``). None stores nothing (JSON ``null`` cannot be told from
                "no result" on the wire). Celery's result backend stores a task's return
                value the same way, beside its state.
            lease_next: ``{"queues", "max_jobs", "lease_ms", "worker_id"}`` (see
                ``_next_claim``): after the ack, ``claim`` as ``lease`` would (queue pauses,
                caps and rates apply), without waiting. One round trip and one commit per
                job for a busy worker instead of two (SQS's ``ReceiveMessage`` after
                ``DeleteMessageBatch`` is two; Faktory's ``ACK`` then ``FETCH`` too). A repeated
                ack leases as well (its first reply may have been lost with its leases,
                which then expire).
        Returns:
            ``{"job_id", "state": "succeeded", "queue", "duplicate": false}``, or
            ``{"job_id", "state": "succeeded", "duplicate": true}`` for a repeat; with
            ``lease_next``, plus ``"next": [Lease, ...]``.
        Raises:
            InvalidArgument (also for a result JSON cannot carry faithfully: NaN, ±Infinity,
            lone surrogates; ``lease_next.<field>``), FrameTooLarge (a result over
            ``RELAY_MAX_RESULT_BYTES``; nothing changed, the lease is still held),
            JobNotFound, StaleToken, LeaseExpired, StoreBusy: nothing is leased then.
        """
        spec = self._next_claim(lease_next, worker_id)
        end = self._ack_plan(job_id, worker_id, lease_token, result)
        return self._then_lease(end, spec)

    def _ack_plan(
        self, job_id: Any, worker_id: Any, lease_token: Any, result: Any
    ) -> Callable[[Tx], dict[str, Any]]:
        """Check an ack's arguments; return what applies it in a write transaction (``ack``).

        Raises:
            InvalidArgument, FrameTooLarge (see ``ack``).
        """
        guard, stored = self._ack_args(job_id, worker_id, lease_token, result)
        return functools.partial(self._ack_in, guard=guard, stored=stored)

    def _ack_args(
        self, job_id: Any, worker_id: Any, lease_token: Any, result: Any
    ) -> tuple[dict[str, Any], str | None]:
        """An ack's checked lease guard and stored result (None: no result).

        Raises:
            InvalidArgument, FrameTooLarge (see ``ack``).
        """
        guard = self._lease_guard(job_id, worker_id, lease_token)
        return guard, None if result is None else v.result(result, self.settings)

    def _ack_in(self, tx: Tx, *, guard: dict[str, Any], stored: str | None) -> dict[str, Any]:
        """LEASED -> SUCCEEDED on ``tx`` (the write transaction ``_then_lease`` opened); see
        ``ack``."""
        job_id = guard["job_id"]
        at = self._read()
        now = at.now_ms
        params = guard | self._judging(at)
        check(Transition.ACK, JobState.LEASED, JobState.SUCCEEDED)
        row = tx.one("ack", params)
        if row is None:
            if self._ended_attempt(tx, params, ("succeeded",)) is not None:
                return {"job_id": job_id, "state": "succeeded", "duplicate": True}
            raise self._rejection(tx, params, "ack")
        self._end_attempt(tx, job_id, row["attempt"], now, "succeeded", None)
        self._entered(tx, job_id, row["unique_scope"], JobState.SUCCEEDED)
        self._slot_freed(tx, row["queue"])
        if stored is not None:
            tx.run("store_result", {"job_id": job_id, "return_value": stored, "now_ms": now})
        return {
            "job_id": job_id,
            "state": JobState.SUCCEEDED.value,
            "queue": row["queue"],
            "duplicate": False,
        }

    def fail(
        self,
        job_id: str,
        *,
        worker_id: str,
        lease_token: str,
        error: str,
        retryable: bool = True,
        exception_class: str | None = None,
        traceback: str | None = None,
        lease_next: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Record a failed attempt (LEASED -> RETRYING, or LEASED -> DEAD; LEASED -> CANCELLED
        when a cancel was asked for), and optionally lease the worker's next jobs in the same
        transaction (``lease_next``, as ``ack``).

        Decide, then apply: ``retry.decide`` picks retry-at or dead-letter from the job's
        policy and failure count (Oban's executor outcomes), then one guarded UPDATE applies it.

        Args:
            error: failure text, at most ``RELAY_MAX_ERROR_BYTES`` UTF-8 bytes, without lone
                surrogates (no UTF-8 form; refused).
            retryable: False dead-letters the job at once.
            exception_class: the exception's class (``module.QualName``, 1..255 characters);
                given, ``{"attempt", "exception_class", "traceback"}`` joins the job's stored
                errors (``relay_result``, read by ``result``), which keep the newest entries
                that fit ``RELAY_MAX_RESULT_BYTES`` (django-tasks' ``TaskError``).
            traceback: its formatted traceback, at most ``RELAY_MAX_RESULT_BYTES`` UTF-8
                bytes (only stored with ``exception_class``; default ``""``).
            lease_next: as ``ack``'s (a retry due at once may be leased straight back).
        Returns:
            ``{"job_id", "state", "retry_at_ms", "dead_reason", "duplicate"}``, plus ``queue``
            when not a duplicate; with ``lease_next``, plus ``"next": [Lease, ...]``.
        Raises:
            InvalidArgument, JobNotFound, StaleToken, LeaseExpired, StoreBusy.
        """
        spec = self._next_claim(lease_next, worker_id)
        end = self._fail_plan(
            job_id, worker_id, lease_token, error, retryable, exception_class, traceback
        )
        return self._then_lease(end, spec)

    def _fail_plan(
        self,
        job_id: Any,
        worker_id: Any,
        lease_token: Any,
        error: Any,
        retryable: Any,
        exception_class: Any,
        traceback: Any,
    ) -> Callable[[Tx], dict[str, Any]]:
        """Check a fail's arguments; return what applies it in a write transaction (``fail``).

        Raises:
            InvalidArgument (see ``fail``).
        """
        guard = self._lease_guard(job_id, worker_id, lease_token)
        error = v.error_text(error, self.settings)
        retryable = v.boolean("retryable", retryable)
        if exception_class is not None:
            exception_class = v.exception_class(exception_class)
        if traceback is not None:
            traceback = v.traceback_text(traceback, self.settings)
        return functools.partial(
            self._fail_in,
            guard=guard,
            error=error,
            retryable=retryable,
            exception_class=exception_class,
            traceback=traceback,
        )

    def _fail_in(
        self,
        tx: Tx,
        *,
        guard: dict[str, Any],
        error: str,
        retryable: bool,
        exception_class: str | None,
        traceback: str | None,
    ) -> dict[str, Any]:
        """LEASED -> RETRYING or DEAD on ``tx`` (the write transaction ``_then_lease`` opened);
        see ``fail``."""
        job_id = guard["job_id"]
        at = self._read()
        now = at.now_ms
        params: dict[str, Any] = guard | self._judging(at)
        lease = tx.one("live_lease", params)
        if lease is None:
            ended = self._ended_attempt(tx, params, ("failed", "cancelled"))
            if ended is not None:
                return self._repeated_fail(tx, job_id, ended)
            raise self._rejection(tx, params, "fail")
        out = self._end_lease(tx, params, lease, error, retryable, now, "failed")
        if exception_class is not None:
            entry = {
                "attempt": lease["attempt"],
                "exception_class": exception_class,
                "traceback": traceback or "",
            }
            self._store_error(tx, job_id, entry, now)
        return out

    def ack_batch(
        self, acks: list[Mapping[str, Any]], *, lease_next: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Acknowledge several leased jobs in one transaction, each fenced by its own token
        (LEASED -> SUCCEEDED each), and optionally lease the next jobs in it too.

        The acks run on the batch's transaction, without a SAVEPOINT each: one guarded UPDATE
        acks every entry whose token, worker and unexpired lease match (``ack_many``, a
        statement per batch where ``ack`` takes one per job), and one ``executemany`` closes
        their attempts. An entry it did not ack, or whose job an earlier entry names, then
        runs alone as ``ack`` runs, which says why (a stale token, an expired lease) or
        answers ``duplicate``; refused before it changed a row, it is set apart with
        ``mark``/``forgive`` and the others go on, so one stale token refuses that ack only
        (the group commit's rule; SQS's ``DeleteMessageBatch`` answers per entry too). An ack
        that fails after writing (a storage fault) fails the whole batch: nothing commits.

        Args:
            acks: 1..100 ``{"job_id", "worker_id", "lease_token", "result"?}`` (``ack``'s
                arguments).
            lease_next: as ``ack``'s; its ``worker_id`` defaults to the first ack's.
        Returns:
            ``{"results": [{"job_id", "ok", "state", "duplicate", "error"}, ...], "next"}``
            in input order: ``ok`` with ``state`` ``"succeeded"`` and ``duplicate``, or not
            ``ok`` with ``error`` ``{"code", "message", "retryable"}``; ``queue`` too on a
            first ack (for the metrics). ``next`` is ``[]`` without ``lease_next``.
        Raises:
            InvalidArgument: ``acks`` is not a list of 1..100 objects, an entry has an unknown
                field or lacks a string ``job_id``, ``worker_id`` or ``lease_token`` (the whole
                request is refused, as ``submit_batch`` refuses a malformed entry; the HTTP
                schema refuses the same), or ``lease_next`` is invalid. A value out of range
                (a malformed job id, a result over its limit) refuses that entry only.
            StoreBusy: nothing changed.
        """
        if not isinstance(acks, list) or not 1 <= len(acks) <= MAX_BATCH_ACKS:
            raise InvalidArgument(
                f"acks: must be a list of 1 to {MAX_BATCH_ACKS} acks", field="acks"
            )
        _check_entries("acks", acks, ACK_ENTRY_FIELDS)
        spec = self._next_claim(lease_next, acks[0].get("worker_id"))  # type: ignore[arg-type]
        results: list[dict[str, Any] | None] = [None] * len(acks)
        plans: dict[int, tuple[dict[str, Any], str | None]] = {}
        for index, item in enumerate(acks):
            try:
                plans[index] = self._ack_args(
                    item.get("job_id"),
                    item.get("worker_id"),
                    item.get("lease_token"),
                    item.get("result"),
                )
            except RelayError as exc:
                results[index] = _refused_entry(item, exc)
        with self.driver.write() as tx:
            slow = self._ack_many(tx, plans, results) if plans else []
            # Refused, repeated or a duplicate: one by one, as ``ack``.
            self._each_alone(
                slow,
                acks,
                results,
                lambda index: self._ack_in(tx, guard=plans[index][0], stored=plans[index][1]),
            )
            leases = []
            if spec is not None:  # the results share the reply's frame with the leases
                reserved = len(orjson.dumps(results))
                leases = self._claim_in(tx, **spec, reserved_bytes=reserved)
        return {"results": results, "next": leases}

    def _ack_many(
        self,
        tx: Tx,
        plans: Mapping[int, tuple[dict[str, Any], str | None]],
        results: list[dict[str, Any] | None],
    ) -> list[int]:
        """LEASED -> SUCCEEDED for the acks of ``plans`` (input index -> checked guard and
        stored result) in one guarded statement (``ack_many``, through ``_guarded_many``),
        each entry fenced by its own token, worker and expiry as ``ack`` fences one; fills
        ``results`` for those it acked.

        Returns:
            The indexes it did not ack, in input order: an entry the guard refused (stale,
            expired, gone, or already acked: ``ack`` tells which) or whose job an earlier entry
            names too; the caller runs each alone.
        """
        at = self._read()
        now = at.now_ms
        check(Transition.ACK, JobState.LEASED, JobState.SUCCEEDED)
        guards = {index: guard for index, (guard, _) in plans.items()}
        done, slow = self._guarded_many(tx, "ack_many", "acks", guards, at, "succeeded")
        for index, row in done:
            job_id = row["id"]
            self._entered(tx, job_id, row["unique_scope"], JobState.SUCCEEDED)
            self._slot_freed(tx, row["queue"])
            stored = plans[index][1]
            if stored is not None:
                tx.run("store_result", {"job_id": job_id, "return_value": stored, "now_ms": now})
            results[index] = {
                "job_id": job_id,
                "state": JobState.SUCCEEDED.value,
                "queue": row["queue"],
                "duplicate": False,
                "ok": True,
                "error": None,
            }
        return slow

    def _each_alone(
        self,
        indexes: Sequence[int],
        entries: Sequence[Mapping[str, Any]],
        results: list[dict[str, Any] | None],
        run: Callable[[int], dict[str, Any]],
        blanks: Sequence[str] = ACK_BLANKS,
    ) -> None:
        """Run the batch entries at ``indexes`` one by one (``run(index)``, in the batch's
        transaction), each result as ``{**out, "ok": True, "error": None}``. An entry
        refused before it changed a row gets ``_refused_entry`` (with ``blanks``) and the
        others go on; anything else fails the whole batch (``ack_batch``, ``release_batch``,
        ``renew_batch``)."""
        for index in indexes:
            mark = self.mark()
            try:
                out = run(index)
            except RelayError as exc:
                if not self.forgive(mark):
                    raise
                results[index] = _refused_entry(entries[index], exc, blanks)
                continue
            results[index] = {**out, "ok": True, "error": None}

    def _guarded_many(
        self,
        tx: Tx,
        statement: str,
        param: str,
        guards: Mapping[int, Mapping[str, Any]],
        at: Reading,
        outcome: str,
    ) -> tuple[list[tuple[int, dict[str, Any]]], list[int]]:
        """Run a batch's guarded statement (``ack_many``, ``release_many``: its JSON array
        of entries in ``param``) over the first entry naming each job of ``guards`` (input
        index -> checked ``_lease_guard``), and close the attempts of the rows it changed
        with ``outcome`` in one ``executemany``.

        Returns:
            ``(index, row)`` for each entry it changed, and the indexes it did not, in input
            order: an entry the guard refused or whose job an earlier entry names too; the
            caller runs each alone, which says why.
        """
        first: dict[str, int] = {}
        slow: list[int] = []
        for index, guard in guards.items():
            if guard["job_id"] in first:
                slow.append(index)
            else:
                first[guard["job_id"]] = index
        if not first:
            return [], slow
        # In job id order: two batches naming the same jobs lock their rows in one order
        # (PostgreSQL's nested loop follows the array), so they queue rather than deadlock.
        entries = orjson.dumps([guards[first[job_id]] for job_id in sorted(first)]).decode()
        rows = tx.all(statement, {param: entries, **self._judging(at)})
        tx.many(
            "end_attempt",
            [
                {
                    "job_id": row["id"],
                    "attempt": row["attempt"],
                    "now_ms": at.now_ms,
                    "outcome": outcome,
                    "error": None,
                    "retry_at_ms": None,
                }
                for row in rows
            ],
        )
        done = [(first.pop(row["id"]), row) for row in rows]
        return done, sorted([*slow, *first.values()])

    def _end_lease(
        self,
        tx: Tx,
        params: dict[str, Any],
        lease: Mapping[str, Any],
        error: str,
        retryable: bool,
        now: int,
        outcome: str,
    ) -> dict[str, Any]:
        """Fail a live lease (``live_lease`` row) in ``tx``: RETRYING or DEAD by its retry
        policy, or CANCELLED when a cancel was requested; close its attempt with ``outcome``
        (``"failed"``, or ``"timeout"`` for a renew past the time limit). Returns ``fail``'s
        result."""
        job_id = params["job_id"]
        self._slot_freed(tx, lease["queue"])
        if lease["cancel_requested_at_ms"] is not None:
            check(Transition.CANCEL, JobState.LEASED, JobState.CANCELLED)
            tx.run("finish_cancelled", params | {"now_ms": now, "error": error})
            self._end_attempt(tx, job_id, lease["attempt"], now, "cancelled", error)
            self._event(
                tx,
                job_id,
                Transition.CANCEL,
                JobState.LEASED,
                JobState.CANCELLED,
                now,
                None,
                f"worker stopped: {error}"[:500],
            )
            self._entered(tx, job_id, lease["unique_scope"], JobState.CANCELLED)
            return {
                "job_id": job_id,
                "state": JobState.CANCELLED.value,
                "retry_at_ms": None,
                "dead_reason": None,
                "queue": lease["queue"],
                "duplicate": False,
            }
        policy = RetryPolicy(
            max_retries=lease["max_retries"],
            backoff=lease["backoff"],
            base_ms=lease["backoff_base_ms"],
            cap_ms=lease["backoff_cap_ms"],
            jitter=bool(lease["jitter"]),
        )
        decision = decide(
            policy,
            failures=lease["failures"] + 1,
            retryable=retryable,
            now_ms=now,
            rng=self.rng,
            error=error,
        )
        params["error"] = error
        if decision.retry_at_ms is not None:
            params["retry_at_ms"] = decision.retry_at_ms
            check(Transition.FAIL_RETRY, JobState.LEASED, JobState.RETRYING)
            tx.run("fail_retry", params)
            state = JobState.RETRYING
        else:
            params["reason"] = decision.dead_reason
            check(Transition.FAIL_DEAD, JobState.LEASED, JobState.DEAD)
            tx.run("fail_dead", params)
            state = JobState.DEAD
        self._end_attempt(tx, job_id, lease["attempt"], now, outcome, error, decision.retry_at_ms)
        self._entered(tx, job_id, lease["unique_scope"], state)
        return {
            "job_id": job_id,
            "state": state.value,
            "retry_at_ms": decision.retry_at_ms,
            "dead_reason": decision.dead_reason,
            "queue": lease["queue"],
            "duplicate": False,
        }

    def _store_error(self, tx: Tx, job_id: str, entry: dict[str, Any], now: int) -> None:
        """Append ``entry`` to the job's stored errors, dropping the oldest until the list
        fits ``RELAY_MAX_RESULT_BYTES`` as JSON (the newest entry always stays)."""
        row = tx.one("result_of", {"job_id": job_id})
        entries: list[dict[str, Any]] = orjson.loads(row["errors"]) if row else []
        kept = [entry]
        size = len(orjson.dumps(entry)) + 2
        for older in reversed(entries):
            size += len(orjson.dumps(older)) + 1
            if size > self.settings.result_limit_bytes:
                break
            kept.append(older)
        kept.reverse()
        tx.run(
            "store_errors",
            {"job_id": job_id, "errors": orjson.dumps(kept).decode("utf-8"), "now_ms": now},
        )

    def _repeated_fail(self, tx: Tx, job_id: str, attempt: Mapping[str, Any]) -> dict[str, Any]:
        """Answer a fail repeated with the token of an attempt that already failed: say what
        that failure did (its attempt row keeps the decision), whatever happened since."""
        row = self._job(tx, job_id)
        if attempt["outcome"] == "cancelled":
            return {
                "job_id": job_id,
                "state": JobState.CANCELLED.value,
                "retry_at_ms": None,
                "dead_reason": None,
                "duplicate": True,
            }
        dead = attempt["retry_at_ms"] is None
        still = row["attempt"] == attempt["attempt"] and row["state"] in (
            JobState.RETRYING,
            JobState.DEAD,
        )
        return {
            "job_id": job_id,
            "state": (JobState.DEAD if dead else JobState.RETRYING).value,
            "retry_at_ms": row["available_at_ms"] if still and not dead else None,
            "dead_reason": row["dead_reason"] if still and dead else None,
            "duplicate": True,
        }

    def release(self, job_id: str, *, worker_id: str, lease_token: str) -> dict[str, Any]:
        """Give a leased job back without counting a failure (LEASED -> READY), or, when a
        cancel was requested, end it (LEASED -> CANCELLED: a worker that stopped its handler
        because the renew said ``stop: "cancelled"``).

        For a worker that shuts down before finishing (beanstalkd's ``release``; an SQS
        visibility timeout of 0).

        Returns:
            ``{"job_id", "state": "ready" | "cancelled", "queue"}``.
        Raises:
            InvalidArgument, JobNotFound, StaleToken, LeaseExpired, StoreBusy.
        """
        guard = self._lease_guard(job_id, worker_id, lease_token)
        with self.driver.write() as tx:
            return self._release_in(tx, guard)

    def _release_in(self, tx: Tx, guard: dict[str, Any]) -> dict[str, Any]:
        """``release`` of one checked guard (``_lease_guard``) in ``tx``; its result and
        errors."""
        job_id = guard["job_id"]
        at = self._read()
        now = at.now_ms
        params = guard | self._judging(at)
        lease = tx.one("live_lease", params)
        if lease is None:
            raise self._rejection(tx, params, "release")
        if lease["cancel_requested_at_ms"] is not None:
            out = self._end_lease(tx, params, lease, "cancelled", False, now, "cancelled")
            return {"job_id": job_id, "state": out["state"], "queue": out["queue"]}
        check(Transition.RELEASE, JobState.LEASED, JobState.READY)
        row = tx.one("release", params)
        if row is None:  # pragma: no cover - live_lease read it in this transaction
            raise self._rejection(tx, params, "release")
        self._end_attempt(tx, job_id, row["attempt"], now, "released", None)
        tx.made_ready(row["queue"])
        return {"job_id": job_id, "state": JobState.READY.value, "queue": row["queue"]}

    def release_batch(self, leases: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Give back several leased jobs in one transaction, each fenced by its own token and
        worker, as ``release`` gives back one (LEASED -> READY, or CANCELLED when a cancel was
        requested).

        For the server's give-back of leases whose reply never reached its client
        (``protocol.requests.Requests.give_back``): a cut connection may hold a thousand.
        One guarded statement (``release_many``) releases every entry whose token, worker
        and unexpired lease match and whose job has no cancel requested, and one
        ``executemany`` closes their attempts (``_guarded_many``, as ``ack_batch``'s). An
        entry it did not release, or whose job an earlier entry names, then runs alone as
        ``release``, which ends a cancel-requested job or says why it refused. A refused
        entry changes nothing and the others go on; a storage fault fails the whole batch.

        Lease bookkeeping: no reply promises it, so it commits without waiting for the disk
        (``driver.write(durable=False)``; docs/design-decisions.md, decision 3). A crash that
        loses it leaves its jobs LEASED until restart recovery (SQLite) or their leases'
        expiry, as if it never ran.

        Args:
            leases: 1..``MAX_BATCH_ACKS`` ``{"job_id", "worker_id", "lease_token"}`` (other
                keys ignored), of any workers.
        Returns:
            One result per entry, in input order: ``{"job_id", "ok": True, "state":
            "ready" | "cancelled", "queue", "error": None}`` or, refused, ``ack_batch``'s shape
            (``{"job_id", "ok": False, "state": None, "duplicate": None, "error": {"code",
            "message", "retryable"}}``).
        Raises:
            InvalidArgument: ``leases`` is not a list of 1..``MAX_BATCH_ACKS`` objects.
            StoreBusy: nothing changed.
        """
        if not isinstance(leases, list | tuple) or not 1 <= len(leases) <= MAX_BATCH_ACKS:
            raise InvalidArgument(
                f"leases: must be a list of 1 to {MAX_BATCH_ACKS} leases", field="leases"
            )
        results: list[dict[str, Any] | None] = [None] * len(leases)
        guards: dict[int, dict[str, Any]] = {}
        for index, item in enumerate(leases):
            if not isinstance(item, Mapping):
                raise InvalidArgument(f"leases[{index}]: must be an object", index=index)
            try:
                guards[index] = self._lease_guard(
                    item.get("job_id"), item.get("worker_id"), item.get("lease_token")
                )
            except RelayError as exc:
                results[index] = _refused_entry(item, exc)
        with self.driver.write(durable=False) as tx:
            at = self._read()
            check(Transition.RELEASE, JobState.LEASED, JobState.READY)
            done, slow = self._guarded_many(tx, "release_many", "leases", guards, at, "released")
            for index, row in done:
                tx.made_ready(row["queue"])
                results[index] = {
                    "job_id": row["id"],
                    "ok": True,
                    "state": JobState.READY.value,
                    "queue": row["queue"],
                    "error": None,
                }
            # Cancel requested, refused or repeated: one by one, as ``release``.
            self._each_alone(
                slow, leases, results, lambda index: self._release_in(tx, guards[index])
            )
        answered = [r for r in results if r is not None]
        assert len(answered) == len(leases), "every entry has its result"
        return answered

    @staticmethod
    def _lease_guard(job_id: Any, worker_id: Any, lease_token: Any) -> dict[str, Any]:
        """Validate the three values every lease-guarded UPDATE compares."""
        return {
            "job_id": v.job_id(job_id),
            "worker_id": v.worker_id(worker_id),
            "lease_token": v.lease_token(lease_token),
        }

    @staticmethod
    def _ended_attempt(
        tx: Tx, params: Mapping[str, Any], outcomes: Iterable[str]
    ) -> dict[str, Any] | None:
        """The attempt this token and worker held, if it already ended with one of ``outcomes``."""
        attempt = tx.one("attempt_by_token", params)
        if (
            attempt is not None
            and attempt["worker_id"] == params["worker_id"]
            and attempt["outcome"] in outcomes
        ):
            return attempt
        return None

    @staticmethod
    def _rejection(tx: Tx, params: Mapping[str, Any], verb: str) -> Exception:
        """Explain a guard miss, in a fixed order: missing, stale token, expired."""
        job_id = params["job_id"]
        row = tx.one("lease_state", params)
        if row is None:
            return JobNotFound(f"no job {job_id}", job_id=job_id)
        current = row["state"] == JobState.LEASED and row["lease_token"] == params["lease_token"]
        if current and row["leased_by"] == params["worker_id"]:
            # The token and worker match, so the guard failed on time.
            return LeaseExpired(
                f"cannot {verb} {job_id}: its lease expired at {row['lease_expires_at_ms']}",
                job_id=job_id,
            )
        if not current:
            attempt = tx.one("attempt_by_token", params)
            if (
                attempt is not None
                and attempt["worker_id"] == params["worker_id"]
                and attempt["outcome"] == "timeout"
            ):
                return LeaseExpired(
                    f"cannot {verb} {job_id}: the attempt ran past its time limit",
                    job_id=job_id,
                    reason="timeout",
                )
            if (
                attempt is not None
                and attempt["worker_id"] == params["worker_id"]
                and attempt["outcome"] == "lease_expired"
                and row["state"] != JobState.LEASED
            ):
                return LeaseExpired(
                    f"cannot {verb} {job_id}: its lease expired and nobody holds it now",
                    job_id=job_id,
                )
        return StaleToken(
            f"cannot {verb} {job_id}: the lease token or worker is not the current lease's",
            job_id=job_id,
        )

    def _end_attempt(
        self,
        tx: Tx,
        job_id: str,
        attempt: int,
        now: int,
        outcome: str,
        error: str | None,
        retry_at_ms: int | None = None,
    ) -> None:
        tx.run(
            "end_attempt",
            {
                "job_id": job_id,
                "attempt": attempt,
                "now_ms": now,
                "outcome": outcome,
                "error": error,
                "retry_at_ms": retry_at_ms,
            },
        )

    # ------------------------------------------------------------ maintenance

    def promote_due(self) -> list[str]:
        """Move due PENDING/RETRYING jobs to READY (bounded sweep).

        Returns:
            The queues that got READY jobs (with repeats removed); ``[]`` when another
            server's sweep holds the sweep lock (it does the work).
        """
        with self.driver.write(durable=False) as tx:  # redone by the next sweep if lost
            return self._promote(tx, self._now()) if tx.sweep_lock() else []

    def _promote(self, tx: Tx, now: int) -> list[str]:
        # promote_due moves PENDING and RETRYING jobs alike (its guard names both states).
        check(Transition.PROMOTE, JobState.PENDING, JobState.READY)
        check(Transition.PROMOTE, JobState.RETRYING, JobState.READY)
        rows = tx.all("promote_due", {"now_ms": now, "limit": SWEEP_LIMIT})
        queues = list(dict.fromkeys(r["queue"] for r in rows))
        for queue in queues:
            tx.made_ready(queue)
        return queues

    def expire_leases(self) -> list[str]:
        """Reclaim expired leases (LEASED -> READY, or DEAD once the retry budget is spent;
        CANCELLED when a cancel was asked for).

        An expiry counts as a failed attempt, so a job that crashes its workers ends in DEAD
        with the reason "lease expired" (``timeout`` at or past its time limit) instead of
        looping forever.

        Returns:
            The queues that got jobs back as READY; ``[]`` when another server's sweep holds
            the sweep lock.
        """
        with self.driver.write(durable=False) as tx:  # redone by the next sweep if lost
            return self._expire(tx, self._read()) if tx.sweep_lock() else []

    def _sweep(self, tx: Tx, at: Reading) -> list[str]:
        """Expire leases and promote due jobs, if this transaction gets the sweep lock (one
        sweep at a time across servers); return the queues that got READY jobs."""
        now = at.now_ms
        plan = tx.sweep_plan(now)
        if plan is None:
            return []
        expire, promote = plan
        queues = [
            *(self._expire(tx, at) if expire else []),
            *(self._promote(tx, now) if promote else []),
        ]
        return list(dict.fromkeys(queues))

    def sweep(self) -> list[str]:
        """Expire leases, then promote due jobs, in one transaction (the server's reaper);
        once it commits, run the storage's upkeep (``maintain``).

        Returns:
            The queues that got READY jobs or a freed slot under their cap (``[]`` when
            another server is sweeping), and the rate-limited queues whose next token has
            come since a claim here found none.
        """
        # Lease bookkeeping, as a claim's own sweep: a sweep an OS crash takes back is done
        # again by the next one (or by recovery), so its COMMIT does not wait for the disk.
        with self.driver.write(durable=False) as tx:
            self.driver.after_commit(self.maintain)
            at = self._read()
            queues = self._sweep(tx, at)
        # Rate-limited queues whose next token has come: their long-polls look again.
        with self._hints:
            due = [q for q, when in self._throttled.items() if when <= at.now_ms]
            for q in due:
                del self._throttled[q]
        return list(dict.fromkeys([*queues, *due]))

    def maintain(self) -> None:
        """Storage upkeep outside a transaction (``Driver.maintain``: on SQLite, keep the
        write-ahead log under ``RELAY_SQLITE_WAL_LIMIT_BYTES``). Cheap when there is nothing
        to do; the reaper reaches it after each sweep."""
        self.driver.maintain(self.clock.monotonic())

    def _expire(self, tx: Tx, at: Reading) -> list[str]:
        """Expire the leases ``at`` judges expired (``_judging``), at most SWEEP_LIMIT;
        return the queues whose jobs went back to READY, and those at their cap
        (``held_back``) where a lease that ended (dead, cancelled) freed a slot."""
        now = at.now_ms
        queues: dict[str, None] = {}
        for r in tx.all("expired_leases", self._judging(at) | {"limit": SWEEP_LIMIT}):
            # A lease that ran out at or past its attempt's time limit (a hung worker that
            # stopped renewing) counts as a timeout.
            timed_out = r["time_limit_ms"] is not None and (
                r["lease_expires_at_ms"] >= r["leased_at_ms"] + r["time_limit_ms"]
            )
            reason = TIMEOUT_REASON if timed_out else LEASE_EXPIRED_REASON
            params = {"job_id": r["id"], "attempt": r["attempt"], "now_ms": now, "reason": reason}
            if r["cancel_requested_at_ms"] is not None:
                check(Transition.CANCEL, JobState.LEASED, JobState.CANCELLED)
                if tx.run("expire_to_cancelled", params):
                    self._observe("lease_expired", r["queue"])
                    self._observe("cancelled", r["queue"])
                    self._entered(tx, r["id"], r["unique_scope"], JobState.CANCELLED)
                    if self._slot_freed(tx, r["queue"]):
                        queues[r["queue"]] = None  # a freed slot: its long-polls look again
                    self._end_attempt(tx, r["id"], r["attempt"], now, "lease_expired", reason)
                    self._event(
                        tx,
                        r["id"],
                        Transition.CANCEL,
                        JobState.LEASED,
                        JobState.CANCELLED,
                        now,
                        None,
                        "cancel requested; lease expired",
                    )
                continue
            dead = r["failures"] + 1 > r["max_retries"]
            check(Transition.EXPIRE, JobState.LEASED, JobState.DEAD if dead else JobState.READY)
            # Guarded by state and attempt: a lease acked meanwhile is left alone.
            if not tx.run("expire_to_dead" if dead else "expire_to_ready", params):
                continue
            self._observe("lease_expired", r["queue"])
            if timed_out:
                self._observe("timed_out", r["queue"])
            if dead:
                self._observe("dead", r["queue"])
                self._entered(tx, r["id"], r["unique_scope"], JobState.DEAD)
                if self._slot_freed(tx, r["queue"]):
                    # A slot freed in a queue at its cap: its long-polls look again (a review:
                    # they waited for an unrelated wake, 1.4-4.7 s on SQLite).
                    queues[r["queue"]] = None
            else:
                queues[r["queue"]] = None
            self._end_attempt(tx, r["id"], r["attempt"], now, "lease_expired", reason)
            log.info(
                "event=lease_expired job_id=%s attempt=%s",
                r["id"],
                r["attempt"],
                extra={"event": "lease_expired", "job_id": r["id"], "attempt": r["attempt"]},
            )
        for queue in queues:
            tx.made_ready(queue)
        return list(queues)

    @staticmethod
    def _entered(tx: Tx, job_id: str, unique_scope: str | None, state: JobState) -> None:
        """After a state change in ``tx``: a job submitted with ``unique: "active"`` that has
        entered a terminal state frees its idempotency key (``release_unique_key``), in the
        same transaction, so no submit sees the job terminal with its key still bound.

        Every transition into a terminal state calls this (a new terminal state joins
        ``states.TERMINAL_STATES`` and its transition calls this too).
        """
        if unique_scope == "active" and is_terminal(state):
            tx.run("release_unique_key", {"job_id": job_id})

    def _observe(self, event: str, queue: str) -> None:
        if self.observer is not None:
            self.driver.after_commit(functools.partial(self.observer, event, queue))

    def recover(self) -> int:
        """Release every lease at server start (LEASED -> READY), without counting a failure.

        Only where one server serves the database (``capabilities.single_writer``: SQLite):
        nobody else can hold a lease then. Old tokens are cleared, so a worker still running
        from before the restart can no longer ack, fail or renew. Terminal jobs are untouched.
        Where several servers share the database (PostgreSQL), leases belong to workers, a
        server start releases nothing, and a lost lease comes back by expiry.

        Returns:
            How many leases were released (0 where several servers share the database).
        """
        if not self.capabilities.single_writer:
            return 0
        with self.driver.write() as tx:
            now = self._now()
            check(Transition.RECOVER, JobState.LEASED, JobState.READY)
            tx.run("recover_attempts", {"now_ms": now})
            # A lease whose cancel was requested ends CANCELLED instead.
            if tx.run("recover_cancel_events", {"now_ms": now}):
                check(Transition.CANCEL, JobState.LEASED, JobState.CANCELLED)
                tx.run("recover_cancelled", {"now_ms": now})
            tx.run("recover_events", {"now_ms": now})
            released = tx.run("recover_jobs", {"now_ms": now})
            if released:
                tx.made_ready()
            return released

    def repair_counts(self) -> list[dict[str, Any]]:
        """Compare the kept job counts with the jobs, and rebuild them if they differ (at
        server start, where the driver keeps counts in a table: ``capabilities.kept_counts``).

        A Relay older than migration 0008 inserts jobs without counting them, so one run
        against a migrated file (started again after an upgrade, or still serving while
        another process migrated it) left ``stats``, the gauges and the console's overview
        short by its inserts for good, and negative once those jobs moved on (a review: 5
        jobs ready, ``ready: 0``). The scan costs 0.1-0.3 s a million jobs (measured), beside the
        start-up check's read of the whole file.

        Returns:
            The (queue, state) pairs that were wrong: ``{"queue", "state", "kept", "jobs"}``
            each, sorted; empty when the counts held (or the driver keeps none).
        """
        if not self.capabilities.kept_counts:
            return []
        with self.driver.write() as tx:
            kept = {(r["queue"], r["state"]): int(r["n"]) for r in tx.all("counts_kept")}
            jobs = {(r["queue"], r["state"]): int(r["n"]) for r in tx.all("counts_scanned")}
            wrong = [
                {
                    "queue": q,
                    "state": st,
                    "kept": kept.get((q, st), 0),
                    "jobs": jobs.get((q, st), 0),
                }
                for q, st in sorted(kept.keys() | jobs.keys())
                if kept.get((q, st), 0) != jobs.get((q, st), 0)
            ]
            if wrong:
                tx.run("recount_clear")
                tx.run("recount")
            tx.run("counts_forget_all")  # the rows at zero an older Relay left
            return wrong

    def _forget_counts(self, tx: Tx, queues: set[str]) -> None:
        """Where the driver keeps counts (``capabilities.kept_counts``), delete the rows at
        zero of ``queues``, whose jobs this transaction deleted (``counts_forget``)."""
        if queues and self.capabilities.kept_counts:
            tx.run("counts_forget", {"queues": orjson.dumps(sorted(queues)).decode()})

    # --------------------------------------------------------- queue controls

    def pause(self, queue: str, *, actor: str | None = None) -> dict[str, Any]:
        """Pause a queue: it still accepts submits and its leased jobs still finish (ack,
        fail, renew, expiry), but no claim leases from it until ``resume``; long-polls on it
        wait. Kept in ``relay_queue``, so it survives restarts and holds on every server.

        River's ``Client.QueuePause`` is the closest: kept in its ``river_queue`` table, so it
        outlives restarts and holds for every client. Oban's ``Oban.pause_queue/2`` stops
        each node's producer (in memory: a restart runs the queue again unless configured
        ``paused``), Sidekiq Pro's ``Sidekiq::Queue#pause!`` marks the queue in Redis for its
        fetchers, Faktory's ``QUEUE PAUSE`` makes the server skip the queue when fetching, as
        this claim does. Pausing a paused queue changes nothing (and records nothing).

        Args:
            queue: the queue name (it need not have jobs yet).
            actor: who asked (a username or ``tcp:``/``http:`` peer, 1..150 characters),
                recorded with the change and in the audit log (``relay_event``, job id
                ``queue:<name>``).
        Returns:
            The queue's controls (``QueueControls``: ``queue``, ``paused``, ``max_leased``,
            ``rate_per_s``, ``burst``, ``updated_at_ms``, ``updated_by``).
        Raises:
            InvalidArgument, StoreBusy.
        """
        return self._control(queue, actor, "paused", paused=True)

    def resume(self, queue: str, *, actor: str | None = None) -> dict[str, Any]:
        """Resume a paused queue: claims lease from it again, and its waiting long-polls are
        woken (the transaction marks the queue ready, so other servers wake theirs too).

        Args:
            queue, actor: as for ``pause``.
        Returns:
            The queue's controls (as ``pause``).
        Raises:
            InvalidArgument, StoreBusy.
        """
        return self._control(queue, actor, "resumed", paused=False)

    def set_queue_limits(
        self,
        queue: str,
        *,
        max_leased: int | None = None,
        rate_per_s: float | None = None,
        burst: int | None = None,
        actor: str | None = None,
    ) -> dict[str, Any]:
        """Set a queue's cap on leased jobs and its start rate; arguments left None keep
        their current value.

        The cap counts the queue's LEASED jobs across every worker and server, inside the
        claim (a claim takes at most ``max_leased`` minus those); the rate is a token bucket
        of ``burst`` tokens refilled at ``rate_per_s``, one taken per job a claim starts.
        Oban's queue ``limit`` and River's ``MaxWorkers`` bound one node's (one client's)
        concurrency only; the global forms are paid add-ons: Oban Pro's ``global_limit`` and
        ``rate_limit`` (jobs per period), River Pro's concurrency limits, Sidekiq
        Enterprise's concurrent and bucket rate limiters (taken by the job's own code, not
        the fetch), Faktory Enterprise's queue throttles. Here both live in the claim, so a
        worker is never handed a job it would have to give back. A queue at its cap or
        without a token is skipped by the claim, which takes from the other queues it names.
        Raising the cap or the rate wakes the queue's long-polls.

        Args:
            queue: the queue name.
            max_leased: 1..1 000 000 jobs leased at once; 0 removes the cap.
            rate_per_s: jobs started per second, 0.0001..1 000 000 (fractions allowed:
                0.5 is one job every 2 s); 0 removes the rate.
            burst: 1..1 000 000 tokens the bucket holds (jobs that may start at once after a
                quiet spell); default 1. A new rate starts with a full bucket.
            actor: as for ``pause``.
        Returns:
            The queue's controls (as ``pause``).
        Raises:
            InvalidArgument, StoreBusy.
        """
        changes: dict[str, Any] = {}
        if max_leased is not None:
            n = v.integer("max_leased", max_leased, lo=0, hi=MAX_LEASED_MAX)
            changes["max_leased"] = n or None
        if rate_per_s is not None:
            if isinstance(rate_per_s, bool) or not isinstance(rate_per_s, int | float):
                raise InvalidArgument("rate_per_s: must be a number", field="rate_per_s")
            if (
                math.isnan(rate_per_s)
                or not 0 <= rate_per_s <= RATE_PER_S_MAX
                or 0 < rate_per_s < RATE_PER_S_MIN
            ):
                raise InvalidArgument(
                    f"rate_per_s: must be {RATE_PER_S_MIN:g}..{RATE_PER_S_MAX:g} "
                    "(0 removes the rate)",
                    field="rate_per_s",
                )
            changes["rate_per_s"] = float(rate_per_s) or None
        if burst is not None:
            changes["burst"] = v.integer("burst", burst, lo=1, hi=BURST_MAX)
        return self._control(queue, actor, "limits_set", **changes)

    def queue_controls(
        self, queue: str | None = None, *, limit: int | None = None, after: str | None = None
    ) -> dict[str, Any]:
        """Read the queues' controls.

        Args:
            queue: one queue (its defaults when nobody controls it), or None for the
                controlled queues.
            limit: without ``queue``: at most this many (1..1000), in name order after
                ``after``, and no more than fit one frame; None for all (in-process).
            after: the previous page's ``next_after``.
        Returns:
            ``{"queues": {name: QueueControls}, "next_after": str | None}``.
        Raises:
            InvalidArgument.
        """
        if queue is not None:
            queue = v.queue_name(queue, self.settings)
        if limit is not None:
            limit = v.integer("limit", limit, lo=1, hi=1000)
        if after is not None:
            after = v.queue_name(after, self.settings, field="after")
        with self.driver.read() as tx:
            rows = tx.all("queue_controls_all")
        found = {r["name"]: _controls_view(r) for r in rows}
        if queue is not None:
            view = found.get(queue) or _controls_view({"name": queue})
            return {"queues": {queue: view}, "next_after": None}
        names = [name for name in found if after is None or name > after]  # in name order
        if limit is None:
            return {"queues": {name: found[name] for name in names}, "next_after": None}
        room = self.settings.max_frame_bytes - REPLY_OVERHEAD_BYTES
        page: dict[str, Any] = {}
        for name in names[:limit]:
            room -= _encoded_len({name: found[name]})
            if room < 0 and page:
                break
            page[name] = found[name]
        more = len(names) > len(page)
        return {"queues": page, "next_after": name_before(page) if more and page else None}

    def _control(self, queue: str, actor: str | None, event: str, **changes: Any) -> dict[str, Any]:
        """Apply ``changes`` to a queue's controls in one transaction; record ``event`` in
        the audit log when something changed, and wake the queue's long-polls when the
        change can let claims take more."""
        queue = v.queue_name(queue, self.settings)
        actor = v.actor(actor)
        with self.driver.write() as tx:
            now = self._now()
            if not self.capabilities.single_writer:
                # Its name's lock first, even alone in its transaction: a row this inserts
                # must not appear under a batch that took the name's lock and found no row
                # (``hold_queue_controls``; a review's deadlock between such a batch and a
                # claim).
                tx.all("hold_queue_names", {"queues": [queue]})
            row = tx.one("queue_get", {"name": queue})
            old = _controls_view(row or {"name": queue})
            new = {**old, **changes}
            tokens = float(row["tokens"]) if row else 0.0
            tokens_at_ms = int(row["tokens_at_ms"]) if row else now
            if new["rate_per_s"] is not None:
                if old["rate_per_s"] is None:
                    tokens = float(new["burst"])  # a new rate starts with a full bucket
                elif row is not None:
                    tokens = _refill(row, now)  # refilled at the old rate up to now
                tokens, tokens_at_ms = min(tokens, float(new["burst"])), now
            if new == old:
                return old
            view = {**new, "updated_at_ms": now, "updated_by": actor}
            if not new["paused"] and new["max_leased"] is None and new["rate_per_s"] is None:
                tx.run("queue_delete", {"name": queue})  # back to the defaults: no row
            else:
                tx.run(
                    "queue_put",
                    {
                        "name": queue,
                        "paused": new["paused"],
                        "max_leased": new["max_leased"],
                        "rate_per_s": new["rate_per_s"],
                        "burst": new["burst"],
                        "tokens": tokens,
                        "tokens_at_ms": tokens_at_ms,
                        "now_ms": now,
                        "actor": actor,
                    },
                )
            detail = " ".join(
                f"{k}={new[k]}" for k in ("paused", "max_leased", "rate_per_s", "burst")
            )
            tx.run(
                "insert_event",
                {
                    "job_id": queue_event_id(queue),
                    "event": event,
                    "from_state": None,
                    "to_state": None,
                    "now_ms": now,
                    "actor": actor,
                    "detail": f"queue={queue} {detail}",
                },
            )
            if _loosened(old, new):
                tx.made_ready(queue)
        with self._hints:
            self._capped.discard(queue)
            self._throttled.pop(queue, None)
            if new["max_leased"] is None:
                self._slotted.discard(queue)
            else:
                self._slotted.add(queue)
        log.info(
            "event=queue_%s queue=%s %s actor=%s",
            event,
            queue,
            detail,
            actor,
            extra={"event": f"queue_{event}", "queue": queue},
        )
        return view

    # -------------------------------------------------------------- operators

    def replay(self, job_id: str, *, actor: str | None = None) -> dict[str, Any]:
        """Redrive a dead letter or a cancelled job (DEAD/CANCELLED -> READY) with a fresh
        retry budget (Oban's ``retry_job`` takes cancelled and discarded jobs alike).

        Keeps the job id, the delivery counter ``attempt`` (a fencing epoch never goes back)
        and the history; clears the lease fields, the dead reason and the cancel request;
        records who did it.

        Args:
            actor: who asked (a username of 1..150 characters, or None for the CLI).
        Returns:
            The job after the transition.
        Raises:
            InvalidArgument, JobNotFound, InvalidState (neither DEAD nor CANCELLED, e.g.
            replayed by someone else already), StoreBusy.
        """
        job_id = v.job_id(job_id)
        actor = v.actor(actor)
        with self.driver.write() as tx:
            now = self._now()
            state = self._job(tx, job_id)["state"]
            row = None
            if state in (JobState.DEAD, JobState.CANCELLED):
                check(Transition.REPLAY, JobState(state), JobState.READY)
                params = {"job_id": job_id, "from_state": state, "now_ms": now}
                row = tx.one("replay", params)
            if row is None:
                current = self._job(tx, job_id)
                raise InvalidState(
                    f"cannot replay {job_id}: it is {current['state']}, not dead or cancelled",
                    job_id=job_id,
                    state=current["state"],
                )
            self._event(tx, job_id, Transition.REPLAY, state, JobState.READY, now, actor)
            tx.made_ready(row["queue"])
            return self._job(tx, job_id)

    def cancel(self, job_id: str, *, actor: str | None = None) -> dict[str, Any]:
        """Cancel a job: a waiting one at once, a running one at its worker's next renew.

        * READY, PENDING or RETRYING -> CANCELLED: terminal, never leased again, purgeable
          and prunable (``RELAY_RETENTION_DEAD``), replayable like a dead letter.
        * LEASED: marked for cancellation (``cancel_requested_at_ms``; LEASED -> LEASED).
          The next renew answers ``stop: "cancelled"``; when the worker then fails or
          releases the job it ends CANCELLED, and if its lease expires first, too. If the
          handler finishes anyway, its ack is accepted and the job SUCCEEDED: the work ran,
          and a cancel never fences out the token (the ack still needs the live lease). A
          second cancel of the job changes nothing.
        * SUCCEEDED, DEAD, CANCELLED: refused with ``JOB_FINISHED``.

        After Oban's ``cancel_job`` (cancels available/scheduled/retryable jobs at once, and
        an executing one through its node) and Celery's ``revoke`` (a running task only stops
        when its worker acts on it). Records a ``cancelled`` or ``cancel_requested`` event
        with the actor.

        Args:
            job_id: the job.
            actor: who asked (a username of 1..150 characters, or None for the CLI).
        Returns:
            ``{"job": Job, "cancelled": bool}``: ``cancelled`` is false while a leased job
            waits for its worker to stop.
        Raises:
            InvalidArgument, JobNotFound, JobFinished (SUCCEEDED, DEAD or CANCELLED already),
            StoreBusy (the job kept changing state under other servers' claims).
        """
        job_id = v.job_id(job_id)
        actor = v.actor(actor)
        with self.driver.write() as tx:
            now = self._now()
            for _ in range(CANCEL_TRIES):
                job = self._job(tx, job_id)
                state = JobState(job["state"])
                if state in TERMINAL_STATES:
                    raise JobFinished(
                        f"cannot cancel {job_id}: it is {state.value} already",
                        job_id=job_id,
                        state=state.value,
                    )
                if state in WAITING_STATES:
                    check(Transition.CANCEL, state, JobState.CANCELLED)
                    params = {"job_id": job_id, "from_state": state.value, "now_ms": now}
                    if tx.one("cancel_waiting", params) is None:
                        continue  # claimed or promoted meanwhile (another server): look again
                    self._event(
                        tx, job_id, Transition.CANCEL, state, JobState.CANCELLED, now, actor
                    )
                    scope = "active" if job["unique"] == "active" else None
                    self._entered(tx, job_id, scope, JobState.CANCELLED)
                    return {"job": self._job(tx, job_id), "cancelled": True}
                check(Transition.REQUEST_CANCEL, JobState.LEASED, JobState.LEASED)
                params = {"job_id": job_id, "attempt": job["attempt"], "now_ms": now}
                if tx.one("request_cancel", params) is None:
                    continue  # the lease ended meanwhile: look again
                if job["cancel_requested_at_ms"] is None:
                    self._event(
                        tx,
                        job_id,
                        Transition.REQUEST_CANCEL,
                        JobState.LEASED,
                        JobState.LEASED,
                        now,
                        actor,
                        f"attempt {job['attempt']} held by {job['leased_by']}",
                    )
                return {"job": self._job(tx, job_id), "cancelled": False}
        raise StoreBusy(f"{job_id} kept changing state; try the cancel again")

    def purge(
        self, job_id: str, *, actor: str | None = None, dead_only: bool = False
    ) -> dict[str, Any]:
        """Delete a terminal job (SUCCEEDED, DEAD, CANCELLED) and its history, keeping a
        ``purged`` event (who, when).

        With the ``relay_tasks`` app installed, the Django task result stored for the job goes
        too (``relay_task_result``), so purging keeps the database from growing.

        Args:
            actor: who asked (as for ``replay``).
            dead_only: refuse SUCCEEDED jobs too (the ``dead_purge`` op): only DEAD and
                CANCELLED jobs, the ones that did not succeed, go.
        Returns:
            ``{"job_id", "purged": true}``.
        Raises:
            InvalidArgument, JobNotFound, InvalidState (not terminal, or SUCCEEDED with
            ``dead_only``), StoreBusy.
        """
        job_id = v.job_id(job_id)
        actor = v.actor(actor)
        with self.driver.write() as tx:
            now = self._now()
            # Delete first, guarded by state: a concurrent replay (another server) either
            # happened before (the job is READY: refused) or waits for this commit.
            row = tx.one(
                "delete_dead_job" if dead_only else "delete_terminal_job", {"job_id": job_id}
            )
            if row is None:
                state = self._job(tx, job_id)["state"]
                raise InvalidState(
                    f"cannot purge {job_id}: it is {state}", job_id=job_id, state=state
                )
            # Checked once the row says what it was; raising here rolls the delete back.
            check(Transition.PURGE, JobState(row["state"]), None)
            self._forget_counts(tx, {row["queue"]})
            tx.run("delete_attempts", {"job_id": job_id})
            tx.run("delete_result", {"job_id": job_id})
            if apps.is_installed("relay_tasks"):
                tx.run("delete_task_result", {"job_id": job_id})
            self._event(tx, job_id, Transition.PURGE, row["state"], None, now, actor)
        return {"job_id": job_id, "purged": True}

    # -------------------------------------------------------------- retention

    def _cutoffs(self, older_than_ms: Mapping[str, int] | None, now: int) -> dict[str, int]:
        """``{state: before_ms}`` for each state to prune (0 or absent: that state is kept).

        Raises:
            InvalidArgument: a state other than succeeded/dead/cancelled, or an age that is
                not a whole number of ms in 0..``PRUNE_MAX_AGE_MS`` (100 years).
        """
        if older_than_ms is None:
            older_than_ms = self.settings.retention_ms()
        cutoffs: dict[str, int] = {}
        for state, age in older_than_ms.items():
            if state not in PRUNABLE_STATES:
                raise InvalidArgument(
                    f"prune: state must be succeeded, dead or cancelled, got {state!r}",
                    field="state",
                )
            if (
                isinstance(age, bool)
                or not isinstance(age, int)
                or not 0 <= age <= PRUNE_MAX_AGE_MS
            ):
                raise InvalidArgument(
                    f"prune: {state} age must be a whole number of ms, 0..{PRUNE_MAX_AGE_MS}",
                    field="older_than_ms",
                )
            if age:
                cutoffs[state] = now - age
        return cutoffs

    def prune_batch(
        self,
        older_than_ms: Mapping[str, int] | None = None,
        *,
        limit: int = PRUNE_BATCH,
        before_ms: Mapping[str, int] | None = None,
        actor: str | None = None,
    ) -> dict[str, int]:
        """Delete up to ``limit`` finished jobs past their retention, in one short write
        transaction (SUCCEEDED/DEAD/CANCELLED -> deleted), with their attempts, events and, with the
        ``relay_tasks`` app, task results. No ``purged`` event is kept: the job's whole
        history goes. A job that finished exactly its retention ago is kept; 1 ms earlier, it
        goes. Its idempotency key is free again (a new submit with it makes a new job).

        Args:
            older_than_ms: ``{"succeeded": ms, "dead": ms, "cancelled": ms}``: delete jobs of
                that state that finished (or were cancelled) more than this long ago; a state
                absent or 0 is kept forever. Default: ``RELAY_RETENTION_SUCCEEDED`` /
                ``RELAY_RETENTION_DEAD`` (for dead and cancelled jobs alike).
            limit: the most jobs this call deletes (1..10 000), SUCCEEDED ones first.
            before_ms: ``{state: epoch ms}``: the cutoffs themselves, instead of now minus
                ``older_than_ms`` (``prune`` passes the ones it computed once).
            actor: who asked (an operator's prune over TCP, HTTP or the console): when
                set and jobs went, one ``pruned`` event with no job id records who, when and
                how many (the jobs' own events go with them). Retention passes none.
        Returns:
            ``{"succeeded": n, "dead": m, "cancelled": c}``, the jobs deleted.
        Raises:
            InvalidArgument, StoreBusy.
        """
        limit = v.integer("limit", limit, lo=1, hi=PRUNE_LIMIT_MAX)
        deleted = dict.fromkeys(PRUNABLE_STATES, 0)
        with self.driver.write() as tx:
            cutoffs = (
                dict(before_ms)
                if before_ms is not None
                else self._cutoffs(older_than_ms, self._now())
            )
            left = limit
            gone: set[str] = set()
            for state in PRUNABLE_STATES:
                if state not in cutoffs or left <= 0:
                    continue
                # Prune is a purge by age: the same transition, checked once per state.
                check(Transition.PURGE, JobState(state), None)
                rows = tx.all(f"prune_{state}", {"before_ms": cutoffs[state], "limit": left})
                if not rows:
                    continue
                ids = [{"job_id": r["id"]} for r in rows]
                tx.many("delete_attempts", ids)
                tx.many("delete_events", ids)
                tx.many("delete_result", ids)
                if apps.is_installed("relay_tasks"):
                    tx.many("delete_task_result", ids)
                for r in rows:
                    self._observe("pruned", r["queue"])
                    gone.add(r["queue"])
                deleted[state] = len(rows)
                left -= len(rows)
            self._forget_counts(tx, gone)
            if actor is not None and any(deleted.values()):
                self._operator_event(tx, "pruned", self._now(), actor, _counts(deleted))
        if any(deleted.values()):
            log.info(
                "event=pruned succeeded=%s dead=%s cancelled=%s",
                deleted["succeeded"],
                deleted["dead"],
                deleted["cancelled"],
                extra={"event": "pruned", **deleted},
            )
        return deleted

    def prune(
        self,
        older_than_ms: Mapping[str, int] | None = None,
        *,
        batch: int = PRUNE_BATCH,
        max_batches: int | None = None,
        yield_factor: float = 0.0,
        actor: str | None = None,
    ) -> dict[str, int]:
        """Delete every finished job past its retention, one ``prune_batch`` transaction of
        at most ``batch`` jobs at a time (other writers get the lock between batches).

        The cutoffs are fixed when the call starts, so it ends even while jobs keep finishing.

        Args:
            older_than_ms: as for ``prune_batch``.
            batch: jobs per transaction (1..10 000).
            max_batches: stop after this many transactions (None: until none are left).
            yield_factor: after each full batch, sleep (on the service's clock) this many
                times as long as the batch took, so other writers get that share of the
                write lock (``relay prune`` passes 2: a third of the time for pruning).
            actor: who asked: when set and jobs went, one ``pruned`` event with no job id
                records who, when and how many in all (not one per batch).
        Returns:
            ``{"succeeded": n, "dead": m, "cancelled": c}``, the jobs deleted in all.
        Raises:
            InvalidArgument, StoreBusy (the batches committed before it stay committed).
        """
        cutoffs = self._cutoffs(older_than_ms, self._now())
        total = dict.fromkeys(PRUNABLE_STATES, 0)
        done = 0
        while cutoffs and (max_batches is None or done < max_batches):
            started = self.clock.monotonic()
            deleted = self.prune_batch(limit=batch, before_ms=cutoffs)
            done += 1
            for state, n in deleted.items():
                total[state] += n
            if sum(deleted.values()) < batch:
                break
            self.leave_lock(started, yield_factor)
        if actor is not None and any(total.values()):
            with self.driver.write() as tx:
                self._operator_event(tx, "pruned", self._now(), actor, _counts(total))
        return total

    def count_prunable(self, older_than_ms: Mapping[str, int] | None = None) -> dict[str, int]:
        """Count the finished jobs ``prune`` would delete now (``relay prune --dry-run``).

        Args:
            older_than_ms: as for ``prune_batch``.
        Returns:
            ``{"succeeded": n, "dead": m, "cancelled": c}``.
        Raises:
            InvalidArgument.
        """
        counts = dict.fromkeys(PRUNABLE_STATES, 0)
        with self.driver.read() as tx:
            for state, before in self._cutoffs(older_than_ms, self._now()).items():
                row = tx.one(f"count_prunable_{state}", {"before_ms": before})
                counts[state] = int(row["n"]) if row else 0
        return counts

    @staticmethod
    def _operator_event(tx: Tx, event: str, now: int, actor: str, detail: str) -> None:
        """Record an operator's action on no one job (``job_id`` empty) in the event log."""
        tx.run(
            "insert_event",
            {
                "job_id": "",
                "event": event,
                "from_state": None,
                "to_state": None,
                "now_ms": now,
                "actor": actor,
                "detail": detail,
            },
        )

    @staticmethod
    def _event(
        tx: Tx,
        job_id: str,
        event: Transition,
        from_state: str | None,
        to_state: str | None,
        now: int,
        actor: str | None,
        detail: str | None = None,
    ) -> None:
        tx.run(
            "insert_event",
            {
                "job_id": job_id,
                "event": event.value,
                "from_state": from_state,
                "to_state": to_state,
                "now_ms": now,
                "actor": actor,
                "detail": detail,
            },
        )


def _counts(counts: Mapping[str, int]) -> str:
    """``{"succeeded": 3, "dead": 0}`` -> ``"succeeded=3 dead=0"`` (event details)."""
    return " ".join(f"{name}={n}" for name, n in counts.items())
