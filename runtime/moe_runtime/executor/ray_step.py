"""The step path of `RayExecutor`: how one lockstep step reaches the rank actors, and the
handover that keeps a graph compile out of the switch pause.

A step goes either through plain actor calls (``actor.execute_step.remote``, on each actor's
default lane) or through a Ray compiled graph over the same actors (with their TP followers
or pipeline stages: `ray_mesh`; its loop runs on the actors' ``_ray_system`` lane). Both
reach the same `RankWorker.execute_step` (its stepper runs one step at a time). The engine
may send a second step before the first is collected (`submit`, then `collect`: two steps in
flight, docs/ENGINE.md); it takes the path the first one took, so each actor runs them in the
order they were sent (one default-lane thread for plain calls, one loop for a graph).

Handover (`StepPath.set`): a new step path over new actors serves at once through plain calls.
In compiled mode a background job then tears down the graphs that were retired (two compiled
graphs must never be live on the same actors: their loops would queue behind each other on
``_ray_system``, docs/INTERNALS.md), compiles the graph over the new actors, executes it once with a
probe step that the actors answer without touching their worker (`ray_graph.build`: the first
execution of a fresh graph is slow), and installs it: the next step takes it. A job whose
step path was replaced meanwhile (`gen` changed) tears its graph down instead. So a switch
pauses serving only for the workers' `activate`, never for a compile (measured here: ~0.2 s
over actors that were in a graph before, ~2.5 s over fresh ones).

Parking (`park_after`): Ray 2.60's compiled-graph actors busy-wait for their next input (the
shared-memory channel's read is a ``sched_yield`` loop, no setting makes it block: 0.9 of a
core per serving rank), so a thread of the step path parks the graph once no step has run for
`park_after` s: it sends a hold through it (`HOLD_STEP_ID`), which each actor's graph loop
(a TP follower's too, `ray_mesh`) answers by waiting on an event, idle, its output unread
(measured: no process above 0.03 of a core). The next step releases the hold (one call per
actor on its health lane, `release_hold`), reads the hold's output and goes through the same
graph: ~3 ms, no compile. Where a hold cannot be sent or released the graph is torn down and
compiled again (plain calls serving meanwhile). A graph retired while held (a switch,
`clear`, `close`) is released before its teardown, which could not otherwise stop the
waiting loop. A busy server never parks. The collecting thread sleeps through most of each
step before it reads the output, which spins too (`step_wait`).

Failures: a compile or a probe that fails leaves the plain-call path serving (no request
notices) and is tried again `RETRY_SECONDS` later, at the next step. A graph whose compile
ended after the step path moved on (a switch or a removal: an actor of it may be gone) is
torn down unprobed, and so is one that Ray left half-live (`ray_graph.broken`); the probe
waits at most `PROBE_TIMEOUT_SECONDS`. A compile that hangs holds the job (plain calls keep
serving); it runs in the job's thread, never beside another compile. `clear()` leaves no step
path (a rank was lost); its graph is torn down by the next job, or by `close()`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from moe_runtime import step as step_mod
from moe_runtime.executor import guards, ray_calls, ray_graph, ray_mesh, step_wait

log = logging.getLogger(__name__)

#: Seconds after a failed background compile before the next compile.
RETRY_SECONDS = 5.0
#: Seconds without a step after which a live graph is parked (held; module docstring):
#: default of `StepPath`'s park_after, env MOE_STEP_GRAPH_PARK_SECONDS (0: never park).
PARK_AFTER_SECONDS = 2.0
PARK_ENV = "MOE_STEP_GRAPH_PARK_SECONDS"
#: Seconds the probe step of a new graph may take (measured: 0.01-0.55 s, the first execution
#: over fresh actors on a loaded machine); past it the graph is dropped and compiled again
#: `RETRY_SECONDS` later. `StepPath`'s probe_timeout, never above its compile_timeout.
PROBE_TIMEOUT_SECONDS = 10.0
#: Seconds a step waits for plain calls in flight to land before a new graph carries it.
HANDOVER_WAIT_SECONDS = 5.0


def park_after_from_env() -> float:
    """`PARK_AFTER_SECONDS`, or the env's MOE_STEP_GRAPH_PARK_SECONDS (0: never park)."""
    return guards.float_from_env(
        PARK_ENV, PARK_AFTER_SECONDS, valid=lambda v: v >= 0, wanted="a number of seconds >= 0"
    )


class StepPath:
    """Plain calls or a compiled graph over the stepped actors (see the module docstring).

    compiled: whether graphs are built at all ("compiled" step mode). compile_timeout bounds
    the probe step of a new graph, and probe_timeout (`PROBE_TIMEOUT_SECONDS`) bounds it
    further. park_after: seconds without a step before a live graph is parked (held in a
    wait) until the next step; 0 never parks. wait: how long `collect` sleeps before it reads
    a graph's output (`step_wait`; default from the env). transport: how a graph's pipeline
    lanes carry tensors (`ray_mesh.stage_transport`). split: plain calls in two parts
    (`ray_calls.step_calls`; `--pipeline-interleave`).
    """

    def __init__(
        self,
        *,
        compiled: bool,
        compile_timeout: float,
        park_after: float = PARK_AFTER_SECONDS,
        wait: step_wait.StepWait | None = None,
        probe_timeout: float = PROBE_TIMEOUT_SECONDS,
        transport: str = "pickle",
        split: bool = False,
    ) -> None:
        self.compiled, self.transport, self.split = compiled, transport, split
        self.compile_timeout = compile_timeout
        self.probe_timeout = min(compile_timeout, probe_timeout)
        self.park_after = park_after
        self.wait = wait or step_wait.StepWait(step_wait.fraction_from_env())
        self._lock = threading.Lock()
        #: Wakes the parking thread: a graph was installed, or the path closed.
        self._wake = threading.Condition(self._lock)
        #: One compile or teardown at a time: the graphs of two jobs never overlap.
        self._compile_lock = threading.Lock()
        #: the ranks stepped (None: no step path), their TP followers in the graph included
        self._stepped: ray_mesh.Stepped | None = None
        self._graph: Any = None
        self._retired: list[Any] = []
        self._gen = 0
        self._jobs: list[threading.Thread] = []
        self._retry_at: float | None = None
        self._closed = False
        #: Steps running now; the monotonic time the last one ended (or a graph was installed).
        self._in_flight = 0
        self._answered: dict[int, float] = {}  # interleaved graph steps (`ray_mesh.merged`)
        #: The graph the steps in flight were sent through (None: plain calls).
        self._flying_graph: Any = None
        self._last_step = time.monotonic()
        #: The graph was parked for idleness: held (`_held`), or torn down where a hold failed
        #: (the next step then starts its recompile).
        self._parked = False
        #: The parked graph's hold in flight: (graph, its output, its actors).
        self._held: ray_graph.Held | None = None
        #: A step is releasing the hold (`_resume_held`): no new hold meanwhile.
        self._releasing = False
        #: Holds of graphs retired while held, by id(graph): released before their teardown.
        self._retired_holds: dict[int, ray_graph.Held] = {}
        #: How often the graph was parked and how often a step resumed it (benchmarks, tests).
        self.parks = 0
        self.resumes = 0
        self._parker: threading.Thread | None = None
        #: Seconds of the last background compile (teardown, compile, probe), for the logs
        #: and benchmarks; "error" when it failed.
        self.last_compile: dict[str, Any] = {}

    # -- what serves -----------------------------------------------------------------------
    @property
    def ranks(self) -> list[int] | None:
        """Labels stepped now (in step order), None when there is no step path."""
        with self._lock:
            return None if self._stepped is None else list(self._stepped.ranks)

    def graph_live(self) -> bool:
        """A compiled graph carries the steps now (else plain calls do)."""
        return self.graph_nodes() > 0

    def graph_nodes(self) -> int:
        """Actors with a node in the live graph (its TP followers too), 0: plain calls."""
        with self._lock:
            if self._graph is None or self._stepped is None:
                return 0
            return len(self._stepped.graph_actors())

    def parked(self) -> bool:
        """The graph was torn down because no step ran for `park_after` s."""
        with self._lock:
            return self._parked

    def set(
        self,
        ranks: Sequence[int],
        actors: Sequence[Any],
        followers: Sequence[Sequence[Any]] = (),
        stages: Sequence[Sequence[Any]] = (),
    ) -> None:
        """Step `actors` (labels `ranks`) from the next step on, through plain calls at once;
        in compiled mode a graph over them (and `followers[i]`, the TP followers of
        `actors[i]`, or `stages[i]`, its pipeline stages: nodes of the graph, `ray_mesh`) is
        compiled in the background and takes over."""
        with self._lock:
            self._retire_locked()
            self._stepped = ray_mesh.Stepped.of(ranks, actors, followers, stages)
            self._gen += 1
            gen = self._gen
            self._retry_at = None
            self._parked = False
        if self.compiled:
            self._start_job(gen)

    def clear(self) -> None:
        """No step path (until the next `set`); the graph is retired."""
        with self._lock:
            self._retire_locked()
            self._stepped = None
            self._gen += 1
            self._parked = False

    def _retire_locked(self) -> None:
        if self._graph is not None:
            self._retired.append(self._graph)
            if self._held is not None and self._held.graph is self._graph:
                self._retired_holds[id(self._graph)] = self._held
            self._held = None
            self._graph = None

    # -- one step --------------------------------------------------------------------------
    def execute(self, step: step_mod.StepInput, *, timeout: float) -> list[step_mod.StepOutput]:
        """Run `step` on every stepped actor within `timeout` s; raises what the call raised."""
        return self.collect(self.submit(step), timeout=timeout)

    def submit(self, step: step_mod.StepInput) -> Submitted:
        """Send `step` to every stepped actor and return at once (`collect` waits for it).

        A step sent while another is in flight takes the same path as that one (the actors
        run them in the order they were sent: plain calls on their default lane, a graph's
        executions in turn). A graph installed while plain calls are in flight takes over
        once they landed: this waits for them (at most `HANDOVER_WAIT_SECONDS`, then plain
        calls again): with two steps in flight under steady load none would otherwise ever
        find the path empty. A parked graph's hold is released first (module docstring)."""
        self._resume_held()
        with self._lock:
            if self._graph is not None and self._in_flight and self._flying_graph is None:
                self._wake.wait_for(
                    lambda: not self._in_flight or self._graph is None or self._closed,
                    timeout=HANDOVER_WAIT_SECONDS,
                )
            stepped, gen = self._stepped, self._gen
            graph = self._graph
            if self._in_flight and self._flying_graph is not graph:
                graph = None  # plain calls in flight (or a retired graph's step): plain calls
            retry = (
                self.compiled
                and graph is None
                and self._graph is None
                and self._retry_at is not None
                and time.monotonic() >= self._retry_at
            )
            if retry:
                self._retry_at = None
            resume = self._parked and stepped is not None
            if resume:
                self._parked = False
                self.resumes += 1
            if stepped is not None:
                self._in_flight += 1
                self._flying_graph = graph
        if stepped is None:
            raise RuntimeError("no step path")
        ranks = list(stepped.ranks)
        if retry or resume:
            self._start_job(gen)
        try:
            if graph is not None:
                sent_at = time.monotonic()
                ref = graph.execute(step)
                return Submitted(step, ranks, gen, graph_ref=ref, sent_at=sent_at, stepped=stepped)
            refs = ray_calls.step_calls(stepped.actors, step, split=self.split)
        except BaseException:
            self._landed()
            raise
        return Submitted(step, ranks, gen, refs=refs)

    def collect(self, sent: Submitted, *, timeout: float) -> list[step_mod.StepOutput]:
        """The outputs of a step `submit` sent, within `timeout` s; raises what the call
        raised. A graph's output is read after a sleep through most of the step
        (`step_wait`: the read spins)."""
        try:
            if sent.graph_ref is not None:
                tokens = sent.step.most_tokens()
                slept = self.wait.wait(tokens, sent.sent_at)
                raw = ray.get(sent.graph_ref, timeout=max(0.0, timeout - slept))
                answered = self._answered if self.split else None
                outs = ray_mesh.outputs(raw, sent.ranks, sent.stepped, sent.step.step_id, answered)
                self.wait.landed(tokens, max((o.seconds for o in outs), default=0.0))
                return outs
            plain: list[step_mod.StepOutput] = ray_calls.get_all(
                sent.refs, sent.ranks, what="execute_step", timeout=timeout
            )
            return plain
        finally:
            self._landed()

    def _resume_held(self) -> None:
        """Release the parked graph's hold (if any) so that this step takes the graph; a hold
        that cannot be released retires the graph: the step goes through plain calls and
        resumes the old way (`submit`: a compile job)."""
        with self._lock:
            held, self._held = self._held, None
            self._releasing = held is not None  # the parker holds off meanwhile
        if held is None:
            return
        released = ray_graph.release(held)
        with self._lock:
            self._releasing = False
            self._last_step = time.monotonic()  # a whole park_after before the next park
            if released:
                self._parked = False
                self.resumes += 1
            elif self._graph is held.graph:
                self._retired.append(self._graph)  # torn down by the compile job
                self._graph = None

    def current(self, gen: int) -> bool:
        """The step path is still the one of generation `gen` (no `set` or `clear` since)."""
        with self._lock:
            return gen == self._gen

    def _landed(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._last_step = time.monotonic()
            if not self._in_flight:
                self._flying_graph = None
                self._wake.notify_all()  # a graph waiting to take over (`submit`)

    # -- parking ---------------------------------------------------------------------------
    def _park_wait_locked(self) -> float | None:
        """Seconds until the live graph is due to be parked (<= 0: now); None: nothing to
        park (no graph, or never parking)."""
        if self._graph is None or self._closed or self.park_after <= 0:
            return None
        if self._held is not None or self._releasing:
            return None
        if self._in_flight:
            return self.park_after
        return self._last_step + self.park_after - time.monotonic()

    def _run_parker(self) -> None:
        """The parking thread: holds the graph once no step has run for `park_after` s (tears
        it down where the hold cannot be sent). Under load it wakes about once per
        `park_after` s and finds a recent step."""
        while True:
            with self._lock:
                if self._closed:
                    return
                wait = self._park_wait_locked()
                if wait is None or wait > 0:
                    self._wake.wait(wait)  # re-checked on wake-up
                    continue
                graph = self._graph
                self._parked = True
                self.parks += 1
                try:
                    # under the lock: no step is sent behind the hold before it is recorded
                    assert self._stepped is not None  # a graph is only ever over a step path
                    self._held = ray_graph.hold(graph, self._stepped.graph_actors())
                except Exception:  # noqa: BLE001 - parked the old way instead
                    log.exception("holding the idle step graph failed; tearing it down")
                    self._retire_locked()
                    gen = self._gen
                else:
                    log.info("no step for %.1fs: parking the step graph (held)", self.park_after)
                    continue
            self._start_job(gen, compile=False)

    def _start_parker_locked(self) -> None:
        if self.park_after > 0 and self._parker is None and not self._closed:
            self._parker = threading.Thread(
                target=self._run_parker, name="step-graph-parker", daemon=True
            )
            self._parker.start()

    # -- the background job ---------------------------------------------------------------
    def _start_job(self, gen: int, *, compile: bool = True) -> None:
        """A background job: tear the retired graphs down, then (compile) compile, probe and
        install the graph over the stepped actors."""
        job = threading.Thread(
            target=self._run_job, args=(gen, compile), name="step-graph", daemon=True
        )
        with self._lock:
            if self._closed:
                return
            self._jobs = [j for j in self._jobs if j.is_alive()] + [job]
            # started under the lock: `wait_idle` (or the next `_start_job`) never sees a job
            # that is listed but not started (join raises on it; is_alive is False)
            job.start()

    def _current(self, gen: int) -> bool:
        with self._lock:
            return gen == self._gen and not self._closed

    def _run_job(self, gen: int, compile: bool) -> None:
        with self._compile_lock:
            started = time.monotonic()
            self._teardown_retired()
            torn = time.monotonic()
            with self._lock:
                stepped = self._stepped
            if not compile or stepped is None or not self._current(gen):
                return
            built = ray_graph.build(
                stepped.actors,
                probe_timeout=self.probe_timeout,
                current=lambda: self._current(gen),
                retry_in=RETRY_SECONDS,
                followers=stepped.followers,
                stages=stepped.stages,
                transport=self.transport,
                interleave=self.split,
            )
            if built.failed:
                self.last_compile = built.figures
                self._retry_later(gen)
            if built.dropped is not None:
                self._teardown(built.dropped)
            if built.graph is None:
                return
            with self._lock:
                installed = gen == self._gen and not self._closed
                if installed:
                    self._graph = built.graph
                    self._last_step = max(self._last_step, time.monotonic())
                    self._start_parker_locked()
                    self._wake.notify_all()
            if not installed:
                self._teardown(built.graph)  # the step path changed meanwhile
                return
            self.last_compile = {"teardown_s": torn - started, **built.figures}
            log.info(
                "step graph over %d ranks took over from plain calls: teardown %.3fs, "
                "compile %.3fs, probe %.3fs (%d nodes hand tensors on by Ray's tensor transport)",
                len(stepped.actors),
                torn - started,
                *(built.figures[k] for k in ("compile_s", "probe_s", "tensor_nodes")),
            )

    def _retry_later(self, gen: int) -> None:
        """The next step `RETRY_SECONDS` from now starts another compile (if still `gen`)."""
        with self._lock:
            if gen == self._gen:
                self._retry_at = time.monotonic() + RETRY_SECONDS

    def _teardown_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        for graph in retired:
            self._teardown(graph)

    def _teardown(self, graph: Any) -> None:
        with self._lock:
            held = self._retired_holds.pop(id(graph), None)
        if held is not None:
            ray_graph.release(held)  # the held loops would never see the teardown
        try:
            graph.teardown()
        except Exception:  # noqa: BLE001 - a broken graph is dropped anyway
            log.exception("step graph teardown failed")

    def wait_idle(self, timeout: float) -> bool:
        """Wait for the background jobs (`close`; a caller that needs the graph installed);
        True when none runs."""
        deadline = time.monotonic() + timeout
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.join(max(0.0, deadline - time.monotonic()))
        return not any(job.is_alive() for job in jobs)

    def close(self, timeout: float = 30.0) -> None:
        """No more steps: stop the job (its graph is torn down) and tear every graph down,
        within `timeout` s in all: a job still running then (a probe waiting on an actor that
        died meanwhile waits out `compile_timeout`) is left to end on its own, its graph
        with it."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            self._retire_locked()
            self._stepped = None
            self._gen += 1
            self._wake.notify_all()
            parker = self._parker
        if parker is not None:
            parker.join(timeout)
        self.wait_idle(max(0.0, deadline - time.monotonic()))
        if not self._compile_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            log.warning(
                "closing the step path with a graph job still running after %.0fs; its "
                "graph is torn down when it ends",
                timeout,
            )
            return
        try:
            self._teardown_retired()
        finally:
            self._compile_lock.release()


@dataclasses.dataclass(frozen=True)
class Submitted:
    """A step sent (`StepPath.submit`): the step, the labels stepped, the path's generation,
    and what to wait for (the graph's execution, or one plain call per actor)."""

    step: step_mod.StepInput
    ranks: list[int]
    gen: int
    graph_ref: Any = None
    refs: list[Any] = dataclasses.field(default_factory=list)
    #: Monotonic time a graph's execution was sent (`step_wait`).
    sent_at: float = 0.0
    #: What it was sent to (a graph's: its TP followers answer too, `ray_mesh.outputs`).
    stepped: ray_mesh.Stepped | None = None
