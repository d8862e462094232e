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
  thread and changes only there, so resize operations (`migrate_from`, `set_active_ranks`,
  `add_step_control`, through the `boundary.Boundary` part) are queued to the next boundary.
  Requests that arrive meanwhile wait in the queue; none is refused.
- queue: `queue.RequestQueue`, requests waiting for a sequence slot; its bound refuses
  arrivals with `queue.QueueFull` under overload, never while a resize runs (`exempt()`).

One step: admit (per-rank sequence and KV bounds), schedule each running sequence's next
slice (`scheduler.Scheduler`), run it on the ranks, apply the outputs (`outputs.Outputs`;
`delivery.Delivery`'s thread streams them while the ranks run the next step). With async
scheduling the step runs on the step thread (`flight.StepThread`) while the engine thread
prepares the next (`prepare`) and, with overlapping steps, launches it before the one in
flight lands (`flight.Aheads`: two in flight, the ranks fill the placeholders; one per set
of interleaved step groups); whatever might make a prepared step wrong (a failure, a
boundary call, a step control, a stop) sends the loop to a boundary with no step in flight.
The `Engine` holds those parts and the boundary's (`boundary.Boundary`). docs/ENGINE.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from moe_runtime import step as step_types
from moe_runtime.engine import admission, prepare, seam
from moe_runtime.engine import boundary as boundary_mod
from moe_runtime.engine import delivery as delivery_mod
from moe_runtime.engine import flight as flight_mod
from moe_runtime.engine import listeners as listeners_mod
from moe_runtime.engine import outputs as outputs_mod
from moe_runtime.engine import queue as queue_mod
from moe_runtime.engine import request as req
from moe_runtime.engine import scheduler as scheduler_mod

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineStopped(RuntimeError):
    """The engine is stopped (or its loop died): it takes no more work."""


class Engine:
    """Continuous batching over the executor's DP ranks, stepped by a dedicated thread."""

    def __init__(
        self,
        executor: seam.StepRunner,
        tokenizer: seam.Tokenizer,
        config: seam.EngineConfig,
        *,
        active_ranks: Iterable[int] | None = None,
        observer: seam.StepObserver | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = config
        # Shared with other threads: guarded by _cond.
        self._cond = threading.Condition()
        #: Requests waiting for a slot; the bound is `queue.max_queued` (live: set_max_queued).
        self.queue = queue_mod.RequestQueue(max_queued=max_queued_requests)
        self.boundary = boundary_mod.Boundary(
            cond=self._cond,
            notify=self._notify_locked,
            # A call from the engine thread runs at once, unless a step is in flight (a step
            # callback while the next step runs): then it waits for the boundary.
            on_engine_thread=lambda: (
                threading.current_thread() is self._thread and self._flying is None
            ),
            refused=self._refused,
        )
        self._aborts: set[str] = set()
        #: Step and failure callbacks, the observer.
        self.listeners = listeners_mod.Listeners(self._cond, observer)
        self._events = 0
        self._stopping = False
        #: The Service no longer sends this process new requests (a rollout moved it to
        #: another RayCluster; ``PATCH /elastic_ep/config`` sets it): the HTTP server answers
        #: with ``Connection: close``, so kept-alive clients reconnect through the Service.
        self.draining = False
        self._stats = seam.EngineStats(alive=False)
        # Owned by the engine thread.
        self.scheduler = scheduler_mod.Scheduler(
            ranks=range(executor.num_ranks) if active_ranks is None else active_ranks,
            max_num_seqs_per_rank=config.max_num_seqs_per_rank,
            max_tokens_per_step=config.max_tokens_per_step,
            kv_tokens_per_rank=config.kv_tokens_per_rank,
            kv_block_size=config.kv_block_size,
            kv_budget=config.kv_budget,
        )
        #: Makes and streams the outputs off the step path (its own thread).
        self.delivery = delivery_mod.Delivery(threaded=config.async_outputs)
        self.outputs = outputs_mod.Outputs(
            scheduler=self.scheduler,
            delivery=self.delivery,
            stop_token_ids=tokenizer.stop_token_ids,
            max_model_len=config.max_model_len,
            max_step_retries=config.max_step_retries,
            observer=lambda: self.listeners.observer,
        )
        #: Runs the steps (async scheduling: on its own thread); the step launched, not landed.
        submit = getattr(executor, "submit_step", None) if config.overlap_steps else None
        self._steps = flight_mod.StepThread(
            lambda step: self.executor.execute_step(step),
            threaded=config.async_scheduling,
            wake=self._wake,
            submit=submit,
            collect=getattr(executor, "collect_step", None) if submit is not None else None,
        )
        if self._steps.overlaps:  # sets of sequences in turn, overlapped by the executor
            self.scheduler.step_groups = max(1, getattr(executor, "step_groups", 1))
        self._flying: flight_mod.Flight | None = None
        #: The steps launched ahead of `_flying` (`flight.Aheads`).
        self._aheads = flight_mod.Aheads(max(1, self.scheduler.step_groups - 1))
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
        self.delivery.start()
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
        req.check(
            request,
            max_model_len=self.config.max_model_len,
            kv_tokens_per_rank=self.scheduler.kv_tokens_per_rank,  # an int read: at this size
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
        """Runs `fn` on the engine thread between two steps (`boundary.Boundary.call`)."""
        return self.boundary.call(fn)

    def add_step_control(self, control: dict[str, Any]) -> boundary_mod.ControlFuture:
        """Merges `control` into the next step's StepInput.control (`boundary.Boundary.control`);
        the future gives that step's outputs."""
        return self.boundary.control(control)

    def run_at_boundary(self, fn: Callable[[], T], *, timeout: float) -> T:
        """`call_at_boundary(fn)` and its result, with a deadline (`boundary.Boundary.run`)."""
        return self.boundary.run(fn, timeout=timeout)

    def run_step_control(
        self, control: dict[str, Any], *, timeout: float
    ) -> list[step_types.StepOutput]:
        """`add_step_control(control)` and that step's outputs, with a deadline."""
        return self.boundary.run_control(control, timeout=timeout)

    def set_active_ranks(
        self, ranks: Iterable[int], *, slots: Mapping[int, int] | None = None
    ) -> concurrent.futures.Future[None]:
        """At the next boundary: step exactly these ranks (holding `slots` expert slots each:
        their KV budgets follow); clears the draining marks.

        Sequences on ranks that leave are migrated first (see `migrate_from`), so none is lost.
        Leaving ranks get no more StepInput, so KV frees still owed to them are dropped: call
        `migrate_from` one boundary earlier (while they still step) to have them delivered.
        """
        new = sorted(set(ranks))
        if not new:
            raise ValueError("at least one active rank is needed")
        return self.call_at_boundary(lambda: self.scheduler.set_active(new, slots))

    def migrate_from(self, ranks: Iterable[int]) -> concurrent.futures.Future[list[str]]:
        """At the next boundary: move the sequences of `ranks` to other active ranks (with no
        room there: ahead of the queue, until a rank has room).

        The ranks are marked draining (no new sequence goes there). Each moved sequence is
        re-prefilled on its new rank with prompt + tokens generated so far, and keeps its
        num_generated, so seeded sampling continues identically; its KV on the old rank is
        freed in the next step. The future gives the ids of the moved sequences.
        """
        leaving = set(ranks)
        return self.call_at_boundary(lambda: self.scheduler.migrate(leaving))

    def drain(self, ranks: Iterable[int]) -> concurrent.futures.Future[list[str]]:
        """At the next boundary: `ranks` take no new sequence; theirs run on there to the end
        (a shrink's drain, before `migrate_from` moves what is left). The future gives the ids
        of the sequences on those ranks then."""
        leaving = set(ranks)
        return self.call_at_boundary(lambda: self.scheduler.drain(leaving))

    def relabel_ranks(self, mapping: dict[int, int]) -> concurrent.futures.Future[None]:
        """At the next boundary: rank `old` is now called `mapping[old]` (after an executor
        switch renumbers its workers 0..n-1); sequences, KV frees and marks follow their worker.
        Ranks the engine knows and the mapping omits keep their label; two ranks sent to one
        label are refused (ValueError through the future) and nothing changes.
        """
        return self.call_at_boundary(lambda: self.scheduler.relabel(dict(mapping)))

    def active_ranks(self) -> list[int]:
        """The ranks stepped now. Exact on the engine thread (boundary calls, step callbacks);
        elsewhere the last published value (`stats()`)."""
        if threading.current_thread() is self._thread:
            return list(self.scheduler.active)
        return list(self.stats().active_ranks)

    # ------------------------------------------------------------------ callbacks and figures
    def on_step(self, callback: seam.StepCallback) -> None:
        """Registers `callback(outputs)`, called on the engine thread after every step."""
        self.listeners.on_step(callback)

    def on_step_failure(self, callback: seam.FailureCallback) -> None:
        """Registers `callback(StepFailure)`, called on the engine thread after a failed step,
        before it is retried: a fault handler can repair the ranks there (directly, or with
        `call_at_boundary`, which runs before the retry), so the requests survive.
        """
        self.listeners.on_failure(callback)

    def set_observer(self, observer: seam.StepObserver | None) -> None:
        """Replaces the receiver of step and finish figures (metrics); call before start()."""
        self.listeners.observer = observer

    def stats(self) -> seam.EngineStats:
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

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _refused(self) -> BaseException | None:
        """What a new boundary call gets instead of running (holding _cond)."""
        if self._stopping or (self._thread is not None and not self._alive):
            return EngineStopped("the engine is stopped")
        return None

    def _run(self) -> None:
        log.info("engine: step loop started (active ranks %s)", self.scheduler.active)
        try:
            self._loop()
        except Exception:
            log.exception("engine: step loop died at step %d", self._step_id)
        finally:
            flying = [f.future for f in (self._flying, *self._aheads.flights) if f is not None]
            if flying:  # the loop died with a step running: let it end
                concurrent.futures.wait(flying, timeout=30.0)
            self._steps.close()
            with self._cond:
                self._alive = False
                calls = self.boundary.take_calls()
                controls = self.boundary.take_controls()
                queued = self.queue.clear()
            boundary_mod.fail(calls, controls, EngineStopped("the engine stopped"))
            self.outputs.end_all(queued, self.scheduler.sequences(), "the engine stopped")
            self.delivery.close()  # every output pushed before stop() returns
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
                calls = self.boundary.take_calls()
                self.queue.take_inbox()
                aborts, self._aborts = self._aborts, set()
            for fn, future in calls:
                boundary_mod.run_into(fn, future)
            self.outputs.abort(aborts, self.queue)
            self._admit()
            self.delivery.send()
            self._publish_stats()
            with self._cond:
                if self.boundary.waiting() or self._stopping:
                    continue  # more boundary work arrived while we ran fn: do it first
                if not self._must_step():
                    continue
                pending = self.boundary.take_controls()
            controls: dict[str, Any] = {}
            control_futures: list[boundary_mod.ControlFuture] = []
            for control, future in pending:
                if future.set_running_or_notify_cancel():  # False: withdrawn by its caller
                    controls.update(control)
                    control_futures.append(future)
            batches, work = self.scheduler.schedule()
            flight: flight_mod.Flight | None = self._launch(
                batches, work, controls, control_futures
            )
            while flight is not None:
                self._flying = flight
                flight = self._fly(flight)
            self._flying = None
            self.delivery.send()  # the outputs of a failed step (retries exhausted)
            self._publish_stats()

    def _must_step(self) -> bool:
        return self.scheduler.must_step() or self.boundary.has_controls()

    def _launch(
        self,
        batches: dict[int, step_types.RankBatch],
        work: list[scheduler_mod.Work],
        controls: dict[str, Any],
        control_futures: list[boundary_mod.ControlFuture],
        assumed: dict[str, tuple[int, int, int]] | None = None,
    ) -> flight_mod.Flight:
        self._step_id += 1
        step = step_types.StepInput(step_id=self._step_id, batches=batches, control=controls)
        flight = self._steps.launch(step, work, control_futures)
        flight.assumed = assumed
        return flight

    def _fly(self, flight: flight_mod.Flight) -> flight_mod.Flight | None:
        """While `flight` runs: take arrivals and aborts, admit, prepare the next step (and
        launch it: `_launch_ahead`). Land `flight`; return the next step in flight (None: the
        loop goes to a boundary)."""
        prepared: prepare.Prepared | None = None
        later: set[str] = set()  # aborts: running sequences end once the step is applied
        seen = -1
        while self.config.async_scheduling:
            with self._cond:  # a stop waits for the step to end
                while self._events == seen and not flight.done():
                    self._cond.wait()
                seen = self._events
                self.queue.take_inbox()
                aborts, self._aborts = self._aborts, set()
            self.outputs.abort_queued(aborts, self.queue)
            later |= aborts
            if (self._admit() or prepared is None) and self._aheads.room():
                work = self._aheads.work(flight)  # every step in flight
                prepared = prepare.prepare_or_none(self.scheduler, work, self._step_id + 1)
                if prepared is not None and self._steps.overlaps:
                    if self._launch_ahead(prepared, flight) and self._aheads.room():
                        prepared, seen = None, -1  # the next set's step at once
            self.delivery.send()
            self._publish_stats()
            if flight.done():
                break
        aheads = list(self._aheads.flights)  # kept there until they land or are dropped
        self._flying = aheads[0] if aheads else None  # boundary calls wait for a boundary
        landed = self.outputs.land(flight)
        self.outputs.abort(later, self.queue)
        ran = self.boundary.ran_at_once
        failure = self._answer(flight, landed)  # step callbacks: at this boundary
        launched = None
        if aheads and failure is None:
            launched = self._aheads.flights.popleft()
        elif aheads:
            for ahead in self._aheads.take():
                self.outputs.drop(ahead)  # what `flight` failed, the retries re-run
            self._flying = None
        elif failure is None and prepared is not None and self.boundary.ran_at_once == ran:
            committed = None if self._held() else prepare.commit(prepared, self.scheduler)
            if committed is not None:
                launched = self._launch(*committed, {}, [])
        if landed.exception is None:
            tokens, ahead_of = [w.num_tokens for w in flight.work], flight.assumed is not None
            self.listeners.observe(tokens, landed.outputs, landed.elapsed, ahead=ahead_of)
        if failure is not None:
            self._failed(failure)  # no step in flight: the next one is scheduled afresh
        return launched

    def _launch_ahead(self, prepared: prepare.Prepared, flight: flight_mod.Flight) -> bool:
        """Launch the prepared step before `flight` lands, unless a control or boundary waits;
        whether it did."""
        if flight.step.control or self._held():
            return False
        ok = getattr(self.executor, "step_placeholders", True)  # its ranks fill placeholders
        limit = self.config.max_model_len
        return self._aheads.launch(prepared, self.scheduler, self._launch, ok, limit)

    def _held(self) -> bool:
        with self._cond:  # a stop, a boundary call or a step control waits
            return self._stopping or self.boundary.waiting() or self.boundary.has_controls()

    def _answer(
        self, flight: flight_mod.Flight, landed: flight_mod.Landed
    ) -> seam.StepFailure | None:
        """A landed step's outputs sent, its step controls answered, the step callbacks run
        (their boundary calls run at once, or next boundary with a step ahead); the failure."""
        step = flight.step
        if landed.exception is not None:
            return landed.failure(step)
        self._last_step_seconds = landed.elapsed
        self.delivery.send()  # made and streamed while the next step runs
        if landed.produced:
            self._last_token_time = time.monotonic()
        for cf in flight.control_futures:
            cf.set_result(landed.outputs)
        self.listeners.stepped(step.step_id, landed.outputs)
        return landed.failure(step)

    def _failed(self, failure: seam.StepFailure) -> None:
        """The failure callbacks (a fault handler repairs there), then a backoff."""
        self.listeners.failed(failure)
        failures = max((s.failures for s in self.scheduler.running.values()), default=0)
        delay = min(0.05 * 2 ** max(0, failures), 1.0)
        with self._cond:  # a boundary call (a repair) or a stop ends the wait early
            self._cond.wait_for(lambda: self._stopping or self.boundary.waiting(), delay)

    def _admit(self) -> bool:
        return admission.admit(
            self.scheduler,
            self.queue,
            self.outputs,
            max_model_len=self.config.max_model_len,
            tokenizer=self.tokenizer,
        )

    def _publish_stats(self) -> None:
        sched = self.scheduler
        stats = seam.EngineStats(
            alive=self._alive,
            num_waiting=len(self.queue) + len(sched.waiting),
            num_running=len(sched.running),
            active_ranks=tuple(sched.active),
            draining_ranks=tuple(sorted(sched.draining)),
            seqs_per_rank=sched.load(),
            step_count=self._step_id,
            last_step_seconds=self._last_step_seconds,
            last_token_time=self._last_token_time,
        )
        with self._cond:
            self._stats = stats
