"""RelayClient's opt-in connection retries: bounded, jittered, and only while nothing was sent."""

from __future__ import annotations

import socket
import threading
from typing import Any

import orjson
import pytest

from queue_core import client as client_mod
from queue_core.client import RelayClient, RelayUnreachable
from tests.unit.test_aclient import free_port


def test_unreachable_after_the_configured_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", pauses.append)
    with (
        RelayClient(f"127.0.0.1:{free_port()}", connect_retries=5) as client,
        pytest.raises(RelayUnreachable, match="cannot connect"),
    ):
        client.ping()
    bounds = [0.1, 0.2, 0.4, 0.8, 1.6]
    assert len(pauses) == len(bounds)
    for pause, bound in zip(pauses, bounds, strict=True):
        assert bound / 2 <= pause <= bound


def test_default_is_a_single_try(monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", pauses.append)
    with RelayClient(f"127.0.0.1:{free_port()}") as client, pytest.raises(RelayUnreachable):
        client.ping()
    assert pauses == []


def test_connects_once_the_server_is_back(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    listeners: list[socket.socket] = []

    def serve_one(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as reader:
            request: dict[str, Any] = orjson.loads(reader.readline())
            reply = {"id": request["id"], "ok": True, "result": {"pong": True}}
            conn.sendall(orjson.dumps(reply) + b"\n")

    def start_server(seconds: float) -> None:
        if not listeners:
            listener = socket.create_server(("127.0.0.1", port))
            listeners.append(listener)
            threading.Thread(target=serve_one, args=(listener,), daemon=True).start()

    monkeypatch.setattr(client_mod.time, "sleep", start_server)
    with RelayClient(f"127.0.0.1:{port}", connect_retries=3) as client:
        assert client.ping() == {"pong": True}
    listeners[0].close()
