"""The client side of a measurement: producers and lease+ack workers in child processes.

``run(...)`` starts ``processes`` children (``python -m relay_bench.load SPEC``), each
with ``concurrency / processes`` threads, and every thread has its own ``RelayClient`` (its own
TCP connection, one request in flight). A child connects all its threads (a ``ping`` each),
prints ``{"event": "ready"}``, waits for ``go`` on stdin, runs its share, and prints one JSON
line with its op count, its start/end instants and every latency. Spreading the clients over
processes keeps the load generator's own GIL from capping what the server can do; instants
are ``time.monotonic()``, which on Linux is one system-wide clock, so windows from different
processes compare.

Kinds of work:

* ``submit``: ``ops`` x ``submit(queue, payload)`` per thread;
* ``submit_batch``: ``ops`` x ``submit_batch([...batch jobs...])`` per thread;
* ``lease_ack``: ``lease(max_jobs=1)`` then ``ack``, until the queue is empty or ``ops`` jobs;
* ``lease_next``: one ``lease(max_jobs=1)``, then ``ack`` with ``lease_next`` (``max_jobs`` 1):
  each reply brings the next job, so one request per job (how ``relay worker`` and the
  application worker lease), until the queue is empty or ``ops`` jobs;
* ``ack_batch``: one ``lease(max_jobs=ACK_BATCH)``, then ``ack_batch`` of what it holds with
  ``lease_next`` (``max_jobs`` ``ACK_BATCH``): each reply brings the next jobs, so one request
  per ``ACK_BATCH`` jobs, as ``relay worker --concurrency 16`` sends its acks (its batches held
  about 4 acks in a server profile, docs/benchmarking.md round 5); until the queue is empty
  or about ``ops`` jobs;
* ``http_submit``: ``ops`` x ``POST /api/v1/queues/{queue}/jobs`` per thread over one
  keep-alive HTTP/1.1 connection (``http.client``); any status but 200/201 counts as an error.

Every loop is bounded in count and by ``deadline_s``. This module imports no Django: the
children start fast and only speak the protocol.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from queue_core import errors
from queue_core.client import RelayClient

READY_TIMEOUT_S = 60.0
ACK_BATCH = 4  # jobs per ``ack_batch`` request (kind ``ack_batch``)
MAX_FRAME_BYTES = 1024 * 1024
_FAILED = object()  # _lease_one: the lease failed (counted as an error)


def payload(n: int, size: int = 100) -> dict[str, Any]:
    """A JSON payload of about ``size`` bytes (``{"n": n, "pad": "xxx..."}``)."""
    return {"n": n, "pad": "x" * max(0, size - 24)}


class _Thread(threading.Thread):
    """One client thread: its own connection, its own latency lists."""

    def __init__(self, spec: dict[str, Any], index: int, go: threading.Event) -> None:
        super().__init__(name=f"bench-{spec['kind']}-{index}", daemon=True)
        self.spec = spec
        self.index = index
        self.go = go
        self.client = RelayClient(spec["address"], timeout_s=60.0, max_frame_bytes=MAX_FRAME_BYTES)
        host, _, port = spec["address"].rpartition(":")
        self.http = http.client.HTTPConnection(host, int(port), timeout=60.0)
        self.lat: dict[str, list[float]] = {}
        self.ops = 0
        self.requests = 0
        self.errors = 0
        self.error_sample: str | None = None
        self.t_start = 0.0
        self.t_end = 0.0

    def _timed(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.lat.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
            self.requests += 1

    def run(self) -> None:
        self.go.wait()
        spec = self.spec
        deadline = time.monotonic() + spec["deadline_s"]
        self.t_start = time.monotonic()
        try:
            getattr(self, "_" + spec["kind"])(spec, deadline)
        finally:
            self.t_end = time.monotonic()
            self.client.close()
            self.http.close()

    def connect(self) -> None:
        """Open the connection before the measured window."""
        if self.spec["kind"].startswith("http"):
            self.http.connect()
        else:
            self.client.ping()

    def _fail(self, exc: BaseException) -> None:
        self.errors += 1
        if self.error_sample is None:
            self.error_sample = f"{type(exc).__name__}: {exc}"

    def _submit(self, spec: dict[str, Any], deadline: float) -> None:
        queue, size = spec["queue"], spec["payload_bytes"]
        for n in range(spec["ops"]):
            if time.monotonic() > deadline:
                return
            body = payload(n, size)
            try:
                self._timed("submit", self.client.submit, queue, body)
                self.ops += 1
            except (errors.RelayError, ConnectionError) as exc:
                self._fail(exc)

    def _submit_batch(self, spec: dict[str, Any], deadline: float) -> None:
        queue, size, batch = spec["queue"], spec["payload_bytes"], spec["batch"]
        for n in range(spec["ops"]):
            if time.monotonic() > deadline:
                return
            jobs = [{"queue": queue, "payload": payload(n * batch + i, size)} for i in range(batch)]
            try:
                self._timed("submit_batch", self.client.submit_batch, jobs)
                self.ops += batch
            except (errors.RelayError, ConnectionError) as exc:
                self._fail(exc)

    def _http_submit(self, spec: dict[str, Any], deadline: float) -> None:
        path = f"/api/v1/queues/{spec['queue']}/jobs"
        headers = {"Content-Type": "application/json", "Connection": "keep-alive"}
        for n in range(spec["ops"]):
            if time.monotonic() > deadline:
                return
            body = json.dumps({"payload": payload(n, spec["payload_bytes"])})
            t0 = time.perf_counter()
            try:
                self.http.request("POST", path, body=body, headers=headers)
                response = self.http.getresponse()
                text = response.read()
            except (OSError, http.client.HTTPException) as exc:
                self._fail(exc)
                self.http.close()
                continue
            finally:
                self.requests += 1
            self.lat.setdefault("submit", []).append((time.perf_counter() - t0) * 1000)
            if response.status in (200, 201):
                self.ops += 1
            else:
                self._fail(RuntimeError(f"HTTP {response.status}: {text[:200]!r}"))

    def _lease_one(self, queue: str, worker_id: str) -> Any:
        """Lease one job: the job, None when the queue is drained, or ``_FAILED`` after an
        error (counted)."""
        try:
            jobs = self._timed("lease", self.client.lease, [queue], worker_id=worker_id, max_jobs=1)
        except (errors.RelayError, ConnectionError) as exc:
            self._fail(exc)
            return _FAILED
        return jobs[0] if jobs else None

    def _lease_ack(self, spec: dict[str, Any], deadline: float) -> None:
        queue = spec["queue"]
        worker_id = f"bench-{os.getpid()}-{self.index}"
        for _ in range(spec["ops"]):
            if time.monotonic() > deadline:
                return
            job = self._lease_one(queue, worker_id)
            if job is _FAILED:
                continue
            if job is None:
                return  # the backlog is drained
            try:
                self._timed(
                    "ack",
                    self.client.ack,
                    job["job_id"],
                    worker_id=worker_id,
                    lease_token=job["lease_token"],
                )
                self.ops += 1
            except (errors.RelayError, ConnectionError) as exc:
                self._fail(exc)

    def _lease_next(self, spec: dict[str, Any], deadline: float) -> None:
        queue = spec["queue"]
        worker_id = f"bench-{os.getpid()}-{self.index}"
        ask = {"queues": [queue], "max_jobs": 1}
        job: dict[str, Any] | None = None
        for _ in range(spec["ops"]):
            if time.monotonic() > deadline:
                return
            if job is None:  # the first job, or after an error: a plain lease
                job = self._lease_one(queue, worker_id)
                if job is _FAILED:
                    job = None
                    continue
                if job is None:
                    return  # the backlog is drained
            try:
                reply = self._timed(
                    "ack",
                    self.client.ack,
                    job["job_id"],
                    worker_id=worker_id,
                    lease_token=job["lease_token"],
                    lease_next=ask,
                )
            except (errors.RelayError, ConnectionError) as exc:
                self._fail(exc)
                job = None
                continue
            self.ops += 1
            following = reply.get("next") or []
            job = following[0] if following else None

    def _ack_batch(self, spec: dict[str, Any], deadline: float) -> None:
        queue = spec["queue"]
        worker_id = f"bench-{os.getpid()}-{self.index}"
        ask = {"queues": [queue], "max_jobs": ACK_BATCH}
        held: list[dict[str, Any]] = []
        for _ in range(spec["ops"]):  # each pass acks at least one job or counts an error
            if self.ops >= spec["ops"] or time.monotonic() > deadline:
                return
            if not held:  # the first jobs, or after an error: a plain lease
                try:
                    held = self._timed(
                        "lease", self.client.lease, [queue], worker_id=worker_id, max_jobs=ACK_BATCH
                    )
                except (errors.RelayError, ConnectionError) as exc:
                    self._fail(exc)
                    continue
                if not held:
                    return  # the backlog is drained
            acks = [
                {"job_id": j["job_id"], "worker_id": worker_id, "lease_token": j["lease_token"]}
                for j in held
            ]
            try:
                reply = self._timed("ack", self.client.ack_batch, acks, lease_next=ask)
            except (errors.RelayError, ConnectionError) as exc:
                self._fail(exc)
                held = []
                continue
            for entry in reply["results"]:
                if entry["ok"]:
                    self.ops += 1
                else:
                    self._fail(RuntimeError(f"ack refused: {entry['error']}"))
            held = list(reply.get("next") or [])


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one child's share: connect, report ready, wait for ``go``, run, return the result."""
    go = threading.Event()
    threads = [_Thread(spec, n, go) for n in range(spec["threads"])]
    for thread in threads:
        thread.connect()  # now, not inside the measured window
        thread.start()
    sys.stdout.write(json.dumps({"event": "ready"}) + "\n")
    sys.stdout.flush()
    sys.stdin.readline()
    go.set()
    for thread in threads:
        thread.join(spec["deadline_s"] + 30)
    lat: dict[str, list[float]] = {}
    for thread in threads:
        for name, values in thread.lat.items():
            lat.setdefault(name, []).extend(round(v, 4) for v in values)
    samples = [t.error_sample for t in threads if t.error_sample]
    return {
        "ops": sum(t.ops for t in threads),
        "requests": sum(t.requests for t in threads),
        "errors": sum(t.errors for t in threads),
        "error_sample": samples[0] if samples else None,
        "t_start": min(t.t_start for t in threads),
        "t_end": max(t.t_end for t in threads),
        "per_thread_ops": [t.ops for t in threads],
        "latency_ms": lat,
    }


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # the directory holding relay_bench/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def split(concurrency: int, processes: int) -> list[int]:
    """Spread ``concurrency`` threads over at most ``processes`` processes, as evenly as can be."""
    processes = max(1, min(processes, concurrency))
    base, extra = divmod(concurrency, processes)
    return [base + (1 if n < extra else 0) for n in range(processes)]


def run(
    address: str,
    kind: str,
    *,
    concurrency: int,
    processes: int,
    ops_per_thread: int,
    deadline_s: float,
    queue: str = "bench",
    batch: int = 100,
    payload_bytes: int = 100,
) -> dict[str, Any]:
    """Run ``kind`` with ``concurrency`` clients over ``processes`` child processes.

    Returns:
        ``{"ops", "requests", "errors", "error_sample", "seconds", "per_s", "latency_ms":
        {op: [ms, ...]}, "per_thread_ops": [...], "processes", "concurrency"}``; ``seconds``
        runs from the first thread's start to the last one's end.
    Raises:
        RuntimeError: a child did not get ready or did not report in time.
    """
    children: list[subprocess.Popen[str]] = []
    try:
        for threads in split(concurrency, processes):
            spec = {
                "kind": kind,
                "address": address,
                "threads": threads,
                "ops": ops_per_thread,
                "deadline_s": deadline_s,
                "queue": queue,
                "batch": batch,
                "payload_bytes": payload_bytes,
            }
            children.append(
                subprocess.Popen(
                    [sys.executable, "-m", "relay_bench.load", json.dumps(spec)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=_child_env(),
                )
            )
        for child in children:
            line = _readline(child, READY_TIMEOUT_S)
            if json.loads(line).get("event") != "ready":
                raise RuntimeError(f"load child said {line!r} instead of ready")
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        results = [json.loads(_readline(child, deadline_s + 60)) for child in children]
        for child in children:
            child.wait(30)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(10)
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
    seconds = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
    lat: dict[str, list[float]] = {}
    for r in results:
        for name, values in r["latency_ms"].items():
            lat.setdefault(name, []).extend(values)
    ops = sum(r["ops"] for r in results)
    samples = [r["error_sample"] for r in results if r["error_sample"]]
    return {
        "ops": ops,
        "requests": sum(r["requests"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "error_sample": samples[0] if samples else None,
        "seconds": round(seconds, 3),
        "per_s": round(ops / seconds, 1) if seconds > 0 else 0.0,
        "latency_ms": lat,
        "per_thread_ops": [n for r in results for n in r["per_thread_ops"]],
        "processes": len(children),
        "concurrency": concurrency,
    }


def _readline(child: subprocess.Popen[str], timeout_s: float) -> str:
    """Read one stdout line of ``child`` within ``timeout_s``, else raise RuntimeError."""
    box: list[str] = []
    reader = threading.Thread(
        target=lambda: box.append(child.stdout.readline() if child.stdout else ""), daemon=True
    )
    reader.start()
    reader.join(timeout_s)
    if not box or not box[0]:
        raise RuntimeError(f"load child {child.pid} gave no answer within {timeout_s:g} s")
    return box[0]


if __name__ == "__main__":
    sys.stdout.write(json.dumps(child_main(json.loads(sys.argv[1]))) + "\n")
    sys.stdout.flush()
