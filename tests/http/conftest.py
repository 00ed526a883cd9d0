"""Fixtures for the HTTP API, API keys and metrics: a JSON test client, keys, gunicorn.

``api`` drives the API through Django's test client; ``gunicorn`` starts a real gunicorn
(``gunicorn.conf.py``) on the test database and a free loopback port, and waits for its
``event=http_ready`` line instead of sleeping.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from django.test import Client
from prometheus_client import REGISTRY

from queue_core import auth
from tests.procs import ROOT, Proc, Spawner, command_env


class Api:
    """JSON calls on Django's test client, with an optional API key."""

    def __init__(self, key: str | None = None) -> None:
        self.client = Client()
        self.key = key

    def headers(self, key: str | None, extra: dict[str, str] | None) -> dict[str, str]:
        out = dict(extra or {})
        chosen = key if key is not None else self.key
        if chosen:
            out["Authorization"] = f"Bearer {chosen}"
        return out

    def get(
        self, path: str, *, key: str | None = None, headers: dict[str, str] | None = None
    ) -> Any:
        return self.client.get(path, headers=self.headers(key, headers))

    def post(
        self,
        path: str,
        body: Any = None,
        *,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        data = b"" if body is None else orjson.dumps(body)
        return self.client.post(
            path, data, content_type="application/json", headers=self.headers(key, headers)
        )

    def delete(self, path: str, *, key: str | None = None) -> Any:
        return self.client.delete(path, headers=self.headers(key, None))

    def with_key(self, key: str) -> Api:
        return Api(key)


def problem(response: Any, status: int, code: str) -> dict[str, Any]:
    """Assert ``response`` is an RFC 9457 problem with ``status`` and ``code``; return it."""
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    body: dict[str, Any] = orjson.loads(response.content)
    assert body["code"] == code, body
    assert body["status"] == status
    assert body["type"] == f"urn:relay:error:{code}"
    assert {"title", "detail", "instance", "retryable"} <= set(body)
    return body


class LongPoll:
    """``POST /api/v1/leases`` on ``queues`` with ``wait_ms``, from a thread of its own (with
    its own database connection, closed at its end); ``join()`` returns the leased jobs and
    sets ``elapsed`` (s)."""

    def __init__(self, queues: list[str], wait_ms: int) -> None:
        self.jobs: list[dict[str, Any]] = []
        self.elapsed = 0.0
        self._body = {"queues": queues, "wait_ms": wait_ms}
        self.thread = threading.Thread(target=self._poll)
        self.thread.start()

    def _poll(self) -> None:
        from django.db import connection

        try:
            started = time.monotonic()
            response = Api().post("/api/v1/leases", self._body)
            self.elapsed = time.monotonic() - started
            self.jobs = response.json()["jobs"]
        finally:
            connection.close()

    def join(self, timeout_s: float = 20) -> list[dict[str, Any]]:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the long-poll did not answer"
        return self.jobs


@pytest.fixture
def long_poll_waits(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when a long-poll starts to wait, past a claim that found nothing (a hook on
    ``Waiter.wait``): what a test waits for before the commit the long-poll must see."""
    from queue_core.protocol.wakeups import Waiter

    waiting = threading.Event()
    original = Waiter.wait

    async def wait(self: Waiter, timeout_s: float) -> bool:
        waiting.set()
        return await original(self, timeout_s)

    monkeypatch.setattr(Waiter, "wait", wait)
    return waiting


@pytest.fixture
def api(transactional_db: None) -> Api:
    """The HTTP API through Django's test client (no key)."""
    auth.invalidate()
    return Api()


@pytest.fixture
def make_key(transactional_db: None) -> Iterator[Callable[..., str]]:
    """``make_key("producer", "worker", name="n") -> "rk_..."``."""

    def make(*scopes: str, name: str = "test") -> str:
        return auth.create_key(name, scopes).key

    auth.invalidate()
    yield make
    auth.invalidate()


def metric(name: str, **labels: str) -> float:
    """The current value of one sample in this process's registry (0 when absent)."""
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


class Gunicorn:
    """A gunicorn process serving the project on a free loopback port."""

    def __init__(self, proc: Proc, port: int) -> None:
        self.proc = proc
        self.port = port

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        key: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            sent = dict(headers or {})
            data: bytes | None = None
            if body is not None:
                data = body if isinstance(body, bytes) else orjson.dumps(body)
                sent.setdefault("Content-Type", "application/json")
            if key:
                sent["Authorization"] = f"Bearer {key}"
            conn.request(method, path, body=data, headers=sent)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, _, raw = self.request(method, path, body, **kw)
        return status, orjson.loads(raw) if raw else None


def start_gunicorn(spawn: Spawner, *args: str, **env: str) -> Gunicorn:
    """Start gunicorn with gunicorn.conf.py on 127.0.0.1:0 and wait for its ready line."""
    popen = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            "gunicorn.conf.py",
            "--bind",
            "127.0.0.1:0",
            *args,
        ],
        cwd=ROOT,
        env=command_env(spawn.db_path, RELAY_HTTP_ACCESS_LOG="0", **env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    proc = Proc(popen, "gunicorn")
    spawn.procs.append(proc)
    ready = proc.wait_event("http_ready", timeout=60)
    server = Gunicorn(proc, int(ready["port"]))
    # The arbiter listens before its workers run: wait until one answers (with a deadline).
    deadline = time.monotonic() + 30
    while True:
        try:
            status, _, _ = server.request("GET", "/api/v1/health", timeout=5)
            if status == 200:
                return server
        except OSError:
            pass
        assert time.monotonic() < deadline, proc.stderr_text()[-3000:]
        time.sleep(0.05)


@pytest.fixture
def gunicorn(spawn: Spawner) -> Gunicorn:
    """A real gunicorn on the test database (killed at teardown)."""
    return start_gunicorn(spawn)
