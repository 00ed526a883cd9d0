"""Job metadata and unique-while-active keys end to end (issue 16, items 6 and 7): a real
``relay_server`` on each driver, ``relay submit --meta ... --unique active`` and ``relay
inspect`` as commands, ``relay_worker --app`` handing ``ctx.meta`` to a handler, and the admin
job page reading the same database.

Waiting is on log lines and on job states, never on fixed sleeps.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from django.test import Client

from queue_core.client import RelayClient
from tests.admin.conftest import OPERATOR_PERMS, job_url, make_operator
from tests.procs import Spawner
from tests.relay_db import DATABASES, RelayDb

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

WAIT_S = 60.0
QUEUE = "traced"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def wait_state(client: RelayClient, job_id: str, state: str) -> dict[str, Any]:
    """Poll the job (a read through the server) until it is in ``state``."""
    deadline = time.monotonic() + WAIT_S
    while (job := client.inspect(job_id)["job"])["state"] != state:
        assert time.monotonic() < deadline, f"{job_id} never reached {state}: {job['state']}"
        time.sleep(0.05)
    return job


def test_meta_and_unique_from_the_cli_worker_and_admin(
    spawn: Spawner, relay_db: RelayDb, tmp_path: Path
) -> None:
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    out = tmp_path / "seen.json"
    payload = orjson.dumps({"task": "record_meta", "out": str(out)}).decode()
    submit = (
        "relay_submit",
        QUEUE,
        "--payload",
        payload,
        "--idempotency-key",
        "signup-42",
        "--unique",
        "active",
        "--meta",
        f"traceparent={TRACEPARENT}",
        "--meta",
        "tenant=acme=eu",  # the value is everything after the first '='
        "--address",
        address,
    )
    meta = {"traceparent": TRACEPARENT, "tenant": "acme=eu"}

    made = spawn.run(*submit, "--json")
    assert made.returncode == 0, made.stderr
    job = orjson.loads(made.stdout)["job"]
    assert (job["meta"], job["unique"], job["idempotency_key"]) == (meta, "active", "signup-42")
    first = job["id"]

    again = spawn.run(*submit)  # while the job waits: the same job
    assert (again.returncode, again.stdout.strip()) == (0, f"{first} (duplicate)"), again.stderr

    shown = spawn.run("relay_inspect", first, "--address", address)
    assert shown.returncode == 0, shown.stderr
    assert TRACEPARENT in shown.stdout and "active" in shown.stdout

    operator = Client()
    operator.force_login(make_operator("alice", *OPERATOR_PERMS))
    html = operator.get(job_url(first)).content.decode()
    assert f"&quot;traceparent&quot;: &quot;{TRACEPARENT}&quot;" in html
    assert "signup-42 (unique while active: bound until the job finishes" in html

    worker = spawn(
        "relay_worker",
        "--address",
        address,
        "--queue",
        QUEUE,
        "--wait-ms",
        "1000",
        "--app",
        "tests.tasks_app.handlers.META_HANDLERS",
        name="relay_worker",
    )
    worker.wait_event("worker_ready")
    with RelayClient(address) as client:
        done = wait_state(client, first, "succeeded")
    assert done["idempotency_key"] is None  # freed in the ack's transaction
    assert orjson.loads(out.read_bytes()) == {"meta": meta, "job_id": first}

    html = operator.get(job_url(first)).content.decode()
    assert "— (unique while active: freed when the job finished)" in html

    after = spawn.run(*submit)  # the job finished: the key makes a new job
    assert after.returncode == 0, after.stderr
    second = after.stdout.strip()
    assert second.startswith("job_") and second != first
    with RelayClient(address) as client:
        wait_state(client, second, "succeeded")
    worker.kill()


def test_cli_refuses_bad_meta_and_unique(spawn: Spawner, relay_db: RelayDb) -> None:
    _, port = spawn.server()
    base = ("relay_submit", QUEUE, "--payload", "1", "--address", f"127.0.0.1:{port}")
    no_equals = spawn.run(*base, "--meta", "traceparent")
    assert no_equals.returncode == 1
    assert "INVALID_ARGUMENT" in no_equals.stderr and "KEY=VALUE" in no_equals.stderr
    twice = spawn.run(*base, "--meta", "a=1", "--meta", "a=2")
    assert twice.returncode == 1 and "given twice" in twice.stderr
    too_big = spawn.run(*base, "--meta", "a=" + "x" * 2000)  # server-side bound
    assert too_big.returncode == 1
    assert "INVALID_ARGUMENT" in too_big.stderr and "RELAY_MAX_META_BYTES" in too_big.stderr
    keyless = spawn.run(*base, "--unique", "active")
    assert keyless.returncode == 1 and "needs an idempotency_key" in keyless.stderr
    assert relay_db.rows("SELECT COUNT(*) FROM relay_job") == [(0,)]
