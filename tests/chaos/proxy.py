"""A line-aware TCP proxy for fault injection between Relay clients and a real server.

``Proxy`` listens on ``127.0.0.1:0`` and forwards every connection to the current upstream port,
which can change (``retarget``): workers keep one stable address while the server behind it is
killed and restarted on a new port. A ``policy`` sees each request frame and may:

* ``FORWARD`` it (the default);
* ``DROP_REPLY``: forward it, then swallow the server's reply and cut the client's connection,
  so the request commits but the client never learns it (a lost ack reply);
* ``DROP_REQUEST``: cut the client's connection without forwarding, so nothing commits;
* ``DELAY_REPLY``: forward it, and hold the server's reply ``reply_delay_s`` before passing it
  on (a slow link: the replies behind it on that connection wait too).

Each connection gets two threads (client -> server, server -> client), both line-oriented. A
reply is matched to its request by its ``id`` (``RelayClient`` always sends one). Nothing
here sleeps but ``DELAY_REPLY``'s latency, the thing it simulates: every other wait is a
blocking read, or an accept on a listening socket.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import threading
from collections.abc import Callable
from typing import Any

import orjson


class Action(enum.Enum):
    """What the proxy does with one request frame."""

    FORWARD = "forward"
    DROP_REPLY = "drop_reply"
    DROP_REQUEST = "drop_request"
    DELAY_REPLY = "delay_reply"


Policy = Callable[[dict[str, Any]], Action]


def _forward_all(frame: dict[str, Any]) -> Action:
    return Action.FORWARD


class _Pair:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: Proxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.drop_ids: set[Any] = set()
        self.delay_ids: set[Any] = set()
        self.lock = threading.Lock()
        self.closed = False

    def start(self) -> None:
        for target in (self._client_to_server, self._server_to_client):
            threading.Thread(target=target, daemon=True, name="relay-proxy").start()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.proxy._forget(self)

    def _client_to_server(self) -> None:
        try:
            with self.client.makefile("rb") as reader:
                for line in reader:
                    frame = _frame(line)
                    action = self.proxy.policy(frame) if frame is not None else Action.FORWARD
                    self.proxy._record(frame, action)
                    if action is Action.DROP_REQUEST:
                        return
                    if action is Action.DROP_REPLY and frame is not None:
                        with self.lock:
                            self.drop_ids.add(frame.get("id"))
                    if action is Action.DELAY_REPLY and frame is not None:
                        with self.lock:
                            self.delay_ids.add(frame.get("id"))
                    self.upstream.sendall(line)
        except (OSError, ValueError):
            pass
        finally:
            self.close()

    def _server_to_client(self) -> None:
        try:
            with self.upstream.makefile("rb") as reader:
                for line in reader:
                    reply = _frame(line)
                    rid = reply.get("id") if reply is not None else None
                    with self.lock:
                        dropped = rid in self.drop_ids
                        delayed = rid in self.delay_ids
                        self.delay_ids.discard(rid)
                    if delayed:  # the link's latency; ended early by close()
                        self.proxy._closing.wait(self.proxy.reply_delay_s)
                    if dropped:
                        self.proxy._dropped_reply(reply)
                        return  # the reply vanishes and the client's connection is cut
                    self.client.sendall(line)
        except (OSError, ValueError):
            pass
        finally:
            self.close()


def _frame(line: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


class Proxy:
    """Forward connections on ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream port>``.

    Args:
        upstream_port: where to forward (None: refuse connections until ``retarget``).
        policy: ``policy(frame) -> Action`` for every request frame (default: forward all).
        reply_delay_s: how long ``DELAY_REPLY`` holds a reply, in s.

    Attributes:
        port: the proxy's own port.
        frames: ``(op, action)`` of every request frame seen, in order.
        dropped_replies: the replies swallowed by ``DROP_REPLY``.
    """

    def __init__(
        self, upstream_port: int | None, policy: Policy | None = None, reply_delay_s: float = 0.0
    ) -> None:
        self.policy: Policy = policy or _forward_all
        self.reply_delay_s = reply_delay_s
        self._closing = threading.Event()
        self._upstream = upstream_port
        self._lock = threading.Lock()
        self._pairs: set[_Pair] = set()
        self.frames: list[tuple[str | None, Action]] = []
        self.dropped_replies: list[dict[str, Any] | None] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="relay-proxy")
        self._thread.start()

    def retarget(self, upstream_port: int | None, *, cut: bool = True) -> None:
        """Forward new connections to ``upstream_port``; with ``cut``, drop the current ones."""
        with self._lock:
            self._upstream = upstream_port
            pairs = list(self._pairs) if cut else []
        for pair in pairs:
            pair.close()

    def close(self) -> None:
        """Stop accepting and cut every connection."""
        self._closed = True
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(5)
        self.retarget(None)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                port = self._upstream
            try:
                if port is None:
                    raise ConnectionRefusedError("no upstream")
                upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()  # the server is down: the client sees the connection close
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(self, client, upstream)
            with self._lock:
                self._pairs.add(pair)
            pair.start()

    def _forget(self, pair: _Pair) -> None:
        with self._lock:
            self._pairs.discard(pair)

    def _record(self, frame: dict[str, Any] | None, action: Action) -> None:
        with self._lock:
            self.frames.append((frame.get("op") if frame else None, action))

    def _dropped_reply(self, reply: dict[str, Any] | None) -> None:
        with self._lock:
            self.dropped_replies.append(reply)
