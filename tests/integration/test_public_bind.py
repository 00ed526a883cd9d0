"""Without API keys, ``relay server`` refuses an address beyond loopback (hardening item 3).

Real processes on a database of their own. The refusal is one ``PUBLIC_WITHOUT_KEYS`` line and
exit code 5; a key, or the explicit opt-in, lets the same start go ahead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_core import exposure
from tests.procs import Spawner, spawner

PUBLIC = "0.0.0.0:0"  # every interface; the tests send nothing to it


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Spawner]:
    """Processes on a fresh SQLite file of their own."""
    with spawner(str(tmp_path / "public.db")) as s:
        yield s
    for proc in s.procs:
        proc.wait_exit()
        if proc.popen.stderr is not None:
            proc.popen.stderr.close()


def test_public_address_without_keys_is_refused_with_exit_5(procs: Spawner) -> None:
    out = procs.run("relay_server", "--address", PUBLIC)
    assert out.returncode == exposure.EXIT_PUBLIC_WITHOUT_KEYS, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("PUBLIC_WITHOUT_KEYS: relay server refuses to listen on 0.0.0.0:0")
    assert "--allow-public-without-keys" in lines[-1]
    assert not any("event=ready" in line for line in lines)
    # The same through RELAY_ADDRESS, and for the IPv6 wildcard.
    out = procs.run("relay_server", RELAY_ADDRESS=PUBLIC)
    assert out.returncode == exposure.EXIT_PUBLIC_WITHOUT_KEYS, out.stderr
    out = procs.run("relay_server", "--address", "[::]:0")
    assert out.returncode == exposure.EXIT_PUBLIC_WITHOUT_KEYS, out.stderr


def test_loopback_needs_no_key(procs: Spawner) -> None:
    for address in ("127.0.0.1:0", "localhost:0", "127.0.0.2:0"):
        proc = procs("relay_server", "--address", address, name="relay_server")
        proc.wait_event("ready", timeout=60)
        proc.kill()


@pytest.mark.parametrize("how", ["flag", "setting", "key"])
def test_opt_in_or_a_key_lets_a_public_address_start(procs: Spawner, how: str) -> None:
    args: list[str] = ["relay_server", "--address", PUBLIC]
    env: dict[str, str] = {}
    if how == "flag":
        args.append("--allow-public-without-keys")
    elif how == "setting":
        env["RELAY_ALLOW_PUBLIC_WITHOUT_KEYS"] = "1"
    else:
        assert procs.run("migrate").returncode == 0
        made = procs.run("relay_keys", "create", "--name", "ops", "--scope", "operator")
        assert made.returncode == 0, made.stderr
    proc = procs(*args, name="relay_server", **env)
    assert proc.wait_event("ready", timeout=60)["port"]
    proc.kill()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.9.9.9", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.1.2.3", False),
        ("no-such-host.invalid", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert exposure.is_loopback(host) is loopback
