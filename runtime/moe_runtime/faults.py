"""Injected failures of a rank, for tests (`FaultHooks`, inherited by `RankWorker`).

`fail_next(operation)` makes the next call of that worker method raise `InjectedFailure`
(collective operations after their collective part, so peers never hang); `stall_next`
makes it hang first (a hung rank); `disarm` forgets both.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class InjectedFailure(RuntimeError):
    """Raised by an operation armed with `RankWorker.fail_next` (tests of Failed resizes)."""


class FaultHooks:
    """The test hooks of a rank; the state is `RankWorker`'s."""

    _fail: dict[str, str]
    _stall: dict[str, float]
    _lock: threading.RLock

    def _ctx(self) -> str:
        raise NotImplementedError

    def fail_next(self, operation: str, message: str = "injected failure") -> None:
        """Make the next call of `operation` (a method name) fail with InjectedFailure.

        Collective operations fail after their collective part, so peers never hang.
        """
        with self._lock:
            self._fail[operation] = message

    def disarm(self) -> None:
        """Forget every armed failure and stall (a test that did not trigger them)."""
        with self._lock:
            self._fail.clear()
            self._stall.clear()

    def stall_next(self, operation: str, seconds: float) -> None:
        """Make the next call of `operation` hang for `seconds` first (a hung rank, in tests)."""
        with self._lock:
            self._stall[operation] = seconds

    def _check_fail(self, operation: str) -> None:
        with self._lock:
            message = self._fail.pop(operation, None)
            stall = self._stall.pop(operation, 0.0)
        if stall:
            log.warning("%s: stalling %.1fs as armed (%s)", operation, stall, self._ctx())
            time.sleep(stall)  # the armed hang itself
        if message is not None:
            raise InjectedFailure(f"{operation}: {message} ({self._ctx()})")
