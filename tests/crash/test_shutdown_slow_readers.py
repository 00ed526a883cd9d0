"""A shutdown with clients that pipeline leases and read none of their replies, against a
real ``relay_server`` process, on SQLite and on PostgreSQL (``relay_db``).

Such a client's lease replies wait in the server's kernel, unsent (its window is shut). At
the shutdown the server closes its side, and the client goes on sending: a reset (the
server's, closing with its input unread, or its kernel's, for input after the close)
destroys those replies unread. Their jobs must be READY once the server has exited, not
LEASED to replies nobody can read: before, a hostile review left 10,077 of 30,000 so, and on
PostgreSQL, where other servers go on serving, they waited for their leases to expire. What
each client's kernel took survives the reset and is read afterwards: those jobs stay LEASED,
and at most a window's worth more.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import orjson
import pytest

from queue_core.client import RelayClient
from tests.procs import Spawner
from tests.relay_db import DATABASES, RelayDb
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

CLIENTS = 3
JOBS = 6000
SEND_FOR_S = 60.0  # each client's sending ends at the latest after this
# Lease replies (at least 150 bytes each) a 4 KiB receive buffer's window (the kernel doubles
# it) can have on the way at a reset: sent, they may arrive with their ACK delayed, or have
# been dropped by the client's full buffer; their jobs stay LEASED (``Conn.transmitted``).
ON_THE_WAY = 2 * 4096 // 150 + 1
# The leases outlast any run of the test. The replies the clients can read are the first ones
# sent, so with the default 30 s lease a run slower than that (under load) has the reaper
# expire exactly their jobs back to READY before the server exits, and fails as if they had
# been given back: seen once in a loaded run (55 readable, none LEASED), and the same with 8 s
# leases and the signal sent after the first expiry (54 readable, all READY, failures 1).
LEASE_MS = 600_000


def received(sock: socket.socket) -> set[str]:
    """The job ids of the whole lease replies ``sock`` can still read (its connection was
    reset: what its kernel had acknowledged)."""
    sock.settimeout(15)
    data = bytearray()
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 20):
            data += chunk
    lines = bytes(data).split(b"\n")[:-1]  # the last is cut short, or empty
    return {
        job["job_id"]
        for line in lines
        for job in (orjson.loads(line).get("result") or {}).get("jobs", [])
    }


def states(relay_db: RelayDb, ids: set[str]) -> list[tuple[object, ...]]:
    """``(id, state, attempt, failures)`` of up to five of ``ids``, for a failure's message."""
    some = sorted(ids)[:5]
    marks = ", ".join(["%s"] * len(some))
    return relay_db.rows(
        f"SELECT id, state, attempt, failures FROM relay_job WHERE id IN ({marks})", some
    )


def pipeline_leases(sock: socket.socket, stop: threading.Event, writes: int | None) -> None:
    """Send lease requests, 50 a write, until the connection fails, ``stop`` is set,
    ``SEND_FOR_S`` passes or ``writes`` writes went (None: no such bound); read nothing."""
    lease = {"op": "lease", "args": {"queues": ["sr"], "worker_id": "slow", "lease_ms": LEASE_MS}}
    frames = b"".join(orjson.dumps({"id": i, **lease}) + b"\n" for i in range(50))
    ends = time.monotonic() + SEND_FOR_S
    with contextlib.suppress(OSError):
        while not stop.is_set() and time.monotonic() < ends and writes != 0:
            sock.sendall(frames)
            writes = None if writes is None else writes - 1


@pytest.mark.parametrize("sending", ["on", "stopped"])
def test_a_shutdown_leaves_leased_only_the_jobs_whose_replies_the_clients_can_read(
    spawn: Spawner, relay_db: RelayDb, sending: str
) -> None:
    # "on": the clients go on sending, so the kernel resets each connection after the close
    # (input after it). "stopped": each sent 1,000 leases, then nothing, so a close would be
    # a FIN and the kernel would go on sending what it holds: the server resets it itself,
    # else jobs it gave back would reach their clients and run twice (a hostile review:
    # 5,844 of 6,000 read after going back).
    server, port = spawn.server(RELAY_SHUTDOWN_GRACE_MS="200")
    with RelayClient(f"127.0.0.1:{port}") as producer:
        for at in range(0, JOBS, 500):
            producer.submit_batch(
                [{"queue": "sr", "payload": {"i": i}} for i in range(at, at + 500)]
            )
    stop = threading.Event()
    clients, senders = [], []
    for _ in range(CLIENTS):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it reads nothing
        sock.connect(("127.0.0.1", port))
        sock.settimeout(SEND_FOR_S)
        clients.append(sock)
        writes = None if sending == "on" else 20
        senders.append(
            threading.Thread(target=pipeline_leases, args=(sock, stop, writes), daemon=True)
        )
    for sender in senders:
        sender.start()

    def leased() -> int:
        return int(relay_db.rows("SELECT COUNT(*) FROM relay_job WHERE state = 'leased'")[0][0])

    at_signal = wait_until(lambda: (n := leased()) >= 1500 and n, what="1,500 leases")
    if sending == "stopped":  # all it sent: the clients' leases claim nothing more
        for sender in senders:
            sender.join(SEND_FOR_S)
        at_signal = wait_until(lambda: (n := leased()) >= 3000 and n, what="3,000 leases")
    server.signal(signal.SIGTERM)
    code = server.wait_exit(60)
    stop.set()
    for sender in senders:
        sender.join(SEND_FOR_S)
    assert code == 0
    readable: set[str] = set()
    for sock in clients:
        readable |= received(sock)
        sock.close()
    held = {r[0] for r in relay_db.rows("SELECT id FROM relay_job WHERE state = 'leased'")}
    # None given back and read (an expired lease would show failures 1, a give-back 0).
    assert readable <= held, (len(readable - held), states(relay_db, readable - held))
    # Replies sent but not taken (at most a window's worth a client) may stay LEASED.
    assert len(held - readable) <= CLIENTS * ON_THE_WAY, (len(held), len(readable))
    (ready,) = relay_db.rows("SELECT COUNT(*) FROM relay_job WHERE state = 'ready'")
    assert ready[0] == JOBS - len(held)
    assert len(held) < at_signal  # replies were destroyed: their jobs went back
    relay_db.audit()
