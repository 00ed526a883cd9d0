"""Relay's settings with Django's default ImmediateBackend instead of Relay's (for the test that
``relay_worker --tasks`` refuses to start without a RelayBackend)."""

from relayproject.settings import *  # noqa: F403

TASKS = {"default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}}
