"""Job states and the transition table (pure): ``QueueService`` checks each state change it
makes against ``TRANSITIONS`` (``check``), and is the only code that makes one.

::

    submit -> READY, or PENDING (delayed) -> READY (due)
    READY -> LEASED (claim, attempt + 1); LEASED -> LEASED (renew)
    LEASED -> SUCCEEDED (ack)
           | READY (lease lost with retries left, released, or recovered at a server start)
           | RETRYING (retryable failure) -> READY (retry due)
           | DEAD (retries exhausted, non-retryable, or lease lost with no budget left)
    READY | PENDING | RETRYING -> CANCELLED (cancel)
    LEASED -> LEASED (cancel requested: the next renew tells the worker to stop)
           -> CANCELLED (its worker fails or releases it, or the lease expires)
    DEAD | CANCELLED -> READY (replay); SUCCEEDED, DEAD and CANCELLED may be purged (the row
    is deleted).

Cancelling follows Oban's ``cancel_job`` (a waiting job is cancelled at once, an executing one
is told to stop) and Celery's ``revoke`` (a running task is only interrupted when its worker
learns of it); a cancelled job may be replayed like a dead letter (Oban's ``retry_job`` of a
cancelled job).
"""

from __future__ import annotations

import enum


class JobState(enum.StrEnum):
    """Where a job is in its life."""

    PENDING = "pending"
    READY = "ready"
    LEASED = "leased"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"


class Priority(enum.IntEnum):
    """Base priority classes; aging raises the effective class one step per minute waited."""

    LOW = 0
    NORMAL = 1
    HIGH = 2
    CRITICAL = 3

    @classmethod
    def parse(cls, value: object) -> Priority:
        """Accept a class name (``"high"``, as ``class_name`` spells it) or its number 0-3.

        Raises:
            ValueError: not a known class.
        """
        name = class_name(value)
        if isinstance(name, str) and name.isascii():  # as class_name left it, lower case
            try:
                return cls[name.upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
            return cls(value)
        raise ValueError(f"priority must be one of low, normal, high, critical (got {value!r})")


def class_name(value: object) -> object:
    """A priority class name as every surface takes it (TCP, HTTP, the CLI): ASCII in any
    case with spaces around, e.g. ``" High "`` -> ``"high"``; anything else as it is, for the
    caller to refuse (``"h\u0131gh"``: its ``upper()`` would be ``"HIGH"``)."""
    return value.strip().lower() if isinstance(value, str) and value.isascii() else value


class Transition(enum.StrEnum):
    """The named state changes ``QueueService`` makes (``TRANSITIONS`` lists each one's moves).

    Five names are also the ``event`` the job's event log (``relay_event``) records:
    ``replayed``, ``purged``, ``recovered``, ``cancelled`` and ``cancel_requested``
    (``LOGGED_EVENTS``). The others leave no event:
    a claim opens a delivery row (``relay_attempt``), which ack, fail, release, expiry and
    recovery close with an outcome (``succeeded``, ``failed``, ``released``,
    ``lease_expired``, ``recovered``); submit, promote and renew change only the job row.
    """

    SUBMIT = "submitted"
    PROMOTE = "promoted"
    CLAIM = "leased"
    RENEW = "renewed"
    ACK = "acked"
    FAIL_RETRY = "retry_scheduled"
    FAIL_DEAD = "dead_lettered"
    EXPIRE = "lease_expired"
    RELEASE = "released"
    RECOVER = "recovered"
    REPLAY = "replayed"
    PURGE = "purged"
    CANCEL = "cancelled"
    REQUEST_CANCEL = "cancel_requested"


S = JobState
# Each transition's (from, to) moves; None is "no row" (before submit, after purge).
TRANSITIONS: dict[Transition, frozenset[tuple[JobState | None, JobState | None]]] = {
    Transition.SUBMIT: frozenset({(None, S.READY), (None, S.PENDING)}),
    Transition.PROMOTE: frozenset({(S.PENDING, S.READY), (S.RETRYING, S.READY)}),
    Transition.CLAIM: frozenset({(S.READY, S.LEASED)}),
    Transition.RENEW: frozenset({(S.LEASED, S.LEASED)}),
    Transition.ACK: frozenset({(S.LEASED, S.SUCCEEDED)}),
    Transition.FAIL_RETRY: frozenset({(S.LEASED, S.RETRYING)}),
    Transition.FAIL_DEAD: frozenset({(S.LEASED, S.DEAD)}),
    Transition.EXPIRE: frozenset({(S.LEASED, S.READY), (S.LEASED, S.DEAD)}),
    Transition.RELEASE: frozenset({(S.LEASED, S.READY)}),
    Transition.RECOVER: frozenset({(S.LEASED, S.READY)}),
    Transition.REPLAY: frozenset({(S.DEAD, S.READY), (S.CANCELLED, S.READY)}),
    Transition.PURGE: frozenset({(S.SUCCEEDED, None), (S.DEAD, None), (S.CANCELLED, None)}),
    # A waiting job at once; a leased one when its worker gives it up (fail, release) or its
    # lease expires after a cancel was requested.
    Transition.CANCEL: frozenset(
        {(S.READY, S.CANCELLED), (S.PENDING, S.CANCELLED), (S.RETRYING, S.CANCELLED)}
        | {(S.LEASED, S.CANCELLED)}
    ),
    Transition.REQUEST_CANCEL: frozenset({(S.LEASED, S.LEASED)}),
}
_ALLOWED = frozenset((t, a, b) for t, moves in TRANSITIONS.items() for a, b in moves)

# The transitions whose name ``relay_event.event`` records (``QueueService._event`` and the
# ``recover_events`` statement write them).
LOGGED_EVENTS = frozenset(
    {
        Transition.REPLAY,
        Transition.PURGE,
        Transition.RECOVER,
        Transition.CANCEL,
        Transition.REQUEST_CANCEL,
    }
)

TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED})
"""The states a job leaves only by replay or deletion (a new terminal state joins this set)."""
# The states a cancel moves straight to CANCELLED (nothing runs them now).
WAITING_STATES = frozenset({JobState.READY, JobState.PENDING, JobState.RETRYING})


def is_terminal(state: JobState | str) -> bool:
    """Return whether ``state`` (a ``JobState`` or its value) is in ``TERMINAL_STATES``.

    ``QueueService`` asks it after every state change it makes: a job submitted with
    ``unique: "active"`` frees its idempotency key on entering a terminal state.
    """
    return state in TERMINAL_STATES


class IllegalTransition(RuntimeError):
    """A state change the table does not list: a bug in the service, never a caller's error
    (the surfaces answer ``INTERNAL`` and log it)."""


def allowed(transition: Transition, from_state: JobState | None, to_state: JobState | None) -> bool:
    """Return whether ``transition`` may move a job from ``from_state`` to ``to_state``."""
    return (transition, from_state, to_state) in _ALLOWED


def check(transition: Transition, from_state: JobState | None, to_state: JobState | None) -> None:
    """Assert that the table lists this move; ``QueueService`` calls it at each state change,
    before (or, where the old state is read back, in the same transaction as) its UPDATE.

    Args:
        transition: the change's name.
        from_state: the state it leaves (None: the job does not exist yet).
        to_state: the state it enters (None: the job is deleted).
    Raises:
        IllegalTransition: the move is not in ``TRANSITIONS``.
    """
    if (transition, from_state, to_state) not in _ALLOWED:
        raise IllegalTransition(
            f"{transition.name}: {from_state} -> {to_state} is not in the transition table"
        )


def effective_priority(base: int, ready_since_ms: int, now_ms: int) -> int:
    """Return the aged priority class: base + whole minutes waited, capped at CRITICAL.

    Args:
        base: base class 0-3 (``Priority``).
        ready_since_ms: when the job last became READY, epoch ms.
        now_ms: the current instant, epoch ms.
    """
    waited_min = max(0, now_ms - ready_since_ms) // 60_000
    return int(min(Priority.CRITICAL, base + waited_min))
