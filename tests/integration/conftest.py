"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from queue_core.protocol.server import RelayServer
from queue_core.service import QueueService
from tests.integration.test_tcp_server import OPEN, Running


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    """Close the raw clients (``test_tcp_server.Client``) a test left open: one that failed
    mid-way would leave its sockets to the garbage collector, whose ResourceWarning then
    fails whichever test runs next on that worker."""
    yield
    while OPEN:
        OPEN.pop().close()


@pytest.fixture
def start(transactional_db: None) -> Iterator[Callable[..., Running]]:
    """Start servers on 127.0.0.1:0 (``start(shutdown_grace_ms=...)``); stopped at teardown."""
    running: list[Running] = []

    def make(**kwargs: Any) -> Running:
        kwargs.setdefault("shutdown_grace_ms", 0)
        r = Running(RelayServer(QueueService(), host="127.0.0.1", port=0, **kwargs))
        running.append(r)
        return r

    yield make
    for r in running:
        if r.thread.is_alive():
            r.stop()
