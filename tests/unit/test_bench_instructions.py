"""``relay_bench.instructions``' pure parts: phases, a callgrind dump's total and its self
costs by shared object (a hand-written dump in callgrind's format), the table."""

from __future__ import annotations

import pytest

from relay_bench import instructions

DUMP = """# callgrind format
version: 1
positions: line
events: Ir
summary: 0

ob=(1) /usr/lib/libpython3.13.so.1.0
fl=(1) ceval.c
fn=(1) _PyEval_EvalFrameDefault
10 100
+2 50
cob=(2) /usr/lib/libsqlite3.so.0
cfi=(2) sqlite3.c
cfn=(2) sqlite3_step
calls=3 7
* 9999
fi=(3) object.h
* 25
ob=(2)
fl=(2)
fn=(2)
7 300
-1 40
ob=/lib/libc.so.6
fl=(4) memset.S
fn=(4) memset
1 5

totals: 520
"""


def test_phases_parse_and_refuse_what_cannot_run() -> None:
    phases = instructions.parse_phases("lease_next:1, submit:16")
    assert [(p.kind, p.clients) for p in phases] == [("lease_next", 1), ("submit", 16)]
    for bad, message in (
        ("lease:1", "unknown phase kind"),
        ("submit:0", "must be 1..64"),
        ("submit:x", "must be 1..64"),
        ("", "no phase given"),
    ):
        with pytest.raises(ValueError, match=message):
            instructions.parse_phases(bad)


def test_the_total_comes_from_the_totals_line() -> None:
    assert instructions.total(DUMP) == 520
    with pytest.raises(ValueError, match="not a callgrind dump"):
        instructions.total("events: Ir\n")


def test_self_costs_are_summed_by_object_without_the_calls_inclusive_cost() -> None:
    # libpython: 100 + 50 + 25 (an inlined file keeps its object); the 9,999 after calls= is
    # the call's inclusive cost; (2) was defined by cob= and used by ob=; libc is uncompressed.
    assert instructions.by_object(DUMP) == {
        "libpython3.13.so.1.0": 175,
        "libsqlite3.so.0": 340,
        "libc.so.6": 5,
    }
    assert sum(instructions.by_object(DUMP).values()) == instructions.total(DUMP)


def test_the_table_gives_thousands_per_job() -> None:
    phase = instructions.Phase("lease_next", 1, jobs=4, instructions=8_000_000)
    phase.objects = {"libpython3.13.so.1.0": 6_000_000, "libsqlite3.so.0": 2_000_000}
    text = instructions.table([phase], objects=True)
    assert "| lease_next, 1 client(s) | 4 | 2,000 |" in text
    assert "| libpython3.13.so.1.0 | 1,500 |" in text
    assert instructions.Phase("submit", 1).per_job == 0.0
