"""``bin/two-servers``, the README's several-servers command, for real: it creates and migrates
a database, serves it on two ports, and a server killed with SIGKILL leaves the other serving
(clients fail over to it) until the script is stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest

from queue_core.client import RelayClient, RelayConnectionError
from tests.postgresql.conftest import DATABASES
from tests.procs import ROOT, Proc
from tests.storage.conftest import database_url
from tests.unit.test_aclient import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]


@pytest.fixture
def fresh_url() -> Iterator[str]:
    """The URL of a database that does not exist yet (dropped afterwards)."""
    admin, _, _ = database_url("postgresql")["RELAY_DATABASE_URL"].rpartition("/")
    name = f"relay_two_{os.getpid()}"
    yield f"{admin}/{name}"
    with psycopg.connect(f"{admin}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Script:
    """``bin/two-servers`` running on two free ports, in its own process group."""

    popen: subprocess.Popen[bytes]
    proc: Proc
    ports: list[int]


@pytest.fixture
def two_servers(fresh_url: str) -> Iterator[Script]:
    """``bin/two-servers fresh_url`` started, both servers ready; the group killed after."""
    ports = [free_port(), free_port()]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DJANGO_"))}
    env |= {"RELAY_SKIP_SETUP": "1", "RELAY_PORTS": " ".join(map(str, ports))}
    env |= {"RELAY_LOG": "info", "PYTHONUNBUFFERED": "1"}
    popen = subprocess.Popen(
        [str(ROOT / "bin" / "two-servers"), fresh_url],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: the script and both servers
    )
    script = Proc(popen, "bin/two-servers")
    try:
        for p in ports:
            script.wait_for(lambda r, p=p: r.get("event") == "ready" and r["port"] == p, 120)
        yield Script(popen, script, ports)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)  # whatever is left of the group
        script.kill()


def test_one_server_killed_leaves_the_other_serving(two_servers: Script) -> None:
    popen, script = two_servers.popen, two_servers.proc
    first, second = (f"127.0.0.1:{p}" for p in two_servers.ports)
    with RelayClient(f"{first},{second}", timeout_s=2) as client:
        servers = {s["address"]: s["pid"] for s in client.stats()["servers"]}
        assert set(servers) == {first, second}
        job = client.submit("two", {"n": 1})["job"]
        # The call that meets a server that no longer answers fails (its outcome is unknown
        # to a client). Stopped first, so the call surely meets it: killed at once, its
        # socket's end could reach the client before the call, which then went straight to
        # the other server (a fresh clone's run failed so: DID NOT RAISE).
        os.kill(servers[first], signal.SIGSTOP)
        try:
            with pytest.raises(RelayConnectionError):
                client.inspect(job["id"])
        finally:
            os.kill(servers[first], signal.SIGKILL)
        # The next one goes to the other server, which serves the same database.
        assert client.inspect(job["id"])["job"]["state"] == "ready"
        assert client.ping()["pong"] is True
    assert popen.poll() is None, "the script stopped with one of its servers"
    popen.send_signal(signal.SIGTERM)
    assert script.wait_exit(30) == 128 + signal.SIGKILL  # one server did not exit 0
    stopped = [r for r in script.records if r.get("event") == "stopped"]
    assert len(stopped) == 1  # the surviving server stopped cleanly on the script's exit


def test_sigterm_stops_both_servers_and_the_script_exits_0(two_servers: Script) -> None:
    two_servers.popen.send_signal(signal.SIGTERM)
    assert two_servers.proc.wait_exit(30) == 0
    stopped = [r for r in two_servers.proc.records if r.get("event") == "stopped"]
    assert len(stopped) == 2
