-- Every statement the SQLite driver runs, one named block each (after procrastinate's
-- queries.sql); ../postgresql/queries.sql has the same names where the work is the same.
-- Parameters use Django's %(name)s style. Instants are epoch ms passed in as parameters:
-- SQL never reads the database clock. {job_columns} stands for queue_core.jobs.JOB_COLUMNS
-- (the columns job_view reads), put in by storage.base.load_queries.

-- name: insert_job
-- Create a job. Params: every column below.
INSERT INTO relay_job (
    id, queue, state, priority, payload, idempotency_key, idempotency_expires_at_ms,
    attempt, failures, max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter,
    created_at_ms, available_at_ms, ready_since_ms, updated_at_ms, unique_scope, meta,
    time_limit_ms)
VALUES (
    %(id)s, %(queue)s, %(state)s, %(priority)s, %(payload)s, %(idempotency_key)s,
    %(idempotency_expires_at_ms)s, 0, 0, %(max_retries)s, %(backoff)s, %(backoff_base_ms)s,
    %(backoff_cap_ms)s, %(jitter)s, %(now_ms)s, %(available_at_ms)s, %(ready_since_ms)s,
    %(now_ms)s, %(unique_scope)s, %(meta)s, %(time_limit_ms)s);

-- name: insert_job_keyed
-- Create a job that has an idempotency key, unless another transaction bound the key first
-- (then no row comes back and the caller reads the job that holds it). Params: as insert_job.
INSERT INTO relay_job (
    id, queue, state, priority, payload, idempotency_key, idempotency_expires_at_ms,
    attempt, failures, max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter,
    created_at_ms, available_at_ms, ready_since_ms, updated_at_ms, unique_scope, meta,
    time_limit_ms)
VALUES (
    %(id)s, %(queue)s, %(state)s, %(priority)s, %(payload)s, %(idempotency_key)s,
    %(idempotency_expires_at_ms)s, 0, 0, %(max_retries)s, %(backoff)s, %(backoff_base_ms)s,
    %(backoff_cap_ms)s, %(jitter)s, %(now_ms)s, %(available_at_ms)s, %(ready_since_ms)s,
    %(now_ms)s, %(unique_scope)s, %(meta)s, %(time_limit_ms)s)
ON CONFLICT (queue, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id;

-- name: find_idempotent
-- The job an idempotency key is bound to in a queue. Params: queue, key.
SELECT id, payload, idempotency_expires_at_ms
  FROM relay_job
 WHERE queue = %(queue)s AND idempotency_key = %(key)s;

-- name: unbind_idempotency_key
-- Free a key whose window has passed, so a new job may take it. Params: job_id, now_ms.
UPDATE relay_job
   SET idempotency_key = NULL, idempotency_expires_at_ms = NULL
 WHERE id = %(job_id)s AND idempotency_expires_at_ms <= %(now_ms)s;

-- name: release_unique_key
-- Free the idempotency key of a job submitted with unique: "active" that has just reached a
-- terminal state (QueueService, in the transaction of that change), so a new submit with the
-- key makes a new job (Sidekiq Enterprise's unique_until: :success, Solid Queue's concurrency
-- keys). Params: job_id.
UPDATE relay_job
   SET idempotency_key = NULL, idempotency_expires_at_ms = NULL
 WHERE id = %(job_id)s AND unique_scope = 'active';

-- name: get_job
-- One job with every column the views show. Params: job_id.
SELECT {job_columns}
  FROM relay_job
 WHERE id = %(job_id)s;

-- name: attempts_of
-- The newest deliveries of a job, newest first. Params: job_id, limit.
SELECT attempt, worker_id, started_at_ms, ended_at_ms, outcome, error
  FROM relay_attempt
 WHERE job_id = %(job_id)s
 ORDER BY attempt DESC LIMIT %(limit)s;

-- name: attempts_count
-- How many deliveries a job has had (when attempts_of could not return them all). Params: job_id.
SELECT COUNT(*) AS n FROM relay_attempt WHERE job_id = %(job_id)s;

-- name: events_of
-- The newest operator and recovery events of a job, newest first. Params: job_id, limit.
SELECT event, from_state, to_state, at_ms, actor, detail
  FROM relay_event
 WHERE job_id = %(job_id)s
 ORDER BY id DESC LIMIT %(limit)s;

-- name: events_count
-- How many events a job has (when events_of could not return them all). Params: job_id.
SELECT COUNT(*) AS n FROM relay_event WHERE job_id = %(job_id)s;

-- name: promote_due
-- PENDING/RETRYING jobs whose time has come become READY; aging counts from the due time.
-- Bounded so one sweep never holds the write lock for long. Params: now_ms, limit.
UPDATE relay_job
   SET state = 'ready', ready_since_ms = available_at_ms, available_at_ms = NULL,
       updated_at_ms = %(now_ms)s
 WHERE id IN (SELECT id FROM relay_job
               WHERE state IN ('pending', 'retrying') AND available_at_ms <= %(now_ms)s
               ORDER BY available_at_ms
               LIMIT %(limit)s)
   AND state IN ('pending', 'retrying')
RETURNING queue;

-- name: sweep_probe
-- Whether a sweep has anything to do, in one statement (every group commit that claims sweeps
-- first; usually nothing is due). Each EXISTS is one seek on a partial index (relay_job_leased,
-- relay_job_scheduled); expired_leases narrows "expired" further after a clock step.
-- Params: now_ms.
SELECT EXISTS (SELECT 1 FROM relay_job
                WHERE state = 'leased' AND lease_expires_at_ms <= %(now_ms)s) AS expired,
       EXISTS (SELECT 1 FROM relay_job
                WHERE state IN ('pending', 'retrying') AND available_at_ms <= %(now_ms)s) AS due;

-- name: expired_leases
-- Leases whose expiry has passed, oldest first. After a forward step of the wall clock, a
-- lease whose expiry was set at or before mark_ms (by the old clock) is judged by judge_ms,
-- the old time (queue_core.clock.StepGuard); mark_ms is -1 and judge_ms = now_ms otherwise.
-- A lease past its attempt's time limit is expired with reason 'timeout', and one whose
-- cancel was requested ends CANCELLED (the service decides from the columns returned).
-- Params: now_ms, judge_ms, mark_ms, limit.
SELECT id, queue, attempt, failures, max_retries, unique_scope, lease_expires_at_ms,
       leased_at_ms, time_limit_ms, cancel_requested_at_ms
  FROM relay_job
 WHERE state = 'leased' AND lease_expires_at_ms <= %(now_ms)s
   AND (lease_expires_at_ms <= %(judge_ms)s OR updated_at_ms > %(mark_ms)s)
 ORDER BY lease_expires_at_ms
 LIMIT %(limit)s;

-- name: expire_to_ready
-- A lost lease returns the job to READY and counts a failure; aging counts from the expiry.
-- Params: job_id, attempt, now_ms, reason ('lease expired', or 'timeout' past the time limit).
UPDATE relay_job
   SET state = 'ready', failures = failures + 1, ready_since_ms = lease_expires_at_ms,
       last_error = %(reason)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = 'leased' AND attempt = %(attempt)s;

-- name: expire_to_dead
-- A lost lease with no retry budget left dead-letters the job. Params: job_id, attempt,
-- now_ms, reason (as expire_to_ready).
UPDATE relay_job
   SET state = 'dead', failures = failures + 1, last_error = %(reason)s,
       dead_reason = %(reason)s, finished_at_ms = %(now_ms)s, lease_token = NULL,
       leased_by = NULL, lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = 'leased' AND attempt = %(attempt)s;

-- name: expire_to_cancelled
-- A lost lease of a job whose cancel was requested: the job is cancelled, not retried. As
-- every lost lease, it counts a failed attempt. Params: job_id, attempt, now_ms, reason.
UPDATE relay_job
   SET state = 'cancelled', failures = failures + 1, last_error = %(reason)s,
       finished_at_ms = %(now_ms)s, lease_token = NULL,
       leased_by = NULL, lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = 'leased' AND attempt = %(attempt)s;

-- name: ready_heads
-- The oldest READY jobs of each base class in one queue: within a class the oldest job has
-- the highest aged priority, so the best job overall is among these heads. One index seek per
-- class on relay_job_ready, whatever the backlog. Params: queue, limit.
SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                WHERE state = 'ready' AND queue = %(queue)s AND priority = 3
                ORDER BY ready_since_ms, id LIMIT %(limit)s)
UNION ALL
SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                WHERE state = 'ready' AND queue = %(queue)s AND priority = 2
                ORDER BY ready_since_ms, id LIMIT %(limit)s)
UNION ALL
SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                WHERE state = 'ready' AND queue = %(queue)s AND priority = 1
                ORDER BY ready_since_ms, id LIMIT %(limit)s)
UNION ALL
SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                WHERE state = 'ready' AND queue = %(queue)s AND priority = 0
                ORDER BY ready_since_ms, id LIMIT %(limit)s);

-- name: claim_by_id
-- Lease one chosen READY job (the driver's claim ranks ready_heads, then leases by id).
-- Params: job_id, token, worker_id, now_ms, expires_ms.
UPDATE relay_job
   SET state = 'leased', attempt = attempt + 1, lease_token = %(token)s,
       leased_by = %(worker_id)s, leased_at_ms = %(now_ms)s,
       lease_expires_at_ms = %(expires_ms)s, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = 'ready'
RETURNING id, queue, payload, attempt, priority, failures, max_retries, created_at_ms, meta,
          time_limit_ms;

-- name: claim_one
-- The claim of one job from one queue (a lease of max_jobs 1 on one queue, the common case)
-- in one statement, where ready_heads then claim_by_id take two and a ranking in Python: the
-- same heads (one seek each on relay_job_ready), ranked as the driver's claim ranks them (aged
-- class: base + one per whole minute waited, capped at CRITICAL = 3; then FIFO; then id) and
-- leased by id, unless the queue has controls (a relay_queue row: the claim_unless_controlled
-- check, one primary-key seek, inside). As postgresql/queries.sql's claim_one.
-- Params: queue, token, worker_id, now_ms, expires_ms.
UPDATE relay_job
   SET state = 'leased', attempt = attempt + 1, lease_token = %(token)s,
       leased_by = %(worker_id)s, leased_at_ms = %(now_ms)s,
       lease_expires_at_ms = %(expires_ms)s, updated_at_ms = %(now_ms)s
 WHERE id = (SELECT id FROM (
                 SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                                 WHERE state = 'ready' AND queue = %(queue)s AND priority = 3
                                 ORDER BY ready_since_ms, id LIMIT 1)
                 UNION ALL
                 SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                                 WHERE state = 'ready' AND queue = %(queue)s AND priority = 2
                                 ORDER BY ready_since_ms, id LIMIT 1)
                 UNION ALL
                 SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                                 WHERE state = 'ready' AND queue = %(queue)s AND priority = 1
                                 ORDER BY ready_since_ms, id LIMIT 1)
                 UNION ALL
                 SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                                 WHERE state = 'ready' AND queue = %(queue)s AND priority = 0
                                 ORDER BY ready_since_ms, id LIMIT 1))
              ORDER BY MIN(3, priority + MAX(0, %(now_ms)s - ready_since_ms) / 60000) DESC,
                       ready_since_ms, id
              LIMIT 1)
   AND state = 'ready'
   AND NOT EXISTS (SELECT 1 FROM relay_queue WHERE name = %(queue)s)
RETURNING id, queue, payload, attempt, priority, failures, max_retries, created_at_ms, meta,
          time_limit_ms;

-- name: claim_many
-- The claim of several jobs from one queue (a lease or lease_next of max_jobs > 1 on one queue:
-- relay worker's when its acks free several slots) in one statement, where ready_heads then
-- claim_by_id take one per job and a ranking in Python: the same heads (one seek each on
-- relay_job_ready, at most limit per class), ranked as the driver's claim ranks them (aged
-- class, then FIFO, then id), and leased while their payloads and metas (+ 1024 bytes each)
-- fit the reply, as _claim_if_fits measures (the first always does), unless the queue has
-- controls. Each job takes the token at its rank in tokens; RETURNING cannot name the rank,
-- so the driver orders the rows by their tokens. As postgresql/queries.sql's claim.
-- Params: queue, limit, tokens (a JSON array of limit tokens), room, worker_id, now_ms,
-- expires_ms.
WITH heads AS (
    SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                    WHERE state = 'ready' AND queue = %(queue)s AND priority = 3
                    ORDER BY ready_since_ms, id LIMIT %(limit)s)
    UNION ALL
    SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                    WHERE state = 'ready' AND queue = %(queue)s AND priority = 2
                    ORDER BY ready_since_ms, id LIMIT %(limit)s)
    UNION ALL
    SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                    WHERE state = 'ready' AND queue = %(queue)s AND priority = 1
                    ORDER BY ready_since_ms, id LIMIT %(limit)s)
    UNION ALL
    SELECT * FROM (SELECT id, priority, ready_since_ms FROM relay_job
                    WHERE state = 'ready' AND queue = %(queue)s AND priority = 0
                    ORDER BY ready_since_ms, id LIMIT %(limit)s)
), ranked AS (
    SELECT h.id,
           row_number() OVER w AS n,
           sum(length(CAST(j.payload AS BLOB)) + COALESCE(length(CAST(j.meta AS BLOB)), 0)
               + 1024) OVER w AS bytes
      FROM heads AS h JOIN relay_job AS j ON j.id = h.id
    WINDOW w AS (ORDER BY MIN(3, h.priority + MAX(0, %(now_ms)s - h.ready_since_ms) / 60000) DESC,
                          h.ready_since_ms, h.id)
)
UPDATE relay_job
   SET state = 'leased', attempt = attempt + 1, lease_token = t.value,
       leased_by = %(worker_id)s, leased_at_ms = %(now_ms)s,
       lease_expires_at_ms = %(expires_ms)s, updated_at_ms = %(now_ms)s
  FROM ranked AS r JOIN json_each(%(tokens)s) AS t ON t.key = r.n - 1
 WHERE relay_job.id = r.id AND relay_job.state = 'ready'
   AND r.n <= %(limit)s AND (r.n = 1 OR r.bytes <= %(room)s)
   AND NOT EXISTS (SELECT 1 FROM relay_queue WHERE name = %(queue)s)
RETURNING id, queue, payload, attempt, priority, failures, max_retries, created_at_ms, meta,
          time_limit_ms, lease_token;

-- name: insert_attempt
-- Open the history row of a delivery. Params: job_id, attempt, worker_id, token, now_ms.
INSERT INTO relay_attempt (job_id, attempt, worker_id, lease_token, started_at_ms)
VALUES (%(job_id)s, %(attempt)s, %(worker_id)s, %(token)s, %(now_ms)s);

-- name: end_attempt
-- Close the history row of a delivery. Params: job_id, attempt, now_ms, outcome, error,
-- retry_at_ms (a failure's retry time, NULL otherwise).
UPDATE relay_attempt
   SET ended_at_ms = %(now_ms)s, outcome = %(outcome)s, error = %(error)s,
       retry_at_ms = %(retry_at_ms)s
 WHERE job_id = %(job_id)s AND attempt = %(attempt)s AND ended_at_ms IS NULL;

-- name: live_lease
-- The lease a renew/ack/fail/release names, if it is the current, unexpired one (the
-- compare-and-set guard, as River guards in the WHERE clause).
-- Params: job_id, lease_token, worker_id, now_ms, judge_ms, mark_ms (as expired_leases).
SELECT queue, attempt, failures, max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter,
       unique_scope, leased_at_ms, time_limit_ms, cancel_requested_at_ms
  FROM relay_job
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s
   AND leased_by = %(worker_id)s
   AND (lease_expires_at_ms > %(now_ms)s
        OR (updated_at_ms <= %(mark_ms)s AND lease_expires_at_ms > %(judge_ms)s));

-- name: renew
-- Move a live lease's expiry, unless the attempt reached its time limit (then no row: the
-- service reads live_lease and fails the attempt with reason 'timeout'). Returns whether a
-- cancel was requested (the worker is told to stop). Params: job_id, lease_token, worker_id,
-- now_ms, judge_ms, mark_ms (as expired_leases), expires_ms.
UPDATE relay_job
   SET lease_expires_at_ms = %(expires_ms)s, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s
   AND leased_by = %(worker_id)s
   AND (lease_expires_at_ms > %(now_ms)s
        OR (updated_at_ms <= %(mark_ms)s AND lease_expires_at_ms > %(judge_ms)s))
   AND (time_limit_ms IS NULL OR leased_at_ms + time_limit_ms > %(now_ms)s)
RETURNING lease_expires_at_ms, attempt, cancel_requested_at_ms;

-- name: ack
-- Leased -> succeeded, guarded like renew. Params: job_id, lease_token, worker_id, now_ms,
-- judge_ms, mark_ms.
-- Returns the queue too, so counting the ack needs no second read, and unique_scope (an
-- "active" job's key is freed: release_unique_key).
UPDATE relay_job
   SET state = 'succeeded', finished_at_ms = %(now_ms)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s
   AND leased_by = %(worker_id)s
   AND (lease_expires_at_ms > %(now_ms)s
        OR (updated_at_ms <= %(mark_ms)s AND lease_expires_at_ms > %(judge_ms)s))
RETURNING attempt, queue, unique_scope;

-- name: ack_many
-- The acks of an ack_batch in one statement, each entry guarded as ack guards one (its own
-- token, worker and expiry). Params: acks (a JSON array of {"job_id", "lease_token",
-- "worker_id"}, no job twice), now_ms, judge_ms, mark_ms. Returns each acked job's id with
-- ack's columns; an entry the guard refused returns nothing. As postgresql/queries.sql's ack_many.
UPDATE relay_job
   SET state = 'succeeded', finished_at_ms = %(now_ms)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
  FROM (SELECT value ->> 'job_id' AS job_id, value ->> 'lease_token' AS lease_token,
               value ->> 'worker_id' AS worker_id
          FROM json_each(%(acks)s)) AS a
 WHERE relay_job.id = a.job_id AND relay_job.state = 'leased'
   AND relay_job.lease_token = a.lease_token AND relay_job.leased_by = a.worker_id
   AND (relay_job.lease_expires_at_ms > %(now_ms)s
        OR (relay_job.updated_at_ms <= %(mark_ms)s AND relay_job.lease_expires_at_ms > %(judge_ms)s))
RETURNING relay_job.id, relay_job.attempt, relay_job.queue, relay_job.unique_scope;

-- name: fail_retry
-- Leased -> retrying; READY again at retry_at_ms. Params: job_id, lease_token, now_ms,
-- retry_at_ms, error.
UPDATE relay_job
   SET state = 'retrying', failures = failures + 1, available_at_ms = %(retry_at_ms)s,
       last_error = %(error)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s;

-- name: fail_dead
-- Leased -> dead. Params: job_id, lease_token, now_ms, error, reason.
UPDATE relay_job
   SET state = 'dead', failures = failures + 1, last_error = %(error)s,
       dead_reason = %(reason)s, finished_at_ms = %(now_ms)s, lease_token = NULL,
       leased_by = NULL, lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s;

-- name: release
-- Leased -> ready without counting a failure (a worker giving a job back).
-- Params: job_id, lease_token, worker_id, now_ms, judge_ms, mark_ms (as expired_leases).
UPDATE relay_job
   SET state = 'ready', ready_since_ms = %(now_ms)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s
   AND leased_by = %(worker_id)s
   AND (lease_expires_at_ms > %(now_ms)s
        OR (updated_at_ms <= %(mark_ms)s AND lease_expires_at_ms > %(judge_ms)s))
RETURNING attempt, queue;

-- name: release_many
-- The give-back of a batch of leases (release_batch) in one statement, each entry guarded as
-- release guards one (its own token, worker and expiry); a job whose cancel was requested is
-- left to release, which ends it. Params: leases (a JSON array of {"job_id", "lease_token",
-- "worker_id"}, no job twice), now_ms, judge_ms, mark_ms. Returns each released job's id,
-- attempt and queue. As postgresql/queries.sql's release_many.
UPDATE relay_job
   SET state = 'ready', ready_since_ms = %(now_ms)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
  FROM (SELECT value ->> 'job_id' AS job_id, value ->> 'lease_token' AS lease_token,
               value ->> 'worker_id' AS worker_id
          FROM json_each(%(leases)s)) AS a
 WHERE relay_job.id = a.job_id AND relay_job.state = 'leased'
   AND relay_job.lease_token = a.lease_token AND relay_job.leased_by = a.worker_id
   AND relay_job.cancel_requested_at_ms IS NULL
   AND (relay_job.lease_expires_at_ms > %(now_ms)s
        OR (relay_job.updated_at_ms <= %(mark_ms)s AND relay_job.lease_expires_at_ms > %(judge_ms)s))
RETURNING relay_job.id, relay_job.attempt, relay_job.queue;

-- name: finish_cancelled
-- Leased -> cancelled: the worker of a job whose cancel was requested failed or released it
-- (after live_lease, in the same transaction). No failure is counted; a fail's text is kept.
-- Params: job_id, lease_token, now_ms, error (or NULL).
UPDATE relay_job
   SET state = 'cancelled', finished_at_ms = %(now_ms)s,
       last_error = COALESCE(%(error)s, last_error), lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s
RETURNING attempt, queue;

-- name: cancel_waiting
-- Ready, pending or retrying -> cancelled, guarded by the state the service read (it names
-- the move it checked). Params: job_id, from_state, now_ms.
UPDATE relay_job
   SET state = 'cancelled', cancel_requested_at_ms = %(now_ms)s, finished_at_ms = %(now_ms)s,
       available_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = %(from_state)s
RETURNING queue;

-- name: request_cancel
-- A leased job is marked for cancellation; its worker learns it at the next renew. The lease
-- and updated_at_ms are left alone (the clock-step guard reads updated_at_ms as the lease's
-- last change). A second request keeps the first instant. Params: job_id, attempt, now_ms.
UPDATE relay_job
   SET cancel_requested_at_ms = COALESCE(cancel_requested_at_ms, %(now_ms)s)
 WHERE id = %(job_id)s AND state = 'leased' AND attempt = %(attempt)s
RETURNING queue;

-- name: lease_state
-- What a rejected renew/ack/fail/release is explained from. Params: job_id.
SELECT state, lease_token, leased_by, lease_expires_at_ms
  FROM relay_job
 WHERE id = %(job_id)s;

-- name: attempt_by_token
-- The delivery a lease token belonged to. Params: job_id, lease_token.
SELECT attempt, worker_id, outcome, ended_at_ms, retry_at_ms
  FROM relay_attempt
 WHERE job_id = %(job_id)s AND lease_token = %(lease_token)s;

-- name: recover_attempts
-- Server start: close the history rows of every lease. Params: now_ms.
UPDATE relay_attempt
   SET ended_at_ms = %(now_ms)s, outcome = 'recovered'
 WHERE (job_id, attempt) IN (SELECT id, attempt FROM relay_job WHERE state = 'leased')
   AND ended_at_ms IS NULL;

-- name: recover_cancel_events
-- Server start: record the cancel of every lease whose cancel was requested. Params: now_ms.
INSERT INTO relay_event (job_id, event, from_state, to_state, at_ms, actor, detail)
SELECT id, 'cancelled', 'leased', 'cancelled', %(now_ms)s, NULL,
       'cancel requested; lease ended at server start'
  FROM relay_job
 WHERE state = 'leased' AND cancel_requested_at_ms IS NOT NULL;

-- name: recover_cancelled
-- Server start: a lease whose cancel was requested ends CANCELLED, not READY (after
-- recover_attempts closed its delivery); a unique-while-active key is freed with it, as
-- release_unique_key frees it on every other way into a terminal state. Params: now_ms.
UPDATE relay_job
   SET state = 'cancelled', finished_at_ms = %(now_ms)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s,
       idempotency_key = CASE WHEN unique_scope = 'active' THEN NULL ELSE idempotency_key END,
       idempotency_expires_at_ms = CASE WHEN unique_scope = 'active' THEN NULL
                                        ELSE idempotency_expires_at_ms END
 WHERE state = 'leased' AND cancel_requested_at_ms IS NOT NULL;

-- name: recover_events
-- Server start: record the release of every lease. Params: now_ms.
INSERT INTO relay_event (job_id, event, from_state, to_state, at_ms, actor, detail)
SELECT id, 'recovered', 'leased', 'ready', %(now_ms)s, NULL, 'lease released at server start'
  FROM relay_job
 WHERE state = 'leased';

-- name: recover_jobs
-- Server start: every leased job becomes READY at once; its token is cleared, so the old
-- holder is fenced out. No failure is counted. Params: now_ms.
UPDATE relay_job
   SET state = 'ready', ready_since_ms = %(now_ms)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE state = 'leased';

-- name: replay
-- Dead or cancelled -> ready: a fresh retry budget, the cancel request cleared; the delivery
-- counter and history are kept. Guarded by the state the service read. Params: job_id,
-- from_state, now_ms.
UPDATE relay_job
   SET state = 'ready', failures = 0, ready_since_ms = %(now_ms)s, dead_reason = NULL,
       finished_at_ms = NULL, cancel_requested_at_ms = NULL, updated_at_ms = %(now_ms)s
 WHERE id = %(job_id)s AND state = %(from_state)s AND state IN ('dead', 'cancelled')
RETURNING queue;

-- name: insert_event
-- Append to the event log. Params: job_id, event, from_state, to_state, now_ms, actor, detail.
INSERT INTO relay_event (job_id, event, from_state, to_state, at_ms, actor, detail)
VALUES (%(job_id)s, %(event)s, %(from_state)s, %(to_state)s, %(now_ms)s, %(actor)s,
        %(detail)s);

-- name: delete_attempts
-- Purge, part two. Params: job_id.
DELETE FROM relay_attempt WHERE job_id = %(job_id)s;

-- name: delete_terminal_job
-- Purge, part one: only a terminal job is ever deleted (its attempts go next, in the same
-- transaction: the foreign key is checked at COMMIT). Params: job_id.
DELETE FROM relay_job WHERE id = %(job_id)s AND state IN ('succeeded', 'dead', 'cancelled')
RETURNING state, queue;

-- name: delete_dead_job
-- Purge of a job that did not succeed: dead or cancelled (the dead_purge op). Params: job_id.
DELETE FROM relay_job WHERE id = %(job_id)s AND state IN ('dead', 'cancelled')
RETURNING state, queue;

-- name: prune_succeeded
-- Retention, part one: delete up to `limit` SUCCEEDED jobs that finished before before_ms,
-- oldest first (a seek on relay_job_succeeded_done; the state is spelled out, not a parameter,
-- so the partial index applies). Their attempts, events and task result go next, in the same
-- transaction. Params: before_ms, limit.
DELETE FROM relay_job
 WHERE id IN (
     SELECT id FROM relay_job
      WHERE state = 'succeeded' AND finished_at_ms < %(before_ms)s
      ORDER BY finished_at_ms
      LIMIT %(limit)s)
RETURNING id, queue;

-- name: count_prunable_succeeded
-- What prune_succeeded would delete in all (relay prune --dry-run). Params: before_ms.
SELECT COUNT(*) AS n FROM relay_job
 WHERE state = 'succeeded' AND finished_at_ms < %(before_ms)s;

-- name: prune_dead
-- Retention, part one: delete up to `limit` DEAD jobs that finished before before_ms,
-- oldest first (a seek on relay_job_dead_done; the state is spelled out, not a parameter,
-- so the partial index applies). Their attempts, events and task result go next, in the same
-- transaction. Params: before_ms, limit.
DELETE FROM relay_job
 WHERE id IN (
     SELECT id FROM relay_job
      WHERE state = 'dead' AND finished_at_ms < %(before_ms)s
      ORDER BY finished_at_ms
      LIMIT %(limit)s)
RETURNING id, queue;

-- name: count_prunable_dead
-- What prune_dead would delete in all (relay prune --dry-run). Params: before_ms.
SELECT COUNT(*) AS n FROM relay_job
 WHERE state = 'dead' AND finished_at_ms < %(before_ms)s;

-- name: prune_cancelled
-- Retention, part one: delete up to `limit` CANCELLED jobs that finished before before_ms,
-- oldest first (a seek on relay_job_cancelled_done; the state is spelled out, not a parameter,
-- so the partial index applies). Their attempts, events and task result go next, in the same
-- transaction. Params: before_ms, limit.
DELETE FROM relay_job
 WHERE id IN (
     SELECT id FROM relay_job
      WHERE state = 'cancelled' AND finished_at_ms < %(before_ms)s
      ORDER BY finished_at_ms
      LIMIT %(limit)s)
RETURNING id, queue;

-- name: count_prunable_cancelled
-- What prune_cancelled would delete in all (relay prune --dry-run). Params: before_ms.
SELECT COUNT(*) AS n FROM relay_job
 WHERE state = 'cancelled' AND finished_at_ms < %(before_ms)s;

-- name: delete_events
-- Retention, part two: a pruned job's events (purge keeps them; prune does not). Params: job_id.
DELETE FROM relay_event WHERE job_id = %(job_id)s;

-- name: store_result
-- The result a worker sent with its ack (service results, migration 0013_task_results).
-- Params: job_id, return_value (canonical JSON text), now_ms.
INSERT INTO relay_result (job_id, return_value, errors, updated_at_ms)
VALUES (%(job_id)s, %(return_value)s, '[]', %(now_ms)s)
ON CONFLICT (job_id) DO UPDATE
   SET return_value = excluded.return_value, updated_at_ms = excluded.updated_at_ms;

-- name: store_errors
-- A job's structured errors, the newest that fit (written by a fail that sent an exception
-- class). Params: job_id, errors (JSON list text), now_ms.
INSERT INTO relay_result (job_id, return_value, errors, updated_at_ms)
VALUES (%(job_id)s, NULL, %(errors)s, %(now_ms)s)
ON CONFLICT (job_id) DO UPDATE
   SET errors = excluded.errors, updated_at_ms = excluded.updated_at_ms;

-- name: result_of
-- The stored result of a job, if any. Params: job_id.
SELECT return_value, errors, updated_at_ms FROM relay_result WHERE job_id = %(job_id)s;

-- name: delete_result
-- Purge and prune: the job's stored result goes with it. Params: job_id.
DELETE FROM relay_result WHERE job_id = %(job_id)s;

-- name: delete_task_result
-- Purge, part three, when the relay_tasks app is installed: the Django task's result row.
-- Params: job_id.
DELETE FROM relay_task_result WHERE job_id = %(job_id)s;

-- name: count_added
-- Add n new jobs of one queue and state to relay_job_count: the driver runs it beside each
-- insert of jobs (migration 0008); triggers count updates and deletes. Params: queue, state, n.
INSERT INTO relay_job_count (queue, state, n) VALUES (%(queue)s, %(state)s, %(n)s)
ON CONFLICT (queue, state) DO UPDATE SET n = n + excluded.n;

-- name: counts_forget
-- Delete the count rows at zero of the queues given, once their jobs were purged or pruned:
-- the triggers only decrement, so a row per (queue, state) ever used stayed, and every stats
-- call and queue count read them (a review: 1,000,000 such rows made each submit to a new
-- queue 48 ms and a sentinel's p50 152 ms). No job has a (queue, state) whose row is at zero,
-- so none of them is decremented again; an insert makes its row anew. Params: queues (a JSON
-- array of names).
DELETE FROM relay_job_count
 WHERE n = 0 AND queue IN (SELECT value FROM json_each(%(queues)s));

-- name: counts_forget_all
-- Every count row at zero (repair_counts at server start: those an older Relay left).
-- Params: none.
DELETE FROM relay_job_count WHERE n = 0;

-- name: counts_kept
-- Every row relay_job_count keeps, zero and negative ones too (what repair_counts compares
-- with counts_scanned). Params: none.
SELECT queue, state, n FROM relay_job_count;

-- name: counts_scanned
-- Jobs by queue and state counted from the jobs (a scan of relay_job_queue_state: 0.2-0.3 s
-- a million jobs). Params: none.
SELECT queue, state, COUNT(*) AS n FROM relay_job GROUP BY queue, state;

-- name: recount_clear
-- Rebuilding relay_job_count (repair_counts at server start; test and bench set-ups that
-- insert jobs by hand), part one. Params: none.
DELETE FROM relay_job_count;

-- name: recount
-- Part two: count every job again (a scan of relay_job_queue_state). Params: none.
INSERT INTO relay_job_count (queue, state, n)
SELECT queue, state, COUNT(*) FROM relay_job GROUP BY queue, state;

-- name: counts
-- Jobs by queue and state: the rows relay_job_count keeps (migrations 0007 and 0008), one per
-- queue and state, so a stats call costs as much with 10 jobs as with 10 million.
SELECT queue, state, n FROM relay_job_count WHERE n > 0;

-- name: counts_live
-- Jobs by queue and live state (SUCCEEDED left out). Params: none.
SELECT queue, state, n FROM relay_job_count WHERE n > 0 AND state <> 'succeeded';

-- name: queues_known
-- Which of the names given are queues holding jobs, in any state: a seek on relay_job_count's
-- primary key each (the queue cap, QueueService._new_queues, asks it of the names it has not
-- seen, all of a batch's in one statement). Params: queues (a JSON array of names).
SELECT value AS queue
  FROM json_each(%(queues)s)
 WHERE EXISTS (SELECT 1 FROM relay_job_count WHERE queue = value AND n > 0);

-- name: queue_count
-- How many queues hold jobs, counting no further than `limit`: a read of relay_job_count, a
-- row per queue and state (2 ms for 10,000 queues of three states each). The queue cap asks it only for a name no queue has yet; the
-- relay_queues gauge at each scrape. Params: limit.
SELECT COUNT(*) AS n
  FROM (SELECT DISTINCT queue FROM relay_job_count WHERE n > 0 LIMIT %(limit)s);

-- name: counts_of_queue
-- One queue's jobs by state: its rows of relay_job_count (a primary-key range), so a stats
-- call for one queue costs the same among 20,000 queues as among 2. Params: queue.
SELECT queue, state, n FROM relay_job_count WHERE queue = %(queue)s AND n > 0;

-- name: oldest_ready_of_queue
-- When one queue's longest-waiting READY job became ready: one seek per base class on
-- relay_job_ready. Params: queue.
SELECT MIN((SELECT MIN(j.ready_since_ms) FROM relay_job j
             WHERE j.state = 'ready' AND j.queue = %(queue)s AND j.priority = p.column1))
       AS oldest
  FROM (VALUES (0), (1), (2), (3)) AS p;

-- name: ready_queue_names
-- The queues holding READY jobs, in name order, at most `limit` of them: a loose index scan
-- of relay_job_ready, one seek a queue, never a scan of the backlog (QueueService.ready_queues
-- asks it instead of a seek per name when many names are waited on: 256,000 names waited on,
-- one seek each for every commit made elsewhere, kept a server's core busy; a hostile
-- review). Params: limit.
WITH RECURSIVE q(queue) AS (
    SELECT (SELECT MIN(queue) FROM relay_job INDEXED BY relay_job_ready WHERE state = 'ready')
    UNION ALL
    SELECT (SELECT MIN(j.queue) FROM relay_job j INDEXED BY relay_job_ready
             WHERE j.state = 'ready' AND j.queue > q.queue)
      FROM q
     WHERE q.queue IS NOT NULL
)
SELECT queue FROM q WHERE queue IS NOT NULL LIMIT %(limit)s;

-- name: queue_has_ready
-- Whether a queue has a READY job: one seek on relay_job_ready (the long-poll fallback poll
-- asks this for each queue somebody waits on). Params: queue.
SELECT EXISTS (SELECT 1 FROM relay_job WHERE state = 'ready' AND queue = %(queue)s) AS ready;

-- name: oldest_ready
-- When the longest-waiting READY job of each queue became ready: for each queue with READY jobs
-- (relay_job_count), one seek per base class on relay_job_ready, never a scan of the backlog.
-- Params: none.
SELECT c.queue AS queue,
       MIN((SELECT MIN(j.ready_since_ms) FROM relay_job j
             WHERE j.state = 'ready' AND j.queue = c.queue AND j.priority = p.column1)) AS oldest
  FROM relay_job_count c, (VALUES (0), (1), (2), (3)) AS p
 WHERE c.state = 'ready' AND c.n > 0
 GROUP BY c.queue;

-- name: dead_page
-- One page of dead letters in id order. Params: after, limit.
SELECT {job_columns}
  FROM relay_job
 WHERE state = 'dead' AND id > %(after)s
 ORDER BY id LIMIT %(limit)s;

-- name: jobs_page
-- One page of one queue's jobs in one state, in id order (one seek on relay_job_queue_state):
-- dead letters, and the HTTP listing, which merges the states itself. Params: queue, state,
-- after, limit.
SELECT {job_columns}
  FROM relay_job
 WHERE queue = %(queue)s AND state = %(state)s AND id > %(after)s
 ORDER BY id LIMIT %(limit)s;

-- name: next_scheduled
-- The earliest due time of a PENDING/RETRYING job. Params: none.
SELECT MIN(available_at_ms) AS at_ms FROM relay_job WHERE state IN ('pending', 'retrying');

-- name: next_expiry
-- The earliest lease expiry. Params: none.
SELECT MIN(lease_expires_at_ms) AS at_ms FROM relay_job WHERE state = 'leased';

-- name: database_now
-- The database's clock, epoch ms (the servers' clocks are checked against it). Params: none.
SELECT CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) AS now_ms;

-- name: register_server
-- A server announces itself (or again, after others forgot it). Params: id, address, host,
-- pid, now_ms, clock_skew_ms.
INSERT INTO relay_server (id, address, host, pid, started_at_ms, seen_at_ms, clock_skew_ms)
VALUES (%(id)s, %(address)s, %(host)s, %(pid)s, %(now_ms)s, %(now_ms)s, %(clock_skew_ms)s)
ON CONFLICT (id) DO UPDATE SET seen_at_ms = excluded.seen_at_ms,
                               clock_skew_ms = excluded.clock_skew_ms;

-- name: forget_servers
-- Drop the rows of servers not seen since before_ms (they died). Params: before_ms.
DELETE FROM relay_server WHERE seen_at_ms < %(before_ms)s;

-- name: deregister_server
-- A server that stops cleanly leaves the registry. Params: id.
DELETE FROM relay_server WHERE id = %(id)s;

-- name: live_servers
-- Servers seen since since_ms, oldest first. Params: since_ms.
SELECT id, address, host, pid, started_at_ms, seen_at_ms, clock_skew_ms
  FROM relay_server
 WHERE seen_at_ms >= %(since_ms)s
 ORDER BY started_at_ms, id;

-- name: queue_controls_for_claim
-- The controls of the queues a claim names (one primary-key seek each on relay_queue; a queue
-- without a row runs unlimited). Params: queues (a JSON array of names).
SELECT name, paused, max_leased, rate_per_s, burst, tokens, tokens_at_ms
  FROM relay_queue
 WHERE name IN (SELECT value FROM json_each(%(queues)s));

-- name: queue_has_controls
-- Whether one queue has controls (a relay_queue row): one primary-key seek, the usual claim's
-- check (queue_controls_for_claim's JSON list costs a json_each scan and a temporary table).
-- Params: queue.
SELECT 1 FROM relay_queue WHERE name = %(queue)s;

-- name: queue_leased
-- How many jobs of a queue are leased now, for its cap: one row of relay_job_count.
-- Params: queue.
SELECT COALESCE((SELECT n FROM relay_job_count
                  WHERE queue = %(queue)s AND state = 'leased'), 0) AS n;

-- name: queue_get
-- One queue's controls. Params: name.
SELECT name, paused, max_leased, rate_per_s, burst, tokens, tokens_at_ms, updated_at_ms,
       updated_by
  FROM relay_queue
 WHERE name = %(name)s;

-- name: queue_controls_all
-- Every controlled queue (few rows: one per queue an operator paused or limited). Params: none.
SELECT name, paused, max_leased, rate_per_s, burst, tokens, tokens_at_ms, updated_at_ms,
       updated_by
  FROM relay_queue
 ORDER BY name;

-- name: queue_put
-- Set a queue's controls. Params: name, paused, max_leased, rate_per_s, burst, tokens,
-- tokens_at_ms, now_ms, actor.
INSERT INTO relay_queue (name, paused, max_leased, rate_per_s, burst, tokens, tokens_at_ms,
                         updated_at_ms, updated_by)
VALUES (%(name)s, %(paused)s, %(max_leased)s, %(rate_per_s)s, %(burst)s, %(tokens)s,
        %(tokens_at_ms)s, %(now_ms)s, %(actor)s)
ON CONFLICT (name) DO UPDATE
   SET paused = excluded.paused, max_leased = excluded.max_leased,
       rate_per_s = excluded.rate_per_s, burst = excluded.burst, tokens = excluded.tokens,
       tokens_at_ms = excluded.tokens_at_ms, updated_at_ms = excluded.updated_at_ms,
       updated_by = excluded.updated_by;

-- name: queue_delete
-- A queue back to its defaults (running, no cap, no rate) keeps no row. Params: name.
DELETE FROM relay_queue WHERE name = %(name)s;

-- name: queue_take_tokens
-- The token bucket after a claim started jobs. Params: name, tokens, at_ms. Its instant never
-- goes back: a server whose clock is behind the last claimer's (refilling nothing, see
-- service._refill) must not hand the one ahead the same interval to earn again.
UPDATE relay_queue SET tokens = %(tokens)s, tokens_at_ms = MAX(tokens_at_ms, %(at_ms)s)
WHERE name = %(name)s;
