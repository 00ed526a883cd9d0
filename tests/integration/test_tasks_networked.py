"""The networked ``RelayBackend`` (``OPTIONS["ADDRESS"]``) against real processes: a
``relay_server`` and a ``relay_worker --tasks`` whose backend is networked too
(``tests.tasks_app.networked_settings``).

The producer is this test process: Django's task API over TCP. Its own database (the test
database) only decides transactions: inside ``transaction.atomic()`` the submit waits for the
commit (``on_commit``), and a rolled-back transaction never reaches the server. Results come
back through the ``result`` op, stored by the service from the worker's ack and fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import transaction
from django.tasks import TaskResultStatus
from django.tasks.exceptions import TaskResultDoesNotExist
from django.test import override_settings

from queue_core.client import RelayClient
from queue_core.tasks_backend import RelayBackend
from tests.procs import Proc, Spawner
from tests.tasks_app import tasks
from tests.unit.canned_server import CannedServer, error, ok

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WAIT_S = 60.0
BACKEND = "queue_core.tasks_backend.RelayBackend"
RESULT_ID = re.compile(r"default/[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}")


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll ``predicate`` until it is truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


class Accepted:
    """The peers of the connections a ``silent_server`` accepted, in order, for tests that
    must know whether a client went back to it (not how long a call took: a loaded machine
    makes any call slow)."""

    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []
        self.changed = threading.Condition()

    def add(self, peer: tuple[str, int]) -> None:
        with self.changed:
            self.peers.append(peer)
            self.changed.notify_all()

    def settled(self, address: str, timeout_s: float = WAIT_S) -> int:
        """How many connections were accepted before a probe connection made now: the probe
        is accepted after every connection the kernel had already queued (one listen queue,
        in order), so none made before it is left uncounted."""
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as probe:
            me = probe.getsockname()
            with self.changed:
                assert self.changed.wait_for(lambda: me in self.peers, timeout_s)
                return self.peers.index(me)


@contextlib.contextmanager
def silent_server(
    first_breaks_after_s: float | None = None, accepted: Accepted | None = None
) -> Iterator[str]:
    """A server that accepts connections and answers nothing (a stopped process, a black
    hole); ``first_breaks_after_s``: the first connection is reset that long after its first
    request instead; ``accepted`` counts the connections it accepts. Yields its
    ``HOST:PORT``."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            held.append(conn)
            if accepted is not None:
                accepted.add(peer)
            if first_breaks_after_s is not None and len(held) == 1:
                conn.recv(65536)  # the request
                stop.wait(first_breaks_after_s)  # a server slow to fail, not a synchronisation
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                conn.close()  # a reset: the reply is lost

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join(5)
        for sock in (*held, listener):
            sock.close()


def finished(result: Any) -> bool:
    result.refresh()
    return bool(result.is_finished)


def networked(address: str, **options: Any) -> Any:
    """``override_settings`` with one networked RelayBackend on ``address``."""
    tasks_setting = {
        "default": {
            "BACKEND": BACKEND,
            "QUEUES": [],
            "OPTIONS": {"ADDRESS": address, "TIMEOUT": 10, **options},
        }
    }
    return override_settings(TASKS=tasks_setting)


def start(spawn: Spawner) -> tuple[str, Proc]:
    """A server, and a networked ``--tasks`` worker on it (found through its backend's
    ``ADDRESS``); return the address and worker."""
    _, port = spawn.server()
    address = f"127.0.0.1:{port}"
    # No --address, and RELAY_ADDRESS left at its default (127.0.0.1:7400, where nothing
    # listens): the worker leases from its networked backend's ADDRESS.
    worker = spawn(
        "relay_worker",
        "--tasks",
        "--wait-ms",
        "1000",
        name="relay_worker",
        DJANGO_SETTINGS_MODULE="tests.tasks_app.networked_settings",
        RELAY_TASKS_ADDRESS=address,
    )
    worker.wait_event("worker_ready")
    return address, worker


def test_a_lost_reply_is_sent_again_with_the_same_key_and_reads_retry_what_can_pass() -> None:
    # A reply lost to a blip raised from enqueue with the job committed: the caller never
    # learned the backend's key, and trying again made a second job; and a worker's read of
    # the task's call failed the task for a blip (hostile review).
    submits: list[dict[str, Any]] = []
    reads: list[dict[str, Any]] = []

    def script(request: dict[str, Any], connection: int) -> bytes | None:
        if request["op"] == "submit":
            submits.append(request["args"])
            if len(submits) == 1:
                return None  # the connection breaks before the reply
            job = {"id": "job_1", "created_at_ms": 1_700_000_000_000}
            return ok(request, {"job": job, "deduplicated": True})
        reads.append(request["args"])
        if len(reads) in (1, 3):
            return error(request, "UNAVAILABLE", "draining")
        return error(request, "NOT_FOUND", "no such job")

    server = CannedServer(script)
    try:
        with networked(server.address):
            result = tasks.add.enqueue(1, 2)
            assert result.enqueued_at is not None
            with pytest.raises(TaskResultDoesNotExist):
                tasks.add.get_backend().get_result(result.id)
            with pytest.raises(TaskResultDoesNotExist):  # aget_result repeats too
                asyncio.run(tasks.add.get_backend().aget_result(result.id))
    finally:
        server.close()
    assert len(submits) == 2 and submits[0] == submits[1]  # the same key: one job
    assert submits[0]["idempotency_key"] == result.id.split("/")[1]
    assert len(reads) == 4  # UNAVAILABLE passes; NOT_FOUND is an answer


@pytest.mark.parametrize("first_breaks_after_s", [None, 0.7])
def test_a_server_that_answers_nothing_costs_one_timeout_not_one_per_try(
    first_breaks_after_s: float | None,
) -> None:
    # The repeats after a lost reply made a black-holed server cost three TIMEOUTs, 30 s at
    # the default, in the caller's request thread (a review). And a try begun late in the
    # first TIMEOUT had a whole one of its own: a first connection broken at 0.7 s of a 1 s
    # TIMEOUT made the call take 1.9 s. Each try now ends by the first's start + TIMEOUT.
    with silent_server(first_breaks_after_s) as address, networked(address, TIMEOUT=1):
        began = time.monotonic()
        with pytest.raises(ConnectionError):
            tasks.add.enqueue(1, 2)
        took = time.monotonic() - began
    # one TIMEOUT of 1 s; three were 3.7 s with the pauses, and a late second try 1.9 s
    assert 0.9 <= took < 1.4, took


def test_a_server_that_does_not_accept_leaves_time_for_the_next_one() -> None:
    # A review: aget_result makes a new client per call, which starts at the first address;
    # with that server not accepting, the connection attempt took the whole TIMEOUT, and
    # every call failed though the second server answered.
    import socket

    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)  # never accepted: once its queue is full, connections hang
    queued: list[socket.socket] = []
    for _ in range(8):
        sock = socket.socket()
        sock.settimeout(0.2)
        queued.append(sock)
        try:
            sock.connect(full.getsockname())
        except TimeoutError:
            break  # the queue is full: this one hung
    else:
        pytest.fail("the listen queue never filled")
    answering = CannedServer(lambda request, n: error(request, "NOT_FOUND", "no such job"))
    try:
        address = f"127.0.0.1:{full.getsockname()[1]},{answering.address}"
        with networked(address, TIMEOUT=2):
            backend = tasks.add.get_backend()
            for read in (
                lambda: asyncio.run(backend.aget_result("default/x")),
                lambda: backend.get_result("default/y"),
            ):
                began = time.monotonic()
                with pytest.raises(TaskResultDoesNotExist):  # the second server's answer
                    read()
                assert time.monotonic() - began < 1.5
    finally:
        answering.close()
        for sock in (*queued, full):
            sock.close()


def test_aget_result_moves_past_a_server_that_accepts_and_never_answers() -> None:
    # A second review: each aget_result has a client of its own, which started at the first
    # address every time; with that server accepting and never answering (a stopped
    # process), every call failed though the second answered. With a key, the hello that
    # timed out now moves the client on within the call; without one, the reply that timed
    # out moves the next call on, as the blocking client's persistent connection does.
    def script(request: dict[str, Any], n: int) -> bytes:
        if request["op"] == "hello":
            return ok(request, {"key": "rk_x", "scopes": ["producer"]})
        return error(request, "NOT_FOUND", "no such job")

    answering = CannedServer(script)
    accepted = Accepted()
    try:
        with silent_server(accepted=accepted) as silent:
            address = f"{silent},{answering.address}"
            with networked(address, TIMEOUT=1.5, API_KEY="rk_x"):
                backend = tasks.add.get_backend()
                with pytest.raises(TaskResultDoesNotExist):  # within the call
                    asyncio.run(backend.aget_result("default/x"))
                went = accepted.settled(silent)
                assert went == 1
                for _ in range(3):  # and the next calls start at the server that answered
                    with pytest.raises(TaskResultDoesNotExist):
                        asyncio.run(backend.aget_result("default/x"))
                # (a third review: each went back to the silent server and paid the hello's
                # 0.5 s there; the probe of settled() counts one more)
                assert accepted.settled(silent) == went + 1
            with networked(address, TIMEOUT=1):
                backend = tasks.add.get_backend()
                with pytest.raises(ConnectionError):
                    asyncio.run(backend.aget_result("default/x"))
                went = accepted.settled(silent)
                for _ in range(3):  # the next calls start at the server that answers
                    with pytest.raises(TaskResultDoesNotExist):
                        asyncio.run(backend.aget_result("default/x"))
                assert accepted.settled(silent) == went + 1
    finally:
        answering.close()


def test_networked_backend_runs_tasks_and_reads_results_over_tcp(spawn: Spawner) -> None:
    address, worker = start(spawn)
    with networked(address):
        backend = tasks.add.get_backend()
        assert isinstance(backend, RelayBackend) and backend.networked
        added = tasks.add.enqueue(2, 3)
        assert RESULT_ID.fullmatch(added.id), added.id
        assert added.enqueued_at is not None  # outside a transaction: submitted at once
        nan = tasks.identity.enqueue(float("nan"))
        big = tasks.identity.enqueue(2**70)
        failing = tasks.refuse.enqueue("no thanks")
        own = tasks.own_id.enqueue()
        for result in (added, nan, big, failing, own):
            wait_for(lambda result=result: finished(result), result.id)
        assert added.status == TaskResultStatus.SUCCESSFUL
        assert added.return_value == 5
        assert own.return_value == own.id  # its context shows the id enqueue returned
        assert added.attempts == 1 and len(added.worker_ids) == 1
        assert added.started_at is not None and added.finished_at is not None
        assert big.return_value == 2**70  # beyond 64 bits: acked as return_json
        assert nan.return_value != nan.return_value  # NaN
        assert failing.status == TaskResultStatus.FAILED
        (error,) = failing.errors
        assert error.exception_class_path == "queue_core.worker.handlers.NonRetryableError"
        assert "NonRetryableError: no thanks" in error.traceback
        again = asyncio.run(backend.aget_result(added.id))
        assert again.return_value == 5 and again.status == TaskResultStatus.SUCCESSFUL
        with RelayClient(address) as client:  # the job id works too, as in relay inspect
            job_id = client.result(queue="default", idempotency_key=added.id.split("/")[1])
            assert backend.get_result(job_id["job"]["id"]).return_value == 5
        with pytest.raises(TaskResultDoesNotExist):
            backend.get_result("default/no-such-key")
        with pytest.raises(TaskResultDoesNotExist):
            asyncio.run(backend.aget_result("job_nope"))
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0


def test_networked_enqueue_in_a_transaction_is_sent_on_commit_and_never_on_rollback(
    spawn: Spawner,
) -> None:
    address, _ = start(spawn)
    with networked(address):
        with transaction.atomic():
            rolled_back = tasks.add.enqueue(100, 1)
            transaction.set_rollback(True)
        with transaction.atomic():
            committed = tasks.add.enqueue(1, 1)
            # Not sent yet: the server has no such job until the commit.
            assert committed.enqueued_at is None
            with pytest.raises(TaskResultDoesNotExist):
                committed.refresh()
        assert committed.enqueued_at is not None
        wait_for(lambda: finished(committed), "the committed task")
        assert committed.status == TaskResultStatus.SUCCESSFUL
        assert committed.return_value == 2
        with pytest.raises(TaskResultDoesNotExist):
            rolled_back.refresh()
    with RelayClient(address) as client:
        totals = client.stats()["totals"]
    assert sum(totals.values()) == 1  # only the committed task ever reached the server
    assert totals["succeeded"] == 1
