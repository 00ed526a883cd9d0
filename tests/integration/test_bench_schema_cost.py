"""``python -m relay_bench.schema_cost``: real children under valgrind on real SQLite files.
What the parts cost is what it measures (docs/benchmarking.md); here only that it measures the
statements it says, in each variant, and refuses what it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay_bench import schema_cost


@pytest.mark.slow
def test_each_variant_runs_its_statements_and_taking_a_part_away_costs_less(
    tmp_path: Path,
) -> None:
    found = schema_cost.measure(["relay", "no-attempts"], jobs=20, workdir=tmp_path)
    assert 10_000 < found["no-attempts"] < found["relay"] < 20_000_000, found


def test_unknown_variants_and_sizes_are_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="variants must be some of"):
        schema_cost.measure(["relay", "postgres"], jobs=20, workdir=tmp_path)
    with pytest.raises(ValueError, match="group must be"):
        schema_cost.measure(["relay"], jobs=10, group=16, workdir=tmp_path)
    assert list(tmp_path.iterdir()) == []
