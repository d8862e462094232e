"""Injected failures of a rank: the fault hooks tests install (`moe_runtime.rank.hooks`).

Give `Faults` (the class is the factory) to an executor, `LocalExecutor(n, rank_hooks=Faults)`
or `RayExecutor(n, rank_hooks=Faults)` (a Ray actor imports this module: the repository root is
on its path, since Ray puts the driver's working directory there), or name it for
`moe-runtime serve`: `MOE_RANK_HOOKS=tests.support.faults:Faults`. Then, through
`collective_rpc`: `fail_next(operation)` makes the next call of that operation raise
`InjectedFailure` (collective operations after their collective part, so peers never hang;
`error="oom"`: `torch.cuda.OutOfMemoryError`, what a GPU raises, at "forward": its peers wait
for it in the step's collectives); `stall_next(operation, seconds)` makes it hang first (a hung
rank); `disarm` forgets both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from moe_runtime.rank import hooks

log = logging.getLogger(__name__)

#: What `MOE_RANK_HOOKS` names to install them in `moe-runtime serve`.
PATH = "tests.support.faults:Faults"


class InjectedFailure(RuntimeError):
    """Raised by an operation armed with `fail_next` (tests of failed resizes)."""


#: What `fail_next(..., error=)` raises.
ERRORS: dict[str, type[Exception]] = {
    "failure": InjectedFailure,
    "oom": torch.cuda.OutOfMemoryError,
}


class Faults:
    """The fault hooks of one rank (`moe_runtime.rank.hooks.Hooks`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fail: dict[str, tuple[str, str]] = {}
        self._stall: dict[str, float] = {}

    def controls(self) -> Mapping[str, Callable[..., Any]]:
        return {"fail_next": self.fail_next, "stall_next": self.stall_next, "disarm": self.disarm}

    def fail_next(
        self, operation: str, message: str = "injected failure", error: str = "failure"
    ) -> None:
        """Make the next call of `operation` (a fault point) fail with InjectedFailure (error
        "failure") or torch.cuda.OutOfMemoryError ("oom")."""
        self._known(operation)
        if error not in ERRORS:
            raise ValueError(f"error must be one of {sorted(ERRORS)}, got {error!r}")
        with self._lock:
            self._fail[operation] = (message, error)

    def stall_next(self, operation: str, seconds: float) -> None:
        """Make the next call of `operation` hang for `seconds` first (a hung rank)."""
        self._known(operation)
        with self._lock:
            self._stall[operation] = seconds

    def disarm(self) -> None:
        """Forget every armed failure and stall (a test that did not trigger them)."""
        with self._lock:
            self._fail.clear()
            self._stall.clear()

    def check(self, point: str, where: str) -> None:
        with self._lock:
            armed = self._fail.pop(point, None)
            stall = self._stall.pop(point, 0.0)
        if stall:
            log.warning("%s: stalling %.1fs as armed (%s)", point, stall, where)
            time.sleep(stall)  # the armed hang itself
        if armed is not None:
            message, error = armed
            raise ERRORS[error](f"{point}: {message} ({where})")

    @staticmethod
    def _known(operation: str) -> None:
        if operation not in hooks.POINTS:
            raise ValueError(f"no fault point {operation!r}; the points are {hooks.POINTS}")
