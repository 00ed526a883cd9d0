"""Job states and the allowed transitions (pure; ``service.py`` is the only code applying them).

::

    submit -> PENDING (delayed) -> READY (due) -> LEASED (claim, attempt + 1)
    LEASED -> SUCCEEDED (ack) | READY (lease lost or released)
           | RETRYING (retryable failure) -> READY (retry due)
           | DEAD (retries exhausted, non-retryable, or lease lost with no budget left)
    DEAD -> READY (replay); SUCCEEDED and DEAD may be purged.
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


class Priority(enum.IntEnum):
    """Base priority classes; aging raises the effective class one step per minute waited."""

    LOW = 0
    NORMAL = 1
    HIGH = 2
    CRITICAL = 3

    @classmethod
    def parse(cls, value: object) -> Priority:
        """Accept a class name (``"high"``, any case) or its number 0-3.

        Raises:
            ValueError: not a known class.
        """
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
            return cls(value)
        raise ValueError(f"priority must be one of low, normal, high, critical (got {value!r})")


class Transition(enum.StrEnum):
    """Named transitions; each is also the event name recorded in history."""

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


S = JobState
TRANSITIONS: dict[Transition, tuple[frozenset[JobState | None], frozenset[JobState | None]]] = {
    Transition.SUBMIT: (frozenset({None}), frozenset({S.PENDING, S.READY})),
    Transition.PROMOTE: (frozenset({S.PENDING, S.RETRYING}), frozenset({S.READY})),
    Transition.CLAIM: (frozenset({S.READY}), frozenset({S.LEASED})),
    Transition.RENEW: (frozenset({S.LEASED}), frozenset({S.LEASED})),
    Transition.ACK: (frozenset({S.LEASED}), frozenset({S.SUCCEEDED})),
    Transition.FAIL_RETRY: (frozenset({S.LEASED}), frozenset({S.RETRYING})),
    Transition.FAIL_DEAD: (frozenset({S.LEASED}), frozenset({S.DEAD})),
    Transition.EXPIRE: (frozenset({S.LEASED}), frozenset({S.READY, S.DEAD})),
    Transition.RELEASE: (frozenset({S.LEASED}), frozenset({S.READY})),
    Transition.RECOVER: (frozenset({S.LEASED}), frozenset({S.READY})),
    Transition.REPLAY: (frozenset({S.DEAD}), frozenset({S.READY})),
    Transition.PURGE: (frozenset({S.SUCCEEDED, S.DEAD}), frozenset({None})),
}

TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.DEAD})


def allowed(transition: Transition, from_state: JobState | None, to_state: JobState | None) -> bool:
    """Return whether ``transition`` may move a job from ``from_state`` to ``to_state``."""
    sources, targets = TRANSITIONS[transition]
    return from_state in sources and to_state in targets


def effective_priority(base: int, ready_since_ms: int, now_ms: int) -> int:
    """Return the aged priority class: base + whole minutes waited, capped at CRITICAL.

    Args:
        base: base class 0-3 (``Priority``).
        ready_since_ms: when the job last became READY, epoch ms.
        now_ms: the current instant, epoch ms.
    """
    waited_min = max(0, now_ms - ready_since_ms) // 60_000
    return int(min(Priority.CRITICAL, base + waited_min))
