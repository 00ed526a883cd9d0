"""Request and response bodies of the HTTP API, in the wire shapes of ``docs/protocol.md``.

Input bodies forbid unknown fields and take JSON types strictly (``"5"`` is not an integer,
``1`` is not ``true``), as the TCP op table does. Ranges (queue names, lease lengths, payload
size, ...) are the service's to check, so they are not repeated here. Instants are integer
epoch milliseconds (``*_at_ms``) with ISO 8601 twins (``*_at``) in job bodies.

Response bodies are not written here: each is built by ``out`` from the op result's
``TypedDict`` in ``queue_core.types`` (the one declaration of a result's shape), so a field
added there is in the HTTP API and its OpenAPI document too. Job bodies add the ISO twins.
"""

import datetime as dt
import types as pytypes
from collections.abc import Callable, Mapping
from typing import (
    Annotated,
    Any,
    Literal,
    NotRequired,
    TypedDict,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from ninja import Schema
from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    computed_field,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from queue_core import types, validation
from queue_core.conf import RelaySettings, relay_settings
from queue_core.errors import InvalidArgument
from queue_core.service import PRUNE_BATCH, PRUNE_LIMIT_MAX
from queue_core.states import class_name


def iso(ms: int | None) -> str | None:
    """Epoch ms as ISO 8601 UTC (``2026-01-01T00:00:00.000Z``), or None."""
    if ms is None:
        return None
    instant = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return instant.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _In(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _first_unknown_only(cls, data: Any) -> Any:
        """Keep the known fields and the first unknown one: pydantic reports that one, as
        TCP refuses a request at its first unknown argument. It reported every unknown field,
        each fault built as Python objects: 120,000 of them (960 KB) took 0.4-0.5 s and 185
        MB of the HTTP worker, and three such clients held a sentinel up 7 s (a review)."""
        if not isinstance(data, dict):
            return data
        known = cls.model_fields
        first = next((name for name in data if name not in known), None)
        if first is None:
            return data
        kept = {name: value for name, value in data.items() if name in known}
        kept[first] = data[first]
        return kept


def _count_of(kind: type, check: Callable[[Any, RelaySettings], None]) -> BeforeValidator:
    """Run TCP's length check of a list (or map) argument (``validation.batch_count``,
    ``queue_count``, ``meta_count``) on a value of its ``kind`` before any of its items is
    validated, its fault as a schema fault in its words; other values go on to the field's
    own checks.

    pydantic validates every item first and lists each one's fault: a hostile review's
    150,000 empty jobs (450 KB) took 2.3 s and answered 17 MB, and 350,000 lease queues
    held the event loop 2 s. TCP refuses both by their length at once.
    """

    def bounded(value: Any) -> Any:
        if isinstance(value, kind):
            try:
                check(value, relay_settings())
            except InvalidArgument as exc:  # "field: message"; pydantic adds the field
                message = exc.message.split(": ", 1)[-1]
                raise PydanticCustomError("too_long", message) from None
        return value

    return BeforeValidator(bounded)


_JOBS_COUNT = _count_of(list, validation.batch_count)
_QUEUES_COUNT = _count_of(list, validation.queue_count)
_META_COUNT = _count_of(dict, validation.meta_count)


# A class name as TCP takes it (``states.class_name``), then checked against the names.
PriorityIn = Annotated[
    Literal["low", "normal", "high", "critical"] | int | None, BeforeValidator(class_name)
]


# ---------------------------------------------------------------------- producers


class SubmitOptions(_In):
    """Options of one job; left out (or null) means the server's default."""

    payload: Any = Field(
        ..., description="Any JSON value except null, at most RELAY_MAX_PAYLOAD_BYTES encoded."
    )
    priority: PriorityIn = Field(
        None, description="low, normal (default), high, critical (any case); or 0-3."
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
    unique: Literal["window", "active"] | None = Field(
        None,
        description="window (default): the key stays bound for the window; active: it is "
        "also freed when the job succeeds, goes dead or is cancelled (needs idempotency_key).",
    )
    meta: Annotated[dict[str, str] | None, _META_COUNT] = Field(
        None,
        description="Small map of strings stored with the job and returned with its lease "
        "(RELAY_MAX_META_KEYS keys, RELAY_MAX_META_BYTES encoded), e.g. a traceparent.",
    )
    time_limit_ms: int | None = Field(
        None,
        description="The most one attempt may run, in ms from its lease (1..RELAY_MAX_DELAY_MS); "
        "default: the queue's RELAY_QUEUE_TIME_LIMITS entry, else none.",
    )


class SubmitIn(SubmitOptions):
    """``POST /queues/{queue}/jobs``: the queue is in the path."""


class BatchJobIn(SubmitOptions):
    """One job of a batch submit."""

    queue: str


class BatchIn(_In):
    """``POST /jobs/batch``: 1..RELAY_MAX_BATCH_SUBMIT jobs, all created or none."""

    # fail_fast (on every list of a body here): stop at the first bad item, reporting its
    # faults only, as TCP refuses a request at its first bad entry. pydantic went on through
    # every job: 1,000 jobs of 16 non-string meta values each made 16,000 faults, 72-307 ms
    # a request in a review; validating such a body now stops after one job's 16.
    jobs: Annotated[list[BatchJobIn], Field(fail_fast=True), _JOBS_COUNT]


# ---------------------------------------------------------------------- responses

_OUT: dict[Any, type[Schema]] = {}  # each TypedDict's response model, for nested fields

# OpenAPI descriptions of response fields, by field name, in whichever body they appear.
FIELD_DOCS = {
    "clock_skew_ms": "The server's clock minus the database's, in ms.",
    "max_leased": "Most jobs leased at once, all workers; null: none.",
    "rate_per_s": "Jobs started per second; null: no rate.",
    "burst": "Jobs that may start at once after a quiet spell.",
    "return_value": "The result sent with the ack; null when none was stored.",
    "errors": "Structured errors of failed attempts, oldest first (the newest that fit "
    "RELAY_MAX_RESULT_BYTES).",
    "history_omitted": "Older attempts and events left out.",
}
# Response fields that default when absent (the TypedDict may leave them out).
FIELD_DEFAULTS: dict[str, Any] = {"history_omitted": 0, "return_value": None}


def _swap(hint: Any) -> Any:
    """``hint`` with every TypedDict that has a response model replaced by that model."""
    if hint in _OUT:
        return _OUT[hint]
    origin, args = get_origin(hint), get_args(hint)
    if origin in (list, dict):
        return origin[tuple(_swap(arg) for arg in args)]
    if origin in (Union, pytypes.UnionType):
        return Union[tuple(_swap(arg) for arg in args)]  # noqa: UP007 - built at run time
    return hint


def out(
    typed: Any,
    name: str,
    *,
    base: type[Schema] = Schema,
    skip: frozenset[str] = frozenset(),
    hints: Mapping[str, Any] | None = None,
) -> type[Schema]:
    """The response model of a ``queue_core.types`` TypedDict: its keys as fields (keys
    marked ``NotRequired`` default to None, ``FIELD_DEFAULTS`` to theirs), described by
    ``FIELD_DOCS``, nested TypedDicts as their own models.

    Args:
        typed: the TypedDict.
        name: the model's name (OpenAPI's component name).
        base: a model with extra fields (the ISO twins of a job).
        skip: keys left out.
        hints: ``{key: type}`` for keys whose model is not the TypedDict's own (a job with
            its history).
    """
    hints = hints or {}
    fields: dict[str, Any] = {}
    for key, hint in get_type_hints(typed).items():
        if key in skip:
            continue
        required = key in typed.__required_keys__ and key not in FIELD_DEFAULTS
        default = ... if required else FIELD_DEFAULTS.get(key)
        fields[key] = (
            hints.get(key) or _swap(hint),
            Field(default, description=FIELD_DOCS.get(key)),
        )
    model = create_model(name, __base__=base, __module__=__name__, **fields)
    model.__doc__ = typed.__doc__
    _OUT.setdefault(typed, model)
    return model


def _iso_twin(ms_field: str) -> Any:
    """A computed field: ``ms_field`` (epoch ms) as ISO 8601, or None."""

    def twin(self: Schema) -> str | None:
        return iso(getattr(self, ms_field))

    twin.__doc__ = f"``{ms_field}`` as ISO 8601."
    return computed_field(property(twin))


class _JobTimes(Schema):
    """The ISO 8601 twins of a job's instants."""

    created_at_ms: int
    available_at_ms: int | None
    lease_expires_at_ms: int | None
    finished_at_ms: int | None

    created_at = _iso_twin("created_at_ms")
    available_at = _iso_twin("available_at_ms")
    lease_expires_at = _iso_twin("lease_expires_at_ms")
    finished_at = _iso_twin("finished_at_ms")


INSPECT_ONLY = frozenset({"history", "events", "history_omitted"})
RetryPolicyOut = out(types.RetryPolicy, "RetryPolicyOut")
AttemptOut = out(types.Attempt, "AttemptOut")
EventOut = out(types.JobEvent, "EventOut")
JobOut = out(types.Job, "JobOut", base=_JobTimes, skip=INSPECT_ONLY)
JobDetailOut = out(types.Job, "JobDetailOut", base=_JobTimes)
SubmitOut = out(types.SubmitResult, "SubmitOut")
BatchItemOut = out(types.BatchEntry, "BatchItemOut")
BatchOut = out(types.SubmitBatchResult, "BatchOut")
ServerOut = out(types.Server, "ServerOut")
QueueStatsOut = out(types.QueueStats, "QueueStatsOut")
TotalsOut = out(types.Totals, "TotalsOut")
QueueControlsOut = out(types.QueueControls, "QueueControlsOut")
QueueControlsListOut = out(types.QueueControlsResult, "QueueControlsListOut")
StatsOut = out(types.StatsResult, "StatsOut")
JobPageOut = out(types.DeadListResult, "JobPageOut")
LeaseOut = out(types.Lease, "LeaseOut")
LeasesOut = out(types.LeaseResult, "LeasesOut")
RenewOut = out(types.RenewResult, "RenewOut")
AckOut = out(types.AckResult, "AckOut")
FailOut = out(types.FailResult, "FailOut")
AckErrorOut = out(types.AckError, "AckErrorOut")
AckBatchItemOut = out(types.AckBatchEntry, "AckBatchItemOut")
AckBatchOut = out(types.AckBatchResult, "AckBatchOut")
RenewBatchOut = out(types.RenewBatchResult, "RenewBatchOut")
ReleaseOut = out(types.ReleaseResult, "ReleaseOut")
PurgeOut = out(types.DeadPurgeResult, "PurgeOut")
PruneOut = out(types.PruneResult, "PruneOut")
ErrorEntryOut = out(types.ErrorEntry, "ErrorEntryOut")
ResultOut = out(types.ResultResult, "ResultOut", hints={"job": JobDetailOut})
CancelOut = out(types.CancelResult, "CancelOut")


class QueueLimitsIn(_In):
    """New limits; a field left out (or null) keeps its value, 0 removes a cap or rate."""

    max_leased: int | None = Field(None, description="0..1000000 jobs leased at once; 0: no cap.")
    rate_per_s: float | None = Field(
        None, description="Jobs started per second, 0.0001..1000000; 0: no rate."
    )
    burst: int | None = Field(None, description="1..1000000 jobs that may start at once.")


# ---------------------------------------------------------------------- workers


class LeaseIn(_In):
    """``POST /leases``: lease up to ``max_jobs`` ready jobs, waiting up to ``wait_ms``."""

    queues: Annotated[list[str], Field(fail_fast=True), _QUEUES_COUNT] = Field(
        ..., description="1..RELAY_MAX_QUEUES_PER_LEASE queue names."
    )
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


class LeaseIdsIn(_In):
    """The lease being acted on: the worker id it was leased with and its token."""

    worker_id: str
    lease_token: str


class LeaseNextIn(_In):
    """``lease_next`` of an ack or fail: also lease up to ``max_jobs`` ready jobs in the same
    commit, without waiting; the reply's ``next`` lists them."""

    queues: Annotated[list[str], Field(fail_fast=True), _QUEUES_COUNT] = Field(
        ..., description="1..RELAY_MAX_QUEUES_PER_LEASE queue names."
    )
    max_jobs: int | None = Field(None, description="1..100 (default 1).")
    lease_ms: int | None = Field(None, description="Lease length in ms (the visibility timeout).")
    worker_id: str | None = Field(None, description="Default: the ack's worker id.")


_LEASE_NEXT = Field(
    None, description="Lease the next jobs in the same commit; the reply's next lists them."
)


class AckIn(LeaseIdsIn):
    """``POST /jobs/{job_id}/ack`` body."""

    result: Any = Field(
        None,
        description="The handler's result, any JSON value of at most RELAY_MAX_RESULT_BYTES "
        "(64 KiB) as compact JSON, stored with the job (GET /jobs/{job_id}/result); null or "
        "absent stores nothing.",
    )
    lease_next: LeaseNextIn | None = _LEASE_NEXT


class AckItemIn(LeaseIdsIn):
    """One ack of ``POST /acks`` (``ack``'s arguments)."""

    job_id: str
    result: Any = Field(None, description="As the ack's result.")


class AckBatchIn(_In):
    """``POST /acks``: several acks (1..100) in one commit, each fenced by its own token."""

    acks: list[AckItemIn] = Field(..., min_length=1, max_length=100, fail_fast=True)
    lease_next: LeaseNextIn | None = _LEASE_NEXT


class RenewIn(LeaseIdsIn):
    """``POST /jobs/{id}/renew``."""

    lease_ms: int | None = None


class RenewItemIn(RenewIn):
    """One renew of ``POST /renewals`` (``renew``'s arguments)."""

    job_id: str


class RenewBatchIn(_In):
    """``POST /renewals``: several renews (1..100) in one commit, each fenced by its own
    token."""

    renews: list[RenewItemIn] = Field(..., min_length=1, max_length=100, fail_fast=True)


class FailIn(LeaseIdsIn):
    """``POST /jobs/{id}/fail``."""

    error: str
    retryable: bool | None = Field(None, description="false dead-letters the job at once.")
    exception_class: str | None = Field(
        None,
        description="The exception's class path (module.QualName, 1..255 characters); given, "
        "the error joins the job's stored errors.",
    )
    traceback: str | None = Field(
        None, description="Its traceback, at most RELAY_MAX_RESULT_BYTES UTF-8 bytes."
    )
    lease_next: LeaseNextIn | None = _LEASE_NEXT


# ---------------------------------------------------------------------- operators


class JobIdsIn(_In):
    """Several job ids (1..1000)."""

    job_ids: list[str] = Field(..., min_length=1, max_length=1000, fail_fast=True)


class ItemError(TypedDict):
    """Why one item of a bulk request was refused."""

    code: str
    message: str


class ReplayItem(TypedDict):
    """One job of a bulk replay."""

    job_id: str
    ok: bool
    job: NotRequired[types.Job | None]
    error: NotRequired[ItemError | None]


class ReplayMany(TypedDict):
    """Per-job results of a bulk replay; each job is its own transaction."""

    results: list[ReplayItem]


class PurgeItem(TypedDict):
    """One job of a bulk purge."""

    job_id: str
    ok: bool
    error: NotRequired[ItemError | None]


class PurgeMany(TypedDict):
    """Per-job results of a bulk purge."""

    results: list[PurgeItem]


# The bulk bodies are the HTTP API's own (TCP has no bulk replay or purge).
ItemErrorOut = out(ItemError, "ItemErrorOut")
ReplayItemOut = out(ReplayItem, "ReplayItemOut")
ReplayManyOut = out(ReplayMany, "ReplayManyOut")
PurgeItemOut = out(PurgeItem, "PurgeItemOut")
PurgeManyOut = out(PurgeMany, "PurgeManyOut")


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


# ---------------------------------------------------------------------- maintenance


class PruneIn(_In):
    """``POST /prune``: one bounded batch of retention, on demand."""

    older_than_ms: int = Field(..., ge=1, description="Finished more than this long ago (ms).")
    state: Literal["succeeded", "dead", "cancelled", "all"] = "all"
    limit: int = Field(
        PRUNE_BATCH, ge=1, le=PRUNE_LIMIT_MAX, description="The most jobs this call deletes."
    )
