"""``relay_bench.instructions`` on a real ``relay_server`` under valgrind's callgrind: each
phase's jobs all run, and their instructions are counted and split by shared object.

Needs valgrind (``.ci/run`` installs it); without it this test fails, it does not skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from relay_bench import instructions


@pytest.mark.slow
def test_a_servers_instructions_are_counted_per_phase(tmp_path: Path) -> None:
    phases = instructions.count(
        instructions.parse_phases("lease_next:1,submit:1"), jobs=20, objects=True, workdir=tmp_path
    )
    assert [(p.kind, p.jobs) for p in phases] == [("lease_next", 20), ("submit", 20)]
    for phase in phases:
        # Hundreds of thousands to a few million per job here; a count of nothing, or of the
        # whole start-up, would fall outside.
        assert 100_000 < phase.per_job < 20_000_000, phase
        assert sum(phase.objects.values()) == phase.instructions
        assert any(name.startswith("libpython") for name in phase.objects)
        assert any(name.startswith("libsqlite3") for name in phase.objects)
    # Leasing and acking a job is more work than submitting one.
    assert phases[0].per_job > phases[1].per_job


@pytest.mark.slow
def test_the_ceiling_servers_instructions_are_counted_the_same_way(tmp_path: Path) -> None:
    # The lean table's; --ceiling-schema relay's server is tested without valgrind
    # (tests/integration/test_bench_ceiling.py: about 3 s, against about 14 s here).
    (phase,) = instructions.count(
        instructions.parse_phases("lease_next:1"), jobs=20, workdir=tmp_path, server="ceiling"
    )
    assert phase.jobs == 20
    assert 10_000 < phase.per_job < 20_000_000, phase


def test_an_unknown_server_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown server"):
        instructions.count([], jobs=1, workdir=tmp_path, server="beanstalkd")
    with pytest.raises(ValueError, match="unknown ceiling schema"):
        instructions.count([], jobs=1, workdir=tmp_path, server="ceiling", ceiling_schema="x")
