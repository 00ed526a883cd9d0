"""The CPython ceiling: the least any Python server must do to serve the bench's ops on SQLite.

``relay bench --with-ceiling`` measures this module's server beside ``relay_server`` in every
run, with the same client processes, floors, scenarios, ratios and targets, and
``python -m relay_bench.instructions --server ceiling`` counts its instructions per job the
way it counts Relay's. It is not Relay and not a queue anyone should run: it is the
measurement that says whether a target of issue 15 is out of reach for a CPython server at
all, or only for Relay's code. A target the ceiling misses cannot be met by any server
written this way on the same machine; the gap between Relay and the ceiling is what Relay's
own per-request work costs (its schema, history, validation, guards and layers).

What it does, and no more: one ``asyncio`` stream server (with ``--reader protocol``, one
``asyncio.Protocol`` per connection instead: ``LineProtocol``), on the event loop Relay's server
runs on (``RELAY_EVENT_LOOP``: uvloop when installed, ``queue_core.protocol.loops``), speaking
the NDJSON frames of ``docs/protocol.md`` for ``ping``, ``submit``, ``submit_batch``,
``lease`` (``max_jobs`` 1, ``wait_ms`` long-poll) and ``ack`` (with
``lease_next``); one ``sqlite3`` connection on the lean floor's table (``floor.LEAN_SCHEMA``)
with the lean floor's statements, or with ``--schema relay`` on Relay's own migrated table with
the statements Relay's transitions run there (``RelaySql``: the job row, its count, its attempt
history row); group commit (every request read in one loop pass shares
one ``BEGIN IMMEDIATE`` ... ``COMMIT`` on the loop's thread, as Relay's server does on SQLite
for up to 32 jobs' worth; Relay hands heavier batches to a writer thread, which this skips);
Relay's durability decision of issue 15 item 2 (a commit that only leases runs at
``synchronous=NORMAL``, any other at the file's level); replies of the same shape as
Relay's (a submit returns the whole job), each payload copied into the reply as stored
(``orjson.Fragment``, no decode).

What it leaves out, each of which Relay needs: validation beyond what reading its arguments
needs, limits, authentication, idempotency, priorities and aging, attempt history, retries,
lease expiry, counters, metrics, logging, error translation, savepoints (no request here can
fail halfway), crash recovery. With ``--schema relay`` it pays for Relay's table (its columns,
indexes, CHECK constraints and count trigger), the aged-class claim, the counts and the
attempt history, and still leaves the rest out: what a server of this kind can reach on
Relay's schema. Run it as ``python -m relay_bench.ceiling --db PATH --synchronous FULL
[--schema lean|relay] [--reader streams|protocol] [--address 127.0.0.1:0]``; it logs
``{"event": "ready", "port": N}`` on stderr and stops on SIGTERM.
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
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from queue_core.protocol.loops import loop_factory, loop_name
from queue_core.storage.sqlite.library import memory_statistics_off
from relay_bench import floor

MAX_LINE_BYTES = 1024 * 1024 + 1  # Relay's default frame limit and its newline
LEASE_MS = 30_000
SCHEMAS = ("lean", "relay")
READERS = ("streams", "protocol")
NORMAL = 1  # PRAGMA synchronous value of NORMAL (0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA)
_CLAIM = floor.LEAN_CLAIM.replace("RETURNING id, payload", "RETURNING id, payload, created_at_ms")
_INSERT = floor.LEAN_INSERT
_ACK = floor.LEAN_ACK


class Sink(typing.Protocol):
    """Where replies go: an ``asyncio.StreamWriter`` or a transport."""

    def write(self, data: bytes) -> None: ...


class LineProtocol(asyncio.Protocol):
    """One connection read with ``asyncio.Protocol`` callbacks (``--reader protocol``): each
    whole line of a ``data_received`` goes to ``Ceiling.take`` from the callback itself, with
    no stream reader, waiter future or task wake-up per request. A line over
    ``MAX_LINE_BYTES`` closes the connection."""

    def __init__(self, ceiling: Ceiling) -> None:
        self.ceiling = ceiling
        self.rest = b""  # the start of a line whose newline has not come yet
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        assert transport is not None
        buf = self.rest + data if self.rest else data
        start, take = 0, self.ceiling.take
        while (end := buf.find(b"\n", start)) >= 0:
            take(buf[start : end + 1], transport)
            start = end + 1
        self.rest = buf[start:]
        if len(self.rest) > MAX_LINE_BYTES:
            transport.close()


@dataclass(slots=True)
class Request:
    """One request waiting for the next group commit: its frame and where its reply goes."""

    frame: dict[str, Any]
    writer: Sink
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
_PRIORITIES = ("low", "normal", "high", "critical")  # queue_core.states.Priority's names


class LeanSql:
    """The lean floor's statements on its table (``floor.LEAN_SCHEMA``)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def insert(self, rows: list[dict[str, Any]]) -> None:
        """Insert READY jobs (``_row`` dicts) in the open transaction."""
        if len(rows) == 1:
            self.db.execute(_INSERT, rows[0])
        else:
            self.db.executemany(_INSERT, rows)

    def claim(self, queue: str, worker_id: str, token: str, now: int) -> dict[str, Any] | None:
        """Lease the head of ``queue`` (normal class, FIFO); its lease's reply, or None."""
        params = {"token": token, "expires_ms": now + LEASE_MS, "now_ms": now, "queue": queue}
        row = self.db.execute(_CLAIM, params).fetchone()
        if row is None:
            return None
        return _lease(row[0], queue, orjson.Fragment(row[1]), 1, "normal", 0, 3, row[2], {}, None)

    def ack(self, job_id: str, token: str, worker_id: str, now: int) -> bool:
        """Succeed the job if ``token`` is its live lease's; whether it was."""
        params = {"job_id": job_id, "token": token, "now_ms": now}
        return bool(self.db.execute(_ACK, params).rowcount == 1)


class RelaySql:
    """Relay's statements on Relay's table (a migrated ``relay_server`` file), the ones its
    transitions run for these ops (``queue_core/storage/sqlite/queries.sql``): ``insert_job``
    and ``count_added`` per submit (one ``executemany`` and one count per queue for a batch);
    ``claim_one`` and ``insert_attempt`` per lease; ``ack`` and ``end_attempt`` per ack. The
    count trigger fires on every state change as in Relay. Left out: idempotency, the sweep
    probe and expiry, controls' reads, results, events. ``attempts=False`` leaves out the
    attempt history's two statements too (``relay_bench.schema_cost``'s ``no-attempts``)."""

    def __init__(self, db: sqlite3.Connection, *, attempts: bool = True) -> None:
        import django

        django.setup()  # the driver's module reads Relay's settings on import
        from queue_core.storage.sqlite.driver import NAMED_QUERIES

        self.db = db
        self.attempts = attempts
        names = ("insert_job", "count_added", "claim_one", "insert_attempt", "ack", "end_attempt")
        self.q = {name: NAMED_QUERIES[name] for name in names}

    def insert(self, rows: list[dict[str, Any]]) -> None:
        """Insert READY jobs (``_row`` dicts) and count them, in the open transaction."""
        jobs = [floor.job_row(0, r["now_ms"], r["payload"], r["queue"]) | r for r in rows]
        if len(jobs) == 1:
            self.db.execute(self.q["insert_job"], jobs[0])
        else:
            self.db.executemany(self.q["insert_job"], jobs)
        added: dict[str, int] = {}
        for row in rows:
            added[row["queue"]] = added.get(row["queue"], 0) + 1
        for queue, n in added.items():
            self.db.execute(self.q["count_added"], {"queue": queue, "state": "ready", "n": n})

    def claim(self, queue: str, worker_id: str, token: str, now: int) -> dict[str, Any] | None:
        """Lease the first of ``queue`` by aged class (``claim_one``) and open its attempt
        row; its lease's reply, or None."""
        params = {
            "queue": queue,
            "token": token,
            "worker_id": worker_id,
            "now_ms": now,
            "expires_ms": now + LEASE_MS,
        }
        cur = self.db.execute(self.q["claim_one"], params)
        row = cur.fetchone()
        cur.fetchall()  # RETURNING completes
        if row is None:
            return None
        job_id, _queue, payload, attempt, priority, failures, retries, created, meta, limit = row
        if self.attempts:
            opened = {"job_id": job_id, "attempt": attempt, "worker_id": worker_id, "now_ms": now}
            self.db.execute(self.q["insert_attempt"], opened | {"token": token})
        return _lease(
            job_id,
            queue,
            orjson.Fragment(payload),
            attempt,
            _PRIORITIES[priority],
            failures,
            retries,
            created,
            {} if meta is None else orjson.Fragment(meta),
            limit,
        )

    def ack(self, job_id: str, token: str, worker_id: str, now: int) -> bool:
        """Succeed the job if ``token`` and ``worker_id`` hold its live lease (Relay's guard,
        no clock step outstanding) and close its attempt row; whether they did."""
        params = {"job_id": job_id, "lease_token": token, "worker_id": worker_id, "now_ms": now}
        cur = self.db.execute(self.q["ack"], params | {"judge_ms": now, "mark_ms": -1})
        row = cur.fetchone()
        cur.fetchall()
        if row is None:
            return False
        if not self.attempts:
            return True
        ended = {"job_id": job_id, "attempt": row[0], "now_ms": now, "outcome": "succeeded"}
        self.db.execute(self.q["end_attempt"], ended | {"error": None, "retry_at_ms": None})
        return True


def _lease(
    job_id: str,
    queue: str,
    payload: Any,
    attempt: int,
    priority: str,
    failures: int,
    max_retries: int,
    created_at_ms: int,
    meta: Any,
    time_limit_ms: int | None,
) -> dict[str, Any]:
    """A lease's reply, with the fields Relay's has (``docs/protocol.md``); the token and
    expiry are added by the caller."""
    return {
        "job_id": job_id,
        "queue": queue,
        "payload": payload,
        "attempt": attempt,
        "priority": priority,
        "failures": failures,
        "max_retries": max_retries,
        "created_at_ms": created_at_ms,
        "meta": meta,
        "time_limit_ms": time_limit_ms,
    }


def _new_id(now: int) -> str:
    """A time-ordered id (the floor's shape), so ``ORDER BY ready_since_ms, id`` is FIFO."""
    return f"job_{now:013d}{next(_SEQUENCE):013d}"


class Ceiling:
    """The server's state: the connection, the requests of the next commit, parked long-polls.

    Args:
        path: a lean floor database (``floor.create_lean``), or with ``schema="relay"`` a
            migrated Relay database.
        synchronous: the file's ``synchronous`` level (``FULL``, ``NORMAL``...), kept by every
            commit that does more than lease.
        schema: ``"lean"`` (``LeanSql``) or ``"relay"`` (``RelaySql``).
    """

    def __init__(self, path: str, synchronous: str, schema: str = "lean") -> None:
        self.db = floor.connect(path, synchronous)
        self.sql = RelaySql(self.db) if schema == "relay" else LeanSql(self.db)
        self.level = int(self.db.execute("PRAGMA synchronous").fetchone()[0])
        self.pending: list[Request] = []
        self.parked: dict[str, list[Request]] = {}
        self.loop = asyncio.get_running_loop()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection read through asyncio's streams (``--reader streams``, as Relay's
        server reads): read frames, ``take`` each (one request in flight per connection is
        all the bench sends)."""
        try:
            while line := await reader.readline():
                self.take(line, writer)
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    def take(self, line: bytes, writer: Sink) -> None:
        """One frame: answer ``ping`` at once, queue the rest for the next group commit."""
        try:
            frame = orjson.loads(line)
            if not isinstance(frame, dict):
                raise ValueError("not an object")
        except ValueError:
            self._error(writer, None, "BAD_FRAME", "frame is not a JSON object")
            return
        if frame.get("op") == "ping":
            self._reply(writer, frame.get("id"), {"pong": True, "server_time_ms": _now_ms()})
            return
        if not self.pending:
            self.loop.call_soon(self.commit)
        self.pending.append(Request(frame, writer))

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
            self.sql.insert([_row(job_id, queue, body, now)])
            woken.add(queue)
            result: dict[str, Any] = {"job": _job(job_id, queue, body, now)}
            result["deduplicated"] = False
        elif op == "submit_batch":
            rows = [
                _row(_new_id(now), _text(j["queue"]), orjson.dumps(j["payload"]).decode(), now)
                for j in args["jobs"]
            ]
            self.sql.insert(rows)
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
            jobs = self._claim(queue, _text(args.get("worker_id", "ceiling")), now)
            if not jobs and wait_ms:
                self._park(request, queue, float(wait_ms))
                return lambda: None
            result = {"jobs": jobs}
        elif op == "ack":
            job_id, token = _text(args["job_id"]), _text(args["lease_token"])
            worker_id = _text(args.get("worker_id", "ceiling"))
            ask = args.get("lease_next")
            next_queue = _text(ask["queues"][0]) if ask else None
            next_worker = _text(ask.get("worker_id") or worker_id) if ask else worker_id
            if not self.sql.ack(job_id, token, worker_id, now):
                return lambda: self._error(writer, req_id, "STALE_TOKEN", "not this lease")
            result = {"job_id": job_id, "state": "succeeded", "duplicate": False}
            if next_queue is not None:
                result["next"] = self._claim(next_queue, next_worker, now)
        else:
            return lambda: self._error(writer, req_id, "UNKNOWN_OP", f"no op {op!r} here")
        return lambda: self._reply(writer, req_id, result)

    def _claim(self, queue: str, worker_id: str, now: int) -> list[dict[str, Any]]:
        token = secrets.token_urlsafe(24)
        lease = self.sql.claim(queue, worker_id, token, now)
        if lease is None:
            return []
        lease["lease_token"] = token
        lease["lease_expires_at_ms"] = now + LEASE_MS
        return [lease]

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
    def _reply(writer: Sink, req_id: Any, result: dict[str, Any]) -> None:
        frame = {"id": req_id, "ok": True, "result": result}
        writer.write(orjson.dumps(frame, option=orjson.OPT_APPEND_NEWLINE))

    @staticmethod
    def _error(writer: Sink, req_id: Any, code: str, message: str) -> None:
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


async def _main(
    path: str, synchronous: str, schema: str, host: str, port: int, reader: str = "streams"
) -> None:
    ceiling = Ceiling(path, synchronous, schema)
    if reader == "protocol":
        server = await ceiling.loop.create_server(lambda: LineProtocol(ceiling), host, port)
    else:
        server = await asyncio.start_server(ceiling.serve, host, port, limit=MAX_LINE_BYTES)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        ceiling.loop.add_signal_handler(signum, stop.set)
    bound = server.sockets[0].getsockname()[1]
    ready = {"event": "ready", "port": bound, "pid": os.getpid(), "loop": loop_name(ceiling.loop)}
    sys.stderr.write(orjson.dumps(ready).decode())
    sys.stderr.write("\n")
    sys.stderr.flush()
    async with server:
        await stop.wait()
    ceiling.db.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m relay_bench.ceiling --db PATH [--synchronous LEVEL] [--schema lean|relay]
    [--reader streams|protocol] [--address H:P]``."""
    parser = argparse.ArgumentParser(prog="python -m relay_bench.ceiling")
    parser.add_argument(
        "--db",
        required=True,
        help="a lean floor database (created if absent), or with --schema relay a migrated "
        "Relay database (relay_server's)",
    )
    parser.add_argument("--synchronous", default="FULL")
    parser.add_argument(
        "--schema",
        choices=SCHEMAS,
        default="lean",
        help="lean: the lean floor's table and statements; relay: Relay's own table and the "
        "statements its transitions run there (RelaySql)",
    )
    parser.add_argument(
        "--reader",
        choices=READERS,
        default="streams",
        help="streams: asyncio's StreamReader and one task per connection, as Relay's server "
        "reads; protocol: asyncio.Protocol callbacks (LineProtocol)",
    )
    parser.add_argument("--address", default="127.0.0.1:0")
    args = parser.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    if args.schema == "lean" and not os.path.exists(args.db):
        floor.create_lean(args.db)
    elif args.schema == "relay" and not os.path.exists(args.db):
        parser.error(f"--schema relay needs a migrated Relay database; {args.db} does not exist")
    memory_statistics_off()  # SQLite configured as in relay_server (QueueCoreConfig.ready)
    factory = loop_factory(os.environ.get("RELAY_EVENT_LOOP", "auto"))  # as relay_server's
    asyncio.run(
        _main(args.db, args.synchronous.upper(), args.schema, host, int(port), args.reader),
        loop_factory=factory,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
