"""Wake-ups for the HTTP API's long-polls without a thread per waiting request.

One daemon thread per process (``CommitWatch``) follows the service's change feed
(``queue_core.storage.base.ChangeFeed``: ``PRAGMA data_version`` on the thread's own SQLite
connection, polled every ``WATCH_INTERVAL_S``; LISTEN/NOTIFY with PostgreSQL) and counts the
commits it sees in ``generation``. A waiting ``lease`` request is a future on its event loop:
it reads ``generation`` before its claim, and ``wait(generation, timeout_s)`` returns at once if
the count moved since, else when it moves, else at the timeout. The HTTP views also ``poke()``
after their own commits, which a PostgreSQL feed does not report back to this process.

The thread starts on first use and runs until ``stop()`` (tests) or the process ends; its
first position counts as a commit, so a claim made before the thread started is always tried
again once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from queue_core.service import QueueService

log = logging.getLogger("relay.http")

FEED_WAIT_S = 0.2  # longest single feed.wait (how soon the thread notices stop())
RETRY_S = 0.5  # pause after the feed failed (database down), before reconnecting
START_TIMEOUT_S = 10.0  # how long the first waiter waits for the thread's first position


class CommitWatch:
    """Counts commits made elsewhere and wakes asyncio waiters (see the module docstring).

    Args:
        service: returns the ``QueueService`` whose change feed the thread follows.
    """

    def __init__(self, service: Callable[[], QueueService]) -> None:
        self._service = service
        self._lock = threading.Lock()
        self._generation = 0
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stopping = threading.Event()

    @property
    def generation(self) -> int:
        """The count of commits seen so far (take it before a claim, pass it to ``wait``)."""
        with self._lock:
            return self._generation

    async def start(self) -> None:
        """Start the thread if needed and wait (up to ``START_TIMEOUT_S``) for its first
        position; after that, every commit is counted."""
        with self._lock:
            if self._thread is None:
                self._stopping.clear()
                self._started.clear()
                self._thread = threading.Thread(
                    target=self._run, name="relay-http-commit-watch", daemon=True
                )
                self._thread.start()
            started = self._started
        if not started.is_set():
            await asyncio.to_thread(started.wait, START_TIMEOUT_S)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (it closes its database connection); ``start()`` makes a new one."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping.set()
            thread.join(timeout_s)

    def poke(self) -> None:
        """Count a commit and wake every waiter (thread-safe; views call it after a commit)."""
        with self._lock:
            self._generation += 1
            waiters = list(self._waiters)
            self._waiters.clear()
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    async def wait(self, generation: int, timeout_s: float) -> None:
        """Return when ``generation`` is out of date (maybe at once) or after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (loop, future)
        with self._lock:
            if self._generation != generation:
                return
            self._waiters.add(entry)
        try:
            await asyncio.wait_for(future, max(0.0, timeout_s))
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.discard(entry)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._follow()
                except Exception:
                    log.exception("event=commit_watch_failed retry_in_s=%.1f", RETRY_S)
                    try:
                        self._service().heal()
                    except Exception:  # noqa: BLE001 - best effort before the retry
                        log.debug("event=commit_watch_heal_failed")
                    self._stopping.wait(RETRY_S)
        finally:
            self._service().close()

    def _follow(self) -> None:
        """Count the feed's moves until ``stop()``; raise when the feed fails."""
        feed = self._service().changes()
        token = feed.token()
        self.poke()  # the first position, and after a failure: look again
        self._started.set()
        while not self._stopping.is_set():
            moved = feed.wait(token, FEED_WAIT_S)
            if moved is not None:
                token = moved
                self.poke()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
