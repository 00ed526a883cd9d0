"""Unique while active under a race on each driver (issue 16, item 6): threads calling
``QueueService`` directly and clients of a real ``relay_server`` submit one key with ``unique:
"active"`` at once; each round makes exactly one job, and once it is acked the next round makes
exactly one new one. ``tests/postgresql/test_unique_active_races.py`` runs the same rounds
through two servers, and submits racing acks."""

from __future__ import annotations

import pytest

from tests.postgresql.test_unique_active_races import rounds_make_one_active_job
from tests.procs import Spawner
from tests.relay_db import DATABASES, RelayDb

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]


def test_racing_submits_make_one_active_job_per_round(spawn: Spawner, relay_db: RelayDb) -> None:
    _, port = spawn.server()
    alias = "default" if relay_db.backend == "sqlite" else "postgresql"
    rounds_make_one_active_job([f"127.0.0.1:{port}"], alias)
    relay_db.audit()
