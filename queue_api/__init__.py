"""Relay HTTP API (django-ninja) under ``/api/v1``, its API-key admin and ``/metrics``."""
