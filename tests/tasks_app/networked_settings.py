"""Relay's settings with a networked RelayBackend (``OPTIONS["ADDRESS"]``, from the tests'
``RELAY_TASKS_ADDRESS``): the worker reads task results over TCP from that server, not from a
shared database, and without ``--address`` leases from it too."""

import os

from relayproject.settings import *  # noqa: F403

TASKS = {
    "default": {
        "BACKEND": "queue_core.tasks_backend.RelayBackend",
        "QUEUES": [],
        "OPTIONS": {"ADDRESS": os.environ["RELAY_TASKS_ADDRESS"], "TIMEOUT": 10},
    }
}
