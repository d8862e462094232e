"""Work waiting for the next step boundary (`Boundary`, a part of `core.Engine`): calls that
run on the engine thread between two steps (no step runs meanwhile; requests that arrive
wait in the queue) and step controls merged into the next `StepInput.control`.

The `run*` variants wait with a deadline and cancel what has not started by then, so nothing
queued by a failed operation runs after its rollback.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from moe_runtime import step as step_types

log = logging.getLogger(__name__)

T = TypeVar("T")
ControlFuture = concurrent.futures.Future[list[step_types.StepOutput]]
BoundaryCall = tuple[Callable[[], Any], concurrent.futures.Future[Any]]
StepControl = tuple[dict[str, Any], ControlFuture]


class Boundary:
    """The boundary calls and step controls of one engine.

    cond: the engine's condition (it guards this state too); notify(): wake the engine thread
    (called holding cond); on_engine_thread(): the caller is the engine thread; refused():
    the exception a new call gets instead (the engine is stopped), or None (called holding
    cond).
    """

    def __init__(
        self,
        *,
        cond: threading.Condition,
        notify: Callable[[], None],
        on_engine_thread: Callable[[], bool],
        refused: Callable[[], BaseException | None],
    ) -> None:
        self._cond = cond
        self._notify = notify
        self._on_engine_thread = on_engine_thread
        self._refused = refused
        self._calls: list[BoundaryCall] = []
        self._controls: list[StepControl] = []
        #: Calls run at once on the engine thread (a prepared step made before one is dropped).
        self.ran_at_once = 0

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Runs `fn` on the engine thread between two steps; no step runs while it runs.

        Called from the engine thread itself (inside another boundary call or a step
        callback), `fn` runs at once, unless a step is still in flight (a step callback while
        the step launched ahead runs: it then waits for the next boundary). Requests added
        meanwhile wait in the queue.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._on_engine_thread():
            self.ran_at_once += 1
            run_into(fn, future)
            return future
        with self._cond:
            refused = self._refused()
            if refused is not None:
                future.set_exception(refused)
                return future
            self._calls.append((fn, future))
            self._notify()
        return future

    def control(self, control: dict[str, Any]) -> ControlFuture:
        """Merges `control` into the next step's StepInput.control (a step runs even when idle).

        The future completes with that step's outputs once every rank has applied it.
        """
        future: ControlFuture = concurrent.futures.Future()
        with self._cond:
            self._controls.append((dict(control), future))
            self._notify()
        return future

    def run(self, fn: Callable[[], T], *, timeout: float) -> T:
        """`call(fn)` and wait for its result, with a deadline.

        If no boundary was reached within `timeout` s, the call is cancelled (it will never
        run) and TimeoutError is raised. A call that has started runs to its end, so `fn` must
        bound its own work (pass it the time left); its outcome is awaited at most another
        `timeout` s.
        """
        return _await(self.call(fn), timeout, what="boundary call")

    def run_control(
        self, control: dict[str, Any], *, timeout: float
    ) -> list[step_types.StepOutput]:
        """`control(control)` and wait for that step's outputs, with the same deadline rule as
        `run`: a control not sent within `timeout` s is withdrawn."""
        return _await(self.control(control), timeout, what="step control")

    # -- the engine thread's side (holding cond) -----------------------------------------
    def waiting(self) -> bool:
        """Calls are waiting (the loop runs them before it steps)."""
        return bool(self._calls)

    def has_controls(self) -> bool:
        return bool(self._controls)

    def take_calls(self) -> list[BoundaryCall]:
        calls, self._calls = self._calls, []
        return calls

    def take_controls(self) -> list[StepControl]:
        controls, self._controls = self._controls, []
        return controls


def fail(calls: list[BoundaryCall], controls: list[StepControl], exc: BaseException) -> None:
    """Those calls and controls will never run (the engine stopped): `exc` for each."""
    for _, future in calls:
        future.set_exception(exc)
    for _, cf in controls:
        if cf.set_running_or_notify_cancel():
            cf.set_exception(exc)


def run_into(fn: Callable[[], T], future: concurrent.futures.Future[T]) -> None:
    """Run `fn` and hand its outcome to `future` (unless the future was cancelled)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except Exception as exc:  # handed to the caller through the future
        log.warning("engine: boundary call %r failed", fn, exc_info=True)
        future.set_exception(exc)
    else:
        future.set_result(result)


def _await(future: concurrent.futures.Future[T], timeout: float, *, what: str) -> T:
    """future's result within `timeout`; if it has not started by then, cancel it."""
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        if future.cancel():
            raise TimeoutError(
                f"{what}: no step boundary within {timeout:.1f}s; cancelled, it will not run"
            ) from None
    log.warning("engine: %s started late; waiting for its end", what)
    return future.result(timeout=timeout)
