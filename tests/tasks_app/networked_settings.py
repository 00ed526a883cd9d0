"""Relay's settings with a networked RelayBackend (``OPTIONS["ADDRESS"]``): the worker reads
task results over TCP from the server at ``RELAY_ADDRESS``, not from a shared database."""

from relayproject.settings import *  # noqa: F403
from relayproject.settings import RELAY_ADDRESS

TASKS = {
    "default": {
        "BACKEND": "queue_core.tasks_backend.RelayBackend",
        "QUEUES": [],
        "OPTIONS": {"ADDRESS": RELAY_ADDRESS, "TIMEOUT": 10},
    }
}
