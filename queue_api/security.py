"""API-key authentication for ninja operations, one scope check per operation.

``Authorization: Bearer rk_…`` (or ``X-Api-Key: rk_…``) is checked against the key table by
``queue_core.auth``, the same code the TCP ``hello`` uses. With no key in the table, requests
run as ``auth.ANONYMOUS``. Refusals raise ``Unauthenticated`` / ``PermissionDenied``, which the
API's exception handler turns into 401 / 403 problem details.
"""

from __future__ import annotations

from django.http import HttpRequest
from ninja.security.base import AuthBase

from queue_core import auth


def presented_key(request: HttpRequest) -> str | None:
    """Return the key a request carries (Bearer token or ``X-Api-Key``), or None."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = request.headers.get("X-Api-Key", "").strip()
    return key or None


def peer_of(request: HttpRequest) -> str:
    """The client's address as ``host:port`` when the server gives the port."""
    host = request.META.get("REMOTE_ADDR") or "unknown"
    port = request.META.get("REMOTE_PORT")
    return f"{host}:{port}" if port else str(host)


class ApiKey(AuthBase):
    """Require a key whose scopes allow ``op`` (a TCP op name, or ``list_jobs``).

    The OpenAPI scheme is HTTP bearer; ``X-Api-Key`` is accepted as well.
    """

    openapi_type = "http"
    openapi_scheme = "bearer"
    openapi_description = (
        "An API key (rk_…) from `relay keys create` or the admin, as `Authorization: Bearer "
        "<key>` (or `X-Api-Key: <key>`). Needed once any key exists."
    )

    def __init__(self, op: str) -> None:
        self.op = op
        super().__init__()

    def __call__(self, request: HttpRequest) -> auth.Principal:
        """Return the request's principal.

        Raises:
            Unauthenticated, PermissionDenied; RelayError: the key table cannot be read now.
        """
        from queue_api.calls import key_ring, service  # calls imports this module

        peer = peer_of(request)
        key, ring = presented_key(request), key_ring()
        if auth.may_be_newer(ring, key):  # made since the snapshot? read again
            ring = auth.read_ring(service().driver)
        principal = auth.authenticate(key, surface="http", peer=peer, ring=ring)
        auth.authorize(principal, self.op, surface="http", peer=peer)
        return principal
