"""Typed shapes of the protocol's results (``docs/protocol.md``), shared by the clients.

They are ``TypedDict``s, so at run time a result is the plain dict the server sent: code that
indexes ``result["job"]["id"]`` works the same with or without the types, and a type checker
catches a misspelt key. ``AsyncRelayClient`` is annotated with them; ``RelayClient`` returns
the same dicts (annotated ``dict[str, Any]``, which these are assignable from at run time).

Instants are integer epoch milliseconds (``*_at_ms``); durations are milliseconds (``*_ms``).
Annotations are evaluated (no ``from __future__ import annotations``), so ``__required_keys__``
tells ``NotRequired`` keys apart, as ``queue_api.schemas`` needs.
"""

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "AckBatchEntry",
    "AckBatchResult",
    "AckError",
    "AckResult",
    "Attempt",
    "BatchEntry",
    "CancelResult",
    "DeadListResult",
    "DeadPurgeResult",
    "ErrorEntry",
    "FailResult",
    "HelloResult",
    "Job",
    "JobEvent",
    "JobResult",
    "JobState",
    "Lease",
    "LeaseResult",
    "PingResult",
    "Priority",
    "PruneResult",
    "QueueStats",
    "ReleaseResult",
    "RenewBatchEntry",
    "RenewBatchResult",
    "RenewResult",
    "ResultResult",
    "RetryPolicy",
    "Server",
    "StatsResult",
    "SubmitBatchResult",
    "SubmitResult",
    "Totals",
]

JobState = Literal["pending", "ready", "leased", "retrying", "succeeded", "dead", "cancelled"]
Priority = Literal["low", "normal", "high", "critical"]
Unique = Literal["window", "active"]


class RetryPolicy(TypedDict):
    """A job's retry policy: ``backoff`` is ``"fixed"`` or ``"exponential"``."""

    backoff: str
    base_ms: int
    cap_ms: int
    jitter: bool


class Attempt(TypedDict):
    """One delivery of a job (``inspect`` history); ``outcome`` is None while it runs."""

    attempt: int
    worker_id: str
    started_at_ms: int
    ended_at_ms: int | None
    # "succeeded", "failed", "released", "lease_expired", "recovered", "cancelled",
    # "timeout", or None while it runs
    outcome: str | None
    error: str | None


class JobEvent(TypedDict):
    """An operator or recovery event (replay, purge, cancel, a cancel requested, lease released
    at restart)."""

    event: str
    from_state: str | None
    to_state: str | None
    at_ms: int
    actor: str | None
    detail: NotRequired[str | None]


class Job(TypedDict):
    """A job as ``submit``, ``inspect`` and ``dead_list`` return it (never its lease token)."""

    id: str
    queue: str
    state: JobState
    priority: Priority
    payload: Any
    attempt: int
    failures: int
    max_retries: int
    retry_policy: RetryPolicy
    idempotency_key: str | None
    created_at_ms: int
    available_at_ms: int | None
    ready_since_ms: int | None
    leased_by: str | None
    lease_expires_at_ms: int | None
    finished_at_ms: int | None
    last_error: str | None
    dead_reason: str | None
    unique: Unique  # when the idempotency key is freed: after the window, or at a terminal state
    meta: dict[str, str]  # the submit's meta map ({} when none)
    cancel_requested_at_ms: int | None  # when a cancel was asked for (leased or cancelled)
    time_limit_ms: int | None  # the most one attempt may run, in ms; None: no limit
    history: NotRequired[list[Attempt]]  # inspect only
    events: NotRequired[list[JobEvent]]  # inspect only
    history_omitted: NotRequired[int]  # inspect only: older attempts and events left out


class Lease(TypedDict):
    """A leased job: ack, fail, renew and release need ``job_id`` and ``lease_token``."""

    job_id: str
    queue: str
    payload: Any
    attempt: int
    priority: Priority
    lease_token: str
    lease_expires_at_ms: int
    failures: int
    max_retries: int
    created_at_ms: int
    meta: dict[str, str]  # the job's meta map ({} when none)
    time_limit_ms: int | None  # abandon the handler this many ms after the lease; None: never


class PingResult(TypedDict):
    """``ping``."""

    pong: bool
    server_time_ms: int


class HelloResult(TypedDict):
    """``hello``: the key the connection now runs as (never its secret)."""

    authenticated: bool
    name: str
    prefix: str | None
    scopes: list[str]
    server_time_ms: int


class SubmitResult(TypedDict):
    """``submit``; ``deduplicated`` is true when an idempotency key matched a job."""

    job: Job
    deduplicated: bool


class BatchEntry(TypedDict):
    """One job of a ``submit_batch``: its id and state now (``ready`` or ``pending`` when new)."""

    job_id: str
    queue: str
    state: JobState
    available_at_ms: int | None
    deduplicated: bool


class SubmitBatchResult(TypedDict):
    """``submit_batch``: one entry per job, in order."""

    results: list[BatchEntry]


class LeaseResult(TypedDict):
    """``lease`` on the wire (the clients return just the list)."""

    jobs: list[Lease]


class RenewResult(TypedDict):
    """``renew``: ``stop`` tells the worker to stop the handler: ``"cancelled"`` (a cancel was
    asked for; the lease was renewed so the handler can stop cleanly) or ``"timeout"`` (the
    attempt ran past its time limit: it was failed, nothing was renewed, and
    ``lease_expires_at_ms`` is None); None to carry on."""

    job_id: str
    lease_expires_at_ms: int | None
    stop: Literal["cancelled", "timeout"] | None


class AckResult(TypedDict):
    """``ack``; ``duplicate`` is true for a repeated ack of the same attempt; ``next`` (only
    when the ack asked for ``lease_next``) the jobs leased in the same commit."""

    job_id: str
    state: Literal["succeeded"]
    duplicate: bool
    next: NotRequired[list[Lease]]


class AckError(TypedDict):
    """Why one ack of an ``ack_batch`` was refused (``STALE_TOKEN``, ``LEASE_EXPIRED``...)."""

    code: str
    message: str
    retryable: bool


class AckBatchEntry(TypedDict):
    """One ack of an ``ack_batch``: ``ok`` with ``state`` and ``duplicate``, or ``error``;
    ``job_id`` as sent, None for a refused entry whose id could not be one (not a string
    of at most 40 characters)."""

    job_id: str | None
    ok: bool
    state: Literal["succeeded"] | None
    duplicate: bool | None
    error: AckError | None


class AckBatchResult(TypedDict):
    """``ack_batch``: one entry per ack, in order, and the jobs leased by ``lease_next``
    (``[]`` without it, or when nothing was ready)."""

    results: list[AckBatchEntry]
    next: list[Lease]


class RenewBatchEntry(TypedDict):
    """One renew of a ``renew_batch``: ``ok`` with ``renew``'s ``lease_expires_at_ms`` and
    ``stop``, or ``error`` (``STALE_TOKEN``, ``LEASE_EXPIRED``...; the other entries stand);
    ``job_id`` as sent, None for a refused entry whose id could not be one."""

    job_id: str | None
    ok: bool
    lease_expires_at_ms: int | None
    stop: Literal["cancelled", "timeout"] | None
    error: AckError | None


class RenewBatchResult(TypedDict):
    """``renew_batch``: one entry per renew, in order."""

    results: list[RenewBatchEntry]


class FailResult(TypedDict):
    """``fail``: ``state`` is ``"retrying"`` (with ``retry_at_ms``) or ``"dead"``, or
    ``"cancelled"`` when a cancel had been asked for."""

    job_id: str
    state: Literal["retrying", "dead", "cancelled"]
    retry_at_ms: int | None
    dead_reason: str | None
    duplicate: bool
    next: NotRequired[list[Lease]]


class ReleaseResult(TypedDict):
    """``release``: ``state`` is ``"cancelled"`` when a cancel had been asked for."""

    job_id: str
    state: Literal["ready", "cancelled"]


class JobResult(TypedDict):
    """``inspect`` and ``dead_retry``: one job."""

    job: Job


class ErrorEntry(TypedDict):
    """One failed attempt's structured error, as a ``fail`` with ``exception_class`` sent it."""

    attempt: int
    exception_class: str
    traceback: str


class ResultResult(TypedDict):
    """``result``: the job (as ``inspect``) and what its worker reported."""

    job: Job
    return_value: Any  # the result sent with the ack; None when none was stored
    errors: list[ErrorEntry]  # oldest first; the newest that fit RELAY_MAX_RESULT_BYTES


class CancelResult(TypedDict):
    """``cancel``: the job after it (``cancelled``, or still ``leased`` with
    ``cancel_requested_at_ms`` set until its worker stops), and whether it is cancelled now."""

    job: Job
    cancelled: bool


class Server(TypedDict):
    """A live ``relay server`` in the registry (instants in epoch ms)."""

    id: str
    address: str
    host: str
    pid: int
    started_at_ms: int
    seen_at_ms: int
    clock_skew_ms: int


class Totals(TypedDict):
    """Job counts of every queue by state."""

    pending: int
    ready: int
    leased: int
    retrying: int
    succeeded: int
    dead: int
    cancelled: int


class QueueStats(Totals):
    """One queue's job counts by state, and how long its oldest ready job has waited (ms;
    None when none is ready)."""

    oldest_ready_age_ms: int | None


class QueueControls(TypedDict):
    """``pause``, ``resume``, ``set_queue_limits``: one queue's controls (``relay_queue``)."""

    queue: str
    paused: bool
    max_leased: int | None  # most jobs leased at once, all workers; None: no cap
    rate_per_s: float | None  # jobs started per second (token bucket); None: no rate
    burst: int  # tokens the bucket holds at most
    updated_at_ms: int | None  # None: never controlled (the defaults)
    updated_by: str | None


class QueueControlsResult(TypedDict):
    """``queue_controls``: the controls of one queue, or a page of the controlled queues';
    pass ``next_after`` as ``after`` for the next page (None on the last)."""

    queues: dict[str, QueueControls]
    next_after: str | None


class StatsResult(TypedDict):
    """``stats``: per-queue counts by state plus ``oldest_ready_age_ms`` (None when empty),
    the live servers, and the controls of each paused, capped or rate-limited queue on the
    page (over TCP and HTTP a page holds up to 1,000 queues in name order: ``next_after``)."""

    queues: dict[str, QueueStats]
    totals: Totals
    server_time_ms: int
    servers: list[Server]
    next_after: str | None  # the next page's cursor; None on the last page
    controls: dict[str, QueueControls]


class DeadListResult(TypedDict):
    """``dead_list``: a page of dead jobs; pass ``next_after`` for the next page."""

    jobs: list[Job]
    next_after: str | None


class DeadPurgeResult(TypedDict):
    """``dead_purge``."""

    job_id: str
    purged: bool


class PruneResult(TypedDict):
    """``prune``: jobs deleted per state by one bounded transaction, and whether the batch
    was full (call again: more may be past their age)."""

    deleted: dict[str, int]
    more: bool
