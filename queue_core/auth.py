"""API keys: create, verify, revoke; and which op each scope allows.

A key reads ``rk_<prefix>_<secret>``: ``prefix`` is 12 hex characters that find the row (safe
to show and to log), ``secret`` 32 random bytes in URL-safe base64. Only the SHA-256 of the
whole key is stored, and it is compared in constant time (``hmac.compare_digest``). A fast
hash is right here: the secret has 256 random bits, so there is nothing to brute-force, unlike
a password.

Access is off until the first key is made: with no ``ApiKey`` row, every request is allowed
(``ANONYMOUS``). Once any row exists, active or revoked, every request except ``ping``,
``hello`` and the health check needs an active key, so revoking the last key locks the API
instead of opening it (delete the rows to switch access control off again).

Scopes (``SCOPE_OPS``, from the op catalogue ``queue_core.protocol.ops``): ``producer``
submits and reads, ``worker`` leases, renews, acks, fails, releases and reads one job,
``operator`` may do everything (dead letters, job listings). Both surfaces check the same op
names; the HTTP API maps each endpoint to one.

Each process keeps a snapshot of the key table (``KeyRing``) for ``RING_TTL_S``, so a revoked
key takes effect within a second everywhere, and at once in the process that revoked it; a
key the snapshot does not know is looked up again before it is refused (``may_be_newer``), so
a new key works at once.
Failed attempts are logged (``event=auth_failed``) with the key's prefix at most, never the
secret.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import DatabaseError
from django.db.models import Q

from queue_core import errors
from queue_core.clock import Clock, SystemClock
from queue_core.protocol.ops import OPS

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from queue_core.models import ApiKey
    from queue_core.storage.base import Driver

log = logging.getLogger("relay.auth")

SCOPES = ("producer", "worker", "operator")
# Ops every scope may use, and the TCP ops that need no key at all (as the catalogue declares).
OPEN_OPS = frozenset(name for name, op in OPS.items() if op.open)
SCOPE_OPS: dict[str, frozenset[str] | None] = {
    "producer": frozenset(name for name, op in OPS.items() if "producer" in op.scopes),
    "worker": frozenset(name for name, op in OPS.items() if "worker" in op.scopes),
    "operator": None,  # everything, HTTP-only actions (list_jobs) included
}
KEY_PREFIX = "rk"
_KEY_RE = re.compile(r"^rk_([0-9a-f]{12})_([A-Za-z0-9_-]{32,128})$")
PREFIX_HEX_CHARS = 12
SECRET_BYTES = 32
RING_TTL_S = 1.0  # how long a process trusts its snapshot of the key table
TOUCH_INTERVAL_MS = 60_000  # last_used_at_ms is written at most this often per key


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """Who a request runs as.

    Attributes:
        name: the key's name (``anonymous`` when access control is off).
        prefix: the key's public prefix (None when anonymous).
        scopes: the key's scopes.
    """

    name: str
    prefix: str | None
    scopes: frozenset[str]

    @property
    def authenticated(self) -> bool:
        """Whether a key was checked (False when access control is off)."""
        return self.prefix is not None

    @property
    def actor(self) -> str:
        """How operator events (replay, purge) record who did it."""
        return f"key:{self.name}" if self.prefix else "anonymous"

    def allows(self, op: str) -> bool:
        """Whether this principal may run ``op`` (a TCP op name or an HTTP action)."""
        return _allows_once(self.scopes, op)

    def describe(self) -> dict[str, object]:
        """The ``hello`` result: name, prefix and scopes (never the secret)."""
        return {
            "authenticated": self.authenticated,
            "name": self.name,
            "prefix": self.prefix,
            "scopes": sorted(self.scopes),
        }


ANONYMOUS = Principal(name="anonymous", prefix=None, scopes=frozenset(SCOPES))


@functools.lru_cache(maxsize=4096)
def _allows_once(scopes: frozenset[str], op: str) -> bool:
    """``allows``, answered once per scope set and op (both tables are fixed at import;
    it ran for every request)."""
    return allows(scopes, op)


def allows(scopes: Iterable[str], op: str) -> bool:
    """Whether any of ``scopes`` allows ``op``."""
    if op in OPEN_OPS:
        return True
    for scope in scopes:
        ops = SCOPE_OPS.get(scope, frozenset())
        if ops is None or op in ops:
            return True
    return False


def hash_key(key: str) -> str:
    """Return the hex SHA-256 of a whole key string."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_prefix(key: str) -> str | None:
    """Return the prefix of a well-formed key, else None (nothing of a malformed key is kept)."""
    match = _KEY_RE.match(key)
    return match.group(1) if match else None


def check_scopes(scopes: Iterable[str]) -> list[str]:
    """Return ``scopes`` sorted and without repeats.

    Raises:
        InvalidArgument: no scope, or one not in ``SCOPES``.
    """
    chosen = sorted(set(scopes))
    if not chosen:
        raise errors.InvalidArgument("give at least one scope", field="scopes")
    unknown = [s for s in chosen if s not in SCOPES]
    if unknown:
        raise errors.InvalidArgument(
            f"unknown scope {unknown[0]!r} (choose from {', '.join(SCOPES)})", field="scopes"
        )
    return chosen


# ---------------------------------------------------------------------- the key table


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    secret_sha256: str
    scopes: frozenset[str]
    active: bool


@dataclasses.dataclass(frozen=True, slots=True)
class KeyRing:
    """A snapshot of the key table.

    Attributes:
        entries: prefix -> key data (revoked keys included, marked inactive).
        loaded_at: ``time.monotonic()`` when it was read.
    """

    entries: dict[str, _Entry]
    loaded_at: float

    @property
    def required(self) -> bool:
        """Whether requests need a key (any key row exists, active or revoked)."""
        return bool(self.entries)

    def is_active(self, prefix: str | None) -> bool:
        """Whether the key with ``prefix`` exists and is not revoked."""
        entry = self.entries.get(prefix) if prefix else None
        return entry is not None and entry.active

    def verify(self, key: str) -> tuple[Principal | None, str]:
        """Check a presented key.

        Returns:
            ``(principal, "ok")``, or ``(None, reason)`` with reason ``malformed``,
            ``unknown_key``, ``revoked`` or ``bad_secret``.
        """
        prefix = parse_prefix(key)
        if prefix is None:
            return None, "malformed"
        entry = self.entries.get(prefix)
        if entry is None:
            return None, "unknown_key"
        if not hmac.compare_digest(hash_key(key), entry.secret_sha256):
            return None, "bad_secret"
        if not entry.active:
            return None, "revoked"
        return Principal(entry.name, prefix, entry.scopes), "ok"


_lock = threading.Lock()
_ring: KeyRing | None = None
_invalidated = 0  # how many times ``invalidate`` ran: a read begun before the last one is stale


def keys() -> QuerySet[ApiKey]:
    """The key table, in Relay's database (``RELAY_DATABASE``), where Relay's other tables
    are: the key table was read and written through Django's default alias once, so with
    another alias the server looked keys up in another database than the one it served (a
    structural audit)."""
    from queue_core.conf import relay_settings
    from queue_core.models import ApiKey

    return ApiKey.objects.using(relay_settings().database)


def load_ring() -> KeyRing:
    """Read the key table (one small query) and make it this process's snapshot, unless
    ``invalidate`` ran while it read: a read begun before a revoke committed may not hold it,
    and must not stand as the snapshot for ``RING_TTL_S`` after the revoke forgot the old one
    (the caller still gets it: its request raced with the revoke)."""
    global _ring
    with _lock:
        began = _invalidated
    rows = keys().values_list("prefix", "name", "secret_sha256", "scopes", "revoked_at_ms")
    entries = {
        prefix: _Entry(name, digest, frozenset(s for s in scopes.split(",") if s), revoked is None)
        for prefix, name, digest, scopes, revoked in rows
    }
    ring = KeyRing(entries, time.monotonic())
    with _lock:
        if _invalidated == began:
            _ring = ring
    return ring


def read_ring(driver: Driver) -> KeyRing:
    """``load_ring`` inside ``driver``'s read: its error mapping (a lost database is
    ``UNAVAILABLE``, a failing disk ``STORAGE_IO``, not ``INTERNAL``) and, on PostgreSQL, a
    fresh connection after one was terminated. What the TCP server and the HTTP API call
    for a stale snapshot (a blocking call: the server runs it in its reader pool).

    Raises:
        RelayError: the table cannot be read now.
    """
    with driver.read():
        return load_ring()


def cached_ring() -> KeyRing | None:
    """Return the snapshot if it is younger than ``RING_TTL_S``, without touching the DB."""
    ring = _ring
    if ring is None or time.monotonic() - ring.loaded_at > RING_TTL_S:
        return None
    return ring


def current_ring() -> KeyRing:
    """Return a fresh-enough snapshot, reading the table when the cached one is stale."""
    return cached_ring() or load_ring()


RING_REREAD_S = 0.05  # a snapshot younger than this is not read again for an unknown key


def may_be_newer(ring: KeyRing, key: str | None) -> bool:
    """Whether ``key`` is well formed, unknown to ``ring`` and ``ring`` at least
    ``RING_REREAD_S`` old: a key made in another process since the snapshot was read, which
    a fresh read would know (without it, a key just made by ``relay keys create`` was
    refused for up to ``RING_TTL_S``: a review). The caller reads the table again once
    before refusing; a read makes the snapshot young again, so bad keys cost a read per
    ``RING_REREAD_S`` (the TCP server shares one read among its waiters; HTTP request
    threads that find it old at once each read)."""
    prefix = parse_prefix(key) if key else None
    return (
        prefix is not None
        and prefix not in ring.entries
        and time.monotonic() - ring.loaded_at >= RING_REREAD_S
    )


def invalidations() -> int:
    """How many times ``invalidate`` has run in this process: a read of the key table begun
    before the count moved may miss a revoke (``load_ring``)."""
    return _invalidated


def invalidate() -> None:
    """Forget the snapshot (after creating or revoking a key in this process)."""
    global _ring, _invalidated
    with _lock:
        _ring = None
        _invalidated += 1


# ---------------------------------------------------------------------- checking requests

_touched: dict[str, float] = {}


AUTH_LOG_EVERY_S = 1.0  # at most one auth_failed warning per second; the counter counts all
_warned_at = -AUTH_LOG_EVERY_S
_unlogged = 0
_warn_lock = threading.Lock()


def _fail(reason: str, *, surface: str, peer: str, prefix: str | None, code: str) -> None:
    """Count a refused request, and log it unless one was logged in the last
    ``AUTH_LOG_EVERY_S`` (a flood of bad keys must not flood the log: the next line says how
    many went unlogged, ``relay_auth_failures_total`` counts every one)."""
    from queue_core import metrics

    global _warned_at, _unlogged
    metrics.AUTH_FAILURES.labels(surface=surface, code=code).inc()
    with _warn_lock:
        now = time.monotonic()
        if now - _warned_at < AUTH_LOG_EVERY_S:
            _unlogged += 1
            return
        _warned_at, unlogged, _unlogged = now, _unlogged, 0
    log.warning(
        "event=auth_failed surface=%s peer=%s prefix=%s reason=%s unlogged=%d",
        surface,
        peer,
        prefix or "-",
        reason,
        unlogged,
        extra={
            "event": "auth_failed",
            "surface": surface,
            "peer": peer,
            "prefix": prefix,
            "reason": reason,
            "unlogged": unlogged,
        },
    )


def authenticate(
    key: str | None, *, surface: str, peer: str, ring: KeyRing | None = None
) -> Principal:
    """Return who presents ``key``.

    Args:
        key: the presented key, or None when the request carried none.
        surface: ``"http"`` or ``"tcp"`` (for the log and the metric).
        peer: the client's address (for the log).
        ring: the snapshot to check against (default ``current_ring()``, which may read the DB).
    Returns:
        The key's ``Principal``; ``ANONYMOUS`` when no key was given and no key exists.
    Raises:
        Unauthenticated: a key is required and none was given, or the key is malformed,
            unknown, revoked or wrong.
    """
    ring = ring or current_ring()
    if key is None:
        if not ring.required:
            return ANONYMOUS
        _fail("missing", surface=surface, peer=peer, prefix=None, code="UNAUTHENTICATED")
        raise errors.Unauthenticated(
            "an API key is required: send 'Authorization: Bearer <key>' over HTTP, or a hello "
            "op with api_key over TCP"
        )
    principal, reason = ring.verify(key)
    if principal is None:
        _fail(reason, surface=surface, peer=peer, prefix=parse_prefix(key), code="UNAUTHENTICATED")
        # An unknown prefix and a wrong secret read alike: the reply must not tell who lacks
        # the secret which prefixes exist (a review). The log keeps the reason.
        said = "unknown or wrong key" if reason in ("unknown_key", "bad_secret") else reason
        raise errors.Unauthenticated(f"API key refused ({said})")
    touch(principal.prefix)
    return principal


def check_session(
    principal: Principal | None,
    ring: KeyRing,
    *,
    surface: str,
    peer: str,
    revoked: bool = False,
) -> Principal:
    """Return who a connection runs as now, for a connection that may have said hello.

    Args:
        principal: what the connection's ``hello`` established (None when it sent none).
        ring: the current snapshot of the key table.
        revoked: the connection's key was revoked and already forgotten (``principal`` is
            None): it is refused as revoked, not as missing a key.
    Returns:
        ``principal``, or ``ANONYMOUS`` while no key exists.
    Raises:
        Unauthenticated: keys exist and the connection has none, or its key was revoked since.
    """
    if not ring.required:
        return ANONYMOUS
    if principal is None or not principal.authenticated:
        if not revoked:
            return authenticate(None, surface=surface, peer=peer, ring=ring)
        prefix = None
    elif ring.is_active(principal.prefix):
        return principal
    else:
        prefix = principal.prefix
    _fail("revoked", surface=surface, peer=peer, prefix=prefix, code="UNAUTHENTICATED")
    then = "send hello with another key" if surface == "tcp" else "use another key"
    raise errors.Unauthenticated(f"API key refused (revoked); {then}")


def authorize(principal: Principal, op: str, *, surface: str, peer: str) -> None:
    """Check that ``principal`` may run ``op``.

    Raises:
        PermissionDenied: none of the key's scopes allows ``op``.
    """
    if principal.allows(op):
        return
    _fail(
        f"scope:{op}", surface=surface, peer=peer, prefix=principal.prefix, code="PERMISSION_DENIED"
    )
    raise errors.PermissionDenied(
        f"key {principal.name!r} (scopes {','.join(sorted(principal.scopes))}) "
        f"may not use op {op!r}",
        op=op,
    )


def still_allowed(
    principal: Principal | None, op: str, ring: KeyRing, *, surface: str, peer: str
) -> Principal:
    """Check again, mid-request, that a request admitted as ``principal`` may still run ``op``:
    a lease re-checks before each claim (after waiting for its reply budget, a thread or a
    job), so a key revoked (or keys created) since leases nothing (``check_session``, then
    ``authorize``).

    Args:
        principal: who the request was admitted as (None: no hello on TCP).
        ring: the current snapshot of the key table (at most ``RING_TTL_S`` old).
    Returns:
        the principal the request runs as now.
    Raises:
        Unauthenticated, PermissionDenied.
    """
    now = check_session(principal, ring, surface=surface, peer=peer)
    authorize(now, op, surface=surface, peer=peer)
    return now


def touch(prefix: str | None, *, clock: Clock | None = None) -> None:
    """Record that a key was used, at most once per ``TOUCH_INTERVAL_MS`` per process.

    Best effort: a locked database skips the update rather than failing the request.
    """
    if prefix is None:
        return
    now = time.monotonic()
    if now - _touched.get(prefix, -1e9) < TOUCH_INTERVAL_MS / 1000:
        return
    _touched[prefix] = now
    now_ms = (clock or SystemClock()).now_ms()
    try:
        keys().filter(
            Q(last_used_at_ms__isnull=True) | Q(last_used_at_ms__lt=now_ms - TOUCH_INTERVAL_MS),
            prefix=prefix,
        ).update(last_used_at_ms=now_ms)
    except DatabaseError as exc:
        log.debug("event=key_touch_skipped prefix=%s error=%r", prefix, exc)


# ---------------------------------------------------------------------- managing keys


@dataclasses.dataclass(frozen=True, slots=True)
class NewKey:
    """A key just made: the only time its secret is known.

    Attributes:
        key: the full key (``rk_<prefix>_<secret>``); show it once, store it nowhere.
        prefix: its public prefix.
        name: its name.
        scopes: its scopes, sorted.
    """

    key: str
    prefix: str
    name: str
    scopes: list[str]


def create_key(name: str, scopes: Iterable[str], *, clock: Clock | None = None) -> NewKey:
    """Make a key and store its hash.

    Args:
        name: who or what it is for (1..100 characters).
        scopes: some of ``producer``, ``worker``, ``operator``.
    Returns:
        ``NewKey`` holding the secret (not stored anywhere).
    Raises:
        InvalidArgument: bad name or scopes.
    """
    name = name.strip()
    if not 1 <= len(name) <= 100:
        raise errors.InvalidArgument("name: must be 1 to 100 characters", field="name")
    chosen = check_scopes(scopes)
    while True:
        prefix = secrets.token_hex(PREFIX_HEX_CHARS // 2)
        if not keys().filter(prefix=prefix).exists():
            break
    key = f"{KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}"
    keys().create(
        name=name,
        prefix=prefix,
        secret_sha256=hash_key(key),
        scopes=",".join(chosen),
        created_at_ms=(clock or SystemClock()).now_ms(),
    )
    invalidate()
    log.info(
        "event=key_created prefix=%s name=%s scopes=%s",
        prefix,
        name,
        ",".join(chosen),
        extra={"event": "key_created", "prefix": prefix, "key_name": name},
    )
    return NewKey(key=key, prefix=prefix, name=name, scopes=chosen)


def revoke(prefix: str, *, clock: Clock | None = None) -> bool:
    """Revoke the key with ``prefix`` (idempotent).

    Returns:
        True when a key with this prefix exists (revoked now or before), False otherwise.
    """
    now_ms = (clock or SystemClock()).now_ms()
    keys().filter(prefix=prefix, revoked_at_ms__isnull=True).update(revoked_at_ms=now_ms)
    invalidate()
    found = keys().filter(prefix=prefix).exists()
    if found:
        log.info(
            "event=key_revoked prefix=%s", prefix, extra={"event": "key_revoked", "prefix": prefix}
        )
    return found


def client_api_key() -> str | None:
    """The key clients (CLI, worker) send by default: the setting ``RELAY_API_KEY``, else the
    environment variable of that name (docs/django.md gives workers their key there, not on
    their command line, in a project that has no such setting), or None."""
    value = getattr(settings, "RELAY_API_KEY", "") or os.environ.get("RELAY_API_KEY", "")
    return str(value) or None
