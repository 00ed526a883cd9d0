"""Typed shapes of the protocol's results (``docs/protocol.md``), shared by the clients.

They are ``TypedDict``s, so at run time a result is the plain dict the server sent: code that
indexes ``result["job"]["id"]`` works the same with or without the types, and a type checker
catches a misspelt key. ``AsyncRelayClient`` is annotated with them; ``RelayClient`` returns
the same dicts (annotated ``dict[str, Any]``, which these are assignable from at run time).

Instants are integer epoch milliseconds (``*_at_ms``); durations are milliseconds (``*_ms``).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "AckResult",
    "Attempt",
    "BatchEntry",
    "DeadListResult",
    "DeadPurgeResult",
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
    "ReleaseResult",
    "RenewResult",
    "RetryPolicy",
    "StatsResult",
    "SubmitBatchResult",
    "SubmitResult",
]

JobState = Literal["pending", "ready", "leased", "retrying", "succeeded", "dead"]
Priority = Literal["low", "normal", "high", "critical"]


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
    outcome: str | None  # "succeeded", "failed", "released", "lease_expired", None
    error: str | None


class JobEvent(TypedDict):
    """An operator or recovery event (replay, purge, lease released at restart)."""

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
    """``renew``."""

    job_id: str
    lease_expires_at_ms: int


class AckResult(TypedDict):
    """``ack``; ``duplicate`` is true for a repeated ack of the same attempt."""

    job_id: str
    state: Literal["succeeded"]
    duplicate: bool


class FailResult(TypedDict):
    """``fail``: ``state`` is ``"retrying"`` (with ``retry_at_ms``) or ``"dead"``."""

    job_id: str
    state: Literal["retrying", "dead"]
    retry_at_ms: int | None
    dead_reason: str | None
    duplicate: bool


class ReleaseResult(TypedDict):
    """``release``."""

    job_id: str
    state: Literal["ready"]


class JobResult(TypedDict):
    """``inspect`` and ``dead_retry``: one job."""

    job: Job


class Server(TypedDict):
    """A live ``relay server`` in the registry (instants in epoch ms)."""

    id: str
    address: str
    host: str
    pid: int
    started_at_ms: int
    seen_at_ms: int
    clock_skew_ms: int


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
    """``queue_controls``: the controls of one queue, or of every controlled queue."""

    queues: dict[str, QueueControls]


class StatsResult(TypedDict):
    """``stats``: per-queue counts by state plus ``oldest_ready_age_ms`` (None when empty),
    the live servers, and every paused, capped or rate-limited queue's controls."""

    queues: dict[str, dict[str, int | None]]
    totals: dict[str, int]
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
