"""Which connection the HTTP worker gives up for a newcomer at its limit
(``relayproject.gunicorn_worker``: ``state``, ``unread_bytes``, ``_oldest_unheard``).

The protocols are stand-ins with the attributes gunicorn 27's ``ASGIProtocol`` has; the sockets
are real (a ``socketpair``), so ``unread_bytes`` asks the kernel. ``tests/http/test_capacity.py``
runs the same code in a real gunicorn.
"""

from __future__ import annotations

import asyncio
import socket
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from relayproject import gunicorn_worker as gw


class Transport(asyncio.WriteTransport):
    def __init__(self, sock: socket.socket | None) -> None:
        super().__init__()
        self.sock = sock
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else default

    def is_closing(self) -> bool:
        return self.closing


class Proto(asyncio.Protocol):
    """What ``state`` reads of gunicorn's ``ASGIProtocol``."""

    def __init__(self, transport: Transport | None, *, requests: int = 1) -> None:
        self.transport = transport
        self._conn_lost_handled = False
        self._current_request: object | None = None
        self.req_count = requests
        self.read_any = False  # gw.ReadNoting's: nothing read from the client yet


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for a, b in made:
        a.close()
        b.close()


def connected(pairs: list[tuple[socket.socket, socket.socket]], **kw: int) -> Proto:
    """A stand-in served connection: the worker's end of a real socket pair."""
    server, client = socket.socketpair()
    pairs.append((server, client))
    return Proto(Transport(server), **kw)


def client_of(proto: Proto, pairs: list[tuple[socket.socket, socket.socket]]) -> socket.socket:
    assert proto.transport is not None
    return next(c for s, c in pairs if s is proto.transport.sock)


def test_state_reads_what_gunicorn_is_doing(pairs: list[Any]) -> None:
    assert gw.state(Proto(None)) == gw.CONNECTING
    fresh = connected(pairs, requests=0)  # its task has not run yet
    assert gw.state(fresh) == gw.UNHEARD
    first = connected(pairs, requests=1)  # waiting for the first head
    assert gw.state(first) == gw.UNHEARD
    first._current_request = object()  # the head is read: a request in progress
    assert gw.state(first) == gw.HEARD
    idle = connected(pairs, requests=2)  # one request served, waiting for the next
    assert gw.state(idle) == gw.HEARD
    first._current_request = None  # served; gunicorn raises req_count before the next head
    first.req_count = 2
    assert gw.state(first) == gw.HEARD
    gone = connected(pairs, requests=2)
    gone._conn_lost_handled = True
    assert gw.state(gone) == gw.GONE
    closing = connected(pairs)
    assert closing.transport is not None
    closing.transport.closing = True
    assert gw.state(closing) == gw.GONE


def test_unread_bytes_are_what_the_kernel_holds(pairs: list[Any]) -> None:
    proto = connected(pairs)
    assert proto.transport is not None
    assert gw.unread_bytes(proto.transport) == 0
    client_of(proto, pairs).sendall(b"GET / HTTP/1.1\r\n")
    assert gw.unread_bytes(proto.transport) == 16
    assert gw.unread_bytes(Transport(None)) == 0


def table(*protos: Proto) -> weakref.WeakKeyDictionary[Any, None]:
    """``protos`` in accept order."""
    out: weakref.WeakKeyDictionary[Any, None] = weakref.WeakKeyDictionary()
    for proto in protos:
        out[proto] = None
    return out


def test_the_oldest_unheard_goes_and_the_heard_are_forgotten_on_the_way(pairs: list[Any]) -> None:
    busy = connected(pairs)
    busy._current_request = object()
    idle = connected(pairs, requests=2)
    first, second = connected(pairs), connected(pairs)
    unheard = table(busy, idle, first, second)
    found = gw._oldest_unheard(unheard)
    assert found is first
    assert list(unheard) == [second]  # the heard ones are looked at once


def test_a_client_with_unread_bytes_is_passed_over_and_kept(pairs: list[Any]) -> None:
    # A review: under a flood, long-polls whose whole request waited in the kernel, not yet
    # read by the worker's loop, were evicted as if they had sent nothing.
    sending, silent = connected(pairs), connected(pairs)
    client_of(sending, pairs).sendall(b"POST /api/v1/leases HTTP/1.1\r\n")
    unheard = table(sending, silent)
    assert gw._oldest_unheard(unheard) is silent
    assert list(unheard) == [sending]  # looked at again for the next newcomer
    assert gw._oldest_unheard(unheard) is None


def test_a_connection_read_from_and_still_short_of_a_head_is_taken(pairs: list[Any]) -> None:
    # A review: sparing every connection with unread bytes let hogs that each sent a byte of
    # a head every 0.2 ms keep the worker behind on reading, and so their slots.
    trickling = connected(pairs)
    trickling.read_any = True  # the worker has read its first bytes: "GET /api/v1/hea"
    client_of(trickling, pairs).sendall(b"l")  # and one more waits
    unheard = table(trickling)
    assert gw._oldest_unheard(unheard) is trickling


def test_read_noting_notes_the_first_bytes_read(monkeypatch: Any) -> None:
    received: list[bytes] = []
    monkeypatch.setattr(gw.ASGIProtocol, "data_received", lambda self, data: received.append(data))
    protocol = gw.ReadNoting.__new__(gw.ReadNoting)  # gunicorn's state is not needed to note it
    assert protocol.read_any is False
    protocol.data_received(b"GET")
    assert protocol.read_any is True and received == [b"GET"]


def test_the_search_stops_at_a_connection_not_made_yet(pairs: list[Any]) -> None:
    connecting, later = Proto(None), connected(pairs)
    unheard = table(connecting, later)
    assert gw._oldest_unheard(unheard) is None
    assert len(unheard) == 2


def test_at_most_max_looked_are_passed_over(pairs: list[Any], monkeypatch: Any) -> None:
    monkeypatch.setattr(gw, "MAX_LOOKED", 3)
    sending = [connected(pairs) for _ in range(3)]
    for proto in sending:
        client_of(proto, pairs).sendall(b"G")
    silent = connected(pairs)
    unheard = table(*sending, silent)
    assert gw._oldest_unheard(unheard) is None
    monkeypatch.setattr(gw, "MAX_LOOKED", 4)
    assert gw._oldest_unheard(unheard) is silent
    assert list(unheard) == sending
