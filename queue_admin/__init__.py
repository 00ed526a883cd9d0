"""Relay operator console in the Django admin."""
