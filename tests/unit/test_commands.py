"""The relay_* client commands against a canned NDJSON server: output, arguments, exit codes."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from django.core.management import call_command, load_command_class
from django.core.management.base import CommandError

from queue_core.client import format_address
from tests.unit.canned_server import CannedServer, Script, error, ok

JOB = {
    "id": "job_1",
    "queue": "email",
    "state": "dead",
    "priority": "high",
    "payload": {"user_id": 42},
    "attempt": 2,
    "failures": 2,
    "max_retries": 1,
    "retry_policy": {"backoff": "exponential", "base_ms": 1000, "cap_ms": 300000, "jitter": True},
    "idempotency_key": None,
    "created_at_ms": 1767225600000,
    "available_at_ms": None,
    "ready_since_ms": 1767225600000,
    "leased_by": None,
    "lease_expires_at_ms": None,
    "finished_at_ms": 1767225660000,
    "last_error": "smtp timeout",
    "dead_reason": "attempts exhausted: smtp timeout",
    "history": [
        {
            "attempt": 1,
            "worker_id": "host:1",
            "started_at_ms": 1767225600000,
            "ended_at_ms": 1767225601500,
            "outcome": "failed",
            "error": "smtp timeout",
        }
    ],
    "events": [
        {
            "event": "dead_lettered",
            "from_state": "leased",
            "to_state": "dead",
            "at_ms": 1767225660000,
            "actor": None,
        }
    ],
}


@pytest.fixture
def server() -> Iterator[Callable[[Script], CannedServer]]:
    servers: list[CannedServer] = []

    def start(script: Script) -> CannedServer:
        servers.append(CannedServer(script))
        return servers[-1]

    yield start
    for canned in servers:
        canned.close()


def run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def fails(*args: str) -> CommandError:
    with pytest.raises(CommandError) as caught:
        run(*args)
    return caught.value


def test_submit_prints_the_job_id_and_sends_the_options(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"job": JOB, "deduplicated": False}))
    out, _ = run(
        "relay_submit",
        "email",
        "--payload",
        '{"user_id":42}',
        "--priority",
        "HIGH",  # any ASCII case, as over TCP and HTTP
        "--retries",
        "5",
        "--backoff",
        "fixed",
        "--backoff-base-ms",
        "250",
        "--no-jitter",
        "--run-at",
        "2026-01-01T00:00:01Z",
        "--idempotency-key",
        "k1",
        "--address",
        canned.address,
    )
    assert out == "job_1\n"
    assert canned.requests[0]["op"] == "submit"
    assert canned.requests[0]["args"] == {
        "queue": "email",
        "payload": {"user_id": 42},
        "priority": "high",
        "max_retries": 5,
        "backoff": "fixed",
        "backoff_base_ms": 250,
        "jitter": False,
        "run_at_ms": 1767225601000,
        "idempotency_key": "k1",
    }


def test_a_refused_key_says_how_relay_commands_send_one(server: Any) -> None:
    # The server's message names the protocol's ways (a Bearer header, a hello op); a
    # newcomer at the command line needs the option (the README walkthrough).
    canned = server(lambda req, conn: error(req, "UNAUTHENTICATED", "an API key is required"))
    refused = fails("relay_stats", "--address", canned.address)
    assert str(refused) == (
        "UNAUTHENTICATED: an API key is required (relay commands: --api-key or RELAY_API_KEY)"
    )
    assert refused.returncode == 1


def test_submit_sends_meta_and_unique(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"job": JOB, "deduplicated": False}))
    run(
        "relay_submit",
        "q",
        "--payload",
        "1",
        "--idempotency-key",
        "k",
        "--unique",
        "active",
        "--meta",
        "traceparent=00-abc-01",
        "--meta",
        "query=a=b",
        "--meta",
        "empty=",
        "--address",
        canned.address,
    )
    assert canned.requests[0]["args"] == {
        "queue": "q",
        "payload": 1,
        "idempotency_key": "k",
        "unique": "active",
        "meta": {"traceparent": "00-abc-01", "query": "a=b", "empty": ""},
    }


def test_submit_refuses_meta_without_equals_before_sending(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"job": JOB, "deduplicated": False}))
    with pytest.raises(CommandError, match="INVALID_ARGUMENT: --meta 'oops' is not KEY=VALUE"):
        run("relay_submit", "q", "--payload", "1", "--meta", "oops", "--address", canned.address)
    assert canned.requests == []


def test_submit_marks_a_duplicate(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"job": JOB, "deduplicated": True}))
    out, _ = run("relay_submit", "q", "--payload", "1", "--address", canned.address)
    assert out == "job_1 (duplicate)\n"


def test_submit_reads_a_payload_from_a_file_or_stdin(
    server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A payload past about 128 KiB does not fit one argument (E2BIG), though the limit is
    # 256 KiB: --payload-file (a review).
    canned = server(lambda req, conn: ok(req, {"job": JOB, "deduplicated": False}))
    big = {"pad": "x" * 200_000}
    path = tmp_path / "payload.json"
    path.write_bytes(orjson.dumps(big))
    run("relay_submit", "q", "--payload-file", str(path), "--address", canned.address)
    assert canned.requests[-1]["args"]["payload"] == big
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"from": "stdin"}')))
    run("relay_submit", "q", "--payload-file", "-", "--address", canned.address)
    assert canned.requests[-1]["args"]["payload"] == {"from": "stdin"}
    sent = len(canned.requests)
    err = fails(
        "relay_submit", "q", "--payload-file", str(tmp_path / "nope"), "--address", canned.address
    )
    assert str(err).startswith("INVALID_ARGUMENT: --payload-file: No such file or directory")
    path.write_bytes(b" " * (2 * 1024 * 1024))
    err = fails("relay_submit", "q", "--payload-file", str(path), "--address", canned.address)
    assert "holds more than" in str(err)
    assert len(canned.requests) == sent  # nothing sent for either


def test_submit_json_prints_the_result(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"job": JOB, "deduplicated": False}))
    out, _ = run(
        "relay_submit",
        "q",
        "--payload",
        "{}",
        "--delay-ms",
        "5",
        "--json",
        "--address",
        canned.address,
    )
    assert orjson.loads(out) == {"job": JOB, "deduplicated": False}
    assert canned.requests[0]["args"]["delay_ms"] == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--payload", "{bad"], "INVALID_ARGUMENT: --payload is not valid JSON"),
        (["--payload", "{}", "--run-at", "tomorrow"], "INVALID_ARGUMENT: --run-at 'tomorrow'"),
        (["--payload", "{}", "--address", "nohost"], "INVALID_ARGUMENT: --address"),
    ],
)
def test_submit_rejects_bad_input_before_sending(
    server: Any, args: list[str], message: str
) -> None:
    canned = server(lambda req, conn: ok(req, {"job": JOB, "deduplicated": False}))
    err = fails("relay_submit", "q", "--address", canned.address, *args)
    assert str(err).startswith(message)
    assert err.returncode == 1
    assert canned.requests == []


def test_an_error_reply_exits_1_with_its_code(server: Any) -> None:
    canned = server(lambda req, conn: error(req, "NOT_FOUND", "no job job_x"))
    err = fails("relay_inspect", "job_x", "--address", canned.address)
    assert str(err) == "NOT_FOUND: no job job_x"
    assert err.returncode == 1


def test_an_unreachable_server_exits_2() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        address = format_address("127.0.0.1", probe.getsockname()[1])
    err = fails("relay_stats", "--address", address)
    assert str(err).startswith(f"cannot reach relay server at {address}")
    assert err.returncode == 2


def test_a_lost_connection_exits_2(server: Any) -> None:
    canned = server(lambda req, conn: None)
    err = fails("relay_stats", "--address", canned.address)
    assert "may or may not have been applied" in str(err)
    assert err.returncode == 2


def test_inspect_shows_the_job_and_its_attempts(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"job": JOB}))
    out, _ = run("relay_inspect", "job_1", "--address", canned.address)
    for text in (
        "job_1",
        "dead",
        "attempts exhausted: smtp timeout",
        "host:1",
        "1.5s",
        "dead_lettered",
    ):
        assert text in out
    assert "2026-01-01T00:00:00.000Z" in out
    json_out, _ = run("relay_inspect", "job_1", "--json", "--address", canned.address)
    assert orjson.loads(json_out) == JOB


def test_stats_prints_a_table_per_queue(server: Any) -> None:
    counts = {"pending": 1, "ready": 7, "leased": 2, "retrying": 0, "succeeded": 40, "dead": 3}
    result = {
        "queues": {
            "email": {**counts, "oldest_ready_age_ms": 65_000},
            "sms": {**counts, "oldest_ready_age_ms": None},
        },
        "totals": {k: 2 * v for k, v in counts.items()},
        "server_time_ms": 1767225600000,
    }
    canned = server(lambda req, conn: ok(req, result))
    out, _ = run("relay_stats", "--address", canned.address)
    assert "email" in out and "sms" in out and "total" in out
    assert "1m05s" in out and "80" in out
    json_out, _ = run("relay_stats", "--queue", "email", "--json", "--address", canned.address)
    assert orjson.loads(json_out) == result
    assert canned.requests[-1]["args"] == {"queue": "email"}


def test_stats_gathers_every_pages_queue_controls(server: Any) -> None:
    # Past 1,000 queues stats comes a page at a time, each with its own queues' controls:
    # the table showed only the last page's (a review: one paused queue of three controlled).
    counts = {"ready": 1}

    def pages(req: dict[str, Any], conn: Any) -> bytes:
        if req.get("args", {}).get("after") is None:
            page = {"queues": {"a": counts}, "controls": {"a": {"paused": True}}, "next_after": "a"}
        else:
            page = {
                "queues": {"b": counts},
                "controls": {"b": {"max_leased": 3}},
                "next_after": None,
            }
        return ok(req, {**page, "totals": counts, "server_time_ms": 0})

    canned = server(pages)
    json_out, _ = run("relay_stats", "--json", "--address", canned.address)
    assert orjson.loads(json_out)["controls"] == {"a": {"paused": True}, "b": {"max_leased": 3}}
    out, _ = run("relay_stats", "--address", canned.address)
    assert "paused" in out and "3" in out.split("Queue controls")[1]


def test_stats_tables_stop_at_the_limit_and_say_what_they_left_out(server: Any) -> None:
    # rich lays out about 2,000 rows a second: 30,000 queues took 25 s to print (a review).
    names = [f"q{n:03}" for n in range(150)]
    result = {
        "queues": {name: {"ready": 1} for name in names},
        "controls": {name: {"paused": True} for name in names[:120]},
        "totals": {"ready": 150},
        "server_time_ms": 0,
    }
    canned = server(lambda req, conn: ok(req, result))
    out, _ = run("relay_stats", "--address", canned.address)
    queues_part, controls_part = out.split("Queue controls")
    assert "q099" in queues_part and "q100" not in queues_part
    assert "50 of 150 queues not shown (--limit 0 shows every one" in queues_part
    assert "150" in queues_part.split("total")[1]  # the totals count every queue
    assert "q099" in controls_part and "q100" not in controls_part
    assert "20 of 120 controlled queues not shown" in controls_part
    out, _ = run("relay_stats", "--limit", "2", "--address", canned.address)
    assert "q001" in out and "q002" not in out and "148 of 150 queues" in out
    out, _ = run("relay_stats", "--limit", "0", "--address", canned.address)
    assert "q149" in out and "not shown" not in out
    json_out, _ = run("relay_stats", "--json", "--limit", "1", "--address", canned.address)
    assert len(orjson.loads(json_out)["queues"]) == 150
    err = fails("relay_stats", "--limit", "-1", "--address", canned.address)
    assert "must be a whole number, 0 or more: '-1'" in str(err)


def test_stats_with_no_queues(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"queues": {}, "totals": {}, "server_time_ms": 0}))
    out, _ = run("relay_stats", "--address", canned.address)
    assert out == "no jobs\n"


def test_stats_lists_the_live_servers(server: Any) -> None:
    live = {
        "id": "srv_1",
        "address": "10.0.0.7:7400",
        "host": "relay-b",
        "pid": 4242,
        "started_at_ms": 1_767_225_600_000,
        "seen_at_ms": 1_767_225_605_000,
        "clock_skew_ms": -3,
    }
    stats = {"queues": {}, "totals": {}, "server_time_ms": 0, "servers": [live]}
    canned = server(lambda req, conn: ok(req, stats))
    out, _ = run("relay_stats", "--address", canned.address)
    assert out.startswith("no jobs\n")
    assert "Live servers: 1" in out
    assert all(text in out for text in ("10.0.0.7:7400", "relay-b", "4242", "-3 ms"))


def test_dead_list_prints_jobs_and_the_next_cursor(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"jobs": [JOB], "next_after": "job_1"}))
    out, _ = run(
        "relay_dead", "list", "--queue", "email", "--limit", "1", "--address", canned.address
    )
    assert "job_1" in out and "attempts exhausted" in out
    assert "relay dead list --after job_1" in out
    assert canned.requests[0]["args"] == {"queue": "email", "limit": 1}


def test_dead_retry_reports_each_job_and_fails_if_any_failed(server: Any) -> None:
    def script(req: dict[str, Any], conn: int) -> bytes:
        if req["args"]["job_id"] == "job_1":
            return ok(req, {"job": {**JOB, "state": "ready"}})
        return error(req, "INVALID_STATE", "job_2 is ready, not dead")

    canned = server(script)
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(CommandError) as caught:
        call_command(
            "relay_dead",
            "retry",
            "job_1",
            "job_2",
            "--address",
            canned.address,
            stdout=out,
            stderr=err,
        )
    assert out.getvalue() == "job_1: replayed, now ready\n"
    assert err.getvalue() == "job_2: INVALID_STATE: job_2 is ready, not dead\n"
    assert str(caught.value) == "INVALID_STATE: 1 of 2 jobs failed"
    assert caught.value.returncode == 1


def test_dead_retry_of_one_job_says_its_error_once(server: Any) -> None:
    # A review: `relay dead retry nosuch` printed the error twice (the id's line, then the
    # command's).
    canned = server(lambda req, conn: error(req, "NOT_FOUND", "no job job_9"))
    err = io.StringIO()
    with pytest.raises(CommandError) as caught:
        call_command("relay_dead", "retry", "job_9", "--address", canned.address, stderr=err)
    assert err.getvalue() == ""
    assert str(caught.value) == "NOT_FOUND: no job job_9"


def test_dead_purge_without_a_terminal_asks_nothing(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"job_id": req["args"]["job_id"], "purged": True}))
    out, _ = run("relay_dead", "purge", "job_1", "job_1", "--address", canned.address)
    assert out == "job_1: purged\n"  # each id once
    assert [r["op"] for r in canned.requests] == ["dead_purge"]


def test_dead_purge_dry_run_only_inspects(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"job": JOB}))
    out, _ = run("relay_dead", "purge", "job_1", "--dry-run", "--address", canned.address)
    assert out == "job_1: would purge\n"
    assert [r["op"] for r in canned.requests] == ["inspect"]


def test_dead_retry_dry_run_refuses_a_live_job(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"job": {**JOB, "state": "leased"}}))
    err = fails("relay_dead", "retry", "job_1", "--dry-run", "--address", canned.address)
    assert str(err).startswith("INVALID_STATE: cannot retry job_1: it is leased")


def test_dead_json_output(server: Any) -> None:
    canned = server(lambda req, conn: ok(req, {"job_id": "job_1", "purged": True}))
    out, _ = run("relay_dead", "purge", "job_1", "--yes", "--json", "--address", canned.address)
    assert orjson.loads(out) == {"results": [{"job_id": "job_1", "ok": True, "purged": True}]}


def test_worker_runs_jobs_and_stops_gracefully_on_sigterm(server: Any) -> None:
    lease = {"job_id": "job_1", "queue": "email", "payload": {}, "attempt": 1, "lease_token": "t"}
    handed_out: list[str] = []
    acked = threading.Event()

    def script(req: dict[str, Any], conn: int) -> bytes:
        if req["op"] == "lease":
            if not handed_out:
                handed_out.append("job_1")
                return ok(req, {"jobs": [lease]})
            acked.wait(0.05)  # a short long-poll
            return ok(req, {"jobs": []})
        # --concurrency 8 (the default): the worker sends its acks as ack_batch requests.
        assert req["op"] == "ack_batch"
        (entry,) = req["args"]["acks"]
        acked.set()
        result = {"job_id": entry["job_id"], "ok": True, "state": "succeeded", "duplicate": False}
        return ok(req, {"results": [result | {"error": None}], "next": []})

    canned = server(script)

    def stop_after_the_ack() -> None:
        if acked.wait(10):  # the command's handler is installed by then
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_after_the_ack, daemon=True).start()
    previous = signal.getsignal(signal.SIGTERM)
    out, _ = run(
        "relay_worker", "--queue", "email", "--wait-ms", "50", "--json", "--address", canned.address
    )
    assert orjson.loads(out) == {
        "leased": 1,
        "leased_next": 0,
        "acked": 1,
        "failed": 0,
        "released": 0,
        "renewed": 0,
        "lost": 0,
        "cancelled": 0,
        "timed_out": 0,
    }
    ack = next(r for r in canned.requests if r["op"] == "ack_batch")
    assert [a["lease_token"] for a in ack["args"]["acks"]] == ["t"]
    # The batch asks for the next jobs: its own slot and the free ones (the lease thread may
    # hold some of the other 7 in its long-poll).
    assert ack["args"]["lease_next"]["queues"] == ["email"]
    assert 1 <= ack["args"]["lease_next"]["max_jobs"] <= 8
    assert signal.getsignal(signal.SIGTERM) == previous  # restored


@pytest.mark.parametrize("concurrency", ["0", "1001", "100000000"])
def test_worker_rejects_bad_options(concurrency: str) -> None:
    # 100,000,000 ended in "can't start new thread" and a traceback (a review).
    err = fails("relay_worker", "--concurrency", concurrency, "--address", "127.0.0.1:9")
    assert str(err) == "INVALID_ARGUMENT: concurrency must be 1..1000 (a thread each)"
    assert err.returncode == 1


def test_tables_show_bracketed_job_data_as_text(server: Any) -> None:
    dead = JOB | {
        "last_error": "cannot read [/var/data/in.csv]",
        "dead_reason": "failed [bad input]",
    }
    canned = server(lambda req, conn: ok(req, {"jobs": [dead], "next_after": None}))
    out, _ = run("relay_dead", "list", "--address", canned.address)
    assert "failed [bad input]" in out


@pytest.mark.parametrize("json", [False, True], ids=["table", "json"])
@pytest.mark.parametrize("entry", ["relay", "manage.py"])
def test_a_reader_that_closes_the_output_early_ends_the_command_quietly(
    server: Any, entry: str, json: bool
) -> None:
    """README walkthrough: ``relay stats | head -1`` said "cannot reach relay server" and
    exited 2, the pipe's EPIPE taken for the server's. Now it exits 141 (128 + SIGPIPE), as a
    shell tool does, without a word."""
    queues = {f"q{n}": {"ready": n, "oldest_ready_age_ms": None} for n in range(400)}
    result = {"queues": queues, "totals": {"ready": 1}, "server_time_ms": 0}
    canned = server(lambda req, conn: ok(req, result))
    root = Path(__file__).resolve().parents[2]
    if entry == "relay":
        argv = [sys.executable, "-c", "from queue_core.cli import main; main()", "stats"]
    else:
        argv = [sys.executable, str(root / "manage.py"), "relay_stats"]
    if json:  # one large write (a review: exit 0, where the table's many writes gave 141)
        argv.append("--json")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        done = subprocess.run(
            [*argv, "--address", canned.address],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=root,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert done.stderr == b""


def test_output_that_cannot_be_written_is_one_line_not_a_traceback(server: Any) -> None:
    """Hostile review: ``relay stats > /dev/full`` and ``relay stats >&-`` printed tracebacks."""
    queues = {f"q{n}": {"ready": n, "oldest_ready_age_ms": None} for n in range(400)}
    canned = server(
        lambda req, conn: ok(req, {"queues": queues, "totals": {}, "server_time_ms": 0})
    )
    root = Path(__file__).resolve().parents[2]
    relay = [sys.executable, "-c", "from queue_core.cli import main; main()", "stats"]
    relay += ["--address", canned.address]
    with open("/dev/full", "w") as full:
        done = subprocess.run(relay, stdout=full, stderr=subprocess.PIPE, cwd=root, timeout=60)
    assert done.returncode == 1
    assert done.stderr.decode().strip() == "cannot write the output: No space left on device"
    closed = subprocess.run(
        relay, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=root, timeout=60,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert closed.returncode == 1
    assert closed.stderr.decode().strip() == "cannot write the output: standard output is closed"


def test_a_command_that_writes_nothing_runs_with_stdout_closed(tmp_path: Path) -> None:
    """Hostile review: ``relay server >&-`` refused to start (it writes nothing to stdout)."""
    root = Path(__file__).resolve().parents[2]
    db = tmp_path / "relay.db"
    env = {**os.environ, "RELAY_DB": str(db), "DJANGO_SETTINGS_MODULE": "relayproject.settings"}
    relay = [sys.executable, "-c", "from queue_core.cli import main; main()"]
    migrate = subprocess.run([*relay, "migrate", "-v", "0"], env=env, cwd=root, timeout=120)
    assert migrate.returncode == 0
    server = subprocess.Popen(
        [*relay, "server", "--address", "127.0.0.1:0"],
        env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    try:
        assert server.stderr is not None
        for line in server.stderr:  # JSON log lines, until it serves
            if b"event=ready" in line:
                break
        assert server.poll() is None, "relay server exited with stdout closed"
    finally:
        server.terminate()
        server.wait(30)
        if server.stderr is not None:
            server.stderr.close()


@pytest.mark.parametrize("entry", ["relay", "manage.py"])
def test_ctrl_c_while_waiting_for_a_reply_is_one_line_and_exit_130(server: Any, entry: str) -> None:
    """Hostile review: Ctrl-C while a command waited for its reply printed a 41-line
    traceback ending in ``KeyboardInterrupt``."""
    arrived, release = threading.Event(), threading.Event()

    def stall(req: dict[str, Any], conn: Any) -> bytes:
        if req.get("op") == "stats":
            arrived.set()
            release.wait(30)
        return ok(req, {"queues": {}, "totals": {}, "server_time_ms": 0})

    canned = server(stall)
    root = Path(__file__).resolve().parents[2]
    if entry == "relay":
        argv = [sys.executable, "-c", "from queue_core.cli import main; main()", "stats"]
    else:
        argv = [sys.executable, str(root / "manage.py"), "relay_stats"]
    proc = subprocess.Popen(
        [*argv, "--address", canned.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=root,
        # A shell's background job (CI) ignores SIGINT, and a child inherits that: Python
        # then installs no KeyboardInterrupt handler. Ctrl-C's default, as in a terminal.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert arrived.wait(60), "the request never came"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.decode().splitlines() == [
        "INTERRUPTED: stopped by Ctrl-C; a request already sent may or may not have been applied"
    ]


def test_a_bad_database_url_is_one_line() -> None:
    """Hostile review: ``relay --database-url mysql://x prune`` printed ImproperlyConfigured's
    traceback, then a KeyError's."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            *(sys.executable, "-c", "from queue_core.cli import main; main()"),
            *("--database-url", "mysql://x", "prune", "--older-than", "1d"),
        ],
        capture_output=True,
        cwd=root,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.decode().splitlines() == [
        "INVALID_ARGUMENT: RELAY_DATABASE_URL must read postgresql://user@host:port/dbname, "
        "got 'mysql://x'"
    ]


@pytest.mark.parametrize(
    ("argv", "code", "line"),
    [
        (
            ["--database-url", "postgresql://u@[::1", "stats"],
            1,
            "INVALID_ARGUMENT: RELAY_DATABASE_URL",
        ),
        (
            ["--database-url", "postgresql://u@h:99999/db", "stats"],
            1,
            "INVALID_ARGUMENT: RELAY_DATABASE_URL",
        ),
        (["--db", "{text}", "migrate"], 1, "UNAVAILABLE: cannot reach the database: file is not a"),
        (["--db", "{text}", "backup", "{tmp}/copy.db"], 1, "CORRUPT: {text} is not a database"),
        (
            ["--db", "{tmp}", "migrate"],
            1,
            "CommandError: STORAGE_IO: database {tmp}: it is a directory",
        ),
        (
            ["submit", "q", "--payload-file", "-"],
            1,
            "INVALID_ARGUMENT: --payload-file -: standard input is closed",
        ),
    ],
)
def test_hostile_command_lines_end_in_one_line(
    tmp_path: Path, argv: list[str], code: int, line: str
) -> None:
    """A second review's tracebacks (32 to 95 lines each): a URL Python cannot split, a port
    out of range, a file that is not SQLite, a directory (told it had 2 names), a closed
    standard input."""
    text = tmp_path / "notdb.db"
    text.write_bytes(b"not a database, just text " * 10)
    fill = {"text": str(text), "tmp": str(tmp_path)}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            *(sys.executable, "-c", "from queue_core.cli import main; main()"),
            *(arg.format(**fill) for arg in argv),
        ],
        capture_output=True,
        stdin=subprocess.DEVNULL if "-" not in argv else None,
        preexec_fn=(lambda: os.close(0)) if "-" in argv else None,
        cwd=root,
        timeout=60,
        check=False,
    )
    lines = done.stderr.decode().splitlines()
    assert done.returncode == code, lines
    assert len(lines) == 1 and lines[0].startswith(line.format(**fill)), lines
    assert not (tmp_path / "copy.db").exists()


def test_queue_limits_usage_names_the_command_as_typed() -> None:
    err = io.StringIO()
    command = load_command_class("queue_core", "relay_queue_limits")
    command._called_from_command_line = True
    parser = command.create_parser("relay", "relay_queue_limits")
    with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
        parser.parse_args([])
    assert err.getvalue().startswith("usage: relay queue-limits ")
