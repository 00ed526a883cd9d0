"""Relay HTTP API (django-ninja). Filled in by the HTTP API issue."""
