"""Refuse to listen beyond loopback while API keys are off.

With no API key in the table every request runs as ``anonymous`` (``queue_core.auth``), so a
server reachable from other machines would take jobs from anyone. ``relay server`` and the
HTTP side (``gunicorn.conf.py``) call ``refusal()`` before they bind: it returns one line
naming the address and the two ways out (create a key, or opt in with
``RELAY_ALLOW_PUBLIC_WITHOUT_KEYS=1`` / ``--allow-public-without-keys``), and the caller exits
with ``EXIT_PUBLIC_WITHOUT_KEYS``.
"""

from __future__ import annotations

import ipaddress
import socket

from django.db import DatabaseError

EXIT_PUBLIC_WITHOUT_KEYS = 5
CODE = "PUBLIC_WITHOUT_KEYS"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal, ``[v6]`` or a name) reaches this machine only.

    A name counts when every address it resolves to is loopback; an empty host, ``0.0.0.0``,
    ``::`` and a name that does not resolve do not.
    """
    host = host.strip().removeprefix("[").removesuffix("]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addresses = {str(info[4][0]).split("%")[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def keys_configured() -> bool:
    """Whether the key table has any row (access control on); False when it cannot be read."""
    from queue_core import auth

    try:
        return auth.load_ring().required
    except DatabaseError:
        return False


def refusal(surface: str, binds: list[tuple[str, int]], *, allowed: bool) -> str | None:
    """The one-line refusal to listen on ``binds``, or None when starting is fine.

    Args:
        surface: what is starting, for the message (``relay server``, ``HTTP API``).
        binds: the ``(host, port)`` pairs it is about to listen on.
        allowed: the operator's explicit opt-in (``RELAY_ALLOW_PUBLIC_WITHOUT_KEYS`` or
            ``--allow-public-without-keys``).
    Returns:
        ``"PUBLIC_WITHOUT_KEYS: ..."`` when an address is not loopback, no API key exists and
        ``allowed`` is False; else None. Reads the key table only for a non-loopback address.
    """
    public = [
        f"[{host}]:{port}" if ":" in host else f"{host or '*'}:{port}"
        for host, port in binds
        if not is_loopback(host)
    ]
    if not public or allowed or keys_configured():
        return None
    return (
        f"{CODE}: {surface} refuses to listen on {', '.join(public)}: not a loopback address, "
        "and no API key exists, so anyone who can reach it could submit and lease jobs; create "
        "a key first (relay keys create --name NAME --scope operator), or opt in with "
        "RELAY_ALLOW_PUBLIC_WITHOUT_KEYS=1 (relay server: --allow-public-without-keys)"
    )
