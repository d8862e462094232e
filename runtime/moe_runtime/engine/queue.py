"""The engine's request queue and its bound: admission control (backpressure).

Requests wait here until the engine gives them a sequence slot. Other threads `put` into the
inbox; the engine thread moves the inbox into the waiting line at each boundary and admits
from its head. The inbox and the count behind the bound have a lock of their own; the waiting
line is the engine thread's alone.

The bound (`max_queued`, None = none) counts the requests waiting that arrived while the
engine could drain its queue. A request arriving while `exempt()` is true (a resize or a
recovery runs: the engine may be paused at a step boundary, or serving on fewer ranks) is
never refused and never counts, so a resize never causes a 429; it is queued as before. A
request that finds the counted waiting requests at the bound is refused with `QueueFull`,
whose `retry_after` estimates when a place frees up from the recent admission rate.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator

from moe_runtime.engine import request as req

#: Seconds of admissions the Retry-After estimate looks at.
RATE_WINDOW_SECONDS = 10.0
#: Bounds of the Retry-After estimate (seconds).
MIN_RETRY_AFTER = 1
MAX_RETRY_AFTER = 60


class QueueFull(RuntimeError):
    """The queue holds `max_queued` requests: this one is refused (HTTP 429)."""

    def __init__(self, *, max_queued: int, retry_after: int) -> None:
        super().__init__(
            f"the server is overloaded: {max_queued} requests are already queued "
            f"(--max-queued-requests); retry in {retry_after} s"
        )
        self.max_queued = max_queued
        self.retry_after = retry_after


@dataclasses.dataclass(eq=False)
class _Entry:
    handle: req.RequestHandle
    counted: bool  # charged to the bound (arrived while no resize ran)


class RequestQueue:
    """Inbox + waiting line with a bound (see the module docstring)."""

    def __init__(
        self, *, max_queued: int | None = None, exempt: Callable[[], bool] | None = None
    ) -> None:
        if max_queued is not None and max_queued < 0:
            raise ValueError(f"max_queued must be >= 0 or None, got {max_queued}")
        self.max_queued = max_queued
        self._exempt = exempt
        self._lock = threading.Lock()
        self._inbox: collections.deque[_Entry] = collections.deque()
        self._waiting: collections.deque[_Entry] = collections.deque()
        self._counted = 0  # counted entries in the inbox and the waiting line
        self._admitted: collections.deque[float] = collections.deque()  # monotonic times

    def set_exempt(self, exempt: Callable[[], bool] | None) -> None:
        """While `exempt()` is true, arrivals are neither refused nor counted (a resize)."""
        self._exempt = exempt

    # -- any thread ---------------------------------------------------------------------
    def exempt_now(self) -> bool:
        """Whether an arrival now is exempt from the bound (call it holding no other lock)."""
        return self._exempt is not None and self._exempt()

    def put(self, handle: req.RequestHandle, *, exempt: bool) -> None:
        """Queue `handle`, or raise QueueFull (nothing queued) when the bound is reached.

        exempt: `exempt_now()`, taken by the caller before its own lock."""
        with self._lock:
            limit = self.max_queued
            if not exempt and limit is not None and self._counted >= limit:
                raise QueueFull(max_queued=limit, retry_after=self._retry_after(limit))
            self._inbox.append(_Entry(handle, counted=not exempt))
            if not exempt:
                self._counted += 1

    def set_max_queued(self, max_queued: int | None) -> None:
        """A new bound, for the next arrivals (requests already queued stay)."""
        if max_queued is not None and max_queued < 0:
            raise ValueError(f"max_queued must be >= 0 or None, got {max_queued}")
        with self._lock:
            self.max_queued = max_queued

    def inbox_len(self) -> int:
        with self._lock:
            return len(self._inbox)

    def counted(self) -> int:
        """Queued requests charged to the bound (for status and metrics)."""
        with self._lock:
            return self._counted

    # -- engine thread ------------------------------------------------------------------
    def take_inbox(self) -> None:
        """Move the inbox to the end of the waiting line."""
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()

    def _retry_after(self, limit: int) -> int:
        """Seconds until `limit` queued requests are admitted at the recent rate (lock held)."""
        now = time.monotonic()
        while self._admitted and self._admitted[0] < now - RATE_WINDOW_SECONDS:
            self._admitted.popleft()
        if not self._admitted:
            return MIN_RETRY_AFTER
        rate = len(self._admitted) / RATE_WINDOW_SECONDS
        wait = math.ceil(max(limit, 1) / rate)
        return max(MIN_RETRY_AFTER, min(MAX_RETRY_AFTER, wait))

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[req.RequestHandle]:
        return (e.handle for e in self._waiting)

    def head(self) -> req.RequestHandle | None:
        return self._waiting[0].handle if self._waiting else None

    def pop_head(self, *, admitted: bool) -> req.RequestHandle:
        """Remove the head; `admitted`: it got a sequence slot (feeds Retry-After)."""
        entry = self._waiting.popleft()
        with self._lock:
            self._counted -= entry.counted
            if admitted:
                self._admitted.append(time.monotonic())
        return entry.handle

    def remove(self, request_ids: set[str]) -> list[req.RequestHandle]:
        """Remove and return the waiting requests with these ids (aborts)."""
        gone = [e for e in self._waiting if e.handle.request_id in request_ids]
        for entry in gone:
            self._waiting.remove(entry)
        with self._lock:
            self._counted -= sum(e.counted for e in gone)
        return [e.handle for e in gone]

    def clear(self) -> list[req.RequestHandle]:
        """Empty inbox and waiting line (the engine stops); returns what was queued."""
        self.take_inbox()
        handles = [e.handle for e in self._waiting]
        self._waiting.clear()
        with self._lock:
            self._counted = 0
        return handles
