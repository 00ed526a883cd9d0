"""The transition table and aged priority (pure)."""

from __future__ import annotations

import inspect
import re

import pytest

from queue_core.service import QueueService
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
from queue_core.storage.base import load_queries


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


# Each statement that moves a job into a terminal state, and the service method that runs it
# and then calls QueueService._entered (a job submitted with unique: "active" frees its key).
TERMINAL_STATEMENTS = {
    "ack": "_ack_in",
    "ack_many": "_ack_many",
    "fail_dead": "_end_lease",
    "expire_to_dead": "_expire",
    "expire_to_cancelled": "_expire",
    "finish_cancelled": "_end_lease",
    "cancel_waiting": "cancel",
}
# Bulk statements that free the key in their own SET (SQLite's restart recovery).
SELF_FREEING = {"recover_cancelled"}


@pytest.mark.parametrize("package", ["queue_core.storage.sqlite", "queue_core.storage.postgresql"])
def test_every_statement_into_a_terminal_state_frees_unique_active_keys(package: str) -> None:
    """A new statement that finishes jobs (a new terminal state, say ``cancelled``) must call
    ``QueueService._entered`` after it, or unique-while-active keys would stay bound: list it
    in ``TERMINAL_STATEMENTS`` once it does (tests/storage/test_meta_unique.py tests each)."""
    terminal = "|".join(sorted(s.value for s in TERMINAL_STATES))
    sets_terminal = re.compile(rf"\bSET\s+state\s*=\s*'({terminal})'", re.IGNORECASE)
    queries = load_queries(package)
    found = {name for name, sql in queries.items() if sets_terminal.search(sql)}
    assert found - SELF_FREEING == set(TERMINAL_STATEMENTS)
    for statement in found & SELF_FREEING:
        assert "THEN NULL" in queries[statement] and "unique_scope = 'active'" in queries[statement]
    for statement, method in TERMINAL_STATEMENTS.items():
        source = inspect.getsource(getattr(QueueService, method))
        assert f'"{statement}"' in source and "self._entered(" in source, (statement, method)
