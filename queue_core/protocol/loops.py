"""The event loop a Relay server runs on (``RELAY_EVENT_LOOP``): uvloop when it is installed,
else asyncio's own. No Django here: ``relay_bench.ceiling`` runs on the same loop.

uvloop (libuv, in Cython; https://github.com/MagicStack/uvloop) runs the loop, its sockets and
its timers outside the interpreter: 7-14% fewer instructions per request than asyncio's loop
for Relay's server (docs/benchmarking.md, round 8).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop to serve on, for ``asyncio.run(..., loop_factory=...)``.

    Args:
        choice: ``RELAY_EVENT_LOOP``: ``"auto"`` (uvloop when it can be imported, else
            asyncio's), ``"uvloop"`` or ``"asyncio"``.
    Returns:
        ``uvloop.new_event_loop``, or None for asyncio's default loop.
    Raises:
        ImportError: ``"uvloop"`` was asked for and uvloop is not installed.
    """
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``"uvloop"`` or ``"asyncio"``: which loop ``loop`` is (the ``ready`` line says)."""
    return "uvloop" if type(loop).__module__.partition(".")[0] == "uvloop" else "asyncio"
