"""Relay's tables: jobs, the per-attempt history, an append-only event log, and the registry of
running servers.

No transition methods live here: ``queue_core.service`` changes job state, through the named
SQL of its storage driver (``queue_core.storage``). The ORM is for migrations, the admin and
read-only listings. Instants are integer epoch milliseconds (``*_at_ms``), exact to compare and
free of time zones.
"""

from __future__ import annotations

import functools
import operator

from django.db import models
from django.db.models import Q

from queue_core.states import JobState, Priority

STATE_CHOICES = [(s.value, s.name) for s in JobState]
PRIORITY_CHOICES = [(p.value, p.name.lower()) for p in Priority]
# ``relay_job_state_known``: the state is one of JobState's.
STATE_KNOWN = functools.reduce(operator.or_, (Q(state=s.value) for s in JobState))


class Job(models.Model):
    """One unit of work and its current lease, retry policy and outcome.

    ``attempt`` counts deliveries (claims) and never decreases: it is the fencing epoch a
    handler may hand to its own storage (an OS crash or power loss may take back the latest
    leases, and with them their attempts, unless ``RELAY_DURABLE_LEASES``:
    docs/design-decisions.md). ``failures`` counts failed attempts (fail and lease expiry)
    against ``max_retries``; replay resets it.
    """

    id = models.CharField(primary_key=True, max_length=40)
    queue = models.CharField(max_length=128)
    state = models.CharField(max_length=16, choices=STATE_CHOICES)
    priority = models.SmallIntegerField(choices=PRIORITY_CHOICES, default=Priority.NORMAL)
    payload = models.TextField(help_text="Canonical JSON (sorted keys, compact).")
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    idempotency_expires_at_ms = models.BigIntegerField(null=True, blank=True)
    # "active": the key is freed when the job reaches a terminal state; NULL: "window" (the
    # key stays bound for RELAY_IDEMPOTENCY_WINDOW_MS whatever the state).
    unique_scope = models.CharField(max_length=8, null=True, blank=True)
    meta = models.TextField(null=True, blank=True, help_text="Canonical JSON object of strings.")
    attempt = models.IntegerField(default=0)
    failures = models.IntegerField(default=0)
    max_retries = models.IntegerField()
    backoff = models.CharField(max_length=16)
    backoff_base_ms = models.BigIntegerField()
    backoff_cap_ms = models.BigIntegerField()
    jitter = models.BooleanField()
    created_at_ms = models.BigIntegerField()
    available_at_ms = models.BigIntegerField(null=True, blank=True)
    ready_since_ms = models.BigIntegerField(null=True, blank=True)
    lease_token = models.CharField(max_length=64, null=True, blank=True)
    leased_by = models.CharField(max_length=128, null=True, blank=True)
    leased_at_ms = models.BigIntegerField(null=True, blank=True)
    lease_expires_at_ms = models.BigIntegerField(null=True, blank=True)
    finished_at_ms = models.BigIntegerField(null=True, blank=True)
    updated_at_ms = models.BigIntegerField()
    last_error = models.TextField(null=True, blank=True)
    dead_reason = models.TextField(null=True, blank=True)
    # Cancel (issue 16, item 3): when a cancel was asked for. A LEASED job with it set has its
    # worker told to stop at the next renew; a CANCELLED job keeps it (when it was cancelled).
    cancel_requested_at_ms = models.BigIntegerField(null=True, blank=True)
    # Time limit (issue 16, item 4): the most one attempt may run, in ms from its lease; NULL
    # for none. The effective limit (the job's own, or its queue's RELAY_QUEUE_TIME_LIMITS
    # default) is stored at submit.
    time_limit_ms = models.BigIntegerField(null=True, blank=True)

    class Meta:
        db_table = "relay_job"
        indexes = [
            # The claim: one seek per (queue, base class) to the oldest ready job.
            models.Index(
                fields=["queue", "priority", "ready_since_ms", "id"],
                name="relay_job_ready",
                condition=Q(state="ready"),
            ),
            models.Index(
                fields=["available_at_ms"],
                name="relay_job_scheduled",
                condition=Q(state__in=["pending", "retrying"]),
            ),
            models.Index(
                fields=["lease_expires_at_ms"],
                name="relay_job_leased",
                condition=Q(state="leased"),
            ),
            models.Index(fields=["id"], name="relay_job_dead", condition=Q(state="dead")),
            models.Index(fields=["queue", "state", "id"], name="relay_job_queue_state"),
            # The console's job list of one queue, newest first: a seek, not a sort of the
            # queue (migration 0015; queue and id never change, so only inserts and deletes
            # maintain it).
            models.Index(fields=["queue", "id"], name="relay_job_queue_id"),
            # Retention: the oldest finished jobs of each state, found without a scan.
            models.Index(
                fields=["finished_at_ms"],
                name="relay_job_succeeded_done",
                condition=Q(state="succeeded"),
            ),
            models.Index(
                fields=["finished_at_ms"], name="relay_job_dead_done", condition=Q(state="dead")
            ),
            models.Index(
                fields=["finished_at_ms"],
                name="relay_job_cancelled_done",
                condition=Q(state="cancelled"),
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["queue", "idempotency_key"],
                name="relay_job_idempotency_key",
                condition=Q(idempotency_key__isnull=False),
            ),
            # One equality per state, ORed, not ``state IN (...)``: SQLite checks a constant
            # IN list of more than two values by building a temporary index of it on every
            # INSERT and UPDATE of a row: about a sixth of a claim's statement and a fifth of
            # an ack's, in instructions (migration 0017).
            models.CheckConstraint(condition=STATE_KNOWN, name="relay_job_state_known"),
            models.CheckConstraint(
                condition=Q(priority__gte=0, priority__lte=3), name="relay_job_priority_range"
            ),
            # A live lease has all three fields; no other state has any of them.
            models.CheckConstraint(
                condition=(
                    Q(
                        state="leased",
                        lease_token__isnull=False,
                        leased_by__isnull=False,
                        lease_expires_at_ms__isnull=False,
                    )
                    | (
                        ~Q(state="leased")
                        & Q(
                            lease_token__isnull=True,
                            leased_by__isnull=True,
                            lease_expires_at_ms__isnull=True,
                        )
                    )
                ),
                name="relay_job_lease_iff_leased",
            ),
            models.CheckConstraint(
                condition=(
                    Q(state__in=["pending", "retrying"], available_at_ms__isnull=False)
                    | (~Q(state__in=["pending", "retrying"]) & Q(available_at_ms__isnull=True))
                ),
                name="relay_job_scheduled_iff_due_time",
            ),
            models.CheckConstraint(
                condition=Q(attempt__gte=0, failures__gte=0, max_retries__gte=0),
                name="relay_job_counters_nonnegative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.id} ({self.queue}, {self.state})"


class JobAttempt(models.Model):
    """One delivery of a job: who held it, from when to when, and how it ended."""

    # No index of its own: relay_attempt_unique's (job, attempt) serves every read by job
    # (migration 0014).
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts", db_index=False)
    attempt = models.IntegerField()
    worker_id = models.CharField(max_length=128)
    lease_token = models.CharField(max_length=64)
    started_at_ms = models.BigIntegerField()
    ended_at_ms = models.BigIntegerField(null=True, blank=True)
    # succeeded | failed | lease_expired | released | recovered | cancelled | timeout; NULL
    # while running.
    outcome = models.CharField(max_length=16, null=True, blank=True)
    error = models.TextField(null=True, blank=True)
    # A failed attempt's decision: when the retry was due, or NULL when it dead-lettered the job.
    retry_at_ms = models.BigIntegerField(null=True, blank=True)

    class Meta:
        db_table = "relay_attempt"
        indexes = [
            # The console's recent failures, newest first (migrations 0003, 0015); partial, so
            # acks and successful attempts never touch it.
            models.Index(
                fields=["ended_at_ms"],
                name="relay_attempt_failed",
                condition=Q(outcome="failed"),
            ),
        ]
        constraints = [
            models.UniqueConstraint(fields=["job", "attempt"], name="relay_attempt_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.job_id}#{self.attempt}"


class JobResult(models.Model):
    """What the worker reported about a job beyond its state: the result it sent with its ack,
    and the structured errors (exception class, traceback) it sent with its fails.

    Written only by ``QueueService.ack`` / ``QueueService.fail`` in the transaction that ends
    the attempt, read by the ``result`` op (``QueueService.result``), deleted with the job
    (purge and retention prune). One row per job, created by the first ack or fail that
    carries something; a job whose worker sent nothing has none. After Celery's result
    backend (``celery_taskmeta``: result, traceback) and django-tasks' ``DBTaskResult``
    (return value, per-attempt ``TaskError``s), but stored by the queue service itself.
    """

    job = models.OneToOneField(
        Job,
        primary_key=True,
        on_delete=models.CASCADE,
        related_name="result",
        db_column="job_id",
    )
    return_value = models.TextField(
        null=True,
        blank=True,
        help_text="The result sent with the ack, as canonical JSON text; NULL when none was.",
    )
    errors = models.TextField(
        help_text='JSON list of {"attempt", "exception_class", "traceback"}, oldest first: '
        "the newest that fit RELAY_MAX_RESULT_BYTES."
    )
    updated_at_ms = models.BigIntegerField(help_text="When the row was last written, epoch ms.")

    class Meta:
        db_table = "relay_result"

    def __str__(self) -> str:
        return f"result of {self.job_id}"


class JobEvent(models.Model):
    """Append-only record of transitions outside a delivery (replay, purge, recovery, cancel).

    ``job_id`` is plain text, not a foreign key, so a purge record outlives the job.
    """

    job_id = models.CharField(max_length=40)
    event = models.CharField(max_length=32)
    from_state = models.CharField(max_length=16, null=True, blank=True)
    to_state = models.CharField(max_length=16, null=True, blank=True)
    at_ms = models.BigIntegerField()
    actor = models.CharField(max_length=150, null=True, blank=True)
    detail = models.TextField(null=True, blank=True)

    class Meta:
        db_table = "relay_event"
        indexes = [models.Index(fields=["job_id", "id"], name="relay_event_job")]

    def __str__(self) -> str:
        return f"{self.job_id} {self.event}"


class RelayServer(models.Model):
    """A running ``relay server`` process, kept by its heartbeat (``QueueService.heartbeat``).

    Several servers may serve one PostgreSQL database; each inserts its row at start, renews
    ``seen_at_ms`` every ``RELAY_SERVER_HEARTBEAT_MS`` and deletes it when it stops cleanly.
    A server is live while seen within three heartbeats; rows of servers that died are
    deleted by the others' heartbeats an hour after they were last seen. A registry only:
    leases belong to workers, never to a server.
    """

    id = models.CharField(primary_key=True, max_length=40)
    address = models.CharField(max_length=300)
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    started_at_ms = models.BigIntegerField()
    seen_at_ms = models.BigIntegerField()
    clock_skew_ms = models.BigIntegerField(
        default=0, help_text="This server's clock minus the database's, in ms."
    )

    class Meta:
        db_table = "relay_server"
        ordering = ["started_at_ms"]

    def __str__(self) -> str:
        return f"{self.address} ({self.host} pid {self.pid})"


class DeadLetter(Job):
    """DEAD jobs only, for their own admin list."""

    class Meta:
        proxy = True
        verbose_name = "dead letter"
        permissions = [
            ("replay_job", "Can replay dead-lettered jobs"),
            ("purge_job", "Can purge terminal jobs"),
            ("cancel_job", "Can cancel jobs"),
        ]


class ApiKey(models.Model):
    """An API key for the HTTP API and the TCP protocol; only a hash of its secret is kept.

    A key reads ``rk_<prefix>_<secret>``. ``prefix`` (12 hex characters) finds the row and is
    safe to show and log; ``secret_sha256`` is the SHA-256 of the whole key (the secret has 256
    random bits, so a fast hash is enough: there is nothing to brute-force). ``scopes`` is a
    comma-separated, sorted subset of ``producer``, ``worker``, ``operator``. Keys are made,
    checked and revoked by ``queue_core.auth``; the admin and ``relay_keys`` call it.
    """

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_sha256 = models.CharField(max_length=64)
    scopes = models.CharField(max_length=64)
    created_at_ms = models.BigIntegerField()
    revoked_at_ms = models.BigIntegerField(null=True, blank=True)
    last_used_at_ms = models.BigIntegerField(null=True, blank=True)

    class Meta:
        db_table = "relay_api_key"
        verbose_name = "API key"
        ordering = ["-created_at_ms"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix})"

    @property
    def scope_list(self) -> list[str]:
        """The scopes as a list."""
        return [s for s in self.scopes.split(",") if s]

    @property
    def is_active(self) -> bool:
        """Whether the key is not revoked."""
        return self.revoked_at_ms is None


class QueueSettings(models.Model):
    """An operator's controls on one queue: paused, a cap on leased jobs, a start rate.

    A row exists only while some control differs from the default (running, no cap, no
    rate): ``QueueService.resume`` and clearing the limits delete it, so a claim on a queue
    nobody controls finds no row to read or lock. Written only by ``QueueService.pause``,
    ``resume`` and ``set_queue_limits``; read by every claim that names the queue.

    The token bucket (``tokens`` at ``tokens_at_ms``) refills at ``rate_per_s`` up to
    ``burst``; each job a claim starts takes one token (Sidekiq Enterprise's bucket limiter,
    Oban Pro's ``rate_limit``). ``max_leased`` holds across every server and worker, where
    Oban's queue ``limit`` and River's ``MaxWorkers`` bound one node's concurrency. The
    table is River's ``river_queue`` (a paused queue stays paused across restarts) plus
    the limits.
    """

    name = models.CharField(primary_key=True, max_length=128)
    paused = models.BooleanField(default=False)
    max_leased = models.IntegerField(
        null=True, blank=True, help_text="Most jobs leased at once, all workers; null: no cap."
    )
    rate_per_s = models.FloatField(
        null=True, blank=True, help_text="Jobs started per second (token bucket); null: no rate."
    )
    burst = models.IntegerField(default=1, help_text="Tokens the bucket holds at most.")
    tokens = models.FloatField(default=0.0)
    tokens_at_ms = models.BigIntegerField(default=0)
    updated_at_ms = models.BigIntegerField()
    updated_by = models.CharField(max_length=150, null=True, blank=True)

    class Meta:
        db_table = "relay_queue"
        verbose_name = "queue settings"
        verbose_name_plural = "queue settings"
        permissions = [
            ("pause_queue", "Can pause and resume queues"),
            ("limit_queue", "Can set queue limits"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(max_leased__isnull=True) | Q(max_leased__gte=1),
                name="relay_queue_max_leased_positive",
            ),
            models.CheckConstraint(
                condition=Q(rate_per_s__isnull=True) | Q(rate_per_s__gt=0),
                name="relay_queue_rate_positive",
            ),
            models.CheckConstraint(condition=Q(burst__gte=1), name="relay_queue_burst_positive"),
        ]

    def __str__(self) -> str:
        return self.name
