"""What the HTTP side checks before it listens (``gunicorn.conf.py``'s ``on_starting``).

* A private ``SECRET_KEY`` (it signs the admin's sessions and CSRF tokens): with ``DEBUG`` off,
  an empty one (no ``RELAY_SECRET_KEY``, no key file) or the public development key is refused
  with ``NO_SECRET_KEY`` and exit code ``EXIT_NO_SECRET_KEY``.
* No address beyond loopback while no API key exists (``queue_core.exposure``), unless
  ``RELAY_ALLOW_PUBLIC_WITHOUT_KEYS=1``: ``PUBLIC_WITHOUT_KEYS``, exit code 5.
* A database whose migrations are this code's (``queue_core.schema.problem``): one behind
  (an upgrade whose ``relay migrate`` has not run yet: every submit answered 500 ``INTERNAL``),
  or a SQLite file that does not exist (``bin/http`` migrates first; gunicorn started by hand
  on a mistyped path made an empty file, and every request answered 500 ``INTERNAL``), is
  refused with ``UNAVAILABLE``, exit code 1, which the unit's restart retries; one a newer
  Relay migrated with ``NEWER_SCHEMA``, exit code 9. A database that cannot be reached is not
  a reason: the API answers ``UNAVAILABLE`` until it is back.
"""

from __future__ import annotations

import os

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections

from queue_core import exposure
from queue_core.conf import relay_settings

EXIT_NO_SECRET_KEY = 6


def secret_key_refusal() -> str | None:
    """The one-line refusal when ``SECRET_KEY`` is missing or public with ``DEBUG`` off."""
    if settings.DEBUG:
        return None
    try:
        key = str(settings.SECRET_KEY)
    except ImproperlyConfigured:  # Django refuses to hand out an empty key
        key = ""
    if key and key != getattr(settings, "DEV_SECRET_KEY", None):
        return None
    why = "is not set" if not key else "is the public development key"
    return (
        f"NO_SECRET_KEY: the HTTP API refuses to start: SECRET_KEY {why} (it signs admin "
        "sessions and CSRF tokens); set RELAY_SECRET_KEY to a long random string, or run "
        "bin/setup, which writes a private one to .relay-secret-key (RELAY_SECRET_KEY_FILE)"
    )


def schema_refusal() -> tuple[str, int] | None:
    """The refusal, with its exit code, when the database's migrations are not this code's."""
    from queue_core import schema
    from queue_core.storage import driver_for

    alias = driver_for(relay_settings().database).alias
    where = str(connections[alias].settings_dict.get("NAME"))
    if connections[alias].vendor == "sqlite" and not os.path.exists(where):
        # Not made here: a typo would leave an empty file, whose every request failed.
        return (
            f"UNAVAILABLE: the HTTP API refuses to start: database {where} does not exist: "
            "run `relay migrate` (or start `relay server`, which makes and migrates it)",
            1,
        )
    try:
        found = schema.problem(alias)
    except DatabaseError:
        return None  # unreachable now: each request says UNAVAILABLE until it is back
    if found is None:
        return None
    if found.newer:
        return f"NEWER_SCHEMA: the HTTP API refuses to start: database {where} {found.message}", 9
    return f"UNAVAILABLE: the HTTP API refuses to start: database {where} {found.message}", 1


def refusal(binds: list[object]) -> tuple[str, int] | None:
    """The first reason not to start, with its exit code, or None.

    Args:
        binds: gunicorn's parsed addresses: ``(host, port)`` for TCP, a path (str) for a Unix
            socket (local, always allowed), an int for an inherited file descriptor (counted
            as beyond loopback: it cannot be told).
    """
    secret = secret_key_refusal()
    if secret:
        return secret, EXIT_NO_SECRET_KEY
    behind = schema_refusal()
    if behind:
        return behind
    tcp: list[tuple[str, int]] = []
    for bind in binds:
        if isinstance(bind, tuple):
            tcp.append((str(bind[0]), int(bind[1])))
        elif isinstance(bind, int):
            tcp.append((f"fd://{bind}", 0))
    public = exposure.refusal(
        "the HTTP API", tcp, allowed=relay_settings().allow_public_without_keys
    )
    if public:
        return public, exposure.EXIT_PUBLIC_WITHOUT_KEYS
    return None
