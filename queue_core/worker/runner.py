"""The pull worker: lease -> run the handler -> ack or fail, with lease renewal and a bounded stop.

Threads, and why:

* the **lease thread** long-polls ``lease`` on its own connection, and only while a concurrency
  slot is free; it asks for as many jobs as there are free slots, so the worker never holds more
  than ``concurrency`` jobs (the seed's semaphore rule);
* an **ack or fail** asks for the next jobs in the same request (``lease_next``, as many as
  the slots free once it is done, its own included), one such ack at a time: a worker with
  one slot makes one round trip and the server one commit per job, and with many slots the
  lease thread takes what was freed meanwhile in one claim (a claim per ack cost the server
  more than the round trips it saved). Slots promised to a lease or ``lease_next`` in flight
  are counted (``_reserved``), so the two never lease more than ``concurrency`` between them;
* with more than one slot, **plain acks are coalesced** (``batch_acks``; River's
  ``jobcompleter.BatchCompleter`` does the same for completions): a handler thread queues its
  ack and waits, and one of ``ACK_SENDERS`` sender threads sends every ack queued meanwhile as
  one ``ack_batch``, with ``lease_next`` for the slots they and the free ones leave. While one
  batch is in flight, the next waits until it holds half the slots' acks or that one returns
  (at most two recent round trips), so two batches of about half the slots take turns. Each
  ack is still fenced by its own token and answered on its own (a stale one refuses only
  itself); the server runs one request and one commit for the batch, not one per job. An ack
  that carries a result, and every fail and release, is sent on its own;
* **N handler threads** run the handlers. They are plain daemon threads rather than a
  ``ThreadPoolExecutor``, whose threads the interpreter joins at exit: a handler that hangs
  would then keep the process alive past the shutdown timeout;
* the **renewer** renews every held lease about every third of its length, all those due at
  once in one ``renew_batch`` (SQS's ``ChangeMessageVisibilityBatch``; one ``renew`` each
  against a server without it), on a connection of its own (not the pool's that carries
  ack/fail/release, where calls may wait), by a deadline of a renew interval at most,
  connecting included, so that one silent connection cannot hold the renewals past their
  leases;
* the thread that called ``run()`` waits for ``stop()`` and then runs the shutdown.

Delivery is at-least-once: when a renew or an ack is rejected (the lease expired or was taken
over), the worker logs it and moves on; another worker may run the job again.

Cancel and time limits (issue 16): the renewer reads each renew's ``stop``. On ``"cancelled"``
it sets the job's ``ctx.stop`` (reason ``cancelled``) and keeps renewing until the handler
returns; a handler that then raises (``JobInterrupted`` or anything) has its job released or
failed, which the server turns into CANCELLED, while one that returns normally is acked
(SUCCEEDED: the work ran). A lease with a ``time_limit_ms`` has a local deadline too: at it
(or at a renew answering ``"timeout"``, whichever comes first) ``ctx.stop`` is set with reason
``timeout`` and the handler's stop is reported as a failure with the error ``timeout`` (never a
release, which would hand out a free retry); when the server already failed the attempt, the
result is dropped. Celery's soft time limit and Oban's cancellation work the same way: the
handler is told, and stops itself. One that has not stopped ``_TIME_LIMIT_GRACE_S`` after its
deadline has its lease renewed at once, which the server refuses past the limit by failing the
attempt (``timeout``): the attempt ends at the limit, not up to a renew interval later, while
the handler runs on in its slot and what it returns is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue as queue_mod
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from queue_core import errors, types
from queue_core.clock import Clock, SystemClock
from queue_core.protocol.ops import BlockingClient, Ops
from queue_core.retry import RetryPolicy, jittered_ms
from queue_core.worker.handlers import (
    Handler,
    JobContext,
    JobInterrupted,
    NonRetryableError,
    ReportedError,
    StopSignal,
    StoredResult,
    demo_handler,
    reported_error,
)

logger = logging.getLogger("relay.worker")

MAX_JOBS_PER_LEASE = 100
"""The protocol's cap on ``max_jobs`` in one lease request."""

# Reconnect backoff for the lease loop: 100 ms doubling to 5 s, jittered to 50-100%.
_RECONNECT_BACKOFF = RetryPolicy(max_retries=0, base_ms=100, cap_ms=5_000, jitter=True)
# How soon to retry a renew that failed for a transient reason (connection, BUSY), at most.
_RENEW_RETRY_S = 1.0
# The shortest deadline a renew gets, s (``Worker._renew_budget``).
_RENEW_BUDGET_MIN_S = 0.1
# How long a renew_batch cut short (UNKNOWN_OP: one renew each; FRAME_TOO_LARGE: halved)
# stays so before whole batches are tried again, s: a worker of several addresses may be on
# another server by then, or past a rolling upgrade.
_RENEW_REPROBE_S = 300.0
# How long past its time limit a handler has to stop before the worker renews its lease, so
# that the server fails the attempt (a task body never sees ctx.stop: with a 30 s lease the
# attempt of a 3 s limit ended at the renew 10 s in; a Django review).
_TIME_LIMIT_GRACE_S = 0.5
# An ack or fail that fails for a transient reason (a connection, BUSY, UNAVAILABLE) is sent
# again while its lease may still be live (``_HeldJob.expires_at``; the renewer keeps
# renewing it meanwhile), after pauses of 0.2 s, 0.4 s, ... up to 2 s. Three tries in 0.6 s
# dropped the acks of a 3 s PostgreSQL restart: their jobs ran again, or went DEAD as
# "lease expired" with max_retries 0 (a chaos review).
_SETTLE_PAUSE_S = 0.2
_SETTLE_PAUSE_MAX_S = 2.0
# After the shutdown deadline: how long to wait for an aborted lease call, and how long to spend
# releasing the jobs still held.
_MARGIN_S = 2.0
_RELEASE_BUDGET_S = 5.0
# At shutdown, how long an idle worker's lease call may take to answer once told the worker
# sends nothing more (a server answers at once; one that does not is cut off), in s.
_LEASE_ANSWER_S = 2.0
# How long to pause after an empty lease before asking again: with wait_ms=0 (no long-poll),
# or when a long-poll was answered empty early (``Worker._early_empty_pause``), in s.
_EMPTY_POLL_PAUSE_S = 0.2

# Connections shared by the handler threads and the renewer for ack, fail, renew and release:
# a RelayClient has one request in flight, so one connection capped a worker near one ack per
# round trip (~1,150 jobs/s at --concurrency 16); a few let the server's group commit batch them.
SETTLE_CONNECTIONS = 4

# Threads that send coalesced acks (``batch_acks``): while one batch is in flight, the acks
# queued meanwhile go out on the other, so the server's commit and the handlers overlap; that
# other batch waits until it holds a sender's share of the slots (``Worker._overlap_acks``).
ACK_SENDERS = 2
# How long an ack may be held back while a batch is in flight (``Worker._hold_back_s``): twice
# the recent ``ack_batch`` round trip, within these bounds, in seconds. Real time, not the
# injected clock: it times the network, as the thread joins do. A batch that hangs holds the
# acks queued behind it this long, not until its client gives up.
HOLD_BACK_MIN_S = 0.001
HOLD_BACK_MAX_S = 0.05
_FIRST_ROUND_TRIP_S = 0.0025  # until one is measured
MAX_ACKS_PER_BATCH = 100
"""The protocol's cap on the acks of one ``ack_batch`` request."""
MAX_BATCH_BYTES = 32_768
"""The most bytes of acks (their ids and tokens, ``_ack_bytes``) one ``ack_batch`` carries at
first, well under the default 1 MiB frame; halved each time a server refuses one as too large
(``FRAME_TOO_LARGE``: a server with a small ``RELAY_MAX_FRAME_BYTES``), down to one ack."""

# A lease, renew, ack, fail or release rejected because the lease is no longer ours.
_LEASE_GONE = (errors.LeaseExpired, errors.StaleToken, errors.JobNotFound, errors.InvalidState)
_GONE_CODES = frozenset(cls.code for cls in _LEASE_GONE)


WorkerClient = BlockingClient
"""The client the worker calls: the catalogue's blocking op methods (``RelayClient`` is one).

The worker uses ``lease``, ``renew``, ``ack``, ``fail``, ``release`` and ``close``; they raise
``RelayError`` subclasses for error replies and ``ConnectionError`` when the outcome is
unknown (see ``queue_core.protocol.ops.Ops`` for each method's arguments and result).
"""


def default_worker_id() -> str:
    """Return ``"{hostname}:{pid}"``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def truncate_utf8(text: str, max_bytes: int) -> str:
    """Cut ``text`` to at most ``max_bytes`` UTF-8 bytes without splitting a character.

    Never raises: a lone surrogate (U+D800..U+DFFF, which has no UTF-8 form and which the
    server refuses) becomes its ``\\udXXX`` escape first, so the text can always be sent.
    """
    data = text.encode("utf-8", errors="backslashreplace")
    return data[:max_bytes].decode("utf-8", errors="ignore")


def truncate_utf8_tail(text: str, max_bytes: int) -> str:
    """Keep the last ``max_bytes`` UTF-8 bytes of ``text`` (a traceback's end names the
    exception), without splitting a character; lone surrogates escaped as ``truncate_utf8``."""
    data = text.encode("utf-8", errors="backslashreplace")
    if len(data) <= max_bytes:
        return data.decode("utf-8")
    return data[len(data) - max_bytes :].decode("utf-8", errors="ignore")


def error_text(exc: BaseException) -> str:
    """The text a failed handler's exception is reported with: its message, or its type's
    name when the message is empty or cannot be read (a ``__str__`` that raises)."""
    try:
        return str(exc) or type(exc).__name__
    except Exception:  # noqa: BLE001 - the failure must be reported whatever __str__ does
        return f"{type(exc).__name__} (its message could not be read)"


_Status = Literal["running", "settling", "released"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Outcome:
    """What an ack or fail carries besides the lease ids: the handler's ``StoredResult``
    value, or the failure's class and traceback."""

    result: Any = None
    reported: ReportedError | None = None


class _ClientPool:
    """A few ``WorkerClient``s lent to one thread at a time (each has one request in flight).

    Args:
        factory: builds a client (connected on demand).
        size: how many clients (>= 1).
    """

    def __init__(self, factory: Callable[[], WorkerClient], size: int) -> None:
        self._all = [factory() for _ in range(size)]
        self._free: queue_mod.SimpleQueue[WorkerClient] = queue_mod.SimpleQueue()
        for client in self._all:
            self._free.put(client)

    @contextlib.contextmanager
    def client(self) -> Iterator[WorkerClient]:
        """Borrow a client for one call (waits while all are busy)."""
        client = self._free.get()
        try:
            yield client
        finally:
            self._free.put(client)

    def close(self) -> None:
        """Close every client (a call in flight on one fails with a connection error)."""
        for client in self._all:
            client.close()


@dataclasses.dataclass(slots=True)
class _Promise:
    """Slots an ack's or fail's ``lease_next`` was promised (``Worker._reserved``), until its
    reply's leases take them or they are freed; ``covered``: how many of them are the slots of
    the jobs it settles, held until then (``Worker._covered``)."""

    slots: int
    covered: int = 0


class _Unbatched(Exception):
    """A coalesced ack was not sent as asked; the handler thread sends it again, not counted
    as a try: the server does not know ``ack_batch`` (then on its own) or its ``lease_next``
    (then without), or it refused the whole batch (too large: again, in a smaller one; for
    another reason, ``alone``: by itself, so that it gets its own answer)."""

    def __init__(self, *, alone: bool = False) -> None:
        super().__init__("ack not sent in a batch")
        self.alone = alone


@dataclasses.dataclass(slots=True, eq=False)
class _PendingAck:
    """A handler thread's ack waiting in the coalescer (``Worker._batched_ack``): the sender
    sets ``result`` (``ack``'s reply) or ``error``, then ``done``."""

    job: _HeldJob
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Mapping[str, Any] | None = None
    error: BaseException | None = None
    queued_at: float = dataclasses.field(default_factory=time.monotonic)  # real time, s


@dataclasses.dataclass(slots=True, eq=False)
class _HeldJob:
    """A job this worker holds a lease on. Mutable fields change under ``Worker._cond``."""

    job_id: str
    lease_token: str
    queue: str
    attempt: int
    payload: Any
    lease: types.Lease
    renew_at: float  # clock.monotonic() seconds
    # clock.monotonic() seconds by which the lease has expired unless renewed: counted from the
    # lease's arrival or a renew's sending (its arrival is later, and so is the server's own).
    expires_at: float
    # running: handler busy; settling: ack/fail/release in progress; released: given back at
    # shutdown while the handler still ran (its result is discarded).
    status: _Status = "running"
    lost: bool = False  # a renew was rejected: the lease is gone
    # Why the handler should stop (cancelled, timeout, shutdown); its ctx.stop.
    stop: StopSignal = dataclasses.field(default_factory=StopSignal)
    # clock.monotonic() seconds at which the attempt reaches its time limit, or None.
    deadline: float | None = None
    timed_out: bool = False  # the server failed the attempt for its time limit (renew said so)
    # A newer lease of its job came (its retry, after a time limit or a lost lease) before
    # its handler ended: no longer in Worker._held, it still takes a slot (Worker._displaced).
    displaced: bool = False


def _log(level: int, event: str, *, exc_info: bool = False, **fields: Any) -> None:
    """Log ``event=<event> key=value ...`` with the same fields as ``extra`` (JSON logs).

    The record names this module and the event as its ``pathname`` and ``funcName``, line 0:
    ``Logger.log`` would walk the stack for the caller (``findCaller``), about a fifth of a
    line's cost (docs/benchmarking.md, round 6), twice per job (``leased``, ``acked``).
    """
    if not logger.isEnabledFor(level):
        return
    fmt = "event=" + event + "".join(f" {key}=%s" for key in fields)
    record = logger.makeRecord(
        logger.name,
        level,
        __file__,
        0,
        fmt,
        tuple(fields.values()),
        sys.exc_info() if exc_info else None,
        event,
        {"event": event, **fields},
    )
    logger.handle(record)


# The most handler threads one worker runs (``concurrency``): 100,000,000 asked for ended in
# "can't start new thread" and a traceback (a review); past a few hundred, run more processes.
MAX_CONCURRENCY = 1000


class Worker:
    """Pull jobs from Relay and run them, holding at most ``concurrency`` leases at once.

    Call ``run()`` (blocks) and, from another thread or a signal handler, ``stop()``.

    On ``stop()`` the worker stops leasing at once, sets ``shutdown_event`` (handlers may watch
    it), lets the running handlers finish for up to ``shutdown_timeout_ms``, then releases the
    jobs still held (back to ready, no failure counted) and returns. A lease request already in
    flight is allowed to finish within the timeout (the jobs it brings are released at once), as
    cutting it off would strand those jobs until their leases expire. ``run()`` returns within
    about the timeout plus about 9 s (releases 5, then 2 for settles under way and 2 for
    threads), even if a handler hangs (its thread is abandoned; it is a daemon thread) or the
    server takes requests and answers none (the releases go out on a connection of their own,
    closed when their 5 s are up).

    Args:
        client_factory: builds a connected-on-demand client (``RelayClient``); called once for
            the lease connection and ``min(concurrency, SETTLE_CONNECTIONS)`` times for the
            renew/ack/fail/release connections the handler threads share.
        queues: queue names to lease from (1..16).
        concurrency: most jobs held at once and number of handler threads (>= 1).
        handler: ``handler(payload, ctx)``; return to ack, raise to fail (see
            ``queue_core.worker.handlers``).
        lease_ms: lease length in ms, renewed about every third of it (default
            ``RELAY_VISIBILITY_TIMEOUT_MS``, 30 000).
        wait_ms: long-poll wait of each lease request in ms (0..20 000; default 5 000).
        shutdown_timeout_ms: how long ``stop()`` waits for running handlers, in ms (30 000).
        clock: time source; ``monotonic()`` drives renewals, backoff and the shutdown deadline.
        worker_id: id sent with every lease (default ``"{hostname}:{pid}"``).
        max_error_bytes: failure text is cut to this many UTF-8 bytes (default
            ``RELAY_MAX_ERROR_BYTES``, 4 096).
        max_result_bytes: a failure's traceback is cut to this many UTF-8 bytes, keeping its
            end (default ``RELAY_MAX_RESULT_BYTES``, 64 KiB, capped at an eighth of
            ``RELAY_MAX_FRAME_BYTES``).
        rng: randomness for reconnect jitter (default a fresh ``random.Random``).
        tick_s: the longest real-time wait before re-reading ``clock`` (a ``FakeClock`` cannot
            wake a sleeping thread, so waits are sliced), in seconds.
        lease_next: ack and fail ask for the next jobs in the same request (default True;
            turned off by itself when the server does not know ``lease_next``).
        batch_acks: with ``concurrency`` > 1, coalesce the handlers' plain acks into
            ``ack_batch`` requests (default True; turned off by itself when the server does
            not know ``ack_batch``). False: every ack is its own request.
    Raises:
        ValueError: an argument is out of range, or ``queues`` is a string.

    Attributes:
        leased, acked, failed, released, renewed, lost: counters (``lost``: leases found gone
            by a rejected renew).
        leased_next: of ``leased``, the jobs that came with an ack's or fail's reply.
        cancelled, timed_out: handlers told to stop because their job was cancelled, or
            because their attempt reached its time limit.
        ready: set once ``run()`` has started its threads.
        shutdown_event: set by ``stop()``; handed to handlers as ``ctx.shutdown``.
    """

    def __init__(
        self,
        client_factory: Callable[[], WorkerClient],
        queues: Sequence[str],
        *,
        concurrency: int = 8,
        handler: Handler = demo_handler,
        lease_ms: int | None = None,
        wait_ms: int = 5_000,
        shutdown_timeout_ms: int = 30_000,
        clock: Clock | None = None,
        worker_id: str | None = None,
        max_error_bytes: int | None = None,
        max_result_bytes: int | None = None,
        rng: random.Random | None = None,
        tick_s: float = 0.1,
        lease_next: bool = True,
        batch_acks: bool = True,
    ) -> None:
        if isinstance(queues, str):  # a str is a Sequence[str]: "emails" would be six queues
            raise ValueError(f"queues must be a list of queue names, not a string: [{queues!r}]")
        if not queues:
            raise ValueError("a worker needs at least one queue")
        if not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency must be 1..{MAX_CONCURRENCY} (a thread each)")
        if wait_ms < 0 or shutdown_timeout_ms < 0:
            raise ValueError("wait_ms and shutdown_timeout_ms must be >= 0")
        if lease_ms is None or max_error_bytes is None or max_result_bytes is None:
            from queue_core.conf import relay_settings  # Django settings, only when needed

            settings = relay_settings()
            lease_ms = settings.visibility_timeout_ms if lease_ms is None else lease_ms
            if max_error_bytes is None:
                max_error_bytes = settings.max_error_bytes
            if max_result_bytes is None:
                max_result_bytes = settings.result_limit_bytes
        if lease_ms <= 0:
            raise ValueError("lease_ms must be > 0")
        self._client_factory = client_factory
        self.queues = list(queues)
        self.concurrency = concurrency
        self._handler = handler
        self.lease_ms = lease_ms
        self.wait_ms = wait_ms
        self.shutdown_timeout_ms = shutdown_timeout_ms
        self._clock: Clock = clock or SystemClock()
        self.worker_id = worker_id or default_worker_id()
        self.max_error_bytes = max_error_bytes
        self.max_result_bytes = max_result_bytes
        self._rng = rng or random.Random()
        self._tick_s = tick_s
        self._renew_interval_s = lease_ms / 3000
        self._renew_client: WorkerClient | None = None  # the renewer's own (``run``)
        # The most leases one renew_batch carries: MAX_ACKS_PER_BATCH, halved after a
        # FRAME_TOO_LARGE; 0 against a server without renew_batch (one renew each). Back to
        # MAX_ACKS_PER_BATCH _RENEW_REPROBE_S after (clock.monotonic() s, None: never cut).
        self._renew_chunk = MAX_ACKS_PER_BATCH
        self._renew_cut_at: float | None = None

        self._cond = threading.Condition()  # guards _held, the job statuses and the counters
        self._held: dict[str, _HeldJob] = {}
        # Slots promised to lease calls in flight (the lease thread's, acks' lease_next).
        self._reserved = 0
        # Of those, the slots of held jobs whose ack (or fail) is in flight with a lease_next
        # promised their slot: counted in both _held and _reserved until its _take.
        self._covered = 0
        # Handlers still running for a job whose newer lease replaced theirs (_HeldJob.displaced).
        self._displaced = 0
        self._next_in_flight = False  # an ack's lease_next is in flight (one at a time)
        self._lease_next = lease_next
        self._batch_acks = batch_acks and concurrency > 1
        # Coalesced acks waiting for a sender (``_batched_ack``), and whether senders may stop.
        self._acks_cond = threading.Condition()
        self._acks: list[_PendingAck] = []
        self._acks_closed = False
        self._sending = 0  # batches in flight
        # While a batch is in flight, the next goes out only once it holds this many acks (or
        # when that one returns, or after ``_hold_back_s``): two batches of about half the
        # slots each then take turns, as in double buffering. Sent as soon as a sender was
        # free, they held about 4.75 acks each at --concurrency 16, and the server paid its
        # per-request cost (a commit, a claim, a pass of its loop) that much more often
        # (docs/benchmarking.md, round 7).
        self._overlap_acks = max(1, -(-concurrency // ACK_SENDERS))
        # A moving average of ack_batch round trips (real time, s): acks are held back at most
        # twice that (``_hold_back_s``).
        self._round_trip_s = _FIRST_ROUND_TRIP_S
        self._senders: list[threading.Thread] = []
        # The most request bytes of acks one batch carries (halved when one was too large).
        self._batch_bytes = MAX_BATCH_BYTES
        self._jobs: queue_mod.SimpleQueue[_HeldJob | None] = queue_mod.SimpleQueue()
        self._stop = threading.Event()
        self._renew_stop = threading.Event()
        self._lease_done = threading.Event()
        self._started = False
        self._stop_deadline: float | None = None
        self._fatal: errors.RelayError | None = None
        self._lease_thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.shutdown_event = threading.Event()
        self.leased = 0
        self.leased_next = 0
        self.acked = 0
        self.failed = 0
        self.released = 0
        # Jobs a reply brought while stopping (not kept) whose release is under way: the
        # shutdown waits for them before it closes the clients (``_take``).
        self._returning = 0
        self.renewed = 0
        self.lost = 0
        self.cancelled = 0
        self.timed_out = 0

    # -- public ---------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Number of jobs whose lease this worker holds right now."""
        with self._cond:
            return len(self._held)

    @property
    def busy(self) -> int:
        """Slots taken: the jobs held, and the handlers still running for a job whose newer
        lease replaced theirs (a handler that ignored its time limit)."""
        with self._cond:
            return self._taken()

    def _taken(self) -> int:
        """``busy``, under ``_cond``."""
        return len(self._held) + self._displaced

    def counters(self) -> dict[str, int]:
        """Return a snapshot ``{"leased", "leased_next", "acked", "failed", "released",
        "renewed", "lost", "cancelled", "timed_out"}``."""
        with self._cond:
            return {
                "leased": self.leased,
                "leased_next": self.leased_next,
                "acked": self.acked,
                "failed": self.failed,
                "released": self.released,
                "renewed": self.renewed,
                "lost": self.lost,
                "cancelled": self.cancelled,
                "timed_out": self.timed_out,
            }

    def stop(self) -> None:
        """Ask ``run()`` to shut down gracefully; returns at once. Safe from a signal handler.

        The shutdown timeout counts from the first call.
        """
        if self._stop_deadline is None:
            self._stop_deadline = self._clock.monotonic() + self.shutdown_timeout_ms / 1000
        self._stop.set()
        self.shutdown_event.set()
        with self._cond:  # an RLock: re-entrant if the signal lands inside the worker's code
            for job in self._held.values():
                job.stop.set("shutdown")
            self._cond.notify_all()

    def run(self) -> None:
        """Lease and run jobs until ``stop()``, then shut down (see the class docstring).

        Raises:
            RelayError: the server rejected a lease request for good (for example
                ``INVALID_ARGUMENT`` for a bad queue name); raised after the shutdown.
            RuntimeError: ``run()`` was called before on this worker.
        """
        with self._cond:
            if self._started:
                raise RuntimeError("a Worker runs once")
            self._started = True
        self._lease_client = self._client_factory()
        self._renew_client = self._client_factory()
        self._clients = _ClientPool(self._client_factory, min(self.concurrency, SETTLE_CONNECTIONS))
        for n in range(self.concurrency):
            threading.Thread(
                target=self._handler_loop, name=f"relay-handler-{n}", daemon=True
            ).start()
        if self._batch_acks:
            for n in range(ACK_SENDERS):
                sender = threading.Thread(
                    target=self._ack_sender_loop, name=f"relay-acks-{n}", daemon=True
                )
                sender.start()
                self._senders.append(sender)
        renewer = threading.Thread(target=self._renew_loop, name="relay-renewer", daemon=True)
        renewer.start()
        self._lease_thread = threading.Thread(
            target=self._lease_loop, name="relay-lease", daemon=True
        )
        self._lease_thread.start()
        _log(
            logging.INFO,
            "worker_ready",
            worker_id=self.worker_id,
            queues=",".join(self.queues),
            concurrency=self.concurrency,
            lease_ms=self.lease_ms,
            pid=os.getpid(),
        )
        self.ready.set()
        while not self._stop.wait(1.0):  # a timed wait keeps signal handlers prompt
            pass
        self._shutdown(renewer)
        if self._fatal is not None:
            raise self._fatal

    # -- leasing --------------------------------------------------------------------------

    def _lease_loop(self) -> None:
        try:
            self._lease_until_stopped()
        except Exception as exc:  # noqa: BLE001 - a bug must stop the worker, not idle it
            self._crashed("lease loop", exc)
        finally:
            self._lease_done.set()
            with self._cond:
                self._cond.notify_all()

    def _lease_until_stopped(self) -> None:
        failures = 0
        while not self._stop.is_set():
            with self._cond:
                while self._free() <= 0 and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                asked = min(self._free(), MAX_JOBS_PER_LEASE)
                self._reserved += asked
            asked_at = time.monotonic()
            try:
                leases = self._lease_client.lease(
                    self.queues,
                    worker_id=self.worker_id,
                    max_jobs=asked,
                    lease_ms=self.lease_ms,
                    wait_ms=self.wait_ms,
                )
            except (ConnectionError, errors.RelayError) as exc:
                self._take([], asked)
                if self._stop.is_set():  # cut off by the shutdown deadline
                    _log(logging.INFO, "lease_aborted", error=_describe(exc))
                    return
                if isinstance(exc, errors.RelayError) and not exc.retryable:
                    _log(logging.ERROR, "lease_rejected", code=exc.code, error=str(exc))
                    self._fatal = exc
                    self.stop()
                    return
                failures += 1
                delay_s = jittered_ms(_RECONNECT_BACKOFF, failures, self._rng) / 1000
                _log(
                    logging.WARNING,
                    "lease_error",
                    error=_describe(exc),
                    failures=failures,
                    retry_in_ms=round(delay_s * 1000),
                )
                self._wait(self._stop, delay_s)
                continue
            except BaseException:
                self._take([], asked)
                raise
            failures = 0
            self._take(leases, asked)
            if not leases and self.wait_ms == 0:
                # Without a long-poll an empty queue would be asked again at once, in a loop.
                self._wait(self._stop, _EMPTY_POLL_PAUSE_S)
            elif not leases:
                # Real time, as the reply's: a property of the link, not of the queue's clock.
                self._stop.wait(self._early_empty_pause(time.monotonic() - asked_at))

    def _early_empty_pause(self, took_s: float) -> float:
        """How long to pause (real s) after a long-poll answered empty in ``took_s`` (real s).

        One answered before half its ``wait_ms`` (a draining server, a faulty one) is asked
        again after ``_EMPTY_POLL_PAUSE_S``, at most the rest of that half: against a server
        that answered at once, the worker asked 9,166 times in 2 s (a review). One that waited
        is asked again at once."""
        half_s = self.wait_ms / 2000
        return max(0.0, min(_EMPTY_POLL_PAUSE_S, half_s - took_s))

    def _free(self) -> int:
        """Slots neither held nor promised to a lease call in flight (under ``_cond``); a held
        job whose slot is already promised to its own ack's ``lease_next`` counts once."""
        return self.concurrency - self._taken() - self._reserved + self._covered

    def _take(
        self,
        leases: Sequence[types.Lease],
        reserved: int,
        *,
        covered: int = 0,
        settled: Sequence[_HeldJob] = (),
        via_ack: bool = False,
        acked: int = 0,
    ) -> None:
        """Take what a lease call brought and end its promise of ``reserved`` slots (``covered``
        of them its settled jobs', ``_Promise``), at once (so the lease thread never sees a
        slot free for a moment); ``settled``: the jobs whose ack or fail brought them (their
        slots are theirs now); ``acked``: acks to count with them (an ``ack_batch``'s, counted
        as their jobs are dropped).

        A lease without its fields (a faulty server or proxy) is logged (``bad_leases``) and
        left to expire on the server; the reply's other leases are taken (one such entry
        stopped the worker: a review). A lease this worker already holds with the same token
        (the same lease twice) is logged (``lease_repeated``) and not run again.
        """
        jobs: list[_HeldJob] = []
        malformed: list[Exception] = []
        for lease in leases:
            try:
                jobs.append(self._held_job(lease))
            except Exception as exc:  # noqa: BLE001 - any shape a reply can have
                malformed.append(exc)
        repeated: list[_HeldJob] = []
        with self._cond:
            self._reserved -= reserved
            self._covered -= covered
            for done in settled:
                self._drop(done)
                self._undisplace(done)  # its handler has ended: the slot passes to what came
            self.acked += acked
            kept: list[bool] = []
            fresh: list[_HeldJob] = []
            for job in jobs:
                old = self._held.get(job.job_id)
                if old is not None and old.lease_token == job.lease_token:
                    repeated.append(job)  # two handlers on one lease ran the job twice at once
                    continue
                keep = not self._stop.is_set() and self._taken() < self.concurrency
                if keep:
                    if old is not None and old.status == "running":
                        # Its handler still runs (it ignored a time limit): its thread stays
                        # taken. Counted as held no more, it let the worker lease jobs no
                        # thread was free to run, renewed for good (a Django review).
                        old.displaced = True
                        self._displaced += 1
                    self._held[job.job_id] = job
                fresh.append(job)
                kept.append(keep)
            jobs = fresh
            self.leased += len(jobs)
            if via_ack:
                self.leased_next += len(jobs)
            returning = kept.count(False)
            self._returning += returning
            self._cond.notify_all()
        if malformed:  # they expire on the server
            _log(logging.ERROR, "bad_leases", leases=len(malformed), error=_describe(malformed[0]))
        for job in repeated:
            _log(logging.WARNING, "lease_repeated", job_id=job.job_id, attempt=job.attempt)
        for job, keep in zip(jobs, kept, strict=True):  # logged, then handed over at once
            _log(
                logging.INFO,
                "leased",
                job_id=job.job_id,
                queue=job.queue,
                attempt=job.attempt,
                worker_id=self.worker_id,
                via="ack" if via_ack else "lease",
            )
            if keep:
                self._jobs.put(job)
        try:
            for job, keep in zip(jobs, kept, strict=True):
                if not keep:  # leased while stopping (or more than asked): hand it straight back
                    self._release(job, reason="not_started")
        finally:
            if returning:
                with self._cond:
                    self._returning -= returning
                    self._cond.notify_all()

    def _drop(self, job: _HeldJob) -> bool:
        """Forget a held job (under ``_cond``), unless its id now holds a newer lease (a failed
        job whose retry came back in its own ``lease_next``); True if it was dropped here."""
        if self._held.get(job.job_id) is job:
            del self._held[job.job_id]
            return True
        return False

    def _undisplace(self, job: _HeldJob) -> bool:
        """Give back the slot of a displaced job's handler, which has ended (under ``_cond``);
        True if it was displaced."""
        if not job.displaced:
            return False
        job.displaced = False
        self._displaced -= 1
        return True

    def _held_job(self, lease: types.Lease) -> _HeldJob:
        """The held job of ``lease``.

        Raises:
            ValueError, TypeError, AttributeError: not a lease (no string ``job_id`` and
                ``lease_token``, an ``attempt`` that is no integer, not an object).
        """
        now = self._clock.monotonic()
        job_id, token = lease.get("job_id"), lease.get("lease_token")
        if not (isinstance(job_id, str) and job_id and isinstance(token, str) and token):
            raise ValueError(f"a lease without its job_id and lease_token: {lease!r:.200}")
        limit_ms = lease.get("time_limit_ms")
        return _HeldJob(
            job_id=job_id,
            lease_token=token,
            queue=str(lease.get("queue", "")),
            attempt=int(lease.get("attempt", 0)),
            payload=lease.get("payload"),
            lease=lease,
            renew_at=now + self._renew_interval_s,
            expires_at=now + self.lease_ms / 1000,
            # Counted from the lease's arrival: no later than the server's own deadline.
            deadline=now + limit_ms / 1000 if isinstance(limit_ms, int) and limit_ms > 0 else None,
        )

    # -- running --------------------------------------------------------------------------

    def _handler_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._execute(job)
            except Exception:  # never lose a handler thread (and its slot) to a bug here
                logger.exception(
                    "event=worker_error job_id=%s",
                    job.job_id,
                    extra={"event": "worker_error", "job_id": job.job_id},
                )
                with self._cond:
                    self._drop(job)
                    self._cond.notify_all()
            finally:
                with self._cond:
                    if self._undisplace(job):  # its slot is free only now
                        self._cond.notify_all()

    def _execute(self, job: _HeldJob) -> None:
        ctx = JobContext(
            job_id=job.job_id,
            queue=job.queue,
            attempt=job.attempt,
            worker_id=self.worker_id,
            shutdown=self.shutdown_event,
            lease=job.lease,
            stop=job.stop,
        )
        action: Literal["ack", "fail", "release"] = "ack"
        error = ""
        retryable = True
        outcome = _Outcome()
        try:
            returned = self._handler(job.payload, ctx)
            if isinstance(returned, StoredResult):
                outcome = _Outcome(result=returned.value)
        except JobInterrupted as exc:
            action = "release"
            if not job.stop.is_set() and not self.shutdown_event.is_set():
                # Nothing asked it to stop: a failure, retried with backoff as any other.
                # Released, the job came straight back to the same handler, about 600
                # times a second, an attempt row each, and never went dead (a review).
                action = "fail"
                error, retryable, outcome = self._failed(job, exc, "no stop was asked for: ")
        except BaseException as exc:  # noqa: BLE001 - any handler failure, even SystemExit, fails the job
            action = "fail"
            error, retryable, outcome = self._failed(job, exc)
        if job.stop.reason == "timeout" and action != "ack":
            # A stop at the time limit is a failed attempt (reason "timeout"), never a release.
            action, error, retryable = "fail", "timeout", True
        with self._cond:
            if job.status != "running" or job.timed_out:
                # Released at the shutdown deadline, or failed by the server at its time limit.
                _log(
                    logging.INFO,
                    "result_discarded",
                    job_id=job.job_id,
                    attempt=job.attempt,
                    action=action,
                )
                self._drop(job)
                self._cond.notify_all()
                return
            job.status = "settling"
        try:
            self._settle(job, action, error, retryable, outcome)
        finally:
            with self._cond:
                # A coalesced ack's sender has dropped it already: no slot to announce (a
                # wake-up of the lease thread per job, for nothing).
                if self._drop(job):
                    self._cond.notify_all()

    def _failed(
        self, job: _HeldJob, exc: BaseException, why: str = ""
    ) -> tuple[str, bool, _Outcome]:
        """The fail a handler's exception makes, logged: ``(error, retryable, outcome)``;
        ``why`` goes before the exception's text."""
        error = truncate_utf8(why + error_text(exc), self.max_error_bytes)
        retryable = not isinstance(exc, NonRetryableError)
        _log(
            logging.WARNING,
            "handler_failed",
            job_id=job.job_id,
            attempt=job.attempt,
            retryable=retryable,
            error_type=type(exc).__name__,
            error=error,
            exc_info=logger.isEnabledFor(logging.DEBUG),  # tracebacks with RELAY_LOG=debug
        )
        return error, retryable, _Outcome(reported=self._reported(exc))

    def _reported(self, exc: BaseException) -> ReportedError | None:
        """The class and traceback a failure is sent with, the traceback cut to fit."""
        try:
            found = reported_error(exc)
        except Exception:  # noqa: BLE001 - a traceback that cannot be formatted is left out
            return None
        return ReportedError(
            exception_class=truncate_utf8(found.exception_class, 255) or "Exception",
            traceback=truncate_utf8_tail(found.traceback, self.max_result_bytes),
        )

    def _settle(
        self,
        job: _HeldJob,
        action: Literal["ack", "fail", "release"],
        error: str,
        retryable: bool,
        outcome: _Outcome | None = None,
    ) -> None:
        outcome = outcome or _Outcome()
        if action == "release":
            # Hold the job until our own lease call in flight returns: released now, it could
            # be handed straight back to that call (one more delivery for nothing).
            # At the deadline the shutdown cuts that call off, so this wait ends soon after.
            deadline = self._stop_deadline
            if deadline is not None:
                self._wait(self._lease_done, deadline + _MARGIN_S - self._clock.monotonic())
            self._release(job, reason="interrupted")
            return
        self._send_outcome(job, action, error, retryable, outcome)

    def _reserve_next(self) -> _Promise:
        """How many jobs an ack or fail may ask for (``lease_next``): the slots free once it
        is done, its own included; promised until ``_take``.

        None while stopping, and none while another ack's ``lease_next`` is in flight: that one
        (or the next) takes the slots freed meanwhile in one claim, which costs the server less
        per job than a claim per ack. Measured (docs/benchmarking.md): one claim per ack made
        ``--concurrency 16`` 45% slower, while at 1 the ack's lease_next doubled the rate (the
        round trip is the bound there).
        """
        with self._cond:  # an RLock: _reserve takes it again
            if self._next_in_flight:
                return _Promise(0)
            promise = self._reserve(1)
            self._next_in_flight = promise.slots > 0
            return promise

    def _send_outcome(
        self,
        job: _HeldJob,
        action: Literal["ack", "fail"],
        error: str,
        retryable: bool,
        outcome: _Outcome,
    ) -> None:
        """Send the ack or fail (with ``lease_next`` for the slots it frees), retrying what
        failed for a transient reason; take the jobs its reply brings (a coalesced ack's
        sender takes them: ``_send_ack_batch``)."""
        batched = action == "ack" and outcome.result is None and self._batch_acks
        promise = _Promise(0) if batched else self._reserve_next()
        asked = promise.slots > 0
        try:
            self._send_promising(job, action, error, retryable, outcome, promise)
        finally:
            if promise.slots:  # not taken by a reply: free them
                self._take([], promise.slots, covered=promise.covered)
            if asked:
                with self._cond:
                    self._next_in_flight = False

    def _send_promising(
        self,
        job: _HeldJob,
        action: Literal["ack", "fail"],
        error: str,
        retryable: bool,
        outcome: _Outcome,
        promise: _Promise,
    ) -> None:
        reserved = promise.slots
        attempt = 0
        alone = False  # a batch holding this ack was refused whole: send it by itself
        while True:
            attempt += 1
            lease_next = None
            if reserved and self._lease_next:
                lease_next = {
                    "queues": self.queues,
                    "max_jobs": reserved,
                    "lease_ms": self.lease_ms,
                }
            batched = action == "ack" and outcome.result is None and self._batch_acks and not alone
            try:
                result: Mapping[str, Any]
                if batched:
                    result = self._batched_ack(job)
                else:
                    result = self._send_one(job, action, error, retryable, outcome, lease_next)
            except _Unbatched as again:
                alone = alone or again.alone
                attempt -= 1  # not sent as asked: this try did not count
                continue
            except _LEASE_GONE as exc:
                # At-least-once: the lease expired or moved on, so another worker may run the
                # job again. Nothing to undo here.
                _log(logging.WARNING, f"{action}_rejected", job_id=job.job_id, code=exc.code)
                return
            except (errors.FrameTooLarge, errors.InvalidArgument) as exc:
                field = str(exc.details.get("field", ""))
                if lease_next is not None and field.startswith("lease_next"):
                    # A server from before lease_next: ask for the next jobs by lease alone.
                    _log(logging.INFO, "lease_next_unsupported", error=_describe(exc))
                    self._lease_next = False
                    attempt -= 1  # this try did not count
                    continue
                # Over the frame limit, an ack is refused whole by the client (no field): its
                # result is the only part without a bound of its own.
                whole = isinstance(exc, errors.FrameTooLarge) and not field
                if action == "ack" and (field.startswith("result") or whole):
                    self._refused_result(job, exc)
                    return
                _log(logging.WARNING, f"{action}_error", job_id=job.job_id, error=_describe(exc))
                return  # refused: the same request would be refused again
            except (ConnectionError, errors.RelayError) as exc:
                _log(
                    logging.WARNING,
                    f"{action}_error",
                    job_id=job.job_id,
                    error=_describe(exc),
                    tries=attempt,
                )
                pause = min(_SETTLE_PAUSE_S * attempt, _SETTLE_PAUSE_MAX_S)
                if not self._try_again(job, exc, pause):
                    _log(
                        logging.WARNING,
                        f"{action}_abandoned",
                        job_id=job.job_id,
                        error=_describe(exc),
                        tries=attempt,
                    )
                    return
                # Repeating ack/fail with the same token is safe (protocol: "duplicate").
                self._clock.sleep(pause)
                continue
            with self._cond:
                if action == "fail":
                    self.failed += 1
                elif not batched:  # a batch's sender counted it (``_send_ack_batch``)
                    self.acked += 1
            leases = result.get("next") or []
            if reserved:
                promise.slots = 0  # ended here: the leases take the slots, or _take frees them
                self._take(leases, reserved, covered=promise.covered, settled=(job,), via_ack=True)
            if not batched:  # a batch's sender logged it, before the batch's leases
                _log_settled("acked" if action == "ack" else "failed", job, result)
            return

    def _try_again(self, job: _HeldJob, exc: BaseException, pause: float) -> bool:
        """Whether an ack or fail that failed with ``exc`` is worth sending again after
        ``pause`` s: the error may pass (not ``UNAUTHENTICATED``, ``PERMISSION_DENIED``), the
        lease may still be live then (no renew was refused, ``expires_at`` not passed) and
        the shutdown deadline not passed (the shutdown then releases what is still held)."""
        if isinstance(exc, errors.RelayError) and not exc.retryable:
            return False
        at = self._clock.monotonic() + pause
        deadline = self._stop_deadline
        with self._cond:
            live = not job.lost and at < job.expires_at
        return live and (deadline is None or at < deadline)

    def _send_one(
        self,
        job: _HeldJob,
        action: Literal["ack", "fail"],
        error: str,
        retryable: bool,
        outcome: _Outcome,
        lease_next: Mapping[str, Any] | None,
    ) -> Mapping[str, Any]:
        """Send one ack or fail on a pooled connection; return its reply.

        Raises:
            RelayError, ConnectionError: as the client's ``ack`` / ``fail`` (a result the
                client cannot encode is ``InvalidArgument``, field ``result``).
        """
        extra = {"lease_next": lease_next} if lease_next else {}
        result = outcome.result
        with self._clients.client() as client:
            if action == "ack":
                return client.ack(
                    job.job_id,
                    worker_id=self.worker_id,
                    lease_token=job.lease_token,
                    result=result,
                    **extra,
                )
            reported = outcome.reported
            return client.fail(
                job.job_id,
                worker_id=self.worker_id,
                lease_token=job.lease_token,
                error=error,
                retryable=retryable,
                exception_class=reported.exception_class if reported else None,
                traceback=reported.traceback if reported else None,
                **extra,
            )

    # -- coalesced acks -------------------------------------------------------------------

    def _batched_ack(self, job: _HeldJob) -> Mapping[str, Any]:
        """Queue ``job``'s ack for the next ``ack_batch`` and wait for its own answer.

        Returns:
            ``ack``'s reply for it (``{"job_id", "state", "duplicate"}``); the batch's leases
            (``lease_next``) are taken by the sender.
        Raises:
            RelayError: its entry was refused (``StaleToken``...), or the whole request was;
            ConnectionError: the request's outcome is unknown (repeating an ack is safe);
            _Unbatched: not sent, send it again.
        """
        pending = _PendingAck(job)
        with self._acks_cond:
            if self._acks_closed:  # the senders are gone (a handler that outlived the shutdown)
                raise ConnectionError("the worker has stopped: ack not sent")
            self._acks.append(pending)
            self._acks_cond.notify_all()
        # Bounded by the sender's call: the client's timeouts, or ``_shutdown`` closing it.
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def _ack_sender_loop(self) -> None:
        """A sender thread: send the acks queued so far as one ``ack_batch``, until closed.

        With no batch in flight, any queued ack goes out at once; with one in flight, once
        ``_overlap_acks`` are queued, or that one returns, or the oldest has waited
        ``_hold_back_s`` (a batch that hangs does not hold the others until its timeout).
        """
        while True:
            with self._acks_cond:
                while not self._acks_closed:
                    if self._acks and (not self._sending or len(self._acks) >= self._overlap_acks):
                        break
                    if not self._acks:
                        self._acks_cond.wait()
                        continue
                    held_s = self._acks[0].queued_at + self._hold_back_s() - time.monotonic()
                    if held_s <= 0:
                        break  # held back long enough: sent beside the batch in flight
                    self._acks_cond.wait(held_s)
                if not self._acks:
                    return
                self._sending += 1
                size, budget, n = 0, self._batch_bytes, 0
                for pending in self._acks[:MAX_ACKS_PER_BATCH]:
                    size += _ack_bytes(pending.job, self.worker_id)
                    if n and size > budget:
                        break
                    n += 1
                batch = self._acks[:n]
                del self._acks[:n]
            try:
                self._send_ack_batch(batch)
            except Exception as exc:  # a bug must not leave a handler thread waiting forever
                logger.exception(
                    "event=worker_error error=%r", exc, extra={"event": "worker_error"}
                )
                for pending in batch:
                    if not pending.done.is_set():
                        pending.error = ConnectionError(f"ack batch not sent: {exc!r}")
                        pending.done.set()
            finally:
                with self._acks_cond:
                    self._sending -= 1
                    self._acks_cond.notify_all()  # the acks held back may go now

    def _hold_back_s(self) -> float:
        """How long an ack may wait for more while a batch is in flight, in seconds: twice the
        recent round trip, within ``HOLD_BACK_MIN_S`` .. ``HOLD_BACK_MAX_S``."""
        return min(max(2 * self._round_trip_s, HOLD_BACK_MIN_S), HOLD_BACK_MAX_S)

    def _reserve(self, acks: int) -> _Promise:
        """How many jobs a request settling ``acks`` held jobs may ask for (``lease_next``):
        the slots free once it is done, its own included; none while stopping. Promised until
        ``_take``, which is given the promise's ``slots`` and ``covered``."""
        with self._cond:
            if not self._lease_next or self._stop.is_set():
                return _Promise(0)
            asked = max(0, min(self._free() + acks, MAX_JOBS_PER_LEASE))
            covered = min(acks, asked)
            self._reserved += asked
            self._covered += covered
            return _Promise(asked, covered)

    def _send_ack_batch(self, batch: list[_PendingAck]) -> None:
        """Send ``batch`` as one ``ack_batch`` (with ``lease_next`` for the slots it frees),
        take the leases it brings, count and drop its acked jobs, and answer each entry.

        Its jobs whose ack was refused because the lease is gone (``STALE_TOKEN``...) are
        dropped with them: their slots belong to the leases the batch asked for.
        """
        promise = self._reserve(len(batch))
        asked, covered = promise.slots, promise.covered
        lease_next = None
        if asked:
            lease_next = {"queues": self.queues, "max_jobs": asked, "lease_ms": self.lease_ms}
        acks = [
            {"job_id": p.job.job_id, "worker_id": self.worker_id, "lease_token": p.job.lease_token}
            for p in batch
        ]
        try:
            with self._clients.client() as client:
                sent_at = time.monotonic()
                reply = client.ack_batch(acks, lease_next=lease_next)
                took_s = time.monotonic() - sent_at
            with self._acks_cond:  # a moving average, of the replies that came
                self._round_trip_s += (took_s - self._round_trip_s) / 8
            results = _batch_results(reply, len(batch))
        except BaseException as exc:
            self._take([], asked, covered=covered)
            self._answer_failed(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        # The acks committed: each is answered from its entry whatever happens to the leases.
        done = [p.job for p, entry in zip(batch, results, strict=True) if _settled(entry)]
        acked = 0
        for pending, entry in zip(batch, results, strict=True):
            if entry.get("ok") is True:  # logged here, not by 16 handler threads woken at once
                acked += 1
                _log_settled("acked", pending.job, entry)
        self._take(
            reply.get("next") or [], asked, covered=covered, settled=done, via_ack=True, acked=acked
        )
        for pending, entry in zip(batch, results, strict=True):
            if entry.get("ok") is True:
                pending.result = {
                    "job_id": entry.get("job_id"),
                    "state": entry.get("state"),
                    "duplicate": entry.get("duplicate", False),
                }
            else:
                pending.error = errors.error_from_body(dict(entry.get("error") or {}))
            pending.done.set()

    def _answer_failed(self, batch: list[_PendingAck], exc: BaseException) -> None:
        """Answer every ack of a batch whose request failed as a whole (see ``_Unbatched``)."""
        failure: BaseException = exc
        if isinstance(exc, errors.UnknownOp):
            _log(logging.INFO, "ack_batch_unsupported", error=_describe(exc))
            self._batch_acks = False  # a server from before ack_batch: one ack each
            failure = _Unbatched(alone=True)
        elif isinstance(exc, errors.InvalidArgument) and str(
            exc.details.get("field", "")
        ).startswith("lease_next"):
            _log(logging.INFO, "lease_next_unsupported", error=_describe(exc))
            self._lease_next = False
            failure = _Unbatched()
        elif isinstance(exc, errors.FrameTooLarge) and len(batch) > 1:
            self._batch_bytes = max(1, self._batch_bytes // 2)
            _log(logging.INFO, "ack_batch_too_large", acks=len(batch), bytes=self._batch_bytes)
            failure = _Unbatched()  # again, in smaller batches
        elif isinstance(exc, errors.RelayError) and not exc.retryable:
            # Refused whole (a bad entry the server would not set apart): each ack by itself
            # gets its own answer, and the good ones are not lost.
            _log(logging.WARNING, "ack_batch_refused", acks=len(batch), error=_describe(exc))
            failure = _Unbatched(alone=True)
        for pending in batch:
            if not pending.done.is_set():
                pending.error = _own(failure)
                pending.done.set()

    def _refused_result(self, job: _HeldJob, exc: errors.RelayError) -> None:
        """The server cannot store the handler's result (too large, or not faithful JSON):
        fail the attempt for good, since another run would return the same kind of value."""
        _log(logging.WARNING, "result_refused", job_id=job.job_id, code=exc.code)
        refused = ReportedError(
            exception_class=f"{type(exc).__module__}.{type(exc).__qualname__}",
            traceback=truncate_utf8_tail(exc.message, self.max_result_bytes),
        )
        message = f"the result cannot be stored: {exc.message}"
        self._settle(
            job,
            "fail",
            truncate_utf8(message, self.max_error_bytes),
            False,
            _Outcome(reported=refused),
        )

    def _release_all(self, stuck: list[_HeldJob]) -> None:
        """Release ``stuck`` at the shutdown deadline within ``_RELEASE_BUDGET_S``.

        On a connection of its own: the pooled ones may all wait on acks in flight, each for
        the client's timeout (30 s), and a server that takes requests and answers none would
        hold each release as long. The connection is closed when the budget is up (a call
        blocked on it fails), and the jobs not released by then come back when their leases
        expire. A review's worker took 36 s to exit a 2 s shutdown timeout that way.
        """
        client = self._client_factory()
        cut = threading.Event()

        def cut_off() -> None:
            cut.set()
            client.close()

        cutoff = threading.Timer(_RELEASE_BUDGET_S, cut_off)  # real time, as a socket's
        cutoff.daemon = True
        cutoff.start()
        budget_end = self._clock.monotonic() + _RELEASE_BUDGET_S
        try:
            for job in stuck:
                if cut.is_set() or self._clock.monotonic() > budget_end:
                    _log(logging.WARNING, "release_skipped", job_id=job.job_id, code="NO_TIME")
                    continue
                self._release(job, reason="shutdown_timeout", client=client)
        finally:
            cutoff.cancel()
            client.close()

    def _release(self, job: _HeldJob, *, reason: str, client: WorkerClient | None = None) -> None:
        """Release ``job`` (on ``client``, or on one from the pool); a refusal or a broken
        connection is logged, and the lease then expires."""
        try:
            with (
                contextlib.nullcontext(client) if client is not None else self._clients.client()
            ) as sender:
                sender.release(job.job_id, worker_id=self.worker_id, lease_token=job.lease_token)
        except _LEASE_GONE as exc:
            _log(logging.INFO, "release_skipped", job_id=job.job_id, code=exc.code)
        except (ConnectionError, errors.RelayError) as exc:
            # The lease will expire and the job will be delivered again.
            _log(logging.WARNING, "release_error", job_id=job.job_id, error=_describe(exc))
        else:
            with self._cond:
                self.released += 1
            _log(logging.INFO, "released", job_id=job.job_id, attempt=job.attempt, reason=reason)

    # -- renewing -------------------------------------------------------------------------

    def _renew_loop(self) -> None:
        try:
            self._renew_until_stopped()
        except Exception as exc:  # noqa: BLE001 - a bug must stop the worker: leases expire
            self._crashed("renewer", exc)

    def _crashed(self, thread: str, exc: Exception) -> None:
        """Log a crash of ``thread``'s loop (a bug) and stop the worker; ``run()`` raises
        ``Internal`` after the shutdown."""
        logger.exception("event=worker_crashed error=%r", exc, extra={"event": "worker_crashed"})
        self._fatal = errors.Internal(f"{thread} crashed: {exc!r}")
        self.stop()

    def _renew_until_stopped(self) -> None:
        while not self._renew_stop.is_set():
            now = self._clock.monotonic()
            with self._cond:
                live = [j for j in self._held.values() if not j.lost and j.status != "released"]
            for job in live:
                if job.deadline is not None and job.deadline <= now and not job.stop.is_set():
                    self._stop_handler(job, "timeout")
                    # Not stopped by then: the renew the server answers by failing it.
                    job.renew_at = min(job.renew_at, job.deadline + _TIME_LIMIT_GRACE_S)
            due = [job for job in live if job.renew_at <= now]
            if due:
                self._renew_due(due)
                continue
            times = [job.renew_at for job in live]
            times += [j.deadline for j in live if j.deadline is not None and not j.stop.is_set()]
            next_at = min(times, default=now + self._tick_s)
            self._renew_stop.wait(min(max(next_at - now, 0.0), self._tick_s))

    def _stop_handler(self, job: _HeldJob, reason: str) -> None:
        """Set the job's ``ctx.stop`` for ``reason`` (``cancelled`` or ``timeout``), once."""
        if not job.stop.set(reason):
            return
        with self._cond:
            if reason == "cancelled":
                self.cancelled += 1
            else:
                self.timed_out += 1
        _log(logging.INFO, "handler_stop", job_id=job.job_id, attempt=job.attempt, reason=reason)

    def _renew_due(self, due: Sequence[_HeldJob]) -> None:
        """Renew the leases of ``due``: as many to a ``renew_batch`` as ``_renew_chunk``
        allows (one request and one commit for all of them), or one ``renew`` each against
        a server without it; ``_RENEW_REPROBE_S`` after such a cut, whole batches again.

        Renewed one request at a time, a worker's leases were bounded by the lease length
        over one renew's round trip: 16 leases of 6 s with replies 400 ms late lost 7
        (docs/failure-model.md, "A fifth attack")."""
        cut_at = self._renew_cut_at
        if cut_at is not None and self._clock.monotonic() - cut_at >= _RENEW_REPROBE_S:
            # Another server now (several addresses, a rolling upgrade): try it again.
            self._renew_chunk, self._renew_cut_at = MAX_ACKS_PER_BATCH, None
        at = 0
        while at < len(due):
            if self._renew_chunk == 0:
                for job in due[at:]:
                    self._renew(job)
                return
            chunk = due[at : at + self._renew_chunk]
            at += len(chunk)
            self._renew_batch(chunk)

    def _renew_budget(self, jobs: Sequence[_HeldJob], sent: float) -> float:
        """The deadline of a renew of ``jobs`` sent at ``sent`` (``clock.monotonic()`` s), as
        seconds from now: a renew interval (a third of the lease), or the time the latest of
        their leases has left if less, at least ``_RENEW_BUDGET_MIN_S`` (the soonest's would
        cut a batch for one lease about to expire, which the server refuses on its own).

        A renew on a connection gone silent waited out the client's 30 s timeout while every
        other lease of the worker expired, and another worker ran its jobs beside it (a
        review). Held up for a renew interval at most, the renews queued behind it still have
        a third of their leases left; and a renew cut at its deadline is tried again at once,
        on a new connection, with the rest (a first cut at a sixth of the lease, at least 1 s,
        then a pause, lost a 1.5 s lease to one lost reply; a budget shrinking with the time
        left cut renews answered in 1.1 s: a re-review)."""
        left = max(job.expires_at for job in jobs) - sent
        return max(_RENEW_BUDGET_MIN_S, min(self._renew_interval_s, left))

    def _renew_batch(self, jobs: Sequence[_HeldJob]) -> None:
        """Renew ``jobs``' leases in one ``renew_batch`` on the renewer's own connection (not
        the pool's, where acks and releases may wait), by ``_renew_budget``'s deadline (real
        time, as a socket's; connecting and the ``hello`` included). Each entry of the reply
        is settled as its own ``renew`` (``_settle_renew``); a request that failed as a whole
        is tried again for every job (``_renew_failed``)."""
        sent = self._clock.monotonic()
        client = self._renew_client
        assert client is not None  # set by run(), which starts this thread
        call = Ops.renew_batch(
            [
                {
                    "job_id": job.job_id,
                    "worker_id": self.worker_id,
                    "lease_token": job.lease_token,
                    "lease_ms": self.lease_ms,
                }
                for job in jobs
            ]
        )
        try:
            reply = client.send(call, deadline=time.monotonic() + self._renew_budget(jobs, sent))
            results = reply.get("results")
            if not isinstance(results, list) or len(results) != len(jobs):
                raise errors.Internal("renew_batch reply: not one result per renew")
        except errors.UnknownOp as exc:  # a server from before renew_batch: one renew each
            _log(logging.INFO, "renew_batch_unsupported", error=_describe(exc))
            self._renew_chunk, self._renew_cut_at = 0, sent
            for job in jobs:
                job.renew_at = sent
            return
        except errors.FrameTooLarge as exc:
            if len(jobs) == 1:
                self._renew_failed(jobs, sent, exc)
                return
            # A server with a small RELAY_MAX_FRAME_BYTES: half as many at once, now.
            self._renew_chunk, self._renew_cut_at = max(1, len(jobs) // 2), sent
            _log(logging.INFO, "renew_batch_too_large", renews=len(jobs), now=self._renew_chunk)
            for job in jobs:
                job.renew_at = sent
            return
        except Exception as exc:  # noqa: BLE001 - a connection, a refusal, a malformed reply
            self._renew_failed(jobs, sent, exc)
            return
        for job, entry in zip(jobs, results, strict=True):
            if not isinstance(entry, Mapping) or entry.get("job_id") != job.job_id:
                # A faulty server or proxy: nothing is known of this renew; try it again.
                bad = errors.Internal("renew_batch: a result not of its renew")
                self._renew_failed([job], sent, bad)
            elif entry.get("ok") is True:
                self._settle_renew(job, sent, entry)
            else:
                error = entry.get("error")
                failure = errors.error_from_body(dict(error) if isinstance(error, Mapping) else {})
                self._settle_renew(job, sent, None, failure)

    def _renew(self, job: _HeldJob) -> None:
        """Renew ``job``'s lease alone (``renew``; a server without ``renew_batch``), on the
        renewer's connection, by ``_renew_budget``'s deadline."""
        sent = self._clock.monotonic()
        client = self._renew_client
        assert client is not None  # set by run(), which starts this thread
        try:
            result: Mapping[str, Any] = client.send(
                Ops.renew(
                    job.job_id,
                    worker_id=self.worker_id,
                    lease_token=job.lease_token,
                    lease_ms=self.lease_ms,
                ),
                deadline=time.monotonic() + self._renew_budget([job], sent),
            )
        except Exception as exc:  # noqa: BLE001 - a connection, a refusal, a malformed reply
            self._settle_renew(job, sent, None, exc)
        else:
            self._settle_renew(job, sent, result)

    def _renew_failed(self, jobs: Sequence[_HeldJob], sent: float, exc: BaseException) -> None:
        """A renew of ``jobs`` sent at ``sent`` failed for a passing reason (a connection, a
        refusal of the whole request, a malformed reply): each is tried again, at once when
        the call was cut at its deadline, else a renew interval (at most ``_RENEW_RETRY_S``)
        after it was sent."""
        for job in jobs:
            job.renew_at = sent + min(self._renew_interval_s, _RENEW_RETRY_S)
        _log(
            logging.WARNING,
            "renew_error",
            job_id=",".join(job.job_id for job in jobs),
            error=_describe(exc),
        )

    def _settle_renew(
        self,
        job: _HeldJob,
        sent: float,
        result: Mapping[str, Any] | None,
        exc: BaseException | None = None,
    ) -> None:
        """Act on one renew's answer: ``result`` (``{"lease_expires_at_ms", "stop", ...}``)
        or ``exc``. A lease the server no longer holds for us (``_LEASE_GONE``) is marked
        lost; any other failure is tried again (``_renew_failed``); a ``stop`` stops the
        handler (``"timeout"``: the server failed the attempt, nothing is left to renew)."""
        if exc is not None:
            if isinstance(exc, _LEASE_GONE):
                with self._cond:
                    if self._held.get(job.job_id) is not job or job.status != "running":
                        return  # acked or released meanwhile: nothing was lost
                    job.lost = True
                    self.lost += 1
                # Keep running the handler: its ack will be rejected too, and the job may run
                # again elsewhere (at-least-once).
                _log(logging.WARNING, "lease_lost", job_id=job.job_id, code=exc.code)
            else:
                self._renew_failed([job], sent, exc)
            return
        assert result is not None
        stop = result.get("stop")
        if stop == "timeout":
            # The server failed the attempt: nothing left to renew, ack or fail.
            with self._cond:
                job.timed_out = True
                job.lost = True
            self._stop_handler(job, "timeout")
            return
        job.renew_at = self._clock.monotonic() + self._renew_interval_s
        with self._cond:
            job.expires_at = max(job.expires_at, sent + self.lease_ms / 1000)
            self.renewed += 1
        _log(logging.DEBUG, "renewed", job_id=job.job_id, lease_ms=self.lease_ms)
        if stop == "cancelled":
            self._stop_handler(job, "cancelled")

    # -- stopping -------------------------------------------------------------------------

    def _shutdown(self, renewer: threading.Thread) -> None:
        deadline = self._stop_deadline
        assert deadline is not None  # set by stop(), the only way out of run()'s wait
        _log(
            logging.INFO,
            "worker_stopping",
            held=self.held,
            shutdown_timeout_ms=self.shutdown_timeout_ms,
        )
        lease_thread = self._lease_thread
        assert lease_thread is not None
        # 0. A lease call in its long-poll returns at once: the lease connection tells the
        # server it sends nothing more, and the server answers no jobs (an idle worker used to
        # wait out --wait-ms, 5 s by default); jobs already on their way still arrive and run.
        stop_sending = getattr(self._lease_client, "stop_sending", None)
        if stop_sending is not None:
            stop_sending()
        # 1. Running handlers finish and the lease call in flight returns, until the deadline;
        # with nothing held, the lease call gets _LEASE_ANSWER_S to answer (a server that
        # answers nothing kept an idle worker for its whole shutdown timeout, 30 s: a review).
        answer_by = self._clock.monotonic() + _LEASE_ANSWER_S
        with self._cond:
            while self._held or lease_thread.is_alive():
                now = self._clock.monotonic()
                remaining = deadline - now
                if remaining <= 0 or (not self._held and now >= answer_by):
                    break
                self._cond.wait(min(remaining, self._tick_s))
        # 2. Past the deadline, cut off a lease call still waiting.
        if lease_thread.is_alive():
            self._lease_client.close()
            lease_thread.join(_MARGIN_S)
        # 3. Release the jobs whose handlers are still running; their results are discarded.
        with self._cond:
            stuck = [job for job in self._held.values() if job.status == "running"]
            for job in stuck:
                job.status = "released"
        if stuck:
            self._release_all(stuck)
        with self._cond:
            for job in stuck:
                self._held.pop(job.job_id, None)
            # Acks, fails and releases already under way get a moment to finish, and so do
            # the releases of jobs a reply brought while stopping, which run on the thread
            # that sent it (a handler's, not joined): the process exited with them under way
            # and the jobs stayed leased until their leases expired (a Django review).
            margin_end = self._clock.monotonic() + _MARGIN_S
            while self._held or self._returning:
                remaining = margin_end - self._clock.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, self._tick_s))
        # 4. Stop the renewer, the ack senders (once their queue is empty) and the handler
        # threads (a hung handler's thread is abandoned).
        with self._acks_cond:
            self._acks_closed = True
            self._acks_cond.notify_all()
        self._renew_stop.set()
        joined_by = time.monotonic() + _MARGIN_S  # threads: real time, one deadline for all
        for thread in (renewer, *self._senders):
            thread.join(max(0.0, joined_by - time.monotonic()))
        for _ in range(self.concurrency):
            self._jobs.put(None)
        self._lease_client.close()
        self._clients.close()
        if self._renew_client is not None:
            self._renew_client.close()
        summary: dict[str, Any] = {"abandoned": len(stuck), **self.counters()}
        _log(logging.INFO, "worker_stopped", **summary)

    def _wait(self, event: threading.Event, seconds: float) -> bool:
        """Wait until ``event`` is set or ``seconds`` pass on ``clock``; True if it was set."""
        deadline = self._clock.monotonic() + seconds
        while not event.is_set():
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return False
            event.wait(min(remaining, self._tick_s))
        return True


def _log_settled(event: str, job: _HeldJob, reply: Mapping[str, Any]) -> None:
    """Log an ack's or fail's ``acked``/``failed`` line from its reply (or ``ack_batch``
    entry): the job, its attempt, the state it reached and whether it was a duplicate."""
    _log(
        logging.INFO,
        event,
        job_id=job.job_id,
        attempt=job.attempt,
        state=reply.get("state"),
        duplicate=reply.get("duplicate", False),
    )


def _ack_bytes(job: _HeldJob, worker_id: str) -> int:
    """About the bytes one ack adds to an ``ack_batch`` request (its ids, token and keys)."""
    return len(job.job_id) + len(job.lease_token) + len(worker_id) + 64


def _batch_results(reply: Mapping[str, Any], count: int) -> list[Mapping[str, Any]]:
    """The ``results`` of an ``ack_batch`` reply, checked: one object per ack.

    Raises:
        Internal: the reply is malformed (the acks' outcome is unknown: they are sent again).
    """
    results = reply.get("results") if isinstance(reply, Mapping) else None
    if not isinstance(results, list) or len(results) != count:
        raise errors.Internal(f"ack_batch answered {type(results).__name__}, not {count} results")
    for entry in results:
        error = entry.get("error") if isinstance(entry, Mapping) else None
        ok = isinstance(entry, Mapping) and entry.get("ok") is True
        if not isinstance(entry, Mapping) or not (ok or isinstance(error, Mapping)):
            raise errors.Internal("ack_batch answered a result that is neither ok nor an error")
    next_jobs = reply.get("next") or []
    if not isinstance(next_jobs, list) or not all(isinstance(x, Mapping) for x in next_jobs):
        raise errors.Internal("ack_batch answered a next that is not a list of leases")
    return results


def _settled(entry: Mapping[str, Any]) -> bool:
    """Whether an ``ack_batch`` entry ends its job's hold: acked, or refused because the lease
    is gone (the handler thread then logs it and lets it go)."""
    if entry.get("ok") is True:
        return True
    code = (entry.get("error") or {}).get("code")
    return code in _GONE_CODES


def _own(exc: BaseException) -> BaseException:
    """A copy of a whole ``ack_batch``'s failure for one of its acks (each handler thread
    raises its own): the same ``RelayError`` class and details, or a ``ConnectionError`` (the
    outcome is unknown: repeating an ack is safe)."""
    if isinstance(exc, _Unbatched):
        return _Unbatched(alone=exc.alone)
    if isinstance(exc, errors.RelayError):
        return errors.error_from_body(exc.to_dict())
    return ConnectionError(f"ack_batch failed: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return f"{code}: {exc}" if code else f"{type(exc).__name__}: {exc}"
