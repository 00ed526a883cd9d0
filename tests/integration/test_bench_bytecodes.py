"""``relay_bench.bytecodes`` on a real ``relay_server``: the measured phase's Python is
counted by function, once per job where the code runs once per job, and nothing of the
server's start-up or of the queue's prefill is in it."""

from __future__ import annotations

from relay_bench import bytecodes
from relay_bench.instructions import parse_phases


def _per_job(counts: dict[str, list[int]], suffix: str, jobs: int) -> float:
    (calls,) = [c for name, (_, c) in counts.items() if name.endswith(suffix)]
    return calls / jobs


def test_a_servers_python_is_counted_by_function_per_phase() -> None:
    results = bytecodes.count(parse_phases("submit:1,lease_next:1"), jobs=30)
    [(submit, submitted), (lease_next, leased)] = results
    assert (submit.kind, submit.jobs, lease_next.jobs) == ("submit", 30, 30)
    # One submit per job, and the measured window holds no other: the prefill's 30 submits
    # (a batch) ran before it, the server's start-up (migrations, imports) too.
    assert _per_job(submitted, ":QueueService.submit", 30) == 1.0
    assert not [name for name in leased if name.endswith(":QueueService.submit_batch")]
    assert _per_job(leased, ":QueueService.ack", 30) == 1.0
    assert sum(b for b, _ in submitted.values()) == submit.instructions
    # Thousands of bytecodes per job; a count of nothing or of the start-up falls outside.
    assert 500 < submit.per_job < 50_000
    assert submit.per_job < lease_next.per_job
    table = bytecodes.table(results, top=3)
    assert "| submit, 1 client(s) | 30 |" in table and table.count("| `") == 6


def test_the_hook_refuses_what_it_cannot_run() -> None:
    assert bytecodes.main(["--hook", "out.json", "python", "-m", "x"]) == 2
