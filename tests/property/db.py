"""Database helper for hypothesis tests that share one test database across examples."""

from __future__ import annotations

from django.db import connection


def reset_tables() -> None:
    """Delete every job, attempt and event: a fresh queue for the next example."""
    with connection.cursor() as cursor:
        for table in ("relay_attempt", "relay_event", "relay_job"):
            cursor.execute(f"DELETE FROM {table}")  # fixed table names
