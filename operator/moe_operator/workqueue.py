"""A small per-key work queue (asyncio; no kopf, no API client), like client-go's workqueue.

- **De-duplication**: a key is queued at most once. Adding it again keeps the earliest due
  time and the newest watched body (a trigger without one keeps the body already queued:
  the body is the MoEDeployment as the watch delivered it; what else a reconcile needs is
  read anyway).
- **Serialisation**: one worker task per key runs its work items one after the other, so two
  reconciles of one deployment never overlap. A key added while its work runs is run again
  once that ends (the change it brings is not folded into the run that may have read the
  world just before); a key forgotten while its work runs (the deployment was deleted) is
  not run again unless it is added anew, and its entry goes when the run ends.
- **Backoff**: a run that raised is queued again after ``backoff(failures)`` seconds
  (doubling from ``RETRY_BACKOFF_SECONDS`` up to ``MAX_BACKOFF_SECONDS``); a run that
  succeeded resets it and may ask to run again after a delay (its return value).

The work function decides what is not worth a retry (an invalid spec waits for a spec
change: ``moe_operator.loop``); everything it raises is retried.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

Key = tuple[str, str]
Body = dict[str, Any]
#: ``work(key, body)``: one run for ``key`` (``body``: the watched object to start from, or
#: ``None``: read it); returns the seconds after which to run again, or ``None``.
Work = Callable[[Key, "Body | None"], Awaitable["float | None"]]

#: The first retry of a failed run.
RETRY_BACKOFF_SECONDS: Final = 5.0
#: The longest wait between retries of a key that keeps failing: kopf's own default handler
#: backoff (``ExecutionSettings.default_backoff = 60``, kopf/_cogs/configs/configuration.py).
MAX_BACKOFF_SECONDS: Final = 60.0

logger = logging.getLogger(__name__)


def backoff(failures: int) -> float:
    """Seconds before the retry that follows ``failures`` failed runs in a row (>= 1)."""
    return float(min(RETRY_BACKOFF_SECONDS * 2 ** max(failures - 1, 0), MAX_BACKOFF_SECONDS))


@dataclasses.dataclass
class _Item:
    due: float
    body: Body | None


@dataclasses.dataclass
class _Entry:
    pending: _Item | None = None
    worker: asyncio.Task[None] | None = None
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    failures: int = 0
    #: Bumped by ``forget``: a run that started before does not queue its key again.
    epoch: int = 0


class WorkQueue:
    """Per-key queue of runs of ``work``; see the module docstring.

    ``context()``: the :class:`contextvars.Context` worker tasks are started in (``None``:
    the caller's); the operator passes kopf's per-object context, whose variables hold
    kopf's event queue (``moe_operator.loop``).
    """

    def __init__(
        self,
        work: Work,
        *,
        backoff: Callable[[int], float] = backoff,
        context: Callable[[], contextvars.Context | None] = lambda: None,
    ) -> None:
        self._work = work
        self._backoff = backoff
        self._context = context
        self._entries: dict[Key, _Entry] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def add(self, key: Key, *, delay: float = 0.0, body: Body | None = None) -> None:
        """Run ``key`` in ``delay`` seconds (sooner if it is queued for sooner)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + max(delay, 0.0)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            self._idle.clear()
        queued = entry.pending
        if queued is None:
            entry.pending = _Item(due=due, body=body)
        else:
            entry.pending = _Item(
                due=min(queued.due, due), body=body if body is not None else queued.body
            )
        entry.wake.set()
        if entry.worker is None or entry.worker.done():
            entry.worker = self._start(key, entry)

    def forget(self, key: Key) -> None:
        """Drop what is queued for ``key``; a run in progress ends and is not repeated."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.pending = None
        entry.epoch += 1
        entry.wake.set()

    def queued(self, key: Key) -> bool:
        """Whether a run of ``key`` is queued (not counting one in progress)."""
        entry = self._entries.get(key)
        return entry is not None and entry.pending is not None

    def keys(self) -> set[Key]:
        """Keys with a run queued or in progress."""
        return set(self._entries)

    async def idle(self) -> None:
        """Wait until nothing is queued or running (tests, shutdown)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Cancel every worker (what is queued is dropped)."""
        workers = [e.worker for e in self._entries.values() if e.worker is not None]
        for worker in workers:
            worker.cancel()
        for worker in workers:
            try:
                await worker
            except asyncio.CancelledError:
                pass
        self._entries.clear()
        self._idle.set()

    def _start(self, key: Key, entry: _Entry) -> asyncio.Task[None]:
        loop = asyncio.get_running_loop()
        name = f"reconcile {key[0]}/{key[1]}"
        context = self._context()
        if context is None:
            return loop.create_task(self._run(key, entry), name=name)
        task: asyncio.Task[None] = context.run(loop.create_task, self._run(key, entry), name=name)
        return task

    async def _run(self, key: Key, entry: _Entry) -> None:
        loop = asyncio.get_running_loop()
        try:
            while entry.pending is not None:
                wait = entry.pending.due - loop.time()
                if wait > 0:
                    entry.wake.clear()
                    try:
                        await asyncio.wait_for(entry.wake.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                    continue  # due again, moved sooner, or forgotten
                item, entry.pending = entry.pending, None
                epoch = entry.epoch
                try:
                    again = await self._work(key, item.body)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # noqa: BLE001 - every failure is retried
                    entry.failures += 1
                    delay = self._backoff(entry.failures)
                    logger.warning(
                        "reconcile of %s/%s failed (%s: %s); again in %.0fs",
                        key[0], key[1], type(error).__name__, error, delay,
                        exc_info=entry.failures == 1,
                    )  # fmt: skip
                    if entry.epoch == epoch:
                        self._requeue(entry, delay)
                    continue
                entry.failures = 0
                if again is not None and entry.epoch == epoch:
                    self._requeue(entry, again)
        finally:
            if self._entries.get(key) is entry and entry.pending is None:
                del self._entries[key]
                if not self._entries:
                    self._idle.set()

    @staticmethod
    def _requeue(entry: _Entry, delay: float) -> None:
        due = asyncio.get_running_loop().time() + delay
        queued = entry.pending
        if queued is None:
            entry.pending = _Item(due=due, body=None)
        elif due < queued.due:
            entry.pending = _Item(due=due, body=queued.body)
