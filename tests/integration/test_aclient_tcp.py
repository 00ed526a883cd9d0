"""AsyncRelayClient against a real relay_server process: the job life cycle, error codes from
the server, and a long-poll lease sharing one connection with the submit that wakes it."""

from __future__ import annotations

import asyncio

import pytest

from queue_core import errors
from queue_core.aclient import AsyncRelayClient
from tests.procs import Spawner

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_life_cycle_and_errors_over_a_real_server(spawn: Spawner) -> None:
    _, port = spawn.server()

    async def main() -> None:
        async with AsyncRelayClient(f"127.0.0.1:{port}") as client:
            assert (await client.ping())["pong"] is True
            # A long poll and the submit that wakes it, pipelined on one connection.
            waiting = asyncio.create_task(client.lease(["emails"], worker_id="w1", wait_ms=10_000))
            submitted = await client.submit("emails", {"to": "a"}, priority="high")
            job = submitted["job"]
            assert (job["state"], job["priority"], submitted["deduplicated"]) == (
                "ready",
                "high",
                False,
            )
            (lease,) = await waiting
            assert lease["job_id"] == job["id"]
            assert client.connects == 1
            token = lease["lease_token"]
            renewed = await client.renew(job["id"], worker_id="w1", lease_token=token)
            assert renewed["lease_expires_at_ms"] >= lease["lease_expires_at_ms"]
            with pytest.raises(errors.StaleToken):
                await client.ack(job["id"], worker_id="w1", lease_token="x" * 32)
            acked = await client.ack(job["id"], worker_id="w1", lease_token=token)
            assert acked == {"job_id": job["id"], "state": "succeeded", "duplicate": False}
            again = await client.ack(job["id"], worker_id="w1", lease_token=token)
            assert again["duplicate"] is True
            inspected = (await client.inspect(job["id"]))["job"]
            assert inspected["state"] == "succeeded"
            assert [a["outcome"] for a in inspected.get("history", [])] == ["succeeded"]

            doomed = (await client.submit("emails", {"n": 2}))["job"]["id"]
            (lease,) = await client.lease(["emails"], worker_id="w1")
            failed = await client.fail(
                doomed, worker_id="w1", lease_token=lease["lease_token"], error="x", retryable=False
            )
            assert (failed["state"], failed["dead_reason"]) == ("dead", "non-retryable: x")
            dead = await client.dead_list(queue="emails")
            assert [j["id"] for j in dead["jobs"]] == [doomed]
            assert (await client.dead_retry(doomed))["job"]["state"] == "ready"
            stats = await client.stats("emails")
            assert stats["queues"]["emails"]["ready"] == 1
            with pytest.raises(errors.JobNotFound):
                await client.inspect("job_01JD000000000000000000000")
            with pytest.raises(errors.InvalidArgument):
                await client.submit("bad queue", {})
            batch = await client.submit_batch([{"queue": "q", "payload": i} for i in range(3)])
            assert len(batch["results"]) == 3

    asyncio.run(main())
