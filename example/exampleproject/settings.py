"""Settings of the example shop: an ordinary Django 6 project whose tasks run on Relay.

The three Relay-specific parts are marked "Relay:".
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "example-only-not-secret"  # noqa: S105 - an example, never deployed
DEBUG = True
ALLOWED_HOSTS: list[str] = []

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    # Relay: the queue's tables (task results too) and commands.
    "queue_core.apps.QueueCoreConfig",
    "shop",
]

# Relay: the shop and the queue share one SQLite file in WAL mode. transaction_mode IMMEDIATE
# makes atomic() take the write lock when it begins (check relay.W106).
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_DB", str(BASE_DIR / "shop.db")),
        "OPTIONS": {
            "timeout": 5,
            "transaction_mode": "IMMEDIATE",
            "init_command": (
                "PRAGMA journal_mode=WAL;PRAGMA synchronous=FULL;"
                "PRAGMA busy_timeout=5000;PRAGMA foreign_keys=ON"
            ),
        },
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

# Relay: Django's tasks framework enqueues on Relay.
TASKS = {
    "default": {
        "BACKEND": "queue_core.tasks_backend.RelayBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"MAX_RETRIES": 3},
    }
}
RELAY_ADDRESS = os.environ.get("RELAY_ADDRESS", "127.0.0.1:7400")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {
        "relay": {"handlers": ["stderr"], "level": "INFO"},
        # Not also through Django's own console handler (DEBUG): each line once.
        "django.tasks": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
    },
}
