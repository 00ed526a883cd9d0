"""Percentiles and rates for the benchmark (pure: no I/O, no Django)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Return the ``q``-th percentile (0..100) of already sorted values, nearest-rank method.

    Nearest rank never invents a value between two samples, so p99 of 200 samples is the
    198th smallest and ``max`` is p100.

    Raises:
        ValueError: ``sorted_values`` is empty or ``q`` is out of range.
    """
    if not sorted_values:
        raise ValueError("no values")
    if not 0 <= q <= 100:
        raise ValueError("q must be in 0..100")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return float(sorted_values[rank - 1])


def summarize(values_ms: Sequence[float]) -> dict[str, Any]:
    """Summarise latencies in ms: ``{"n", "p50", "p95", "p99", "max", "mean"}`` (ms, 3 decimals).

    An empty input gives ``{"n": 0}`` and None for the figures.
    """
    if not values_ms:
        return {"n": 0, "p50": None, "p95": None, "p99": None, "max": None, "mean": None}
    ordered = sorted(values_ms)
    return {
        "n": len(ordered),
        "p50": round(percentile(ordered, 50), 3),
        "p95": round(percentile(ordered, 95), 3),
        "p99": round(percentile(ordered, 99), 3),
        "max": round(ordered[-1], 3),
        "mean": round(sum(ordered) / len(ordered), 3),
    }


def rate(count: int, seconds: float) -> float:
    """Return ``count / seconds`` rounded to one decimal (0 when no time passed)."""
    return round(count / seconds, 1) if seconds > 0 else 0.0


def ratio(value: float | None, floor: float | None) -> float | None:
    """Return ``value / floor`` rounded to 3 decimals, or None when either is missing or 0."""
    if not value or not floor:
        return None
    return round(value / floor, 3)


def median(values: Sequence[float | None]) -> float | None:
    """Return the median of the values that are not None (the mean of the middle two for an
    even count), or None when there are none."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    mid = len(present) // 2
    if len(present) % 2:
        return float(present[mid])
    return (present[mid - 1] + present[mid]) / 2


def spread(values: Sequence[float | None], digits: int = 3) -> dict[str, Any]:
    """Summarise one figure over repeated runs: ``{"median", "min", "max", "runs"}``.

    ``runs`` keeps every run's value in run order (None where a run did not measure it);
    ``median``, ``min`` and ``max`` ignore the Nones (all None: all three None). Rounded to
    ``digits`` decimals. Published figures are medians with their spread, never a best run
    (issue 15).
    """
    present = [v for v in values if v is not None]
    mid = median(present)
    return {
        "median": None if mid is None else round(mid, digits),
        "min": round(min(present), digits) if present else None,
        "max": round(max(present), digits) if present else None,
        "runs": list(values),
    }


def judge(value: float | None, op: str, goal: float) -> bool | None:
    """Whether ``value op goal`` holds (``op`` one of ``>=``, ``<=``, ``<``, ``>``), or None
    when ``value`` was not measured.

    Raises:
        ValueError: ``op`` is not one of the four.
    """
    if op not in (">=", "<=", "<", ">"):
        raise ValueError(f"unknown comparison {op!r}")
    if value is None:
        return None
    return {
        ">=": value >= goal,
        "<=": value <= goal,
        "<": value < goal,
        ">": value > goal,
    }[op]
