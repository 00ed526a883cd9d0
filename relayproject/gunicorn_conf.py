"""gunicorn settings for Relay's HTTP API and admin: ``gunicorn -c gunicorn.conf.py`` in a
checkout (that file imports this module), or ``gunicorn -c python:relayproject.gunicorn_conf``
where Relay is installed as a package (the wheel has no ``gunicorn.conf.py``; ``relay bench``
uses this form).

gunicorn itself loads this module, so it reads its few settings from the environment here (the
one place besides ``relayproject/settings.py`` that does); Django's settings still come from
``relayproject/settings.py``. Command-line flags override these (``--bind`` for a test port).

The worker is gunicorn's ``asgi`` worker (``relayproject.gunicorn_worker.BoundedWorker``, which
enforces its connection limit) serving ``relayproject.asgi``: requests are parsed on
an event loop, so a client that sends its request slowly (or never finishes it) holds no
thread, and the lease long-poll is an async view that holds none while it waits. Measured on
the 2-core test machine (tests/http/test_capacity.py): behind 64 stalled clients and 64
waiting long-polls, /health and a submit answer in milliseconds; the gthread worker with 8
threads this replaced answered none of them. In production put a buffering reverse proxy
(nginx) in front anyway: it bounds header and body times per client (docs/http-api.md).

* ``RELAY_HTTP_BIND``: where to listen, default ``127.0.0.1:8000`` (loopback only).
* ``RELAY_HTTP_WORKERS``: worker processes, default 1. Relay's counters are per process, so
  with several workers each scrape of /metrics sees one worker's counts (gauges come from the
  database and agree); SQLite takes one writer at a time anyway.
* ``RELAY_HTTP_CONNECTIONS``: open client connections per worker, default 1000 (past it, a
  new connection is answered 503 ``TOO_MANY_CONNECTIONS`` with ``Retry-After: 1`` and closed).
* ``RELAY_HTTP_HEADER_TIMEOUT_S``: a connection whose first request's headers have not all
  arrived this long after it was accepted is closed, default 15 (0: never).
* ``RELAY_HTTP_REQUEST_TIMEOUT_S``: a connection whose request has been in progress this long
  (its body still arriving, or its response not read) is closed, default 60 (0: never).
* ``RELAY_HTTP_TIMEOUT_S``: a worker silent for this long is restarted, default 60 (above
  ``RELAY_MAX_WAIT_MS`` so a long-poll never trips it).
* ``RELAY_HTTP_GRACEFUL_TIMEOUT_S``: how long in-flight requests get on SIGTERM, default 30.
* ``RELAY_HTTP_KEEPALIVE_S``: idle keep-alive connections are closed after this, default 5.
* ``RELAY_HTTP_ACCESS_LOG``: ``1`` (default) writes an access log line per request to stderr.

Django reads ``RELAY_HTTP_THREADS`` (default 8): each worker's long-lived threads that run the
requests' database work and keep their connections (``queue_api.pool``).

Before listening (``on_starting``) it refuses, with one line on stderr, to start without a
private ``SECRET_KEY`` while ``DEBUG`` is off (exit code 6), or on an address beyond loopback
while no API key exists unless ``RELAY_ALLOW_PUBLIC_WITHOUT_KEYS=1`` (exit code 5); see
``queue_api.startup``.
"""

import json
import os
import sys


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        sys.exit(f"gunicorn settings: {name} must be an integer, got {raw!r}")


wsgi_app = "relayproject.asgi:application"
bind = [os.environ.get("RELAY_HTTP_BIND", "127.0.0.1:8000")]
worker_class = "relayproject.gunicorn_worker.BoundedWorker"  # the "asgi" worker, bounded
asgi_loop = "asyncio"
asgi_lifespan = "off"  # Django has no lifespan handler
workers = _int("RELAY_HTTP_WORKERS", 1)
worker_connections = _int("RELAY_HTTP_CONNECTIONS", 1000)
HEADER_TIMEOUT_S = _int("RELAY_HTTP_HEADER_TIMEOUT_S", 15)
REQUEST_TIMEOUT_S = _int("RELAY_HTTP_REQUEST_TIMEOUT_S", 60)
timeout = _int("RELAY_HTTP_TIMEOUT_S", 60)
graceful_timeout = _int("RELAY_HTTP_GRACEFUL_TIMEOUT_S", 30)
keepalive = _int("RELAY_HTTP_KEEPALIVE_S", 5)
accesslog = "-" if os.environ.get("RELAY_HTTP_ACCESS_LOG", "1") == "1" else None
errorlog = "-"
# Request line and header limits; bodies are bounded by RELAY_MAX_FRAME_BYTES in Django.
limit_request_line = 8190
limit_request_fields = 100
# Load Django once in the arbiter, before forking: a settings or import error stops the start.
preload_app = True
# No control socket (gunicorn 25.1+ opens one at $XDG_RUNTIME_DIR or ~/.gunicorn/gunicorn.ctl,
# one path per user: a second gunicorn of the same user, another copy of Relay or a test's,
# would take it over; a fresh-clone review saw it). Relay manages its workers by signals.
control_socket_disable = True


def on_starting(server) -> None:  # type: ignore[no-untyped-def]
    """Refuse to start (one line on stderr, exit 5 or 6) as ``queue_api.startup`` decides."""
    from queue_api.startup import refusal

    refused = refusal(list(server.cfg.address))
    if refused:
        message, code = refused
        print(message, file=sys.stderr, flush=True)
        sys.exit(code)


def post_fork(server, worker) -> None:  # type: ignore[no-untyped-def]
    """Give the new worker (``relayproject.gunicorn_worker.BoundedWorker``) its timeouts."""
    worker.header_timeout_s = HEADER_TIMEOUT_S
    worker.request_timeout_s = REQUEST_TIMEOUT_S


def when_ready(server) -> None:  # type: ignore[no-untyped-def]
    """Log one JSON line per listening socket (``event=http_ready``) with the bound port."""
    for listener in server.LISTENERS:
        host, port = listener.sock.getsockname()[:2]
        line = {"event": "http_ready", "host": host, "port": port, "message": "event=http_ready"}
        print(json.dumps(line), file=sys.stderr, flush=True)
