"""Request and response bodies of the HTTP API, in the wire shapes of ``docs/protocol.md``.

Input bodies forbid unknown fields and take JSON types strictly (``"5"`` is not an integer,
``1`` is not ``true``), as the TCP op table does. Ranges (queue names, lease lengths, payload
size, ...) are the service's to check, so they are not repeated here. Instants are integer
epoch milliseconds (``*_at_ms``) with ISO 8601 twins (``*_at``) in job bodies.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from ninja import Schema
from pydantic import ConfigDict, Field, computed_field


def iso(ms: int | None) -> str | None:
    """Epoch ms as ISO 8601 UTC (``2026-01-01T00:00:00.000Z``), or None."""
    if ms is None:
        return None
    instant = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return instant.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _In(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------- producers


class SubmitOptions(_In):
    """Options of one job; left out (or null) means the server's default."""

    payload: Any = Field(
        ..., description="Any JSON value except null, at most RELAY_MAX_PAYLOAD_BYTES encoded."
    )
    priority: Literal["low", "normal", "high", "critical"] | int | None = Field(
        None, description="low, normal (default), high, critical; or 0-3."
    )
    max_retries: int | None = Field(None, description="Failures retried before the job is dead.")
    backoff: Literal["fixed", "exponential"] | None = None
    backoff_base_ms: int | None = Field(None, description="Fixed delay, or first delay, in ms.")
    backoff_cap_ms: int | None = Field(None, description="Largest retry delay in ms.")
    jitter: bool | None = Field(None, description="Scale retry delays into 50-100%.")
    delay_ms: int | None = Field(None, description="Run no sooner than this many ms from now.")
    run_at_ms: int | None = Field(None, description="Run no sooner than this epoch-ms instant.")
    idempotency_key: str | None = Field(
        None,
        description="Deduplicate resubmits within RELAY_IDEMPOTENCY_WINDOW_MS; also accepted "
        "as the Idempotency-Key header.",
    )


class SubmitIn(SubmitOptions):
    """``POST /queues/{queue}/jobs``: the queue is in the path."""


class BatchJobIn(SubmitOptions):
    """One job of a batch submit."""

    queue: str


class BatchIn(_In):
    """``POST /jobs/batch``: 1..RELAY_MAX_BATCH_SUBMIT jobs, all created or none."""

    jobs: list[BatchJobIn]


class RetryPolicyOut(Schema):
    """How a job's failures are retried."""

    backoff: str
    base_ms: int
    cap_ms: int
    jitter: bool


class JobSummaryOut(Schema):
    """A job's fields other than its payload (``JobOut`` adds the payload)."""

    id: str
    queue: str
    state: str
    priority: str
    attempt: int
    failures: int
    max_retries: int
    retry_policy: RetryPolicyOut
    idempotency_key: str | None
    created_at_ms: int
    available_at_ms: int | None
    ready_since_ms: int | None
    leased_by: str | None
    lease_expires_at_ms: int | None
    finished_at_ms: int | None
    last_error: str | None
    dead_reason: str | None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def created_at(self) -> str | None:
        """``created_at_ms`` as ISO 8601."""
        return iso(self.created_at_ms)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def available_at(self) -> str | None:
        """``available_at_ms`` as ISO 8601."""
        return iso(self.available_at_ms)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def lease_expires_at(self) -> str | None:
        """``lease_expires_at_ms`` as ISO 8601."""
        return iso(self.lease_expires_at_ms)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def finished_at(self) -> str | None:
        """``finished_at_ms`` as ISO 8601."""
        return iso(self.finished_at_ms)


class JobOut(JobSummaryOut):
    """A job (never its lease token)."""

    payload: Any


class AttemptOut(Schema):
    """One delivery of a job."""

    attempt: int
    worker_id: str
    started_at_ms: int
    ended_at_ms: int | None
    outcome: str | None
    error: str | None


class EventOut(Schema):
    """An operator or recovery event (replay, purge, recovery at server start)."""

    event: str
    from_state: str | None
    to_state: str | None
    at_ms: int
    actor: str | None
    detail: str | None


class JobDetailOut(JobOut):
    """A job with its delivery history and events (the newest that fit one frame)."""

    history: list[AttemptOut]
    events: list[EventOut]
    history_omitted: int = Field(0, description="Older attempts and events left out.")


class SubmitOut(Schema):
    """A submitted job; ``deduplicated`` when an idempotency key matched an existing job."""

    job: JobOut
    deduplicated: bool


class BatchItemOut(Schema):
    """One job of a batch submit: its id and where it stands (the producer has the rest)."""

    job_id: str
    queue: str
    state: str
    available_at_ms: int | None
    deduplicated: bool


class BatchOut(Schema):
    """One result per submitted job, in order."""

    results: list[BatchItemOut]


class QueueStatsOut(Schema):
    """Job counts of one queue by state."""

    pending: int
    ready: int
    leased: int
    retrying: int
    succeeded: int
    dead: int
    oldest_ready_age_ms: int | None


class TotalsOut(Schema):
    """Job counts of every queue by state."""

    pending: int
    ready: int
    leased: int
    retrying: int
    succeeded: int
    dead: int


class ServerOut(Schema):
    """A live ``relay server`` in the registry (instants in epoch ms)."""

    id: str
    address: str
    host: str
    pid: int
    started_at_ms: int
    seen_at_ms: int
    clock_skew_ms: int = Field(description="The server's clock minus the database's, in ms.")


class QueueControlsOut(Schema):
    """One queue's controls: paused, its cap on leased jobs, its start rate."""

    queue: str
    paused: bool
    max_leased: int | None = Field(description="Most jobs leased at once, all workers; null: none.")
    rate_per_s: float | None = Field(description="Jobs started per second; null: no rate.")
    burst: int = Field(description="Jobs that may start at once after a quiet spell.")
    updated_at_ms: int | None
    updated_by: str | None


class QueueControlsListOut(Schema):
    """Queue controls by queue name."""

    queues: dict[str, QueueControlsOut]


class QueueLimitsIn(Schema):
    """New limits; a field left out (or null) keeps its value, 0 removes a cap or rate."""

    max_leased: int | None = Field(None, ge=0, le=1_000_000)
    rate_per_s: float | None = Field(None, ge=0, le=1_000_000)
    burst: int | None = Field(None, ge=1, le=1_000_000)


class StatsOut(Schema):
    """Counts by queue and state, the live servers, and the controlled queues."""

    queues: dict[str, QueueStatsOut]
    totals: TotalsOut
    server_time_ms: int
    servers: list[ServerOut]
    next_after: str | None
    controls: dict[str, QueueControlsOut]


class JobPageOut(Schema):
    """One page of jobs in id order; pass ``next_after`` as ``after`` for the next."""

    jobs: list[JobOut]
    next_after: str | None


# ---------------------------------------------------------------------- workers


class LeaseIn(_In):
    """``POST /leases``: lease up to ``max_jobs`` ready jobs, waiting up to ``wait_ms``."""

    queues: list[str] = Field(..., description="1..RELAY_MAX_QUEUES_PER_LEASE queue names.")
    worker_id: str | None = Field(
        None,
        description="A stable id for this worker; renew/ack/fail must repeat it (default "
        "http:<client address>).",
    )
    max_jobs: int | None = Field(None, description="1..RELAY_MAX_JOBS_PER_LEASE (default 1).")
    lease_ms: int | None = Field(None, description="Lease length (RELAY_VISIBILITY_TIMEOUT_MS).")
    wait_ms: int | None = Field(
        None, description="Long-poll: wait up to this long for a job, 0..RELAY_MAX_WAIT_MS."
    )


class LeaseOut(Schema):
    """A leased job with its fencing token."""

    job_id: str
    queue: str
    payload: Any
    attempt: int
    priority: str
    lease_token: str
    lease_expires_at_ms: int
    failures: int
    max_retries: int
    created_at_ms: int


class LeasesOut(Schema):
    """The leased jobs (empty when none was ready by the end of the wait)."""

    jobs: list[LeaseOut]


class LeaseIdsIn(_In):
    """The lease being acted on: the worker id it was leased with and its token."""

    worker_id: str
    lease_token: str


class RenewIn(LeaseIdsIn):
    """``POST /jobs/{id}/renew``."""

    lease_ms: int | None = None


class FailIn(LeaseIdsIn):
    """``POST /jobs/{id}/fail``."""

    error: str
    retryable: bool | None = Field(None, description="false dead-letters the job at once.")


class RenewOut(Schema):
    """The lease's new expiry."""

    job_id: str
    lease_expires_at_ms: int


class AckOut(Schema):
    """An acked job; ``duplicate`` when this token's ack had already succeeded."""

    job_id: str
    state: str
    duplicate: bool


class FailOut(Schema):
    """A failed attempt: retrying at ``retry_at_ms``, or dead with ``dead_reason``."""

    job_id: str
    state: str
    retry_at_ms: int | None
    dead_reason: str | None
    duplicate: bool


class ReleaseOut(Schema):
    """A job given back to ready."""

    job_id: str
    state: str


# ---------------------------------------------------------------------- operators


class JobIdsIn(_In):
    """Several job ids (1..1000)."""

    job_ids: list[str] = Field(..., min_length=1, max_length=1000)


class ItemErrorOut(Schema):
    """Why one item of a bulk request was refused."""

    code: str
    message: str


class ReplayItemOut(Schema):
    """One job of a bulk replay."""

    job_id: str
    ok: bool
    job: JobOut | None = None
    error: ItemErrorOut | None = None


class ReplayManyOut(Schema):
    """Per-job results of a bulk replay; each job is its own transaction."""

    results: list[ReplayItemOut]


class PurgeOut(Schema):
    """A purged job."""

    job_id: str
    purged: bool


class PurgeItemOut(Schema):
    """One job of a bulk purge."""

    job_id: str
    ok: bool
    error: ItemErrorOut | None = None


class PurgeManyOut(Schema):
    """Per-job results of a bulk purge."""

    results: list[PurgeItemOut]


class HealthOut(Schema):
    """The API and its database answer."""

    ok: bool
    server_time_ms: int


class ProblemOut(Schema):
    """RFC 9457 problem details with Relay's error code."""

    type: str
    title: str
    status: int
    detail: str
    instance: str
    code: str
    retryable: bool
    details: dict[str, Any] | None = None
