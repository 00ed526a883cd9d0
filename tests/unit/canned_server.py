"""A tiny NDJSON server for client and command tests: canned replies, on 127.0.0.1:0."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

import orjson

from queue_core.client import format_address

# (request, connection number from 0) -> bytes to send back, or None to close the connection.
Script = Callable[[dict[str, Any], int], bytes | None]


def ok(request: dict[str, Any], result: Any) -> bytes:
    """Return a success reply line for ``request``."""
    return orjson.dumps({"id": request.get("id"), "ok": True, "result": result}) + b"\n"


def error(request: dict[str, Any], code: str, message: str = "no", **details: Any) -> bytes:
    """Return an error reply line for ``request``."""
    body: dict[str, Any] = {"code": code, "message": message, "retryable": False}
    if details:
        body["details"] = details
    return orjson.dumps({"id": request.get("id"), "ok": False, "error": body}) + b"\n"


class CannedServer:
    """Accepts connections on 127.0.0.1:0; answers each request line as ``script`` says."""

    def __init__(self, script: Script, *, greeting: bytes | None = None) -> None:
        self.script = script
        self.greeting = greeting
        self.requests: list[dict[str, Any]] = []
        self.raw: list[bytes] = []
        self.connections = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = format_address("127.0.0.1", self.listener.getsockname()[1])
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                number = self.connections
                self.connections += 1
                self.open.append(conn)
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        # A client that hangs up (or a test closing the server) ends the loop quietly.
        with contextlib.suppress(OSError), conn, conn.makefile("rb") as reader:
            if self.greeting is not None:
                conn.sendall(self.greeting)
                return
            for line in reader:
                request = orjson.loads(line)
                with self.lock:
                    self.raw.append(line)
                    self.requests.append(request)
                reply = self.script(request, number)
                if reply is None:
                    return
                conn.sendall(reply)

    def drop_connections(self) -> None:
        with self.lock:
            for conn in self.open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            for conn in self.open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
