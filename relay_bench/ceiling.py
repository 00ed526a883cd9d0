"""The CPython ceiling: the least any Python server must do to serve the bench's ops on SQLite.

``relay bench --with-ceiling`` measures this module's server beside ``relay_server`` in every
run, with the same client processes, floors, scenarios, ratios and targets, and
``python -m relay_bench.instructions --server ceiling`` counts its instructions per job the
way it counts Relay's. It is not Relay and not a queue anyone should run: it is the
measurement that says whether a target of issue 15 is out of reach for a CPython server at
all, or only for Relay's code. A target the ceiling misses cannot be met by any server
written this way on the same machine; the gap between Relay and the ceiling is what Relay's
own per-request work costs (its schema, history, validation, guards and layers).

What it does, and no more: one ``asyncio`` stream server (the event loop Relay's server runs
on) speaking the NDJSON frames of ``docs/protocol.md`` for ``ping``, ``submit``,
``submit_batch``, ``lease`` (``max_jobs`` 1, ``wait_ms`` long-poll) and ``ack`` (with
``lease_next``); one ``sqlite3`` connection on the lean floor's table (``floor.LEAN_SCHEMA``)
with the lean floor's statements; group commit (every request read in one loop pass shares
one ``BEGIN IMMEDIATE`` ... ``COMMIT`` on the loop's thread, as Relay's server does on SQLite
for up to 32 jobs' worth; Relay hands heavier batches to a writer thread, which this skips);
Relay's durability decision of issue 15 item 2 (a commit that only leases runs at
``synchronous=NORMAL``, any other at the file's level); replies of the same shape as
Relay's (a submit returns the whole job), each payload copied into the reply as stored
(``orjson.Fragment``, no decode).

What it leaves out, each of which Relay needs: validation beyond what reading its arguments
needs, limits, authentication, idempotency, priorities and aging, attempt history, retries,
lease expiry, counters, metrics, logging, error translation, savepoints (no request here can
fail halfway), crash recovery. Run it as
``python -m relay_bench.ceiling --db PATH --synchronous FULL [--address 127.0.0.1:0]``; it
logs ``{"event": "ready", "port": N}`` on stderr and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import secrets
import signal
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from relay_bench import floor

MAX_LINE_BYTES = 1024 * 1024 + 1  # Relay's default frame limit and its newline
LEASE_MS = 30_000
NORMAL = 1  # PRAGMA synchronous value of NORMAL (0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA)
_CLAIM = floor.LEAN_CLAIM.replace("RETURNING id, payload", "RETURNING id, payload, created_at_ms")
_INSERT = floor.LEAN_INSERT
_ACK = floor.LEAN_ACK


@dataclass(slots=True)
class Request:
    """One request waiting for the next group commit: its frame and where its reply goes."""

    frame: dict[str, Any]
    writer: asyncio.StreamWriter
    parked: bool = False  # a long-poll that has waited once (its timer is set)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _job(job_id: str, queue: str, payload: str, now: int) -> dict[str, Any]:
    """A submit's reply job, with the fields and defaults Relay's has (``docs/protocol.md``)."""
    return {
        "id": job_id,
        "queue": queue,
        "state": "ready",
        "priority": "normal",
        "payload": orjson.Fragment(payload),
        "attempt": 0,
        "failures": 0,
        "max_retries": 3,
        "retry_policy": {
            "backoff": "exponential",
            "base_ms": 1000,
            "cap_ms": 300000,
            "jitter": True,
        },
        "idempotency_key": None,
        "created_at_ms": now,
        "available_at_ms": None,
        "ready_since_ms": now,
        "leased_by": None,
        "lease_expires_at_ms": None,
        "finished_at_ms": None,
        "last_error": None,
        "dead_reason": None,
        "unique": "window",
        "meta": {},
        "cancel_requested_at_ms": None,
        "time_limit_ms": None,
    }


_SEQUENCE = itertools.count()


def _new_id(now: int) -> str:
    """A time-ordered id (the floor's shape), so ``ORDER BY ready_since_ms, id`` is FIFO."""
    return f"job_{now:013d}{next(_SEQUENCE):013d}"


class Ceiling:
    """The server's state: the connection, the requests of the next commit, parked long-polls.

    Args:
        path: a lean floor database (``floor.create_lean``).
        synchronous: the file's ``synchronous`` level (``FULL``, ``NORMAL``...), kept by every
            commit that does more than lease.
    """

    def __init__(self, path: str, synchronous: str) -> None:
        self.db = floor.connect(path, synchronous)
        self.level = int(self.db.execute("PRAGMA synchronous").fetchone()[0])
        self.pending: list[Request] = []
        self.parked: dict[str, list[Request]] = {}
        self.loop = asyncio.get_running_loop()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: read frames, answer ``ping`` at once, queue the rest for the next
        group commit (one request in flight per connection is all the bench sends)."""
        try:
            while line := await reader.readline():
                try:
                    frame = orjson.loads(line)
                    if not isinstance(frame, dict):
                        raise ValueError("not an object")
                except ValueError:
                    self._error(writer, None, "BAD_FRAME", "frame is not a JSON object")
                    continue
                if frame.get("op") == "ping":
                    self._reply(
                        writer, frame.get("id"), {"pong": True, "server_time_ms": _now_ms()}
                    )
                    continue
                if not self.pending:
                    self.loop.call_soon(self.commit)
                self.pending.append(Request(frame, writer))
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    def commit(self) -> None:
        """Run every queued request in one transaction, commit, then write the replies."""
        batch, self.pending = self.pending, []
        leases_only = all(r.frame.get("op") == "lease" for r in batch)
        relaxed = leases_only and self.level > NORMAL
        if relaxed:
            self.db.execute(f"PRAGMA synchronous={NORMAL}")
        replies: list[tuple[Request, Callable[[], None]]] = []
        woken: set[str] = set()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for request in batch:
                replies.append((request, self._answer(request, woken)))
            self.db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.db.execute("ROLLBACK")
            raise
        finally:
            if relaxed:
                self.db.execute(f"PRAGMA synchronous={self.level}")
        for _request, answer in replies:
            answer()
        for queue in woken:
            for request in self.parked.pop(queue, []):
                if not self.pending:
                    self.loop.call_soon(self.commit)
                self.pending.append(request)

    def _answer(self, request: Request, woken: set[str]) -> Callable[[], None]:
        """``_run``, or for arguments it cannot read an ``INVALID_ARGUMENT`` reply (every
        request reads its arguments before its first statement, so it changed nothing)."""
        try:
            return self._run(request, woken)
        except (LookupError, TypeError, AttributeError, orjson.JSONEncodeError) as exc:
            req_id, text = request.frame.get("id"), f"cannot read the arguments: {exc!r}"
            return lambda: self._error(request.writer, req_id, "INVALID_ARGUMENT", text)

    def _run(self, request: Request, woken: set[str]) -> Callable[[], None]:
        """One request's statements inside the open transaction; returns what sends its reply."""
        frame, writer = request.frame, request.writer
        req_id, op, args = frame.get("id"), frame.get("op"), frame.get("args") or {}
        now = _now_ms()
        if op == "submit":
            queue, job_id = _text(args["queue"]), _new_id(now)
            body = orjson.dumps(args["payload"]).decode()
            self.db.execute(_INSERT, _row(job_id, queue, body, now))
            woken.add(queue)
            result: dict[str, Any] = {"job": _job(job_id, queue, body, now)}
            result["deduplicated"] = False
        elif op == "submit_batch":
            rows = [
                _row(_new_id(now), _text(j["queue"]), orjson.dumps(j["payload"]).decode(), now)
                for j in args["jobs"]
            ]
            self.db.executemany(_INSERT, rows)
            woken.update(r["queue"] for r in rows)
            result = {
                "results": [
                    {
                        "job_id": r["id"],
                        "queue": r["queue"],
                        "state": "ready",
                        "available_at_ms": None,
                        "deduplicated": False,
                    }
                    for r in rows
                ]
            }
        elif op == "lease":
            queue, wait_ms = _text(args["queues"][0]), args.get("wait_ms")
            jobs = self._claim(queue, now)
            if not jobs and wait_ms:
                self._park(request, queue, float(wait_ms))
                return lambda: None
            result = {"jobs": jobs}
        elif op == "ack":
            job_id, token = _text(args["job_id"]), _text(args["lease_token"])
            params = {"job_id": job_id, "token": token, "now_ms": now}
            ask = args.get("lease_next")
            next_queue = _text(ask["queues"][0]) if ask else None
            if self.db.execute(_ACK, params).rowcount != 1:
                return lambda: self._error(writer, req_id, "STALE_TOKEN", "not this lease")
            result = {"job_id": job_id, "state": "succeeded", "duplicate": False}
            if next_queue is not None:
                result["next"] = self._claim(next_queue, now)
        else:
            return lambda: self._error(writer, req_id, "UNKNOWN_OP", f"no op {op!r} here")
        return lambda: self._reply(writer, req_id, result)

    def _claim(self, queue: str, now: int) -> list[dict[str, Any]]:
        token = secrets.token_urlsafe(24)
        params = {"token": token, "expires_ms": now + LEASE_MS, "now_ms": now, "queue": queue}
        row = self.db.execute(_CLAIM, params).fetchone()
        if row is None:
            return []
        return [
            {
                "job_id": row[0],
                "queue": queue,
                "payload": orjson.Fragment(row[1]),
                "attempt": 1,
                "priority": "normal",
                "lease_token": token,
                "lease_expires_at_ms": now + LEASE_MS,
                "failures": 0,
                "max_retries": 3,
                "created_at_ms": row[2],
                "meta": {},
                "time_limit_ms": None,
            }
        ]

    def _park(self, request: Request, queue: str, wait_ms: float) -> None:
        """A long-poll with nothing to lease: re-run after a commit that adds a job to
        ``queue``, or answer ``{"jobs": []}`` after ``wait_ms``."""
        self.parked.setdefault(queue, []).append(request)
        if request.parked:
            return  # woken for a job another lease took first: its first timer still runs
        request.parked = True

        def expire() -> None:
            waiting = self.parked.get(queue, [])
            if request in waiting:
                waiting.remove(request)
                self._reply(request.writer, request.frame.get("id"), {"jobs": []})

        self.loop.call_later(wait_ms / 1000, expire)

    @staticmethod
    def _reply(writer: asyncio.StreamWriter, req_id: Any, result: dict[str, Any]) -> None:
        frame = {"id": req_id, "ok": True, "result": result}
        writer.write(orjson.dumps(frame, option=orjson.OPT_APPEND_NEWLINE))

    @staticmethod
    def _error(writer: asyncio.StreamWriter, req_id: Any, code: str, message: str) -> None:
        frame = {"id": req_id, "ok": False, "error": {"code": code, "message": message}}
        writer.write(orjson.dumps(frame, option=orjson.OPT_APPEND_NEWLINE))


def _text(value: Any) -> str:
    """``value`` if it is a string; TypeError (an ``INVALID_ARGUMENT`` reply) if not."""
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _row(job_id: str, queue: str, payload: str, now: int) -> dict[str, Any]:
    return {
        "id": job_id,
        "queue": queue,
        "state": "ready",
        "priority": 1,
        "payload": payload,
        "now_ms": now,
        "ready_since_ms": now,
    }


async def _main(path: str, synchronous: str, host: str, port: int) -> None:
    ceiling = Ceiling(path, synchronous)
    server = await asyncio.start_server(ceiling.serve, host, port, limit=MAX_LINE_BYTES)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        ceiling.loop.add_signal_handler(signum, stop.set)
    bound = server.sockets[0].getsockname()[1]
    sys.stderr.write(orjson.dumps({"event": "ready", "port": bound, "pid": os.getpid()}).decode())
    sys.stderr.write("\n")
    sys.stderr.flush()
    async with server:
        await stop.wait()
    ceiling.db.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m relay_bench.ceiling --db PATH [--synchronous LEVEL] [--address H:P]``."""
    parser = argparse.ArgumentParser(prog="python -m relay_bench.ceiling")
    parser.add_argument("--db", required=True, help="a lean floor database (created if absent)")
    parser.add_argument("--synchronous", default="FULL")
    parser.add_argument("--address", default="127.0.0.1:0")
    args = parser.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    if not os.path.exists(args.db):
        floor.create_lean(args.db)
    asyncio.run(_main(args.db, args.synchronous.upper(), host, int(port)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
