"""A ``RelayClient`` transport without a socket: frames go through the codec and the op table
of this process (``dispatch.handle``) on a ``QueueService``.

For tests that run one case over every surface (``tests/contract/``), and for code that wants
the client's interface in-process. It is not the TCP server: no API key is asked for (a
``hello`` is checked, then remembered nowhere), a request runs on the calling thread in a
transaction of its own (no group commit), and a ``lease`` never waits (``wait_ms`` is checked,
then ignored).
"""

from __future__ import annotations

import logging

from queue_core import errors
from queue_core.protocol import codec, dispatch
from queue_core.service import QueueService

log = logging.getLogger("relay.loopback")


class LoopbackTransport:
    """Carry each frame to ``dispatch.handle`` and its reply back (a ``client.Transport``).

    Args:
        service: the queue service the requests run on.
        ctx: who is asking (default ``dispatch.Context(peer="loopback")``): the default
            ``worker_id`` of a lease, the actor of replay and purge.
    """

    def __init__(self, service: QueueService, ctx: dispatch.Context | None = None) -> None:
        self.service = service
        self.ctx = ctx or dispatch.Context(peer="loopback")

    def roundtrip(self, frame: bytes, *, timeout_s: float, deadline: float | None = None) -> bytes:
        """Run one request frame; return its reply line without the newline.

        Args:
            frame: one encoded request ending in ``\\n``.
            timeout_s, deadline: unused: the call runs to its end on this thread.
        Returns:
            The reply: the result, or the error body of what the request raised (an exception
            that is not a ``RelayError`` is logged and answered ``INTERNAL``, as over TCP).
        """
        try:
            request = codec.decode_request(frame)
        except errors.RelayError as exc:
            return codec.encode_error(codec.request_id_of(frame), exc)[:-1]
        try:
            result = dispatch.handle(self.service, request, self.ctx)
        except Exception as exc:  # every failure becomes an error reply
            if not isinstance(exc, errors.RelayError):
                log.error("event=internal_error op=%s", request.op, exc_info=exc)
            return codec.encode_error(request.id, exc)[:-1]
        return codec.encode_ok(request.id, result)[:-1]

    def close(self) -> None:
        """Nothing to close: there is no connection."""
