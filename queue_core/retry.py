"""Retry policy: fixed or bounded exponential backoff, optional jitter, and the retry decision.

Pure functions, split as River splits its retry policy: the deterministic bounded delay
(``backoff_ms``), tested exactly, and the random part (``jittered_ms``), property-tested for its
bounds. Jitter draws 50-100% of the bounded delay, as Dramatiq does above its cap.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Literal

Backoff = Literal["fixed", "exponential"]


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a job is retried after a failure.

    Attributes:
        max_retries: failures that are retried; failure number ``max_retries + 1`` dead-letters.
        backoff: ``"fixed"`` (always ``base_ms``) or ``"exponential"`` (``base_ms * 2**(n-1)``).
        base_ms: the fixed delay, or the first exponential delay, in ms (>= 0).
        cap_ms: the largest delay in ms (exponential only; >= base_ms).
        jitter: scale each delay by a uniform factor in [0.5, 1.0].
    """

    max_retries: int = 3
    backoff: Backoff = "exponential"
    base_ms: int = 1_000
    cap_ms: int = 300_000
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.backoff not in ("fixed", "exponential"):
            raise ValueError("backoff must be 'fixed' or 'exponential'")
        if self.base_ms < 0 or self.cap_ms < 0:
            raise ValueError("backoff delays must be >= 0 ms")
        if self.backoff == "exponential" and self.cap_ms < self.base_ms:
            raise ValueError("backoff cap_ms must be >= base_ms")


@dataclasses.dataclass(frozen=True, slots=True)
class RetryDecision:
    """Outcome of a failure: retry at ``retry_at_ms``, or dead-letter when it is None.

    Attributes:
        retry_at_ms: epoch ms when the job becomes READY again, or None for DEAD.
        dead_reason: why the job dies (None when it is retried).
    """

    retry_at_ms: int | None
    dead_reason: str | None = None


def backoff_ms(policy: RetryPolicy, failure: int) -> int:
    """Return the bounded delay in ms before retrying after failure number ``failure`` (1-based).

    Never overflows: the exponent stops growing once the delay reaches the cap, so attempt
    numbers in the billions cost the same as small ones.
    """
    if failure < 1:
        raise ValueError("failure numbers start at 1")
    if policy.backoff == "fixed":
        return policy.base_ms
    if policy.base_ms == 0:
        return 0
    shift = failure - 1
    # base << shift > cap as soon as shift reaches cap's bit length, so clamp before shifting.
    if shift >= policy.cap_ms.bit_length():
        return policy.cap_ms
    return min(policy.cap_ms, policy.base_ms << shift)


def jittered_ms(policy: RetryPolicy, failure: int, rng: random.Random) -> int:
    """Return the delay after ``failure``: ``backoff_ms`` scaled into [50%, 100%] when jittered."""
    bounded = backoff_ms(policy, failure)
    if not policy.jitter:
        return bounded
    return round(rng.uniform(0.5, 1.0) * bounded)


def decide(
    policy: RetryPolicy,
    *,
    failures: int,
    retryable: bool,
    now_ms: int,
    rng: random.Random,
    error: str,
) -> RetryDecision:
    """Decide what a failure does.

    Args:
        policy: the job's retry policy.
        failures: failures counted so far, including this one (>= 1).
        retryable: False sends the job straight to DEAD.
        now_ms: the current instant, epoch ms.
        rng: source of jitter.
        error: the failure's text, used in the dead reason.
    Returns:
        RetryDecision with ``retry_at_ms`` set, or with a ``dead_reason``.
    """
    if not retryable:
        return RetryDecision(None, f"non-retryable: {error}")
    if failures > policy.max_retries:
        return RetryDecision(None, f"attempts exhausted: {error}")
    return RetryDecision(now_ms + jittered_ms(policy, failures, rng))
