-- Every statement the PostgreSQL driver runs, one named block each, with the names of
-- ../sqlite/queries.sql where the work is the same. Parameters use psycopg's %(name)s style.
-- Instants are epoch ms passed in as parameters: SQL never reads the database clock.
-- {job_columns} stands for queue_core.jobs.JOB_COLUMNS (the columns job_view reads), put in
-- by storage.base.load_queries.
--
-- What differs from SQLite, and why: several servers write at once here, so every sweep
-- update carries its state guard and skips rows other transactions hold (FOR UPDATE SKIP
-- LOCKED), the claim is one statement that locks what it takes, and an idempotency key is
-- bound by INSERT ... ON CONFLICT (two servers may insert the same key at the same moment).
-- And a row's instants never go back: servers' clocks agree to within a reading of the
-- database's (queue_core.clock.AnchoredClock), not exactly, so a change stamps GREATEST(now,
-- the row's last change) and an attempt ends no earlier than it started (the audit's order of
-- attempts holds when one server leases a job and another acks it).

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
       updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
 WHERE id IN (SELECT id FROM relay_job
               WHERE state IN ('pending', 'retrying') AND available_at_ms <= %(now_ms)s
               ORDER BY available_at_ms
               LIMIT %(limit)s
                 FOR UPDATE SKIP LOCKED)
   AND state IN ('pending', 'retrying')
RETURNING queue;

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
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: expire_to_ready
-- A lost lease returns the job to READY and counts a failure; aging counts from the expiry.
-- Params: job_id, attempt, now_ms, reason ('lease expired', or 'timeout' past the time limit).
UPDATE relay_job
   SET state = 'ready', failures = failures + 1, ready_since_ms = lease_expires_at_ms,
       last_error = %(reason)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
 WHERE id = %(job_id)s AND state = 'leased' AND attempt = %(attempt)s;

-- name: expire_to_dead
-- A lost lease with no retry budget left dead-letters the job. Params: job_id, attempt,
-- now_ms, reason (as expire_to_ready).
UPDATE relay_job
   SET state = 'dead', failures = failures + 1, last_error = %(reason)s,
       dead_reason = %(reason)s, finished_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms), lease_token = NULL,
       leased_by = NULL, lease_expires_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
 WHERE id = %(job_id)s AND state = 'leased' AND attempt = %(attempt)s;

-- name: expire_to_cancelled
-- A lost lease of a job whose cancel was requested: the job is cancelled, not retried. As
-- every lost lease, it counts a failed attempt. Params: job_id, attempt, now_ms, reason.
UPDATE relay_job
   SET state = 'cancelled', failures = failures + 1, last_error = %(reason)s,
       finished_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms), lease_token = NULL,
       leased_by = NULL, lease_expires_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
 WHERE id = %(job_id)s AND state = 'leased' AND attempt = %(attempt)s;

-- name: claim
-- Lease the best READY jobs in one statement. The heads of each (queue, base class) are one
-- index seek each on relay_job_ready (LATERAL, LIMIT), locked with SKIP LOCKED so concurrent
-- claims on other servers take other jobs instead of waiting; they are ranked by aged class
-- (base + one per whole minute waited, capped at CRITICAL = 3), then FIFO, and leased while
-- their payloads and metas (+ 1024 bytes each) fit the reply (the first always does; a job's
-- size is its payload's plus its meta's). Each queue gives at most its own limit (the room
-- under its cap and its tokens, which the service computed with the queue's relay_queue row
-- locked; the claim's limit for a queue without controls), applied after the seeks: a LIMIT
-- taken from q.lim is one the planner cannot see, and it then costs the lateral as the whole
-- table and joins the UPDATE by a sequential scan. Heads locked but not taken stay READY. The
-- lease starts at now_ms, or at the job's last change if another server's sweep (its own
-- clock, read a moment later) returned the job to READY after this transaction read now_ms: a
-- delivery never starts before the previous one ended. With guard true, it leases nothing
-- when any of the queues has a relay_queue row (controls), checked once for the statement
-- (claim_unless_controlled). Params: guard (bool), queues (text[]), limits (int[], one per
-- queue), limit, now_ms, expires_ms, worker_id, tokens (text[], one per job wanted), room.
WITH heads AS (
    SELECT q.name, q.lim, h.id, h.priority, h.ready_since_ms, h.size,
           LEAST(3, h.priority + GREATEST(0, %(now_ms)s::bigint - h.ready_since_ms) / 60000)
               AS eff
      FROM unnest(%(queues)s::text[], %(limits)s::int[]) AS q(name, lim)
     CROSS JOIN (VALUES (3), (2), (1), (0)) AS c(cls)
     CROSS JOIN (SELECT NOT (%(guard)s::boolean
                             AND EXISTS (SELECT 1 FROM relay_queue
                                          WHERE name = ANY(%(queues)s::text[])))) AS g(go)
     CROSS JOIN LATERAL (
           SELECT id, priority, ready_since_ms,
                  octet_length(payload) + COALESCE(octet_length(meta), 0) AS size
             FROM relay_job
            WHERE g.go AND state = 'ready' AND queue = q.name AND priority = c.cls
            ORDER BY ready_since_ms, id
            LIMIT %(limit)s
              FOR UPDATE SKIP LOCKED) AS h
), capped AS (
    SELECT id, eff, ready_since_ms, size, lim,
           row_number() OVER (PARTITION BY name ORDER BY eff DESC, ready_since_ms, id) AS qn
      FROM heads
), ranked AS (
    SELECT id,
           row_number() OVER w AS n,
           sum(size + 1024) OVER w AS bytes
      FROM capped
     WHERE qn <= lim
    WINDOW w AS (ORDER BY eff DESC, ready_since_ms, id)
)
UPDATE relay_job AS j
   SET state = 'leased', attempt = j.attempt + 1,
       lease_token = (%(tokens)s::text[])[r.n::int], leased_by = %(worker_id)s,
       leased_at_ms = GREATEST(%(now_ms)s::bigint, j.updated_at_ms),
       lease_expires_at_ms = %(expires_ms)s,
       updated_at_ms = GREATEST(%(now_ms)s::bigint, j.updated_at_ms)
  FROM ranked AS r
 WHERE j.id = r.id AND r.n <= %(limit)s AND (r.n = 1 OR r.bytes <= %(room)s)
RETURNING j.id, j.queue, j.payload, j.attempt, j.priority, j.failures, j.max_retries,
          j.created_at_ms, j.lease_token, j.leased_at_ms, j.meta, j.time_limit_ms, r.n;

-- name: claim_one
-- The claim of one job from one queue (a lease of max_jobs 1 on one queue, the common case):
-- the same choice as claim (the head of each base class, locked with SKIP LOCKED, ranked by
-- aged class then FIFO) and the same UPDATE, spelled with no array and no LIMIT parameter.
-- claim's plan depends on its parameters, so PostgreSQL plans it again at every run (0.3 ms
-- of its CPU here, twice the run itself); this one's generic plan is the same index seeks
-- whatever the queue, and a prepared claim_one is planned once per connection. Params:
-- guard (bool), queue, now_ms, expires_ms, worker_id, token.
WITH heads AS (
    SELECT h.id, h.ready_since_ms,
           LEAST(3, h.priority + GREATEST(0, %(now_ms)s::bigint - h.ready_since_ms) / 60000)
               AS eff
      FROM (VALUES (3), (2), (1), (0)) AS c(cls)
     CROSS JOIN LATERAL (
           SELECT id, priority, ready_since_ms
             FROM relay_job
            WHERE state = 'ready' AND queue = %(queue)s::text AND priority = c.cls
            ORDER BY ready_since_ms, id
            LIMIT 1
              FOR UPDATE SKIP LOCKED) AS h
     WHERE NOT (%(guard)s::boolean
                AND EXISTS (SELECT 1 FROM relay_queue WHERE name = %(queue)s::text))
)
UPDATE relay_job AS j
   SET state = 'leased', attempt = j.attempt + 1,
       lease_token = %(token)s::text, leased_by = %(worker_id)s::text,
       leased_at_ms = GREATEST(%(now_ms)s::bigint, j.updated_at_ms),
       lease_expires_at_ms = %(expires_ms)s::bigint,
       updated_at_ms = GREATEST(%(now_ms)s::bigint, j.updated_at_ms)
 WHERE j.id = (SELECT id FROM heads ORDER BY eff DESC, ready_since_ms, id LIMIT 1)
RETURNING j.id, j.queue, j.payload, j.attempt, j.priority, j.failures, j.max_retries,
          j.created_at_ms, j.lease_token, j.leased_at_ms, j.meta, j.time_limit_ms;

-- name: insert_attempt
-- Open the history row of a delivery. Params: job_id, attempt, worker_id, token, now_ms.
INSERT INTO relay_attempt (job_id, attempt, worker_id, lease_token, started_at_ms)
VALUES (%(job_id)s, %(attempt)s, %(worker_id)s, %(token)s, %(now_ms)s);

-- name: end_attempt
-- Close the history row of a delivery. Params: job_id, attempt, now_ms, outcome, error,
-- retry_at_ms (a failure's retry time, NULL otherwise).
UPDATE relay_attempt
   SET ended_at_ms = GREATEST(%(now_ms)s::bigint, started_at_ms), outcome = %(outcome)s,
       error = %(error)s,
       retry_at_ms = %(retry_at_ms)s
 WHERE job_id = %(job_id)s AND attempt = %(attempt)s AND ended_at_ms IS NULL;

-- name: live_lease
-- The lease a renew/ack/fail/release names, if it is the current, unexpired one (the
-- compare-and-set guard, as River guards in the WHERE clause). Locked until COMMIT, so a
-- sweep on another server cannot expire it between this read and the fail that follows.
-- Params: job_id, lease_token, worker_id, now_ms, judge_ms, mark_ms (as expired_leases).
SELECT queue, attempt, failures, max_retries, backoff, backoff_base_ms, backoff_cap_ms, jitter,
       unique_scope, leased_at_ms, time_limit_ms, cancel_requested_at_ms
  FROM relay_job
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s
   AND leased_by = %(worker_id)s
   AND (lease_expires_at_ms > %(now_ms)s
        OR (updated_at_ms <= %(mark_ms)s AND lease_expires_at_ms > %(judge_ms)s))
   FOR UPDATE;

-- name: renew
-- Move a live lease's expiry, unless the attempt reached its time limit (then no row: the
-- service reads live_lease and fails the attempt with reason 'timeout'). Returns whether a
-- cancel was requested (the worker is told to stop). Params: job_id, lease_token, worker_id,
-- now_ms, judge_ms, mark_ms (as expired_leases), expires_ms.
UPDATE relay_job
   SET lease_expires_at_ms = %(expires_ms)s, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
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
   SET state = 'succeeded', finished_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms), lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s
   AND leased_by = %(worker_id)s
   AND (lease_expires_at_ms > %(now_ms)s
        OR (updated_at_ms <= %(mark_ms)s AND lease_expires_at_ms > %(judge_ms)s))
RETURNING attempt, queue, unique_scope;

-- name: ack_many
-- The acks of an ack_batch in one statement, each entry guarded as ack guards one (its own
-- token, worker and expiry). Params: acks (a JSON array of {"job_id", "lease_token",
-- "worker_id"}, no job twice), now_ms, judge_ms, mark_ms. Returns each acked job's id with
-- ack's columns; an entry the guard refused returns nothing. As sqlite/queries.sql's ack_many.
-- No "state = 'leased'" test: a row holds a token only while leased (the CHECK constraint
-- relay_job_lease_iff_leased), and that test would let the planner hash every live lease
-- through the partial index relay_job_leased, whose statistics of expiry times lie in the past
-- as soon as leases are short; so each entry is one primary-key lookup, as in ack.
UPDATE relay_job
   SET state = 'succeeded', finished_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms), lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
  FROM jsonb_to_recordset(%(acks)s::jsonb) AS a(job_id text, lease_token text, worker_id text)
 WHERE relay_job.id = a.job_id
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
       lease_expires_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s;

-- name: fail_dead
-- Leased -> dead. Params: job_id, lease_token, now_ms, error, reason.
UPDATE relay_job
   SET state = 'dead', failures = failures + 1, last_error = %(error)s,
       dead_reason = %(reason)s, finished_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms), lease_token = NULL,
       leased_by = NULL, lease_expires_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s;

-- name: release
-- Leased -> ready without counting a failure (a worker giving a job back).
-- Params: job_id, lease_token, worker_id, now_ms, judge_ms, mark_ms (as expired_leases).
UPDATE relay_job
   SET state = 'ready', ready_since_ms = %(now_ms)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
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
-- attempt and queue. As sqlite/queries.sql's release_many; no "state = 'leased'" test, for
-- ack_many's reason (a primary-key lookup per entry).
UPDATE relay_job
   SET state = 'ready', ready_since_ms = %(now_ms)s, lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
  FROM jsonb_to_recordset(%(leases)s::jsonb) AS a(job_id text, lease_token text, worker_id text)
 WHERE relay_job.id = a.job_id
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
   SET state = 'cancelled', finished_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms),
       last_error = COALESCE(%(error)s::text, last_error), lease_token = NULL, leased_by = NULL,
       lease_expires_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
 WHERE id = %(job_id)s AND state = 'leased' AND lease_token = %(lease_token)s
RETURNING attempt, queue;

-- name: cancel_waiting
-- Ready, pending or retrying -> cancelled, guarded by the state the service read (it names
-- the move it checked). Params: job_id, from_state, now_ms.
UPDATE relay_job
   SET state = 'cancelled', cancel_requested_at_ms = %(now_ms)s, finished_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms),
       available_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
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

-- name: replay
-- Dead or cancelled -> ready: a fresh retry budget, the cancel request cleared; the delivery
-- counter and history are kept. Guarded by the state the service read. Params: job_id,
-- from_state, now_ms.
UPDATE relay_job
   SET state = 'ready', failures = 0, ready_since_ms = %(now_ms)s, dead_reason = NULL,
       finished_at_ms = NULL, cancel_requested_at_ms = NULL, updated_at_ms = GREATEST(%(now_ms)s::bigint, updated_at_ms)
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
-- PostgreSQL: SKIP LOCKED, so servers pruning at once take different rows instead of
-- waiting on each other.
DELETE FROM relay_job
 WHERE id IN (
     SELECT id FROM relay_job
      WHERE state = 'succeeded' AND finished_at_ms < %(before_ms)s
      ORDER BY finished_at_ms
      LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED)
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
-- PostgreSQL: SKIP LOCKED, so servers pruning at once take different rows instead of
-- waiting on each other.
DELETE FROM relay_job
 WHERE id IN (
     SELECT id FROM relay_job
      WHERE state = 'dead' AND finished_at_ms < %(before_ms)s
      ORDER BY finished_at_ms
      LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED)
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
-- PostgreSQL: SKIP LOCKED, so servers pruning at once take different rows instead of
-- waiting on each other.
DELETE FROM relay_job
 WHERE id IN (
     SELECT id FROM relay_job
      WHERE state = 'cancelled' AND finished_at_ms < %(before_ms)s
      ORDER BY finished_at_ms
      LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED)
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

-- name: counts
-- Jobs by queue and state (a scan of relay_job_queue_state, not of the table).
SELECT queue, state, COUNT(*) AS n FROM relay_job GROUP BY queue, state;

-- name: counts_live
-- Jobs by queue and live state (SUCCEEDED left out), each state read from its own partial
-- index, so finished jobs never cost a metrics scrape anything. PostgreSQL picks the partial indexes by itself (tests/postgresql checks the plan).
-- Params: none.
SELECT queue, state, COUNT(*) AS n FROM relay_job
 WHERE state = 'ready' GROUP BY queue, state
UNION ALL
SELECT queue, state, COUNT(*) AS n FROM relay_job
 WHERE state IN ('pending', 'retrying') GROUP BY queue, state
UNION ALL
SELECT queue, state, COUNT(*) AS n FROM relay_job
 WHERE state = 'leased' GROUP BY queue, state
UNION ALL
SELECT queue, state, COUNT(*) AS n FROM relay_job
 WHERE state = 'dead' GROUP BY queue, state
UNION ALL
SELECT queue, state, COUNT(*) AS n FROM relay_job
 WHERE state = 'cancelled' GROUP BY queue, state;

-- name: queues_known
-- Which of the names given are queues holding jobs, in any state: a seek each on an index
-- led by relay_job.queue (the queue cap, QueueService._new_queues, asks it of the names
-- it has not seen, all of a batch's in one statement, not one round trip a name). A LATERAL
-- LIMIT 1, not EXISTS: EXISTS became a hash join over every job (5 ms among 10,500 jobs) where
-- this is a nested loop of seeks (0.04 ms). Params: queues (a JSON array of names).
SELECT name AS queue
  FROM jsonb_array_elements_text(%(queues)s::jsonb) AS name
 CROSS JOIN LATERAL (SELECT 1 FROM relay_job WHERE queue = name LIMIT 1) AS held;

-- name: queue_count
-- How many queues hold jobs, counting no further than `limit`: a loose index scan, one seek
-- per queue on an index led by relay_job.queue (the recursion stops when the outer LIMIT has
-- its rows), never a scan of the jobs: 55 ms for 10,000 queues. The queue cap asks it under
-- hold_queue_cap once a submit naming a queue that held no jobs has inserted them, not again
-- for a second for what would not fit a count that refused; the relay_queues gauge asks it
-- at each scrape. Params: limit.
WITH RECURSIVE q(queue) AS (
    (SELECT queue FROM relay_job ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM relay_job j WHERE j.queue > q.queue ORDER BY j.queue LIMIT 1)
      FROM q
     WHERE q.queue IS NOT NULL
)
SELECT COUNT(*) AS n FROM (SELECT queue FROM q WHERE queue IS NOT NULL LIMIT %(limit)s) AS s;

-- name: counts_of_queue
-- One queue's jobs by state (a range of relay_job_queue_state), so a stats call for one
-- queue does not count the others'. Params: queue.
SELECT queue, state, COUNT(*) AS n FROM relay_job WHERE queue = %(queue)s GROUP BY queue, state;

-- name: oldest_ready_of_queue
-- When one queue's longest-waiting READY job became ready: one seek per base class on
-- relay_job_ready. Params: queue.
SELECT MIN(h.oldest) AS oldest
  FROM (VALUES (0), (1), (2), (3)) AS p(cls)
 CROSS JOIN LATERAL (SELECT MIN(ready_since_ms) AS oldest FROM relay_job
                      WHERE state = 'ready' AND queue = %(queue)s AND priority = p.cls) AS h;

-- name: ready_queue_names
-- The queues holding READY jobs, in name order, at most `limit` of them: a loose index scan
-- of relay_job_ready, one seek a queue, never a scan of the backlog (QueueService.ready_queues
-- asks it instead of a seek per name when many names are waited on: 256,000 names waited on,
-- one seek each for every commit made elsewhere, kept a server's core busy; a hostile
-- review). Ordered by (queue, priority), which only relay_job_ready supplies: by queue alone
-- the planner took relay_job_queue_id and filtered every finished job it passed. Params: limit.
WITH RECURSIVE q(queue) AS (
    (SELECT queue FROM relay_job WHERE state = 'ready' ORDER BY queue, priority LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM relay_job j WHERE j.state = 'ready' AND j.queue > q.queue
             ORDER BY j.queue, j.priority LIMIT 1)
      FROM q
     WHERE q.queue IS NOT NULL
)
SELECT queue FROM q WHERE queue IS NOT NULL LIMIT %(limit)s;

-- name: queue_has_ready
-- Whether a queue has a READY job: one seek on relay_job_ready (the long-poll fallback poll
-- asks this for each queue somebody waits on). Params: queue.
SELECT EXISTS (SELECT 1 FROM relay_job WHERE state = 'ready' AND queue = %(queue)s) AS ready;

-- name: oldest_ready
-- When the longest-waiting READY job of each queue became ready. Params: none.
SELECT queue, MIN(ready_since_ms) AS oldest FROM relay_job WHERE state = 'ready' GROUP BY queue;

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
-- name: sweep_lock
-- Only one server sweeps (expires leases, promotes due jobs) at a time: a transaction-scoped
-- advisory lock, let go at COMMIT or ROLLBACK; a server that does not get it skips the sweep.
SELECT pg_try_advisory_xact_lock(hashtext('relay.sweep')) AS locked;

-- name: end_stuck_sessions
-- End the sessions of other relay servers (application_name 'relay server ...', set by
-- server_lock) that have waited for their server in the middle of a transaction for longer
-- than stuck_ms: no statement and no state change since, while PostgreSQL waits for the
-- client (ClientRead, idle or in the middle of a command; ClientWrite). That is a server
-- frozen mid-batch (stopped, its VM paused, cut off from the database); one that is only
-- slow, or waiting for a lock, runs a statement at least every lock_timeout. The idle limit
-- (idle_in_transaction_session_timeout) does not see a session waiting for the rest of a
-- command. Ending it rolls its transaction back and frees its row locks and the sweep's
-- advisory lock. Params: me (this process's application_name), stuck_ms.
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) AS ended
FROM pg_stat_activity
WHERE datname = current_database()
  AND pid <> pg_backend_pid()
  AND application_name LIKE 'relay server %%'
  AND application_name <> %(me)s
  AND xact_start IS NOT NULL
  AND wait_event_type = 'Client'
  AND state_change < clock_timestamp() - make_interval(secs => %(stuck_ms)s / 1000.0);

-- name: sweep_probe
-- The sweep lock, and whether a sweep has anything to do, in one round trip (the claim path
-- sweeps before every group of claims; usually nothing is due). Each EXISTS is one seek on
-- a partial index (relay_job_leased, relay_job_scheduled). Params: now_ms.
SELECT pg_try_advisory_xact_lock(hashtext('relay.sweep')) AS locked,
       EXISTS (SELECT 1 FROM relay_job
                WHERE state = 'leased' AND lease_expires_at_ms <= %(now_ms)s) AS expired,
       EXISTS (SELECT 1 FROM relay_job
                WHERE state IN ('pending', 'retrying') AND available_at_ms <= %(now_ms)s) AS due;

-- name: notify_ready
-- Wake long-polls on other servers once this transaction commits (NOTIFY is transactional,
-- and repeats of one payload in one transaction are delivered once). Params: origin (the
-- sender's id, so its own listener ignores it, then a space and the queue made ready; the
-- id alone: any queue).
SELECT pg_notify('relay_ready', %(origin)s);

-- name: check
-- The start-up check: the database answers and Relay's table is there.
SELECT count(*) AS n FROM (SELECT 1 FROM relay_job LIMIT 1) AS one;

-- name: database_now
-- The database's clock, epoch ms (the servers' clocks are checked against it). Params: none.
SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms;

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

-- name: hold_queue_cap
-- The queue cap's lock, a transaction-level advisory lock taken once a submit that starts
-- queues has inserted its jobs, before it counts the queues (QueueService._admit_new_queues):
-- two transactions starting queues count one after the other, the second once the first has
-- committed (read committed: each statement sees what committed before it began). Without it,
-- eight batches of 1,000 new names sent at once through two servers all found the same room:
-- 9,000 queues against a cap of 2,000 (a review). Its holder only counts and commits: taken
-- last, and by a transaction of its own in the TCP server (a second review saw deadlocks
-- when a group commit took it between other calls' row locks). SQLite needs none: its one
-- writer counts one transaction at a time. Params: none.
SELECT pg_advisory_xact_lock(hashtextextended('relay.queue_cap', 0));

-- name: hold_jobs
-- Lock the rows of the jobs a group commit's calls update, in id order, before any of them
-- runs, when each of them updates named jobs (QueueService.hold_jobs): two batches updating
-- the same jobs in other orders through two servers deadlocked. FOR NO KEY UPDATE, the lock
-- an UPDATE of these rows takes, so foreign key checks on them (KEY SHARE) go on.
-- Params: job_ids (text[], sorted).
SELECT id
  FROM relay_job
 WHERE id = ANY(%(job_ids)s::text[])
 ORDER BY id
   FOR NO KEY UPDATE;

-- name: hold_queue_names
-- A transaction-level advisory lock for each queue named, in the order given (the caller
-- sorts them): a group commit of several calls that lock relay_queue rows takes these for its
-- controls ops' queues first, then the rows (queue_controls_for_claim), so two such batches
-- meet in name order even on rows one of them is yet to insert (a pause of a queue with no
-- row inserts it). Params: queues (text[], sorted).
SELECT pg_advisory_xact_lock(hashtextextended('relay.queue:' || name, 0))
  FROM unnest(%(queues)s::text[]) AS name;

-- name: queue_controls_for_claim
-- The controls of the queues a claim names (one primary-key seek each on relay_queue; a queue
-- without a row runs unlimited). PostgreSQL: the rows are locked until COMMIT, in name order
-- (no deadlock between two claims; a group commit of several calls that lock these rows, claims
-- and controls ops, first runs this once for all their queues, QueueService.hold_queue_controls),
-- so a claim on another server waits here
-- and then counts the leases this one made: a cap holds across servers. Params: queues (a
-- JSON array of names).
SELECT name, paused, max_leased, rate_per_s, burst, tokens, tokens_at_ms
  FROM relay_queue
 WHERE name IN (SELECT jsonb_array_elements_text(%(queues)s::jsonb))
 ORDER BY name
   FOR UPDATE;

-- name: queue_controlled
-- Whether any of a claim's queues has controls (after a guarded claim leased nothing).
-- Params: queues (text[]).
SELECT EXISTS (SELECT 1 FROM relay_queue WHERE name = ANY(%(queues)s::text[])) AS controlled;

-- name: queue_leased
-- How many jobs of a queue are leased now, for its cap. PostgreSQL: a seek on
-- relay_job_queue_state over the queue's leased jobs (at most about its cap), or a read of the
-- partial relay_job_leased (every leased job): either way bounded by the leases, not by the
-- backlog. Run as its own
-- statement after queue_controls_for_claim locked the row, so its snapshot sees the leases of
-- the claim it waited for (READ COMMITTED takes a snapshot per statement). Params: queue.
SELECT count(*) AS n FROM relay_job WHERE queue = %(queue)s AND state = 'leased';

-- name: queue_get
-- One queue's controls, before changing them. PostgreSQL: locked until COMMIT, so a claim's
-- token bucket update and an operator's change do not overwrite each other. Params: name.
SELECT name, paused, max_leased, rate_per_s, burst, tokens, tokens_at_ms, updated_at_ms,
       updated_by
  FROM relay_queue
 WHERE name = %(name)s
   FOR UPDATE;

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
UPDATE relay_queue SET tokens = %(tokens)s, tokens_at_ms = GREATEST(tokens_at_ms, %(at_ms)s)
WHERE name = %(name)s;

-- name: relax_commit
-- Let this transaction's COMMIT return before its WAL is flushed (asynchronous commit), for
-- a transaction of lease bookkeeping only (Driver.write's durable=False); run last, outside
-- any SAVEPOINT, and undone by the transaction's end. PostgreSQL only: SQLite sets its
-- synchronous level per connection, before BEGIN. No params.
SET LOCAL synchronous_commit = off;
