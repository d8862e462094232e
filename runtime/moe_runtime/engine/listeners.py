"""Who hears of the engine's steps: the step callbacks (the elastic layer's per-step
bookkeeping), the step-failure callbacks (the fault handlers) and the observer (metrics).

Registration may come from any thread; calls come from the engine thread, at a step boundary.
A callback that raises is logged with the step it failed at and the others still run.
"""

from __future__ import annotations

import logging
import threading

from moe_runtime import step as step_types
from moe_runtime.engine import seam

log = logging.getLogger(__name__)


class Listeners:
    """The engine's step and failure callbacks and its observer."""

    def __init__(self, lock: threading.Condition, observer: seam.StepObserver | None) -> None:
        self._lock = lock
        self.observer = observer
        self._steps: list[seam.StepCallback] = []
        self._failures: list[seam.FailureCallback] = []

    def on_step(self, callback: seam.StepCallback) -> None:
        with self._lock:
            self._steps.append(callback)

    def on_failure(self, callback: seam.FailureCallback) -> None:
        with self._lock:
            self._failures.append(callback)

    def stepped(self, step_id: int, outputs: list[step_types.StepOutput]) -> None:
        """Every step callback with the step's outputs."""
        with self._lock:
            callbacks = list(self._steps)
        for cb in callbacks:
            try:
                cb(outputs)
            except Exception:
                log.exception("engine: step callback %r failed at step %d", cb, step_id)

    def observe(
        self,
        work_tokens: list[int],
        landed_outputs: list[step_types.StepOutput],
        seconds: float,
        *,
        ahead: bool,
    ) -> None:
        """The observer (if any) of a step that ran: its seconds, sequences (one count of
        tokens each), outputs, and whether it was launched ahead of the step before it."""
        observer = self.observer
        if observer is not None:
            observer.observe_step(
                seconds=seconds,
                num_seqs=len(work_tokens),
                num_tokens=sum(work_tokens),
                outputs=landed_outputs,
                ahead=ahead,
            )

    def failed(self, failure: seam.StepFailure) -> None:
        """Every step-failure callback with the failure."""
        with self._lock:
            callbacks = list(self._failures)
        for cb in callbacks:
            try:
                cb(failure)
            except Exception:
                log.exception(
                    "engine: step-failure callback %r failed at step %d", cb, failure.step_id
                )
