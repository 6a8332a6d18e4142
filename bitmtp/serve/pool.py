"""The server's places: a fixed set of ``model.session()`` views (or of places in the batch engine) and a
bounded wait for one.

A request decodes on a session it holds alone, so two requests never share a KV store. At most
``len(sessions) + queue_size`` requests are admitted at once (decoding or waiting, first come first
served); one more is refused with :class:`QueueFull` (the server's 429) rather than queued without
bound. Every method runs on the event loop's thread (the generation threads hand a session back
through ``loop.call_soon_threadsafe``), so the counters need no lock.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bitmtp.errors import BitMTPError


class QueueFull(BitMTPError):
    """Every session is busy and ``queue_size`` requests already wait."""


class SessionPool:
    """``sessions`` independent KV stores over one model's weights, and a queue of at most ``queue_size``
    waiting requests."""

    def __init__(self, model: Any, sessions: int, queue_size: int, *, batch: bool = False):
        if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1:
            raise BitMTPError(f"sessions: must be an integer >= 1, got {sessions!r}")
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 0:
            raise BitMTPError(f"queue_size: must be an integer >= 0, got {queue_size!r}")
        # sessions, not the model itself: a caller that still holds the model (a test comparing with
        # bitmtp.generate, the chat CLI) never waits for the server's KV stores, nor they for it. With
        # ``batch`` the places are places in the model's batch engine (one shared KV store, rows per request):
        # the model itself, once per place
        self.sessions = [model] * sessions if batch else [model.session() for _ in range(sessions)]
        self.queue_size = queue_size
        self._free: asyncio.Queue = asyncio.Queue()
        for s in self.sessions:
            self._free.put_nowait(s)
        self.admitted = 0  # decoding + waiting

    @property
    def busy(self) -> int:
        """Sessions decoding now."""
        return len(self.sessions) - self._free.qsize()

    @property
    def waiting(self) -> int:
        """Requests admitted and waiting for a session."""
        return max(0, self.admitted - self.busy)

    async def acquire(self) -> Any:
        """A free session: at once, after the requests queued before this one, or :class:`QueueFull`."""
        if self.admitted >= len(self.sessions) + self.queue_size:
            raise QueueFull(f"queue: all {len(self.sessions)} places are busy and {self.queue_size} requests "
                            "wait already; retry later (or serve with a larger --max-batch / more --sessions / a "
                            "longer --queue-size)")
        self.admitted += 1
        try:
            return await self._free.get()
        except BaseException:  # the waiting request was cancelled (its client went away)
            self.admitted -= 1
            raise

    def release(self, session: Any) -> None:
        """Hand a session back (on the event loop's thread)."""
        self.admitted -= 1
        self._free.put_nowait(session)
