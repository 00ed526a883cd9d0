"""Backoff and retry decisions: exact delays, jitter bounds, no overflow."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_core.retry import RetryPolicy, backoff_ms, decide, jittered_ms


def test_exponential_backoff_doubles_up_to_cap() -> None:
    policy = RetryPolicy(backoff="exponential", base_ms=100, cap_ms=1000, jitter=False)
    assert [backoff_ms(policy, n) for n in range(1, 7)] == [100, 200, 400, 800, 1000, 1000]


def test_fixed_backoff_is_constant() -> None:
    policy = RetryPolicy(backoff="fixed", base_ms=250, cap_ms=250, jitter=False)
    assert {backoff_ms(policy, n) for n in range(1, 50)} == {250}


@pytest.mark.parametrize("failure", [64, 65, 10**6, 10**18])
def test_huge_attempt_numbers_do_not_overflow(failure: int) -> None:
    policy = RetryPolicy(backoff="exponential", base_ms=1000, cap_ms=300_000)
    assert backoff_ms(policy, failure) == 300_000


def test_zero_base_means_no_delay() -> None:
    assert backoff_ms(RetryPolicy(base_ms=0, cap_ms=0), 10**9) == 0


def test_failure_numbers_start_at_one() -> None:
    with pytest.raises(ValueError, match="start at 1"):
        backoff_ms(RetryPolicy(), 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_retries": -1},
        {"backoff": "linear"},
        {"base_ms": -1},
        {"base_ms": 10, "cap_ms": 5},
    ],
)
def test_policy_rejects_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each message differs
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


@given(
    base=st.integers(0, 10**7),
    extra=st.integers(0, 10**8),
    failure=st.integers(1, 10**12),
    seed=st.integers(0, 2**32),
    backoff=st.sampled_from(["fixed", "exponential"]),
)
def test_jitter_stays_within_half_to_full_bounded_delay(
    base: int, extra: int, failure: int, seed: int, backoff: str
) -> None:
    policy = RetryPolicy(backoff=backoff, base_ms=base, cap_ms=base + extra, jitter=True)  # type: ignore[arg-type]
    bounded = backoff_ms(policy, failure)
    assert bounded <= (base if backoff == "fixed" else base + extra)
    delay = jittered_ms(policy, failure, random.Random(seed))
    assert 0.5 * bounded - 0.5 <= delay <= bounded


def test_decide_counts_failures_against_budget() -> None:
    policy = RetryPolicy(max_retries=2, backoff="fixed", base_ms=10, cap_ms=10, jitter=False)
    rng = random.Random(0)
    first = decide(policy, failures=1, retryable=True, now_ms=1000, rng=rng, error="e")
    assert first.retry_at_ms == 1010 and first.dead_reason is None
    assert (
        decide(policy, failures=2, retryable=True, now_ms=0, rng=rng, error="e").retry_at_ms == 10
    )
    third = decide(policy, failures=3, retryable=True, now_ms=0, rng=rng, error="e")
    assert third.retry_at_ms is None and third.dead_reason == "attempts exhausted: e"
    hard = decide(policy, failures=1, retryable=False, now_ms=0, rng=rng, error="bad")
    assert hard.retry_at_ms is None and hard.dead_reason == "non-retryable: bad"
