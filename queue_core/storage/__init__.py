"""Storage drivers: the one door to a database, used only by ``QueueService``.

``base.py`` documents the interface once (``Driver``, ``Tx``, ``ChangeFeed``,
``Capabilities``); ``sqlite/`` and ``postgresql/`` each hold a driver and its ``queries.sql``.
``driver_for(alias)`` returns the driver for a Django database alias by its vendor.
"""

from __future__ import annotations

import functools

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.utils.connection import ConnectionDoesNotExist

from queue_core.storage.base import (
    AlreadyServed,
    Capabilities,
    ChangeFeed,
    ClaimRequest,
    Driver,
    Tx,
)

__all__ = [
    "AlreadyServed",
    "Capabilities",
    "ChangeFeed",
    "ClaimRequest",
    "Driver",
    "Tx",
    "driver_for",
    "new_driver",
]


def new_driver(alias: str = "default") -> Driver:
    """Make a new driver for the Django database ``alias``.

    Raises:
        ImproperlyConfigured: the alias is unknown, or its engine is neither SQLite nor
            PostgreSQL.
    """
    try:
        vendor = connections[alias].vendor
    except ConnectionDoesNotExist as exc:
        raise ImproperlyConfigured(f"RELAY_DATABASE: no database alias {alias!r}") from exc
    if vendor == "sqlite":
        from queue_core.storage.sqlite.driver import SqliteDriver

        return SqliteDriver(alias)
    if vendor == "postgresql":
        from queue_core.storage.postgresql.driver import PostgresDriver

        return PostgresDriver(alias)
    raise ImproperlyConfigured(
        f"Relay stores jobs in SQLite or PostgreSQL; database {alias!r} is {vendor}"
    )


@functools.cache
def driver_for(alias: str = "default") -> Driver:
    """The process's shared driver for ``alias`` (one change feed, one NOTIFY origin)."""
    return new_driver(alias)
