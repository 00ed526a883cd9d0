"""Several server addresses: both clients fail over and keep their lease tokens.

Several ``relay server`` processes on one PostgreSQL database serve the same jobs, so a worker
whose server died acks through another with the token it holds. The servers here are canned
(``CannedServer``); tests/storage/test_servers.py does the same against real servers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from queue_core.aclient import AsyncRelayClient
from queue_core.client import (
    RelayClient,
    RelayConnectionError,
    RelayUnreachable,
    format_addresses,
    parse_addresses,
)
from tests.unit.canned_server import CannedServer, ok
from tests.unit.test_aclient import free_port


def acks(request: dict[str, Any], number: int) -> bytes | None:
    return ok(request, {"state": "SUCCEEDED", "duplicate": False})


def hangs_up(request: dict[str, Any], number: int) -> bytes | None:
    return None  # the server died with the request in flight


def test_parse_addresses_splits_on_commas() -> None:
    servers = parse_addresses("127.0.0.1:7400, [::1]:7401,")
    assert servers == [("127.0.0.1", 7400), ("::1", 7401)]
    assert format_addresses(servers) == "127.0.0.1:7400,[::1]:7401"


@pytest.mark.parametrize("bad", ["", " , ", "127.0.0.1:7400,nope", "a:1,b:0"])
def test_parse_addresses_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="address"):
        parse_addresses(bad)


def test_connects_to_the_first_server_that_answers() -> None:
    live = CannedServer(acks)
    try:
        with RelayClient(f"127.0.0.1:{free_port()},{live.address}") as client:
            assert client.ack("j1", worker_id="w", lease_token="t")["state"] == "SUCCEEDED"
        assert live.connections == 1
    finally:
        live.close()


def test_a_broken_connection_fails_over_with_the_same_token() -> None:
    dying, other = CannedServer(hangs_up), CannedServer(acks)
    try:
        with RelayClient(f"{dying.address},{other.address}") as client:
            with pytest.raises(RelayConnectionError):
                client.ack("j1", worker_id="w", lease_token="tok-1")
            # The caller (the worker's settle loop) repeats the ack: it reaches the other server.
            assert client.ack("j1", worker_id="w", lease_token="tok-1")["state"] == "SUCCEEDED"
        assert [r["args"]["lease_token"] for r in dying.requests] == ["tok-1"]
        assert [r["args"]["lease_token"] for r in other.requests] == ["tok-1"]
    finally:
        dying.close()
        other.close()


def test_unreachable_names_every_server() -> None:
    addresses = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with RelayClient(addresses) as client, pytest.raises(RelayUnreachable) as caught:
        client.ping()
    assert caught.value.address == addresses


def test_async_client_fails_over_with_the_same_token() -> None:
    dying, other = CannedServer(hangs_up), CannedServer(acks)

    async def run() -> dict[str, Any]:
        async with AsyncRelayClient(f"{dying.address},{other.address}") as client:
            with pytest.raises(RelayConnectionError):
                await client.ack("j1", worker_id="w", lease_token="tok-1")
            return dict(await client.ack("j1", worker_id="w", lease_token="tok-1"))

    try:
        assert asyncio.run(run())["state"] == "SUCCEEDED"
        assert [r["args"]["lease_token"] for r in dying.requests] == ["tok-1"]
        assert [r["args"]["lease_token"] for r in other.requests] == ["tok-1"]
    finally:
        dying.close()
        other.close()


def test_async_client_skips_an_unreachable_server() -> None:
    live = CannedServer(acks)

    async def run() -> dict[str, Any]:
        async with AsyncRelayClient(f"127.0.0.1:{free_port()},{live.address}") as client:
            return dict(await client.ack("j1", worker_id="w", lease_token="t"))

    try:
        assert asyncio.run(run())["state"] == "SUCCEEDED"
    finally:
        live.close()
