"""The engine's boundary operations: what a resize or a recovery changes between two steps.

`Engine` inherits `BoundaryOps`. Every operation is queued to the next step boundary and runs
on the engine thread (`Engine.call_at_boundary`), so no step runs meanwhile and requests that
arrive wait in the queue. The `run_*` variants wait with a deadline and cancel what has not
started by then, so nothing queued by a failed operation runs after its rollback.

Rank bookkeeping lives here too: the active ranks (stepped), the draining ones (no new
sequence), the least loaded rank for a new sequence, and the moves of sequences between ranks
(migration: re-prefill on another rank with prompt + generated tokens; relabel after an
executor switch renumbers its workers).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from moe_runtime import step as step_types

log = logging.getLogger("moe_runtime.engine.core")

T = TypeVar("T")
ControlFuture = concurrent.futures.Future[list[step_types.StepOutput]]


class BoundaryOps:
    """Boundary operations and rank bookkeeping of `Engine` (see the module docstring)."""

    # Provided by Engine.
    _cond: threading.Condition
    _thread: threading.Thread | None
    _controls: list[tuple[dict[str, Any], ControlFuture]]
    _active: list[int]
    _draining: set[int]
    _running: dict[str, Any]
    _pending_free: dict[int, list[str]]
    config: Any

    def call_at_boundary(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        raise NotImplementedError

    def _notify_locked(self) -> None:
        raise NotImplementedError

    def stats(self) -> Any:
        raise NotImplementedError

    def set_active_ranks(self, ranks: Iterable[int]) -> concurrent.futures.Future[None]:
        """At the next boundary: step exactly these ranks; clears the draining marks.

        Sequences on ranks that leave are migrated first (see `migrate_from`), so none is lost.
        Leaving ranks get no more StepInput, so KV frees still owed to them are dropped: call
        `migrate_from` one boundary earlier (while they still step) to have them delivered.
        """
        new = sorted(set(ranks))
        if not new:
            raise ValueError("at least one active rank is needed")
        return self.call_at_boundary(lambda: self._set_active_now(new))

    def migrate_from(self, ranks: Iterable[int]) -> concurrent.futures.Future[list[str]]:
        """At the next boundary: move the sequences of `ranks` to other active ranks.

        The ranks are marked draining (no new sequence goes there). Each moved sequence is
        re-prefilled on its new rank with prompt + tokens generated so far, and keeps its
        num_generated, so seeded sampling continues identically; its KV on the old rank is
        freed in the next step. The future gives the ids of the moved sequences.
        """
        leaving = set(ranks)
        return self.call_at_boundary(lambda: self._migrate_now(leaving))

    def drain(self, ranks: Iterable[int]) -> concurrent.futures.Future[list[str]]:
        """At the next boundary: `ranks` take no new sequence; theirs run on there to the end
        (a shrink's drain, before `migrate_from` moves what is left). The future gives the ids
        of the sequences on those ranks then."""
        leaving = set(ranks)

        def mark() -> list[str]:
            self._draining |= leaving & set(self._active)
            return [s.seq_id for s in self._running.values() if s.rank in leaving]

        return self.call_at_boundary(mark)

    def relabel_ranks(self, mapping: dict[int, int]) -> concurrent.futures.Future[None]:
        """At the next boundary: rank `old` is now called `mapping[old]` (after an executor
        switch renumbers its workers 0..n-1); sequences, KV frees and marks follow their worker.
        Ranks the engine knows and the mapping omits keep their label; two ranks sent to one
        label are refused (ValueError through the future) and nothing changes.
        """
        return self.call_at_boundary(lambda: self._relabel_now(dict(mapping)))

    def add_step_control(
        self, control: dict[str, Any]
    ) -> concurrent.futures.Future[list[step_types.StepOutput]]:
        """Merges `control` into the next step's StepInput.control (a step runs even when idle).

        The future completes with that step's outputs once every rank has applied it.
        """
        future: ControlFuture = concurrent.futures.Future()
        with self._cond:
            self._controls.append((dict(control), future))
            self._notify_locked()
        return future

    def run_at_boundary(self, fn: Callable[[], T], *, timeout: float) -> T:
        """`call_at_boundary(fn)` and wait for its result, with a deadline.

        If no boundary was reached within `timeout` s, the call is cancelled (it will never
        run) and TimeoutError is raised. A call that has started runs to its end, so `fn` must
        bound its own work (pass it the time left); its outcome is awaited at most another
        `timeout` s.
        """
        return _await(self.call_at_boundary(fn), timeout, what="boundary call")

    def run_step_control(
        self, control: dict[str, Any], *, timeout: float
    ) -> list[step_types.StepOutput]:
        """`add_step_control(control)` and wait for that step's outputs, with the same deadline
        rule as `run_at_boundary`: a control not sent within `timeout` s is withdrawn."""
        return _await(self.add_step_control(control), timeout, what="step control")

    def active_ranks(self) -> list[int]:
        """The ranks stepped now. Exact on the engine thread (boundary calls, step callbacks);
        elsewhere the last published value (`stats()`)."""
        if threading.current_thread() is self._thread:
            return list(self._active)
        return list(self.stats().active_ranks)

    def _load(self) -> dict[int, int]:
        load = dict.fromkeys(self._active, 0)
        for seq in self._running.values():
            load[seq.rank] = load.get(seq.rank, 0) + 1
        return load

    def _least_loaded(self, exclude: set[int] | None = None) -> int | None:
        load = self._load()
        candidates = [
            (load[r], r)
            for r in self._active
            if r not in self._draining
            and (exclude is None or r not in exclude)
            and load[r] < self.config.max_num_seqs_per_rank
        ]
        return min(candidates)[1] if candidates else None

    def _migrate_now(self, leaving: set[int]) -> list[str]:
        self._draining |= leaving & set(self._active)
        moved: list[str] = []
        for seq in list(self._running.values()):
            if seq.rank not in leaving:
                continue
            target = self._least_loaded(exclude=leaving)
            if target is None:
                # Over capacity: the survivors take it anyway (the limit is a batching
                # preference; losing the request is worse).
                survivors = [
                    r for r in self._active if r not in leaving and r not in self._draining
                ]
                if not survivors:
                    raise RuntimeError(f"no rank left to take the sequences of ranks {leaving}")
                load = self._load()
                target = min(survivors, key=lambda r: (load[r], r))
            if seq.dirty:
                self._pending_free.setdefault(seq.rank, []).append(seq.seq_id)
            log.info(
                "engine: migrating %s from rank %d to rank %d (%d tokens to re-prefill)",
                seq.seq_id,
                seq.rank,
                target,
                len(seq.tokens),
            )
            seq.rank = target
            seq.num_computed = 0
            seq.dirty = False
            moved.append(seq.seq_id)
        return moved

    def _set_active_now(self, ranks: list[int]) -> None:
        old = list(self._active)
        leaving = set(old) - set(ranks)
        # While migrating, the leaving ranks still count as active (their KV is freed in the
        # next step, which they still receive); then only `ranks` step.
        self._active = sorted(set(ranks) | leaving)
        if leaving:
            self._migrate_now(leaving)
        self._active = list(ranks)
        self._draining = set()
        # Ranks that no longer step read no StepInput: their KV goes away with them.
        dropped = {r: ids for r, ids in self._pending_free.items() if r not in ranks and ids}
        self._pending_free = {r: ids for r, ids in self._pending_free.items() if r in ranks}
        if dropped:
            log.info("engine: KV frees for leaving ranks dropped: %s", dropped)
        log.info("engine: active ranks %s -> %s", old, self._active)

    def _relabel_now(self, mapping: dict[int, int]) -> None:
        def new(rank: int) -> int:
            return mapping.get(rank, rank)

        known = set(self._active) | self._draining | set(self._pending_free)
        known |= {seq.rank for seq in self._running.values()}
        if len({new(r) for r in known}) != len(known):
            raise ValueError(
                f"relabel mapping {mapping} sends two of ranks {sorted(known)} to one label"
            )

        self._active = sorted(new(r) for r in self._active)
        self._draining = {new(r) for r in self._draining}
        for seq in self._running.values():
            seq.rank = new(seq.rank)
        self._pending_free = {new(r): ids for r, ids in self._pending_free.items()}
        log.info("engine: ranks relabelled %s; active ranks %s", mapping, self._active)


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


def run_into(fn: Callable[[], T], future: concurrent.futures.Future[T]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except Exception as exc:  # handed to the caller through the future
        log.warning("engine: boundary call %r failed", fn, exc_info=True)
        future.set_exception(exc)
    else:
        future.set_result(result)
