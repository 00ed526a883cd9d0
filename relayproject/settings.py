"""Django settings for Relay the standalone service: the only module that reads os.environ.

This is the project ``relay`` and ``manage.py`` run when no other settings are named; a
Django project of one's own uses its own settings instead (docs/django.md) and reads none of
the environment variables below. Every ``RELAY_*`` name below may be set as an environment
variable of the same name; the typed, validated view of them is
``queue_core.conf.relay_settings()``. Files it makes or reads by default (``relay.db``,
``.relay-secret-key``, ``staticfiles/``) are in the current directory, never beside the
installed code.
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent  # the checkout, or site-packages when installed
# Where the service's own files go by default: the directory it was started in.
WORK_DIR = Path.cwd()


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from exc


DEBUG = _env("RELAY_DEBUG", "0") == "1"
# SECRET_KEY signs the admin's sessions and CSRF tokens. It comes from RELAY_SECRET_KEY, else
# from the file RELAY_SECRET_KEY_FILE (default .relay-secret-key in the current directory;
# bin/setup writes a random one, mode 0600, in the checkout's root). Without either it is the
# public DEV_SECRET_KEY when RELAY_DEBUG=1, else empty: the HTTP side then refuses to start
# (queue_api.startup); the TCP server and CLI never use it.
DEV_SECRET_KEY = "relay-insecure-dev-key-change-me-in-production-0123456789"  # noqa: S105


def _secret_key() -> str:
    key = _env("RELAY_SECRET_KEY", "")
    if key:
        return key
    path = Path(_env("RELAY_SECRET_KEY_FILE", str(WORK_DIR / ".relay-secret-key")))
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


SECRET_KEY = _secret_key() or (DEV_SECRET_KEY if DEBUG else "")
ALLOWED_HOSTS = [
    h for h in _env("RELAY_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",") if h
]

INSTALLED_APPS = [
    # django.contrib.admin, branded as Relay's operator console (relayproject/admin.py).
    "relayproject.apps.RelayAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "queue_core.apps.QueueCoreConfig",
    "queue_api",
    "queue_admin",
    "ninja",  # serves the API docs page's scripts from its static files (no CDN)
    "django_prometheus",
    "relay_tasks.apps.RelayTasksConfig",
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    # 400 problem details for an API request whose Host is not in RELAY_ALLOWED_HOSTS.
    "queue_api.middleware.HostProblemMiddleware",
    # 413 for bodies over RELAY_MAX_FRAME_BYTES before anything reads them.
    "queue_api.middleware.BodyLimitMiddleware",
    # 415 for an API request body that is not application/json (no CORS-simple requests).
    "queue_api.middleware.JsonOnlyMiddleware",
    # 405 problem details (UNKNOWN_OP) for a method an API path does not serve.
    "queue_api.middleware.MethodProblemMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "relayproject.urls"
WSGI_APPLICATION = "relayproject.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# The embedded default: SQLite in WAL mode. synchronous=FULL makes every commit durable (one
# fsync per commit; the server shares one commit between many concurrent requests).
# busy_timeout makes a writer wait for another process's write lock instead of failing at once.
# temp_store=MEMORY keeps statement journals off disk: inside the server's per-call SAVEPOINTs a
# statement that fires triggers (relay_job_count) opens one, and a temp file per batch insert
# cost batch submits a third of their rate (16,600 -> 25,300 jobs/s with it, 4 producers).
# The file: RELAY_DB, default relay.db in the current directory.
RELAY_DB = _env("RELAY_DB", str(WORK_DIR / "relay.db"))
RELAY_SQLITE_SYNCHRONOUS = _env("RELAY_SQLITE_SYNCHRONOUS", "FULL").upper()
RELAY_BUSY_TIMEOUT_MS = _env_int("RELAY_BUSY_TIMEOUT_MS", 5000)
# Leases (claims, sweeps) commit without waiting for the disk unless this is 1: an OS crash or
# power loss may take back the leases since the last durable commit (docs/design-decisions.md).
RELAY_DURABLE_LEASES = _env("RELAY_DURABLE_LEASES", "0") == "1"
# PostgreSQL instead, for several relay servers on one database:
# RELAY_DATABASE_URL=postgresql://user[:password]@host[:port]/dbname (RELAY_DB is then unused).
RELAY_DATABASE_URL = _env("RELAY_DATABASE_URL", "")
# Relay's statements as prepared statements on PostgreSQL; 0 behind a transaction-mode pooler
# that cannot keep them (PgBouncer before 1.21).
RELAY_PG_PREPARED_STATEMENTS = _env("RELAY_PG_PREPARED_STATEMENTS", "1") == "1"
# How long a statement waits for a lock another transaction holds, and how long a connection
# may sit idle inside a transaction, on PostgreSQL, in ms (queue_core/conf.py).
RELAY_LOCK_TIMEOUT_MS = _env_int("RELAY_LOCK_TIMEOUT_MS", 2000)
RELAY_PG_IDLE_IN_TRANSACTION_TIMEOUT_MS = _env_int("RELAY_PG_IDLE_IN_TRANSACTION_TIMEOUT_MS", 5000)
# How long data sent to PostgreSQL may go unacknowledged before the connection is given up,
# in ms (libpq's tcp_user_timeout; with keepalives on idle connections and a 5 s
# connect_timeout): a partitioned database fails calls UNAVAILABLE, not after Linux's ~15 min.
RELAY_PG_TCP_USER_TIMEOUT_MS = _env_int("RELAY_PG_TCP_USER_TIMEOUT_MS", 15000)
# A server ends other servers' sessions whose transaction has been open this long, in ms.
RELAY_PG_STUCK_TRANSACTION_MS = _env_int("RELAY_PG_STUCK_TRANSACTION_MS", 15000)
# The alias of the database Relay's tables live in.
RELAY_DATABASE = "default"

SQLITE_DATABASE = {
    "ENGINE": "django.db.backends.sqlite3",
    "NAME": RELAY_DB,
    # Keep each HTTP worker thread's connection between requests: opening one per request,
    # and the WAL checkpoint when a file's last connection closes, dominated HTTP submits.
    "CONN_MAX_AGE": _env_int("RELAY_CONN_MAX_AGE_S", 60),
    "CONN_HEALTH_CHECKS": True,
    "OPTIONS": {
        "timeout": RELAY_BUSY_TIMEOUT_MS / 1000,
        # atomic() takes the write lock at BEGIN: a deferred transaction that reads, then
        # writes, can fail at once with SQLITE_BUSY when another connection wrote between.
        "transaction_mode": "IMMEDIATE",
        "init_command": (
            "PRAGMA journal_mode=WAL;"
            f"PRAGMA synchronous={RELAY_SQLITE_SYNCHRONOUS};"
            f"PRAGMA busy_timeout={RELAY_BUSY_TIMEOUT_MS};"
            "PRAGMA foreign_keys=ON;"
            "PRAGMA temp_store=MEMORY"
        ),
    },
    # Tests share one file-backed database between the test process and the real server,
    # worker and CLI processes they spawn.
    "TEST": {"NAME": _env("RELAY_TEST_DB", str(BASE_DIR / ".test-relay.db"))},
}


def postgresql_database(url: str) -> dict[str, object]:
    """Django's settings for a ``postgresql://user[:password]@host[:port]/dbname`` URL."""
    from urllib.parse import unquote, urlsplit

    from django.core.exceptions import ImproperlyConfigured

    wrong = f"RELAY_DATABASE_URL must read postgresql://user@host:port/dbname, got {url!r}"
    try:
        parts = urlsplit(url)
        port = parts.port  # "Port out of range", or not a number: ValueError
    except ValueError as exc:  # also an unclosed [IPv6 address
        raise ImproperlyConfigured(f"{wrong} ({exc})") from None
    if parts.scheme not in ("postgresql", "postgres") or not parts.path.strip("/"):
        raise ImproperlyConfigured(wrong)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.strip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(port or ""),
        "CONN_MAX_AGE": _env_int("RELAY_CONN_MAX_AGE_S", 60),
        "CONN_HEALTH_CHECKS": True,
        # Server-side binding: the driver prepares Relay's own statements on each connection
        # (RELAY_PG_PREPARED_STATEMENTS; Django's own queries stay unprepared, Django's
        # default). Every process of this project (servers, HTTP workers, commands) gets
        # the lock and idle-in-transaction limits; a relay server sets them itself on any
        # project's database (PostgresDriver.server_lock).
        "OPTIONS": {
            "server_side_binding": True,
            # A host or network that stops answering: a connect waits 5 s at most, an idle
            # connection is found dead in about 25 s, one with a statement in flight in
            # RELAY_PG_TCP_USER_TIMEOUT_MS (libpq's options; a hostile review's servers cut
            # off from PostgreSQL answered nothing for the whole cut).
            "connect_timeout": 5,
            "keepalives": 1,
            "keepalives_idle": 10,
            "keepalives_interval": 5,
            "keepalives_count": 3,
            "tcp_user_timeout": RELAY_PG_TCP_USER_TIMEOUT_MS,
            "options": (
                f"-c lock_timeout={RELAY_LOCK_TIMEOUT_MS} -c idle_in_transaction_session_timeout="
                f"{RELAY_PG_IDLE_IN_TRANSACTION_TIMEOUT_MS}"
            ),
        },
    }


DATABASES = {
    "default": postgresql_database(RELAY_DATABASE_URL) if RELAY_DATABASE_URL else SQLITE_DATABASE
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Relay settings (defaults and units are documented in queue_core/conf.py).
RELAY_ADDRESS = _env("RELAY_ADDRESS", "127.0.0.1:7400")
RELAY_METRICS_ADDRESS = _env("RELAY_METRICS_ADDRESS", "")
# The API key the CLI and relay_worker send in their TCP hello (queue_core.auth); empty: none.
RELAY_API_KEY = _env("RELAY_API_KEY", "")
RELAY_MAX_FRAME_BYTES = _env_int("RELAY_MAX_FRAME_BYTES", 1024 * 1024)
RELAY_MAX_PAYLOAD_BYTES = _env_int("RELAY_MAX_PAYLOAD_BYTES", 256 * 1024)
RELAY_MAX_ERROR_BYTES = _env_int("RELAY_MAX_ERROR_BYTES", 4096)
RELAY_MAX_RESULT_BYTES = _env_int("RELAY_MAX_RESULT_BYTES", 64 * 1024)
RELAY_MAX_QUEUE_NAME_LENGTH = _env_int("RELAY_MAX_QUEUE_NAME_LENGTH", 128)
RELAY_VISIBILITY_TIMEOUT_MS = _env_int("RELAY_VISIBILITY_TIMEOUT_MS", 30_000)
RELAY_MIN_LEASE_MS = _env_int("RELAY_MIN_LEASE_MS", 1_000)
RELAY_MAX_LEASE_MS = _env_int("RELAY_MAX_LEASE_MS", 43_200_000)
RELAY_MAX_WAIT_MS = _env_int("RELAY_MAX_WAIT_MS", 20_000)
RELAY_MAX_QUEUES_PER_LEASE = _env_int("RELAY_MAX_QUEUES_PER_LEASE", 16)
RELAY_MAX_JOBS_PER_LEASE = _env_int("RELAY_MAX_JOBS_PER_LEASE", 100)
RELAY_MAX_BATCH_SUBMIT = _env_int("RELAY_MAX_BATCH_SUBMIT", 1000)
RELAY_MAX_CONNECTIONS = _env_int("RELAY_MAX_CONNECTIONS", 1024)
RELAY_MAX_INFLIGHT_PER_CONNECTION = _env_int("RELAY_MAX_INFLIGHT_PER_CONNECTION", 64)
RELAY_IDLE_TIMEOUT_MS = _env_int("RELAY_IDLE_TIMEOUT_MS", 120_000)
RELAY_SHUTDOWN_GRACE_MS = _env_int("RELAY_SHUTDOWN_GRACE_MS", 5_000)
RELAY_REAPER_INTERVAL_MS = _env_int("RELAY_REAPER_INTERVAL_MS", 1_000)
RELAY_MAX_DELAY_MS = _env_int("RELAY_MAX_DELAY_MS", 30 * 24 * 3600 * 1000)
RELAY_MAX_RETRIES = _env_int("RELAY_MAX_RETRIES", 100)
RELAY_DEFAULT_MAX_RETRIES = _env_int("RELAY_DEFAULT_MAX_RETRIES", 3)
RELAY_DEFAULT_BACKOFF = _env("RELAY_DEFAULT_BACKOFF", "exponential")
RELAY_DEFAULT_BACKOFF_BASE_MS = _env_int("RELAY_DEFAULT_BACKOFF_BASE_MS", 1_000)
RELAY_DEFAULT_BACKOFF_CAP_MS = _env_int("RELAY_DEFAULT_BACKOFF_CAP_MS", 300_000)
RELAY_DEFAULT_JITTER = _env("RELAY_DEFAULT_JITTER", "1") == "1"
RELAY_IDEMPOTENCY_WINDOW_MS = _env_int("RELAY_IDEMPOTENCY_WINDOW_MS", 24 * 3600 * 1000)
RELAY_BUSY_RETRY_BUDGET_MS = _env_int("RELAY_BUSY_RETRY_BUDGET_MS", 10_000)
# "integrity" (PRAGMA integrity_check) or "quick" (PRAGMA quick_check) before the server serves.
RELAY_STARTUP_CHECK = _env("RELAY_STARTUP_CHECK", "integrity")
# The server's event loop: "auto" (uvloop when installed), "uvloop" or "asyncio".
RELAY_EVENT_LOOP = _env("RELAY_EVENT_LOOP", "auto")
# Several servers on one PostgreSQL database: the registry heartbeat, and the clock bound.
RELAY_SERVER_HEARTBEAT_MS = _env_int("RELAY_SERVER_HEARTBEAT_MS", 5_000)
RELAY_MAX_CLOCK_SKEW_MS = _env_int("RELAY_MAX_CLOCK_SKEW_MS", 1_000)
# SQLite: the size the -wal file is kept under (journal_size_limit, and the reaper's checkpoint),
# and how long that checkpoint waits for older readers.
RELAY_SQLITE_WAL_LIMIT_BYTES = _env_int("RELAY_SQLITE_WAL_LIMIT_BYTES", 16 * 1024 * 1024)
RELAY_SQLITE_CHECKPOINT_WAIT_MS = _env_int("RELAY_SQLITE_CHECKPOINT_WAIT_MS", 200)
# Hostile clients: reply and request byte budgets, malformed lines, the hello deadline, a
# per-address cap.
RELAY_MAX_UNSENT_BYTES_PER_CONNECTION = _env_int(
    "RELAY_MAX_UNSENT_BYTES_PER_CONNECTION", 2 * 1024 * 1024
)
RELAY_MAX_UNSENT_BYTES = _env_int("RELAY_MAX_UNSENT_BYTES", 64 * 1024 * 1024)
RELAY_MAX_BUFFERED_REQUEST_BYTES = _env_int("RELAY_MAX_BUFFERED_REQUEST_BYTES", 64 * 1024 * 1024)
RELAY_MAX_BAD_FRAMES = _env_int("RELAY_MAX_BAD_FRAMES", 16)
RELAY_AUTH_TIMEOUT_MS = _env_int("RELAY_AUTH_TIMEOUT_MS", 10_000)
RELAY_MAX_CONNECTIONS_PER_ADDRESS = _env_int("RELAY_MAX_CONNECTIONS_PER_ADDRESS", 0)
RELAY_MAX_CONNECTIONS_PER_KEY = _env_int("RELAY_MAX_CONNECTIONS_PER_KEY", 0)
RELAY_METRICS_MAX_QUEUES = _env_int("RELAY_METRICS_MAX_QUEUES", 100)
RELAY_MAX_QUEUES = _env_int("RELAY_MAX_QUEUES", 10_000)
# Wall-clock steps: the tolerance, and the clock class (a test hook: tests/stepclock.py).
RELAY_CLOCK_STEP_TOLERANCE_MS = _env_int("RELAY_CLOCK_STEP_TOLERANCE_MS", 1_000)
RELAY_CLOCK = _env("RELAY_CLOCK", "queue_core.clock.SystemClock")
# Exposure: listen beyond loopback although no API key exists (1), instead of refusing to start.
RELAY_ALLOW_PUBLIC_WITHOUT_KEYS = _env("RELAY_ALLOW_PUBLIC_WITHOUT_KEYS", "0") == "1"
# HTTP side: long-lived threads per gunicorn worker for requests' database work (queue_api.pool).
RELAY_HTTP_THREADS = _env_int("RELAY_HTTP_THREADS", 8)
# Retention: how long finished jobs are kept (durations such as 7d, 12h, 30m; 0 keeps forever).
RELAY_RETENTION_SUCCEEDED = _env("RELAY_RETENTION_SUCCEEDED", "7d")
RELAY_RETENTION_DEAD = _env("RELAY_RETENTION_DEAD", "30d")
# Where the console's "Back up now" writes its copies (empty: the console offers no backup).
RELAY_BACKUP_DIR = _env("RELAY_BACKUP_DIR", "")
# Job metadata: a job's optional meta map of strings (keys, key length and size bounds).
RELAY_MAX_META_KEYS = _env_int("RELAY_MAX_META_KEYS", 16)
RELAY_MAX_META_KEY_BYTES = _env_int("RELAY_MAX_META_KEY_BYTES", 64)
RELAY_MAX_META_BYTES = _env_int("RELAY_MAX_META_BYTES", 1024)
# Time limits: per-queue default maximum run time of one attempt, "queue=5m,other=2h" (a job's
# own time_limit_ms wins; queues not named have none).
RELAY_QUEUE_TIME_LIMITS = _env("RELAY_QUEUE_TIME_LIMITS", "")

# The HTTP API refuses larger bodies with 413 (queue_api.middleware); Django's own limit is a
# second fence at the same size.
DATA_UPLOAD_MAX_MEMORY_SIZE = RELAY_MAX_FRAME_BYTES

# Django tasks (django.tasks) run on Relay: docs/django.md. QUEUES = [] allows any valid
# Relay queue name as a task's queue_name.
TASKS = {"default": {"BACKEND": "queue_core.tasks_backend.RelayBackend", "QUEUES": []}}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = WORK_DIR / "staticfiles"  # collectstatic's output

# Structured JSON logs on stderr; RELAY_LOG=debug turns on debug output. python-json-logger's
# orjson formatter (queue_core.logformat), a fifth cheaper per line than the stdlib json one: a
# worker's two lines per job took more than half its CPU (docs/benchmarking.md, round 6).
RELAY_LOG = _env("RELAY_LOG", "info").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "json": {
            "()": "queue_core.logformat.JsonFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s",
            "rename_fields": {"asctime": "ts", "levelname": "level", "name": "logger"},
        },
    },
    "filters": {
        "not_an_auth_refusal": {
            "()": "django.utils.log.CallbackFilter",
            "callback": "ext://queue_core.logformat.not_an_auth_refusal",
        },
        "one_line_security": {
            "()": "django.utils.log.CallbackFilter",
            "callback": "ext://queue_core.logformat.one_line_security",
        },
    },
    "handlers": {
        "stderr": {"class": "logging.StreamHandler", "formatter": "json"},
        # A handler's filter sees the records of child loggers (django.security.<Error>).
        "stderr_one_line": {
            "class": "logging.StreamHandler",
            "formatter": "json",
            "filters": ["one_line_security"],
        },
    },
    "loggers": {
        "relay": {"handlers": ["stderr"], "level": RELAY_LOG, "propagate": False},
        "django": {"handlers": ["stderr"], "level": "WARNING"},
        # Refused keys are logged by Relay, rate-limited (queue_core.logformat).
        "django.request": {
            "handlers": ["stderr"],
            "level": "WARNING",
            "filters": ["not_an_auth_refusal"],
            "propagate": False,
        },
        # A refused request: one line each, not a traceback and a whole query string.
        "django.security": {
            "handlers": ["stderr_one_line"],
            "level": "WARNING",
            "propagate": False,
        },
    },
}
