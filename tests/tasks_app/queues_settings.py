"""Relay's settings with a RelayBackend that lists its queues (for the test that ``relay_worker
--tasks`` without ``--queue`` serves every queue in ``QUEUES``)."""

from relayproject.settings import *  # noqa: F403

TASKS = {
    "default": {
        "BACKEND": "queue_core.tasks_backend.RelayBackend",
        "QUEUES": ["default", "emails", "reports"],  # tasks.py puts tasks on default
    }
}
