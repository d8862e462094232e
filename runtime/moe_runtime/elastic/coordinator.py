"""The resize coordinator: one resize at a time, driven stage by stage in a background thread.

The coordinator owns the rules (one resize at a time, same target is idempotent, a different
target while one runs is a conflict, sizes are validated before anything changes) and the
records (stages with durations, bytes moved, blackout). The mechanics of each stage live
behind `ResizeOps` (see `moe_runtime.elastic.ops` for the one that drives a real engine and
executor), so the rules are unit-tested without ranks.

A failure in any stage ends the resize in `Failed` with a message; the ops' `rollback` releases
what the stages before it allocated, and the deployment keeps serving at its last good size.

Recoveries (`begin_recovery` / `end_recovery`, driven by `moe_runtime.elastic.recovery`) are
recorded here too, as records of kind "recovery" in stage `Recovering`: while one runs it is
the current record (a request for its target returns it, any other target is a conflict), and
it joins the same history.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from moe_runtime.elastic import records, stages

log = logging.getLogger(__name__)

HISTORY_LIMIT = 50
SLOW_PROGRESS_SECONDS = 0.5  # a gap in progress longer than this during a resize is logged


class ResizeError(Exception):
    """A resize request that is refused; `status_code` is the HTTP status to answer."""

    status_code = 400


class InvalidResize(ResizeError):
    status_code = 400


class ResizeConflict(ResizeError):
    status_code = 409


class InjectedFailure(RuntimeError):
    """Raised by the test hook that makes a chosen stage fail."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Sizes a deployment may take.

    max_experts_per_rank: expert slots one rank can hold (memory); None = no limit. A size whose
    ranks would need more slots than this to hold every logical (plus redundant) expert is
    refused.
    """

    min_size: int = 1
    max_size: int = 64
    num_experts: int = 1
    num_redundant_experts: int = 0
    max_experts_per_rank: int | None = None

    def slots_per_rank(self, size: int) -> int:
        total = self.num_experts + self.num_redundant_experts
        return -(-total // size)

    def check(self, size: int) -> None:
        """Raise InvalidResize naming the reason when `size` ranks cannot serve the model."""
        if size < 1:
            raise InvalidResize(f"new_data_parallel_size must be >= 1, got {size}")
        if size < self.min_size or size > self.max_size:
            raise InvalidResize(
                f"new_data_parallel_size {size} is outside the allowed range "
                f"[{self.min_size}, {self.max_size}]"
            )
        if self.max_experts_per_rank is not None:
            need = self.slots_per_rank(size)
            if need > self.max_experts_per_rank:
                raise InvalidResize(
                    f"new_data_parallel_size {size} is too small to hold every expert: "
                    f"{self.num_experts} experts + {self.num_redundant_experts} redundant need "
                    f"{need} slots per rank, but a rank holds at most {self.max_experts_per_rank}"
                )


class ResizeOps(Protocol):
    """The mechanics of each stage. `begin` returns an opaque plan passed to every stage."""

    def current_size(self) -> int: ...

    def begin(self, record: records.ResizeRecord) -> Any: ...

    def run_stage(self, stage: stages.Stage, plan: Any, record: records.ResizeRecord) -> None:
        """Do the work of `stage`, updating `record` (bytes moved, freed pods, ...)."""

    def rollback(self, plan: Any, record: records.ResizeRecord, failed: stages.Stage) -> str:
        """Undo what the resize allocated; return where the deployment now serves (a message)."""

    def end(self, plan: Any) -> None:
        """Called once after a resize whose `begin` returned, however it ended."""


class ProgressTracker:
    """Measures the blackout of a resize: the longest gap with no token produced while busy.

    `on_step(produced, busy)` is called after every engine step with the number of tokens the
    step produced and whether requests were in flight. clock: the monotonic clock (tests give
    their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._active = False
        self._last = 0.0
        self._max_gap = 0.0

    def start(self) -> None:
        with self._lock:
            self._active = True
            self._last = self._clock()
            self._max_gap = 0.0

    def on_step(self, produced: int, busy: bool) -> None:
        now = self._clock()
        with self._lock:
            if not self._active:
                return
            if produced > 0:
                gap = now - self._last
                if gap > SLOW_PROGRESS_SECONDS:
                    log.warning("resize: no token produced for %.3fs while requests waited", gap)
                self._max_gap = max(self._max_gap, gap)
                self._last = now
            elif not busy:
                self._last = now  # idle time with nothing to serve is no blackout

    def stop(self, busy: bool) -> float:
        now = self._clock()
        with self._lock:
            if busy:
                self._max_gap = max(self._max_gap, now - self._last)
            self._active = False
            return self._max_gap


class Coordinator:
    """Accepts resize requests and runs them one at a time, stage by stage."""

    def __init__(
        self,
        ops: ResizeOps,
        *,
        limits: Limits,
        busy: Callable[[], bool] | None = None,
        drain_timeout: float = 0.0,
    ) -> None:
        self._ops = ops
        self.limits = limits
        #: Seconds a shrink waits for sequences on departing ranks to finish before migrating
        #: them, when the request does not say (`--drain-timeout`; 0 = migrate at once).
        self.drain_timeout = drain_timeout
        self._busy = busy or (lambda: False)
        self._lock = threading.Lock()
        self._current: records.ResizeRecord | None = None
        self._recovery: records.ResizeRecord | None = None
        self._thread: threading.Thread | None = None
        self._history: deque[records.ResizeRecord] = deque(maxlen=HISTORY_LIMIT)
        self._fail_stage: stages.Stage | None = None
        self.tracker = ProgressTracker()
        self._listeners: list[Callable[[records.ResizeRecord], None]] = []

    # -- queries -------------------------------------------------------------------------
    @property
    def current(self) -> records.ResizeRecord | None:
        """The running recovery, else the running resize, or None."""
        with self._lock:
            return self._running_locked()

    def _running_locked(self) -> records.ResizeRecord | None:
        if self._recovery is not None:
            return self._recovery
        cur = self._current
        return cur if cur is not None and not cur.done else None

    @property
    def recovering(self) -> bool:
        with self._lock:
            return self._recovery is not None

    @property
    def is_scaling(self) -> bool:
        return self.current is not None

    def last(self) -> records.ResizeRecord | None:
        with self._lock:
            if self._recovery is not None:
                return self._recovery
            if self._current is not None:
                return self._current
            return self._history[-1] if self._history else None

    def history(self) -> list[records.ResizeRecord]:
        with self._lock:
            return list(self._history)

    def get(self, resize_id: str) -> records.ResizeRecord | None:
        with self._lock:
            if self._current is not None and self._current.resize_id == resize_id:
                return self._current
            return next((r for r in self._history if r.resize_id == resize_id), None)

    def on_change(self, listener: Callable[[records.ResizeRecord], None]) -> None:
        """Call `listener(record)` whenever a resize enters a stage (metrics, logs)."""
        self._listeners.append(listener)

    # -- commands ------------------------------------------------------------------------
    def set_limits(self, limits: Limits) -> None:
        """Sizes later requests are checked against (a running resize keeps its size)."""
        with self._lock:
            self.limits = limits

    def inject_failure(self, stage: stages.Stage) -> None:
        """Test hook: the next resize that reaches `stage` fails there (after its work ran)."""
        with self._lock:
            self._fail_stage = stage

    def request(
        self,
        new_size: int,
        *,
        trigger: str = records.TRIGGER_API,
        drain_timeout: float | None = None,
    ) -> records.ResizeRecord:
        """Start a resize to `new_size` ranks, or return the running one with the same target.

        drain_timeout: seconds a shrink lets sequences on departing ranks finish (default
        `self.drain_timeout`); the running resize keeps its own.

        Raises InvalidResize (400) for a size the deployment cannot take and ResizeConflict
        (409) when another target is being resized to (or a recovery runs toward another).
        """
        if not isinstance(new_size, int) or isinstance(new_size, bool):
            raise InvalidResize(f"new_data_parallel_size must be an integer, got {new_size!r}")
        with self._lock:
            running = self._running_locked()
            if running is not None:
                if running.to_size == new_size:
                    return running
                raise ResizeConflict(
                    f"a {running.kind} {running.from_size}->{running.to_size} "
                    f"({running.resize_id}) is in stage {running.stage.value}; retry when it ends"
                )
            self.limits.check(new_size)
            from_size = self._ops.current_size()
            record = records.ResizeRecord(
                resize_id=uuid.uuid4().hex[:12],
                from_size=from_size,
                to_size=new_size,
                trigger=trigger,
                drain_timeout_s=self.drain_timeout if drain_timeout is None else drain_timeout,
            )
            if from_size == new_size:
                record.message = f"already serving at data parallel size {new_size}"
                record.enter(stages.Stage.COMPLETED)
                self._history.append(record)
                return record
            # Ops may shorten the stages (`EngineResizeOps.stages_for`: warm spares, no Standby).
            order = getattr(self._ops, "stages_for", stages.stages_for)(from_size, new_size)
            record.enter(order[0])
            self._current = record
            self._thread = threading.Thread(
                target=self._run,
                args=(record, order),
                name=f"resize-{record.resize_id}",
                daemon=True,
            )
            self._thread.start()
            return record

    def begin_recovery(
        self, *, from_size: int, to_size: int, info: records.RecoveryInfo
    ) -> records.ResizeRecord:
        """Record a recovery that starts now (stage Recovering); end it with `end_recovery`."""
        record = records.ResizeRecord(
            resize_id=uuid.uuid4().hex[:12],
            from_size=from_size,
            to_size=to_size,
            kind=records.KIND_RECOVERY,
            trigger=records.TRIGGER_RANK_LOST,
            recovery=info,
        )
        record.enter(stages.Stage.RECOVERING)
        with self._lock:
            self._recovery = record
        self._notify(record)
        return record

    def end_recovery(self, record: records.ResizeRecord, *, error: str | None = None) -> None:
        """The recovery is over: Completed, or Failed with `error`; it joins the history."""
        if error is None:
            record.message = record.message or f"serving at data parallel size {record.to_size}"
            record.enter(stages.Stage.COMPLETED)
        else:
            record.message = f"Recovering failed: {error}"
            record.enter(stages.Stage.FAILED)
        with self._lock:
            if self._recovery is record:
                self._recovery = None
            self._history.append(record)
        self._notify(record)

    def wait(self, record: records.ResizeRecord, timeout: float | None = None) -> bool:
        """Block until `record` is done (or `timeout` seconds); True when it is done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not record.done:
            thread = self._thread
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            if thread is not None and thread.is_alive():
                thread.join(timeout=0.05 if remaining is None else min(0.05, remaining))
            elif not record.done:
                time.sleep(0.01)  # the thread is finishing its record update
        return True

    # -- the resize thread -----------------------------------------------------------------
    def _notify(self, record: records.ResizeRecord) -> None:
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # noqa: BLE001 - a listener must not break a resize
                log.exception("resize listener failed (resize %s)", record.resize_id)

    def _run(self, record: records.ResizeRecord, order: tuple[stages.Stage, ...]) -> None:
        log.info(
            "resize %s: %d -> %d ranks, stages %s",
            record.resize_id,
            record.from_size,
            record.to_size,
            [s.value for s in order],
        )
        self.tracker.start()
        stage = order[0]
        plan: Any = None
        begun = False
        try:
            plan = self._ops.begin(record)
            begun = True
            for stage in order:
                if stage is stages.Stage.COMPLETED:
                    break
                if record.stage is not stage:
                    record.enter(stage)
                self._notify(record)
                log.info("resize %s: stage %s", record.resize_id, stage.value)
                self._ops.run_stage(stage, plan, record)
                with self._lock:
                    fail = self._fail_stage is stage
                    if fail:
                        self._fail_stage = None
                if fail:
                    raise InjectedFailure(f"injected failure in stage {stage.value}")
        except Exception as exc:  # noqa: BLE001 - every failure ends the resize in Failed
            log.exception("resize %s failed in stage %s", record.resize_id, stage.value)
            where = ""
            try:
                where = self._ops.rollback(plan, record, stage)
            except Exception as rb_exc:  # noqa: BLE001 - report both failures
                log.exception("resize %s: rollback failed", record.resize_id)
                where = f"rollback failed: {rb_exc}"
            record.message = f"{stage.value} failed: {exc}" + (f"; {where}" if where else "")
            record.blackout_s = self.tracker.stop(self._busy())
            record.enter(stages.Stage.FAILED)
        else:
            record.blackout_s = self.tracker.stop(self._busy())
            record.message = record.message or f"Scaled to {record.to_size} data parallel engines"
            record.enter(stages.Stage.COMPLETED)
            log.info(
                "resize %s completed in %.2fs (blackout %.3fs): %s",
                record.resize_id,
                record.duration_s or 0.0,
                record.blackout_s,
                record.stage_durations(),
            )
        if begun:
            try:
                self._ops.end(plan)
            except Exception:  # noqa: BLE001 - the record is final already
                log.exception("resize %s: end hook failed", record.resize_id)
        with self._lock:
            self._history.append(record)
            self._current = None
        self._notify(record)
