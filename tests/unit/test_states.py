"""The transition table and aged priority (pure)."""

from __future__ import annotations

import pytest

from queue_core.states import (
    TERMINAL_STATES,
    TRANSITIONS,
    IllegalTransition,
    JobState,
    Priority,
    Transition,
    allowed,
    check,
    effective_priority,
)


def test_every_transition_has_an_entry() -> None:
    assert set(TRANSITIONS) == set(Transition)


def test_terminal_states_only_leave_by_replay_or_purge() -> None:
    leaving = {t for t, moves in TRANSITIONS.items() if any(a in TERMINAL_STATES for a, _ in moves)}
    assert leaving == {Transition.REPLAY, Transition.PURGE}
    assert not allowed(Transition.REPLAY, JobState.SUCCEEDED, JobState.READY)


def test_lease_lost_goes_to_ready_or_dead() -> None:
    assert allowed(Transition.EXPIRE, JobState.LEASED, JobState.READY)
    assert allowed(Transition.EXPIRE, JobState.LEASED, JobState.DEAD)
    assert not allowed(Transition.EXPIRE, JobState.READY, JobState.DEAD)


def test_check_passes_a_listed_move_and_raises_on_any_other() -> None:
    check(Transition.SUBMIT, None, JobState.PENDING)
    check(Transition.PURGE, JobState.SUCCEEDED, None)
    with pytest.raises(IllegalTransition, match="REPLAY: succeeded -> ready"):
        check(Transition.REPLAY, JobState.SUCCEEDED, JobState.READY)
    with pytest.raises(IllegalTransition):
        check(Transition.SUBMIT, None, JobState.LEASED)


@pytest.mark.parametrize(
    ("base", "waited_ms", "expected"),
    [
        (Priority.LOW, 0, 0),
        (Priority.LOW, 59_999, 0),
        (Priority.LOW, 60_000, 1),
        (Priority.LOW, 179_999, 2),
        (Priority.LOW, 180_000, 3),
        (Priority.LOW, 10**12, 3),
        (Priority.CRITICAL, 0, 3),
        (Priority.HIGH, -5_000, 2),  # a clock step back never lowers the class
    ],
)
def test_effective_priority_ages_one_class_per_minute(
    base: Priority, waited_ms: int, expected: int
) -> None:
    assert effective_priority(base, 1_000_000, 1_000_000 + waited_ms) == expected


@pytest.mark.parametrize(("raw", "parsed"), [("high", 2), ("LOW", 0), (" critical ", 3), (1, 1)])
def test_priority_parse(raw: object, parsed: int) -> None:
    assert Priority.parse(raw) == parsed


@pytest.mark.parametrize("raw", ["urgent", 4, -1, True, None, 1.0])
def test_priority_parse_rejects(raw: object) -> None:
    with pytest.raises(ValueError, match="priority"):
        Priority.parse(raw)
