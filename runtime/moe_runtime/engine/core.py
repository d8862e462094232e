"""The engine: request queue, continuous batching and the lockstep step loop over DP ranks.

Glossary
- request: what a caller asked for (`request.Request`); sequence: its running state here.
- rank: a DP rank of the executor. Each sequence lives on one rank (its KV cache is there),
  chosen as the least loaded assignable rank when the sequence is admitted.
- active ranks: the ranks that step. Every active rank gets a `RankBatch` in every step, empty
  when it has nothing to do, because expert parallelism needs every rank in the collectives.
- draining ranks: active ranks that take no new sequence (their sequences were migrated away;
  they keep stepping until `set_active_ranks` drops them).
- step boundary: the moment between two steps. All scheduler state is owned by the engine
  thread and changes only there, so resize operations (`boundary.BoundaryOps`: `migrate_from`,
  `set_active_ranks`, `add_step_control`) are queued to the next boundary. Requests that
  arrive meanwhile wait in the queue; none is refused.
- queue: `queue.RequestQueue`, requests waiting for a sequence slot; its bound
  (`max_queued_requests`) refuses arrivals with `queue.QueueFull` under overload, never while
  its `exempt()` says a resize runs.

One step: admit waiting requests (up to `max_num_seqs_per_rank` per rank), give every running
sequence the next slice of its uncomputed tokens within the per-rank token budget (decodes
first, one token each; then prefill chunks in arrival order), run `execute_step`, and append
the sampled token of each sequence whose uncomputed tokens are now all in its KV cache. A
sequence's uncomputed tokens are `tokens[num_computed:]`, which covers prefill (the prompt),
decode (the last sampled token) and re-prefill after a migration (prompt + generated so far)
with one rule.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from moe_runtime import step as step_types
from moe_runtime.engine import boundary as boundary_mod
from moe_runtime.engine import queue as queue_mod
from moe_runtime.engine import request as req
from moe_runtime.engine import text as text_mod

log = logging.getLogger(__name__)

T = TypeVar("T")
StepCallback = Callable[[list[step_types.StepOutput]], None]


class StepRunner(Protocol):
    """What the engine needs of an executor (moe_runtime.executor.Executor satisfies it)."""

    @property
    def num_ranks(self) -> int: ...

    def execute_step(self, step: step_types.StepInput) -> list[step_types.StepOutput]: ...


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (moe_runtime.model.tokenizer.Tokenizer)."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence (the model's eos ids)."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...


class StepObserver(Protocol):
    """Receives figures of every step (moe_runtime.metrics implements it)."""

    def observe_step(
        self,
        *,
        seconds: float,
        num_seqs: int,
        num_tokens: int,
        outputs: list[step_types.StepOutput],
    ) -> None: ...

    def observe_finished(
        self, *, reason: req.FinishReason, num_prompt_tokens: int, num_generated_tokens: int
    ) -> None: ...


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Limits of the engine.

    max_model_len: the model's context (max_position_embeddings); a sequence ends with
    finish_reason "length" when it is full. max_tokens_per_step: token budget of one rank in
    one step (bounds the prefill chunk, hence the step latency decodes see). max_step_retries:
    how many failed steps in a row a sequence survives (it is re-prefilled after each) before
    it fails with an error.
    """

    max_model_len: int
    max_num_seqs_per_rank: int = 64
    max_tokens_per_step: int = 2048
    max_step_retries: int = 2

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.max_num_seqs_per_rank < 1:
            raise ValueError("max_model_len and max_num_seqs_per_rank must be >= 1")
        if self.max_tokens_per_step < self.max_num_seqs_per_rank:
            raise ValueError("max_tokens_per_step must be >= max_num_seqs_per_rank")


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's progress (monotonic clock times)."""

    alive: bool
    num_waiting: int
    num_running: int
    active_ranks: tuple[int, ...]
    draining_ranks: tuple[int, ...]
    seqs_per_rank: dict[int, int]
    step_count: int
    last_step_seconds: float
    last_token_time: float | None


@dataclasses.dataclass(frozen=True)
class StepFailure:
    """A step that failed on some ranks (its sequences there will be re-prefilled).

    ranks: the ranks that failed (every stepped rank when `execute_step` raised without naming
    any); exception: what `execute_step` raised, None when ranks reported StepOutput.error.
    """

    step_id: int
    ranks: tuple[int, ...]
    message: str
    exception: BaseException | None = None


FailureCallback = Callable[[StepFailure], None]


@dataclasses.dataclass(eq=False)
class _Seq:
    handle: req.RequestHandle
    tokens: list[int]
    prompt_len: int
    text: text_mod.IncrementalText
    rank: int
    num_computed: int = 0
    dirty: bool = False  # this rank may hold KV of the sequence
    failures: int = 0

    @property
    def seq_id(self) -> str:
        return self.handle.request_id

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclasses.dataclass(frozen=True)
class _Work:
    seq: _Seq
    rank: int
    num_tokens: int


class EngineStopped(RuntimeError):
    """The engine is stopped (or its loop died): it takes no more work."""


class Engine(boundary_mod.BoundaryOps):
    """Continuous batching over the executor's DP ranks, stepped by a dedicated thread."""

    def __init__(
        self,
        executor: StepRunner,
        tokenizer: Tokenizer,
        config: EngineConfig,
        *,
        active_ranks: Iterable[int] | None = None,
        observer: StepObserver | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = config
        self._observer = observer
        self._eos = frozenset(tokenizer.stop_token_ids)
        # Shared with other threads: guarded by _cond.
        self._cond = threading.Condition()
        #: Requests waiting for a slot; the bound is `queue.max_queued` (live: set_max_queued).
        self.queue = queue_mod.RequestQueue(max_queued=max_queued_requests)
        self._aborts: set[str] = set()
        self._boundary: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._controls: list[tuple[dict[str, Any], boundary_mod.ControlFuture]] = []
        self._callbacks: list[StepCallback] = []
        self._failure_callbacks: list[FailureCallback] = []
        self._events = 0
        self._stopping = False
        self._stats = EngineStats(
            alive=False,
            num_waiting=0,
            num_running=0,
            active_ranks=(),
            draining_ranks=(),
            seqs_per_rank={},
            step_count=0,
            last_step_seconds=0.0,
            last_token_time=None,
        )
        # Owned by the engine thread.
        ranks = range(executor.num_ranks) if active_ranks is None else active_ranks
        self._active: list[int] = sorted(set(ranks))
        self._draining: set[int] = set()
        self._running: dict[str, _Seq] = {}
        self._pending_free: dict[int, list[str]] = {}
        self._step_id = 0
        self._last_step_seconds = 0.0
        self._last_token_time: float | None = None
        self._thread: threading.Thread | None = None
        self._alive = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Starts the step loop thread."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._alive = True
        self._thread = threading.Thread(target=self._run, name="moe-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stops the loop after the current step; unfinished requests end with an error."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine: step loop did not stop within %s s", timeout)

    def is_alive(self) -> bool:
        """True while the step loop runs (also while a boundary call or a resize is running)."""
        return self._alive and self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ requests

    def add_request(self, request: req.Request) -> req.RequestHandle:
        """Queues a request; returns its handle at once (never blocks on the step loop).

        Raises `queue.QueueFull` when the queue's bound is reached (never during a resize)."""
        if not request.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if len(request.prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(request.prompt_token_ids)} tokens; the context is "
                f"{self.config.max_model_len} tokens"
            )
        handle = req.RequestHandle(request)
        exempt = self.queue.exempt_now()  # before our lock: it may take a resize's lock
        with self._cond:
            if self._stopping or (self._thread is not None and not self._alive):
                raise EngineStopped("the engine is stopped")
            self.queue.put(handle, exempt=exempt)
            self._notify_locked()
        return handle

    def abort(self, request_id: str) -> None:
        """Ends a request (finish_reason "abort") at the next boundary; unknown ids are ignored."""
        with self._cond:
            self._aborts.add(request_id)
            self._notify_locked()

    # ------------------------------------------------------------------ boundary operations

    def call_at_boundary(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Runs `fn` on the engine thread between two steps; no step runs while it runs.

        Called from the engine thread itself (inside another boundary call or a step
        callback), `fn` runs at once. Requests added meanwhile wait in the queue.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if threading.current_thread() is self._thread:
            boundary_mod.run_into(fn, future)
            return future
        with self._cond:
            if self._stopping or (self._thread is not None and not self._alive):
                future.set_exception(EngineStopped("the engine is stopped"))
                return future
            self._boundary.append((fn, future))
            self._notify_locked()
        return future

    def on_step(self, callback: StepCallback) -> None:
        """Registers `callback(outputs)`, called on the engine thread after every step."""
        with self._cond:
            self._callbacks.append(callback)

    def on_step_failure(self, callback: FailureCallback) -> None:
        """Registers `callback(StepFailure)`, called on the engine thread after a failed step,
        before it is retried: a fault handler can repair the ranks there (directly, or with
        `call_at_boundary`, which runs before the retry), so the requests survive.
        """
        with self._cond:
            self._failure_callbacks.append(callback)

    def set_observer(self, observer: StepObserver | None) -> None:
        """Replaces the receiver of step and finish figures (metrics); call before start()."""
        self._observer = observer

    def stats(self) -> EngineStats:
        """Progress records: queue depth, running sequences, time of the last token, …"""
        with self._cond:
            return dataclasses.replace(
                self._stats, num_waiting=self._stats.num_waiting + self.queue.inbox_len()
            )

    @property
    def last_token_time(self) -> float | None:
        """time.monotonic() of the end of the last step that produced at least one token."""
        return self.stats().last_token_time

    # ------------------------------------------------------------------ engine thread

    def _notify_locked(self) -> None:
        self._events += 1
        self._cond.notify_all()

    def _run(self) -> None:
        log.info("engine: step loop started (active ranks %s)", self._active)
        try:
            self._loop()
        except Exception:
            log.exception("engine: step loop died at step %d", self._step_id)
        finally:
            with self._cond:
                self._alive = False
                boundary, self._boundary = self._boundary, []
                control_futures = [f for _, f in self._controls]
                self._controls = []
                queued = self.queue.clear()
            for _, future in boundary:
                future.set_exception(EngineStopped("the engine stopped"))
            for cf in control_futures:
                if cf.set_running_or_notify_cancel():
                    cf.set_exception(EngineStopped("the engine stopped"))
            for handle in queued:
                self._finish_unstarted(handle, req.FinishReason.ERROR, "the engine stopped")
            for seq in list(self._running.values()):
                self._finish(seq, req.FinishReason.ERROR, error="the engine stopped")
            self._publish_stats()
            log.info("engine: step loop stopped after %d steps", self._step_id)

    def _loop(self) -> None:
        seen = -1
        while True:
            with self._cond:
                while not self._stopping and self._events == seen and not self._must_step():
                    self._cond.wait()
                if self._stopping:
                    return
                seen = self._events
                boundary, self._boundary = self._boundary, []
                self.queue.take_inbox()
                aborts, self._aborts = self._aborts, set()
            for fn, future in boundary:
                boundary_mod.run_into(fn, future)
            self._apply_aborts(aborts)
            self._admit()
            self._publish_stats()
            with self._cond:
                if self._boundary or self._stopping:
                    continue  # more boundary work arrived while we ran fn: do it first
                if not self._must_step():
                    continue
                pending, self._controls = self._controls, []
            controls: dict[str, Any] = {}
            control_futures: list[boundary_mod.ControlFuture] = []
            for control, future in pending:
                if future.set_running_or_notify_cancel():  # False: withdrawn by its caller
                    controls.update(control)
                    control_futures.append(future)
            self._step(controls, control_futures)
            self._publish_stats()

    def _must_step(self) -> bool:
        return bool(self._running or self._controls or any(self._pending_free.values()))

    def _step(
        self,
        controls: dict[str, Any],
        control_futures: list[boundary_mod.ControlFuture],
    ) -> None:
        batches, work = self._schedule()
        self._step_id += 1
        step = step_types.StepInput(step_id=self._step_id, batches=batches, control=controls)
        started = time.monotonic()
        try:
            outputs = self.executor.execute_step(step)
        except Exception as exc:
            log.exception(
                "engine: step %d failed (ranks %s, %d sequences, control %s)",
                self._step_id,
                sorted(batches),
                len(work),
                sorted(controls),
            )
            for rank, batch in batches.items():
                if batch.free:
                    self._pending_free.setdefault(rank, []).extend(batch.free)
            for cf in control_futures:
                cf.set_exception(exc)
            message = f"{type(exc).__name__}: {exc}"
            for w in work:
                self._step_failed(w, message)
            named = tuple(getattr(exc, "ranks", None) or ())
            self._failed(
                StepFailure(
                    step_id=self._step_id,
                    ranks=named or tuple(sorted(batches)),
                    message=message,
                    exception=exc,
                )
            )
            return
        elapsed = time.monotonic() - started
        self._last_step_seconds = elapsed
        by_rank = {out.rank: out for out in outputs}
        produced, errors = self._apply_outputs(work, by_rank, batches)
        if produced:
            self._last_token_time = time.monotonic()
        for cf in control_futures:
            cf.set_result(outputs)
        if self._observer is not None:
            self._observer.observe_step(
                seconds=elapsed,
                num_seqs=len(work),
                num_tokens=sum(w.num_tokens for w in work),
                outputs=outputs,
            )
        with self._cond:
            callbacks = list(self._callbacks)
        for cb in callbacks:
            try:
                cb(outputs)
            except Exception:
                log.exception("engine: step callback %r failed at step %d", cb, self._step_id)
        if errors:
            self._failed(
                StepFailure(
                    step_id=self._step_id,
                    ranks=tuple(sorted(errors)),
                    message="; ".join(errors[r] for r in sorted(errors)),
                )
            )

    def _failed(self, failure: StepFailure) -> None:
        with self._cond:
            callbacks = list(self._failure_callbacks)
        for cb in callbacks:
            try:
                cb(failure)
            except Exception:
                log.exception(
                    "engine: step-failure callback %r failed at step %d", cb, failure.step_id
                )
        self._backoff()

    def _schedule(self) -> tuple[dict[int, step_types.RankBatch], list[_Work]]:
        batches = {rank: step_types.RankBatch() for rank in self._active}
        for rank, ids in self._pending_free.items():
            if rank in batches:
                batches[rank].free.extend(ids)
        self._pending_free = {}
        budget = {rank: self.config.max_tokens_per_step for rank in self._active}
        work: list[_Work] = []
        decodes = [s for s in self._running.values() if len(s.tokens) - s.num_computed == 1]
        prefills = [s for s in self._running.values() if len(s.tokens) - s.num_computed > 1]
        for seq in decodes + prefills:
            left = budget.get(seq.rank, 0)
            if left <= 0:
                continue
            n = min(len(seq.tokens) - seq.num_computed, left)
            budget[seq.rank] = left - n
            batches[seq.rank].seqs.append(
                step_types.SeqWork(
                    seq_id=seq.seq_id,
                    token_ids=seq.tokens[seq.num_computed : seq.num_computed + n],
                    start_pos=seq.num_computed,
                    sampling=seq.handle.request.sampling,
                    num_generated=seq.num_generated,
                )
            )
            seq.dirty = True
            work.append(_Work(seq=seq, rank=seq.rank, num_tokens=n))
        return batches, work

    def _apply_outputs(
        self,
        work: list[_Work],
        by_rank: dict[int, step_types.StepOutput],
        batches: dict[int, step_types.RankBatch],
    ) -> tuple[bool, dict[int, str]]:
        """Appends the sampled tokens; returns (any token produced, {failed rank: message})."""
        errors: dict[int, str] = {}
        for rank in batches:
            out = by_rank.get(rank)
            if out is None:
                errors[rank] = f"rank {rank} returned no output for step {self._step_id}"
            elif out.error is not None:
                errors[rank] = f"rank {rank}: {out.error}"
        for rank, message in errors.items():
            log.error("engine: step %d failed on rank %d: %s", self._step_id, rank, message)
            if batches[rank].free:
                self._pending_free.setdefault(rank, []).extend(batches[rank].free)
        produced = False
        for w in work:
            if w.rank in errors:
                self._step_failed(w, errors[w.rank])
                continue
            seq = w.seq
            seq.num_computed += w.num_tokens
            if seq.num_computed < len(seq.tokens):
                continue  # a prefill chunk: its sampled token is not used
            token = by_rank[w.rank].tokens.get(seq.seq_id)
            if token is None:
                seq.num_computed -= w.num_tokens
                self._step_failed(w, f"rank {w.rank} returned no token for {seq.seq_id}")
                continue
            seq.failures = 0
            produced = True
            self._append_token(seq, token)
        return produced, errors

    def _append_token(self, seq: _Seq, token: int) -> None:
        request = seq.handle.request
        seq.tokens.append(token)
        is_eos = not request.ignore_eos and token in self._eos
        delta = "" if is_eos else seq.text.append(token)
        reason: req.FinishReason | None = None
        if is_eos or seq.text.stopped:
            reason = req.FinishReason.STOP
        elif (
            seq.num_generated >= request.max_tokens or len(seq.tokens) >= self.config.max_model_len
        ):
            reason = req.FinishReason.LENGTH
        if reason is None:
            seq.handle.push(
                req.RequestOutput(
                    request_id=seq.seq_id,
                    new_token_ids=[token],
                    new_text=delta,
                    num_prompt_tokens=seq.prompt_len,
                    num_generated_tokens=seq.num_generated,
                )
            )
            return
        self._finish(seq, reason, new_token_ids=[token], new_text=delta)

    def _step_failed(self, w: _Work, message: str) -> None:
        seq = w.seq
        seq.failures += 1
        if seq.dirty:
            self._pending_free.setdefault(seq.rank, []).append(seq.seq_id)
        seq.num_computed = 0
        seq.dirty = False
        if seq.failures > self.config.max_step_retries:
            log.error(
                "engine: request %s failed after %d failed steps on rank %d: %s",
                seq.seq_id,
                seq.failures,
                w.rank,
                message,
            )
            self._finish(
                seq,
                req.FinishReason.ERROR,
                error=f"step failed {seq.failures} times in a row: {message}",
            )
        else:
            log.warning(
                "engine: request %s will be re-prefilled on rank %d after a failed step: %s",
                seq.seq_id,
                seq.rank,
                message,
            )

    def _backoff(self) -> None:
        delay = min(0.05 * 2 ** max(0, self._consecutive_failures()), 1.0)
        with self._cond:  # a boundary call (a repair) or a stop ends the wait early
            self._cond.wait_for(lambda: self._stopping or bool(self._boundary), delay)

    def _consecutive_failures(self) -> int:
        return max((s.failures for s in self._running.values()), default=0)

    def _finish(
        self,
        seq: _Seq,
        reason: req.FinishReason,
        *,
        new_token_ids: list[int] | None = None,
        new_text: str = "",
        error: str | None = None,
    ) -> None:
        self._running.pop(seq.seq_id, None)
        if seq.dirty:
            self._pending_free.setdefault(seq.rank, []).append(seq.seq_id)
            seq.dirty = False
        seq.handle.push(
            req.RequestOutput(
                request_id=seq.seq_id,
                new_token_ids=new_token_ids or [],
                new_text=new_text + seq.text.flush(),
                finished=True,
                finish_reason=reason,
                error=error,
                num_prompt_tokens=seq.prompt_len,
                num_generated_tokens=seq.num_generated,
            )
        )
        if self._observer is not None:
            self._observer.observe_finished(
                reason=reason,
                num_prompt_tokens=seq.prompt_len,
                num_generated_tokens=seq.num_generated,
            )

    def _finish_unstarted(
        self, handle: req.RequestHandle, reason: req.FinishReason, error: str | None
    ) -> None:
        n = len(handle.request.prompt_token_ids)
        handle.push(
            req.RequestOutput(
                request_id=handle.request_id,
                new_token_ids=[],
                new_text="",
                finished=True,
                finish_reason=reason,
                error=error,
                num_prompt_tokens=n,
            )
        )
        if self._observer is not None:
            self._observer.observe_finished(
                reason=reason, num_prompt_tokens=n, num_generated_tokens=0
            )

    def _apply_aborts(self, aborts: set[str]) -> None:
        if not aborts:
            return
        for handle in self.queue.remove(aborts):
            self._finish_unstarted(handle, req.FinishReason.ABORT, None)
        for rid in aborts:
            seq = self._running.get(rid)
            if seq is not None:
                self._finish(seq, req.FinishReason.ABORT)

    def _admit(self) -> None:
        while (handle := self.queue.head()) is not None:
            if handle.request_id in self._running:
                self.queue.pop_head(admitted=False)
                self._finish_unstarted(
                    handle, req.FinishReason.ERROR, f"duplicate request id {handle.request_id}"
                )
                continue
            rank = self._least_loaded()
            if rank is None:
                return
            self.queue.pop_head(admitted=True)
            request = handle.request
            self._running[request.request_id] = _Seq(
                handle=handle,
                tokens=list(request.prompt_token_ids),
                prompt_len=len(request.prompt_token_ids),
                text=text_mod.IncrementalText(self.tokenizer, stop=request.stop),
                rank=rank,
            )

    def _publish_stats(self) -> None:
        stats = EngineStats(
            alive=self._alive,
            num_waiting=len(self.queue),
            num_running=len(self._running),
            active_ranks=tuple(self._active),
            draining_ranks=tuple(sorted(self._draining)),
            seqs_per_rank=self._load(),
            step_count=self._step_id,
            last_step_seconds=self._last_step_seconds,
            last_token_time=self._last_token_time,
        )
        with self._cond:
            self._stats = stats
