"""The networked django.tasks backend's pauses between repeats (``tasks_backend._pause``)."""

from __future__ import annotations

from queue_core.tasks_backend import LAST_TRY_S, NETWORK_PAUSES_S, _pause


def test_a_pause_is_shortened_to_leave_time_for_one_more_try() -> None:
    # A third review: with 0.24 s of TIMEOUT left the 0.5 s pause was refused, and the call
    # failed though the next server was healthy.
    assert _pause(0, 10.0) == NETWORK_PAUSES_S[0]
    assert _pause(99, 10.0) == NETWORK_PAUSES_S[-1]
    assert _pause(1, 0.24) == 0.24 - LAST_TRY_S
    assert _pause(1, LAST_TRY_S) == 0.0
    assert _pause(1, LAST_TRY_S - 0.001) is None
