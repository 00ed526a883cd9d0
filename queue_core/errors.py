"""Relay's error tree: one stable code per failure, shared by TCP and HTTP.

Each ``RelayError`` subclass carries ``code`` (the wire code), ``http_status`` and
``retryable``; its docstring is the default message (procrastinate does the same). Unknown
exceptions become ``INTERNAL``, as Faktory's wire falls back to a generic error.
``docs/protocol.md`` lists every code; a unit test keeps the two in step.
"""

from __future__ import annotations

from typing import Any, ClassVar


class RelayError(Exception):
    """Relay could not complete the request."""

    code: ClassVar[str] = "INTERNAL"
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = True

    def __init__(self, message: str | None = None, **details: Any) -> None:
        self.message = message or (self.__doc__ or self.code).strip()
        self.details = details
        super().__init__(self.message)

    def to_dict(self) -> dict[str, Any]:
        """Return the wire body ``{"code", "message", "retryable", "details"?}``.

        The message is cut to ``MAX_MESSAGE_CHARS`` and each string in ``details`` to
        ``MAX_DETAIL_CHARS`` characters (ending ``…``): an unknown argument's name is echoed
        in both, and a name of 1,000,000 characters made a 2 MB error reply, past the frame
        limit a client reads (a review)."""
        body: dict[str, Any] = {
            "code": self.code,
            "message": _cut(self.message, MAX_MESSAGE_CHARS),
            "retryable": self.retryable,
        }
        if self.details:
            body["details"] = {
                key: _cut(value, MAX_DETAIL_CHARS) if isinstance(value, str) else value
                for key, value in self.details.items()
            }
        return body


# The most characters of an error's message, and of each string in its details, on the wire.
MAX_MESSAGE_CHARS = 1024
MAX_DETAIL_CHARS = 256


def _cut(text: str, most: int) -> str:
    """``text``, or its first ``most - 1`` characters and ``…`` when longer."""
    return text if len(text) <= most else text[: most - 1] + "…"


class InvalidArgument(RelayError):
    """An argument is missing, of the wrong type or out of range."""

    code = "INVALID_ARGUMENT"
    http_status = 422
    retryable = False


class BadFrame(RelayError):
    """The frame is not one UTF-8 JSON object with an "op" string."""

    code = "BAD_FRAME"
    http_status = 400
    retryable = False


class FrameTooLarge(RelayError):
    """The frame or payload is over its size limit."""

    code = "FRAME_TOO_LARGE"
    http_status = 413
    retryable = False


class UnsupportedMediaType(RelayError):
    """The request body is not ``application/json`` (HTTP API)."""

    code = "UNSUPPORTED_MEDIA_TYPE"
    http_status = 415
    retryable = False


class UnknownOp(RelayError):
    """The op is not one Relay knows; over HTTP, a method a route does not take (405, with
    ``Allow``: ``queue_api.middleware``)."""

    code = "UNKNOWN_OP"
    http_status = 405
    retryable = False


class Unauthenticated(RelayError):
    """Credentials are missing or invalid."""

    code = "UNAUTHENTICATED"
    http_status = 401
    retryable = False


class PermissionDenied(RelayError):
    """The credentials do not allow this operation."""

    code = "PERMISSION_DENIED"
    http_status = 403
    retryable = False


class JobNotFound(RelayError):
    """No job has this id."""

    code = "NOT_FOUND"
    http_status = 404
    retryable = False


class IdempotencyConflict(RelayError):
    """The idempotency key is bound to a job with a different payload."""

    code = "IDEMPOTENCY_CONFLICT"
    http_status = 409
    retryable = False


class InvalidState(RelayError):
    """The job is not in a state that allows this transition."""

    code = "INVALID_STATE"
    http_status = 409
    retryable = False


class JobFinished(InvalidState):
    """The job has finished (succeeded, dead or cancelled): there is nothing to cancel.

    A subclass of ``InvalidState`` with a code of its own, so a caller can tell "too late" from
    other refusals (Oban's ``cancel_job`` leaves completed jobs alone; Relay says so).
    """

    code = "JOB_FINISHED"
    http_status = 409
    retryable = False


class LeaseExpired(RelayError):
    """The lease expired before this request; the job may be delivered again."""

    code = "LEASE_EXPIRED"
    http_status = 409
    retryable = False


class StaleToken(RelayError):
    """The lease token is not the job's current one (the lease was lost or taken over)."""

    code = "STALE_TOKEN"
    http_status = 409
    retryable = False


class StoreBusy(RelayError):
    """The database stayed locked past the retry budget; try again."""

    code = "BUSY"
    http_status = 503
    retryable = True


class Unavailable(RelayError):
    """The server is shutting down and takes no new submits or leases, or cannot reach its
    database; nothing changed. Try another moment."""

    code = "UNAVAILABLE"
    http_status = 503
    retryable = True


class OutcomeUnknown(RelayError):
    """The server lost its PostgreSQL connection while the database committed, or SQLite's
    COMMIT failed an I/O operation (a log sync the disk refused): the change may or may not
    have been made, as when a client's own connection breaks before the reply.
    Retry a submit with the same idempotency key; an ack or fail is safe to repeat (a repeat
    answers ``duplicate``); jobs a lease may have handed out come back when it expires.

    After the ambiguous commit of PostgreSQL's docs (a connection lost during COMMIT) and
    gRPC's ``UNKNOWN``.
    """

    code = "OUTCOME_UNKNOWN"
    http_status = 500
    retryable = True


class TooManyConnections(RelayError):
    """The server is at its connection limit."""

    code = "TOO_MANY_CONNECTIONS"
    http_status = 503
    retryable = True


class TooManyQueues(RelayError):
    """The database holds ``RELAY_MAX_QUEUES`` queues with jobs; a job for another queue is
    refused until one of them has none left (its finished jobs pruned or purged) or the cap
    is raised. Jobs for the queues it holds are taken as before (RabbitMQ's per-vhost
    ``max-queues`` limit, NATS JetStream's ``max_streams``)."""

    code = "TOO_MANY_QUEUES"
    http_status = 409
    retryable = False


class Timeout(RelayError):
    """The connection sent no complete frame within the idle timeout, or its frame was still
    arriving a second after it began while the server's request buffers were full
    (``protocol.reading.InputBudget``)."""

    code = "TIMEOUT"
    http_status = 408
    retryable = True


class Internal(RelayError):
    """Internal error; see the server log."""

    code = "INTERNAL"
    http_status = 500
    retryable = True


# Storage faults (docs/failure-model.md, "Storage faults"): the database cannot take writes for
# a reason outside Relay. Nothing is acknowledged meanwhile; the first two clear by themselves
# once the cause is gone (space freed, the device back), the third needs a server restart.


class StorageFull(RelayError):
    """The database's disk is full; nothing was written. Writes resume once space is freed."""

    code = "STORAGE_FULL"
    http_status = 507
    retryable = True


class StorageIO(RelayError):
    """The database file cannot be read or written (an I/O error, or a read-only file, folder
    or file system); nothing was written."""

    code = "STORAGE_IO"
    http_status = 503
    retryable = True


# The exit codes of ``relay server`` and ``relay migrate`` when the storage fails.
EXIT_STORAGE_FULL = 7  # STORAGE_FULL: the disk holding the database is full
EXIT_STORAGE_IO = 8  # STORAGE_IO: I/O error, or a read-only file, folder or file system


# What a storage fault while migrating did: ``relay server`` and ``relay migrate`` say it.
MIGRATION_ROLLED_BACK = (
    "the migration was rolled back (one that rebuilds a table needs up to about three times "
    "the file's size free while it runs)"
)


def storage_exit_code(err: StorageFull | StorageIO) -> int:
    """The process exit code for a storage fault at start-up or while migrating."""
    return EXIT_STORAGE_FULL if isinstance(err, StorageFull) else EXIT_STORAGE_IO


class StorageLost(RelayError):
    """The database file was removed or replaced while the server had it open; writes are
    refused until the server is restarted."""

    code = "STORAGE_LOST"
    http_status = 503
    retryable = True


def all_error_classes() -> list[type[RelayError]]:
    """Return every concrete error class, one per code."""
    out: list[type[RelayError]] = []
    stack: list[type[RelayError]] = list(RelayError.__subclasses__())
    while stack:
        cls = stack.pop()
        out.append(cls)
        stack.extend(cls.__subclasses__())
    return out


ERRORS_BY_CODE: dict[str, type[RelayError]] = {cls.code: cls for cls in all_error_classes()}


def error_body(exc: BaseException) -> dict[str, Any]:
    """Map any exception to the wire body; non-Relay errors become a generic ``INTERNAL``."""
    if isinstance(exc, RelayError):
        return exc.to_dict()
    return Internal().to_dict()


def error_from_body(body: dict[str, Any]) -> RelayError:
    """Rebuild the ``RelayError`` subclass for a wire error body (used by clients).

    Whatever the body holds (details that are no object, a ``message`` among them, keys that
    are no strings: a faulty server), the result is a ``RelayError``; details that are no
    object are dropped. A raw ``TypeError`` killed the worker's renewer thread (a review).
    """
    cls = ERRORS_BY_CODE.get(str(body.get("code")), RelayError)
    err = cls(str(body.get("message") or ""))
    details = body.get("details")
    if isinstance(details, dict):
        err.details = {str(key): value for key, value in details.items()}
    return err
