"""One behaviour suite over three surfaces: in-process, TCP and HTTP.

``surface`` is parametrised over them; each gives ``call(op, **args) -> result`` in the TCP
protocol's shapes (``docs/protocol.md``), or raises the ``RelayError`` subclass of the error
code it got. All three run on the one ``service`` fixture (tests/conftest.py: the test
database, a fake clock):

* ``inprocess``: ``RelayClient`` over ``LoopbackTransport`` (codec + ``dispatch.handle``);
* ``tcp``: ``RelayClient`` over a real ``RelayServer`` on a free loopback port;
* ``http``: Django's test client on ``/api/v1`` (each op mapped to its route, and the HTTP
  result put back in the op's TCP shape where the route answers the bare job).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol
from urllib.parse import urlencode

import orjson
import pytest
from django.test import Client

from queue_api import calls
from queue_core import errors
from queue_core.client import RelayClient
from queue_core.protocol.loopback import LoopbackTransport
from queue_core.protocol.server import RelayServer
from queue_core.service import QueueService
from tests.integration.test_tcp_server import Running

SURFACES = ["inprocess", "tcp", "http"]


class Surface(Protocol):
    """What every surface offers the contract tests."""

    name: str
    job_extras: frozenset[str]  # keys a job object has here beyond the TCP protocol's

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Run ``op``; return its TCP-shaped result, or raise the error's ``RelayError``."""
        ...


class ClientSurface:
    """The Python client, over some transport (loopback or TCP)."""

    job_extras: frozenset[str] = frozenset()

    def __init__(self, name: str, client: RelayClient) -> None:
        self.name = name
        self.client = client

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        result: dict[str, Any] = self.client.call(op, args or None)
        return result


class HttpSurface:
    """The HTTP API through Django's test client."""

    name = "http"
    # The ISO 8601 twins of the epoch-ms instants (docs/http-api.md).
    job_extras = frozenset({"created_at", "available_at", "lease_expires_at", "finished_at"})

    def __init__(self) -> None:
        self.client = Client()

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        method, path, body = self._route(op, dict(args))
        if method == "GET":
            query = {k: v for k, v in body.items() if v is not None}
            response = self.client.get(f"{path}?{urlencode(query)}" if query else path)
        elif method == "DELETE":
            response = self.client.delete(path)
        elif method == "PUT":
            response = self.client.put(path, orjson.dumps(body), content_type="application/json")
        else:
            response = self.client.post(path, orjson.dumps(body), content_type="application/json")
        data: dict[str, Any] = orjson.loads(response.content)
        if response.status_code >= 400:
            assert response["Content-Type"] == "application/problem+json"
            err = errors.error_from_body(
                {"code": data["code"], "message": data["detail"], "details": data.get("details")}
            )
            assert response.status_code == err.http_status, (data["code"], response.status_code)
            raise err
        if op in ("inspect", "dead_retry"):  # these routes answer the bare job
            return {"job": data}
        return data

    @staticmethod
    def _route(op: str, args: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
        """The method, path and body (or query) of ``op``; path arguments leave ``args``."""
        method, template = ROUTES[op]
        if op == "result" and "job_id" not in args:  # by queue and idempotency key
            template = "/queues/{queue}/result"
        names = [name for name in ("queue", "job_id") if "{" + name + "}" in template]
        path = "/api/v1" + template.format(**{name: args.pop(name) for name in names})
        return method, path, args


# Each op's route (docs/http-api.md).
ROUTES = {
    "submit": ("POST", "/queues/{queue}/jobs"),
    "submit_batch": ("POST", "/jobs/batch"),
    "lease": ("POST", "/leases"),
    "renew": ("POST", "/jobs/{job_id}/renew"),
    "renew_batch": ("POST", "/renewals"),
    "ack": ("POST", "/jobs/{job_id}/ack"),
    "ack_batch": ("POST", "/acks"),
    "fail": ("POST", "/jobs/{job_id}/fail"),
    "release": ("POST", "/jobs/{job_id}/release"),
    "inspect": ("GET", "/jobs/{job_id}"),
    "result": ("GET", "/jobs/{job_id}/result"),
    "stats": ("GET", "/stats"),
    "dead_list": ("GET", "/dead"),
    "dead_retry": ("POST", "/dead/{job_id}/replay"),
    "dead_purge": ("DELETE", "/dead/{job_id}"),
    "cancel": ("POST", "/jobs/{job_id}/cancel"),
    "pause": ("POST", "/queues/{queue}/pause"),
    "resume": ("POST", "/queues/{queue}/resume"),
    "set_queue_limits": ("PUT", "/queues/{queue}/limits"),
}


@pytest.fixture(params=SURFACES)
def surface(
    request: pytest.FixtureRequest, service: QueueService, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Surface]:
    """Each surface in turn, on ``service``."""
    name = request.param
    if name == "inprocess":
        client = RelayClient(transport=LoopbackTransport(service))
        yield ClientSurface(name, client)
        client.close()
    elif name == "tcp":
        running = Running(RelayServer(service, host="127.0.0.1", port=0, shutdown_grace_ms=0))
        client = RelayClient(f"127.0.0.1:{running.port}", timeout_s=15)
        try:
            yield ClientSurface(name, client)
        finally:
            client.close()
            running.stop()
    else:
        # The HTTP views reach the service through ``calls.service()``: give them this one.
        monkeypatch.setattr(calls, "service", lambda: service)
        yield HttpSurface()
