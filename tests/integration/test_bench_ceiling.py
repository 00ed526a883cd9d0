"""The CPython ceiling server (``relay_bench.ceiling``): a real process on a real socket,
driven by Relay's own client, answers the bench's ops as ``relay_server`` does, and
``relay bench --with-ceiling`` measures it beside Relay. Its speed is what the benchmark
measures (docs/benchmarking.md), never checked here."""

from __future__ import annotations

import contextlib
import io
import socket
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from django.core.management import call_command

from queue_core import errors
from queue_core.client import RelayClient
from relay_bench import ceiling as ceiling_module
from relay_bench import floor, procs


@pytest.fixture(params=ceiling_module.READERS)
def ceiling(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[procs.CeilingProcess]:
    """The ceiling on a lean file, reading through asyncio's streams or a ``Protocol``."""
    path = Path(floor.create_lean(str(tmp_path / "c.db")))
    server = procs.CeilingProcess(path, "FULL", reader=request.param)
    try:
        yield server
    finally:
        assert server.stop() == 0  # SIGTERM: a clean stop


@pytest.fixture
def relay_ceiling(tmp_path: Path) -> Iterator[procs.CeilingProcess]:
    """The ceiling on Relay's own table (``--schema relay``), a copy of a migrated file."""
    db = procs.fresh_db(procs.template_db(tmp_path), tmp_path, "c")
    server = procs.CeilingProcess(db, "FULL", schema="relay")
    try:
        yield server
    finally:
        assert server.stop() == 0


def _rows(path: Path, table: str = "job") -> dict[str, str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return dict(conn.execute(f"SELECT id, state FROM {table}").fetchall())


def _serve_submit_lease_and_ack(address: str) -> list[str]:
    """Submit three jobs, lease and ack each (one ack leasing the next), refuse a wrong token;
    return the jobs' ids."""
    with RelayClient(address, timeout_s=10) as client:
        client.ping()
        job = client.submit("q", {"n": 1})["job"]
        assert (job["queue"], job["state"], job["payload"]) == ("q", "ready", {"n": 1})
        batch = client.submit_batch([{"queue": "q", "payload": {"n": n}} for n in (2, 3)])
        ids = [job["id"], *(r["job_id"] for r in batch["results"])]
        first = client.lease(["q"], worker_id="w", max_jobs=1)
        assert [j["job_id"] for j in first] == ids[:1]
        assert first[0]["payload"] == {"n": 1}
        with pytest.raises(errors.RelayError) as refused:
            client.ack(ids[0], worker_id="w", lease_token="not-the-token")
        assert refused.value.code == "STALE_TOKEN"
        reply = client.ack(
            ids[0], worker_id="w", lease_token=first[0]["lease_token"], lease_next={"queues": ["q"]}
        )
        assert [j["job_id"] for j in reply["next"]] == ids[1:2]
        second = reply["next"][0]
        client.ack(ids[1], worker_id="w", lease_token=second["lease_token"])
        third = client.lease(["q"], worker_id="w")
        client.ack(ids[2], worker_id="w", lease_token=third[0]["lease_token"])
        assert client.lease(["q"], worker_id="w") == []
    return ids


def test_the_ceiling_serves_submit_lease_and_ack_like_relay(
    ceiling: procs.CeilingProcess, tmp_path: Path
) -> None:
    ids = _serve_submit_lease_and_ack(ceiling.address)
    assert _rows(tmp_path / "c.db") == dict.fromkeys(ids, "succeeded")


def test_on_relays_schema_it_writes_what_relays_transitions_write(
    relay_ceiling: procs.CeilingProcess, tmp_path: Path
) -> None:
    ids = _serve_submit_lease_and_ack(relay_ceiling.address)
    with (
        socket.create_connection(("127.0.0.1", relay_ceiling.port), timeout=10) as sock,
        sock.makefile("rb") as stream,  # closed too, or the connection stays open
    ):
        # Relay's ack guard names the worker: another worker's ack of a live lease is refused.
        submit = {"id": 1, "op": "submit", "args": {"queue": "g", "payload": 1}}
        lease = {"id": 2, "op": "lease", "args": {"queues": ["g"], "worker_id": "a"}}
        for frame in (submit, lease):
            sock.sendall(orjson.dumps(frame) + b"\n")
            reply = orjson.loads(stream.readline())
        held = reply["result"]["jobs"][0]
        ack = {"job_id": held["job_id"], "lease_token": held["lease_token"], "worker_id": "b"}
        sock.sendall(orjson.dumps({"id": 3, "op": "ack", "args": ack}) + b"\n")
        assert orjson.loads(stream.readline())["error"]["code"] == "STALE_TOKEN"
    db = tmp_path / "c.db"
    assert _rows(db, "relay_job") == dict.fromkeys(ids, "succeeded") | {held["job_id"]: "leased"}
    with contextlib.closing(sqlite3.connect(db)) as conn:
        attempts = conn.execute(
            "SELECT job_id, attempt, worker_id, outcome FROM relay_attempt ORDER BY job_id"
        ).fetchall()
        counts = dict(
            conn.execute("SELECT queue || '/' || state, n FROM relay_job_count WHERE n > 0")
        )
    assert attempts == [(i, 1, "w", "succeeded") for i in ids] + [(held["job_id"], 1, "a", None)]
    assert counts == {"q/succeeded": 3, "g/leased": 1}


def test_a_waiting_lease_is_woken_by_a_later_submit_and_an_idle_one_ends_empty(
    ceiling: procs.CeilingProcess,
) -> None:
    with socket.create_connection(("127.0.0.1", ceiling.port), timeout=10) as sock:
        stream = sock.makefile("rb")
        # One connection, in this order: the lease is read (and parks) before the submit.
        lease = {"id": 1, "op": "lease", "args": {"queues": ["w"], "wait_ms": 5000}}
        submit = {"id": 2, "op": "submit", "args": {"queue": "w", "payload": {"n": 7}}}
        sock.sendall(b"".join(orjson.dumps(f) + b"\n" for f in (lease, submit)))
        replies = [orjson.loads(stream.readline()) for _ in range(2)]
        assert [r["id"] for r in replies] == [2, 1]
        assert replies[1]["result"]["jobs"][0]["job_id"] == replies[0]["result"]["job"]["id"]
        idle = {"id": 3, "op": "lease", "args": {"queues": ["empty"], "wait_ms": 20}}
        sock.sendall(orjson.dumps(idle) + b"\n")
        assert orjson.loads(stream.readline()) == {"id": 3, "ok": True, "result": {"jobs": []}}


@pytest.mark.slow
@pytest.mark.parametrize("schema", ["lean", "relay"])
def test_bench_runs_the_ceiling_beside_relay_and_shows_it_per_target(
    tmp_path: Path, schema: str
) -> None:
    out = io.StringIO()
    call_command(
        "relay_bench",
        "--with-ceiling",
        "--ceiling-schema",
        schema,
        "--quick",
        "--json",
        "--scale",
        "0.01",
        "--producers",
        "1,16",
        "--workers",
        "1,16",
        "--no-backlog",
        "--no-http",
        "--no-progress",
        "--markdown-out",
        str(tmp_path / "bench.md"),
        stdout=out,
        stderr=io.StringIO(),
    )
    doc = orjson.loads(out.getvalue())
    assert doc["meta"]["with_ceiling"] is True
    assert doc["meta"]["ceiling_schema"] == schema
    ceiling = doc["ceiling"]
    rows = ceiling["submit"] + ceiling["lease_ack"]
    assert rows and all(r["ops"] > 0 and r["errors"] == 0 for r in rows)
    assert all(r["ratio_to_floor"] > 0 for r in rows)  # against the run's own floors
    assert {r.get("mode") for r in ceiling["lease_ack"]} == {None, "lease_next"}
    assert ceiling["submit_to_start"]["samples"] > 0 and not ceiling["submit_to_start"]["problems"]
    judged = {t["name"]: t for t in doc["targets"]}
    lease = judged["lease+ack, 16 workers in 4 processes, vs lean claim+ack floor"]
    assert lease["ceiling"]["value"] > 0
    assert (
        "ceiling" not in judged["relay_worker --concurrency 16 draining, vs lean claim+ack floor"]
    )
    where = " on Relay's schema" if schema == "relay" else ""
    header = f"| ceiling server{where}: median (min-max), met |"
    assert header in (tmp_path / "bench.md").read_text()


def test_a_request_it_cannot_read_is_refused_alone(
    ceiling: procs.CeilingProcess, tmp_path: Path
) -> None:
    with socket.create_connection(("127.0.0.1", ceiling.port), timeout=10) as sock:
        stream = sock.makefile("rb")
        frames = [
            {"id": 1, "op": "submit", "args": {"queue": ["not", "a", "name"], "payload": 1}},
            {"id": 2, "op": "ack", "args": {"job_id": "j", "lease_token": "t", "lease_next": 5}},
            {"id": 3, "op": "submit", "args": {"queue": "q", "payload": {"n": 1}}},
        ]
        sock.sendall(b"".join(orjson.dumps(f) + b"\n" for f in frames))
        replies = {r["id"]: r for r in (orjson.loads(stream.readline()) for _ in frames)}
    assert replies[1]["error"]["code"] == replies[2]["error"]["code"] == "INVALID_ARGUMENT"
    assert _rows(tmp_path / "c.db") == {replies[3]["result"]["job"]["id"]: "ready"}


def test_lines_split_across_reads_and_several_in_one_are_each_answered(
    ceiling: procs.CeilingProcess,
) -> None:
    """A line's start sent alone, then its rest with two more lines in one write (what
    ``LineProtocol`` keeps between ``data_received`` calls, when the two arrive apart)."""
    frames = b"".join(
        orjson.dumps({"id": n, "op": "submit", "args": {"queue": "s", "payload": n}}) + b"\n"
        for n in range(3)
    )
    with socket.create_connection(("127.0.0.1", ceiling.port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = sock.makefile("rb")
        sock.sendall(frames[:7])  # the first line's start alone
        sock.sendall(frames[7:])  # its rest and two whole lines
        replies = [orjson.loads(stream.readline()) for _ in range(3)]
    assert [(r["id"], r["result"]["job"]["payload"]) for r in replies] == [(0, 0), (1, 1), (2, 2)]
