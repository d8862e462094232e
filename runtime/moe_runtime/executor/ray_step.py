"""The step path of `RayExecutor`: how one lockstep step reaches the rank actors, and the
handover that keeps a graph compile out of the switch pause.

A step goes either through plain actor calls (``actor.execute_step.remote``, on each actor's
default lane) or through a Ray compiled graph over the same actors (whose execution loop runs
on the actors' ``_ray_system`` lane, so plain calls still run while a graph is live). Both
reach the same `RankWorker.execute_step`; the engine runs one step at a time, so a worker never
runs two steps at once whichever path carries them.

Handover (`StepPath.set`): a new step path over new actors serves at once through plain calls.
In compiled mode a background job then tears down the graphs that were retired (two compiled
graphs must never be live on the same actors: their loops would queue behind each other on
``_ray_system``, docs/INTERNALS.md), compiles the graph over the new actors, executes it once with a
probe step that the actors answer without touching their worker (`PROBE_STEP_ID`: the first
execution of a fresh graph is slow), and installs it: the next step takes it. A job whose
step path was replaced meanwhile (`gen` changed) tears its graph down instead. So a switch
pauses serving only for the workers' `activate`, never for a compile (measured here: ~0.2 s
over actors that were in a graph before, ~2.5 s over fresh ones).

Failures: a compile or a probe that fails leaves the plain-call path serving (no request
notices) and is tried again `RETRY_SECONDS` later, at the next step. A compile that hangs holds
the job (plain calls keep serving); it runs in the job's thread, never beside another compile. `clear()` leaves
no step path (a rank was lost); its graph is retired and torn down by the next job, or by
`close()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from moe_runtime import step as step_mod
from moe_runtime.executor import ray_actor, ray_graph

log = logging.getLogger(__name__)

#: StepInput.step_id of the probe a fresh graph executes once before it carries real steps;
#: `ray_actor.RankActor.execute_step` answers it without calling its worker.
PROBE_STEP_ID = ray_actor.PROBE_STEP_ID
#: Seconds after a failed background compile before the next step starts another one.
RETRY_SECONDS = 5.0


class StepPath:
    """Plain calls or a compiled graph over the stepped actors (see the module docstring).

    compiled: whether graphs are built at all ("compiled" step mode). compile_timeout bounds
    the probe step of a new graph.
    """

    def __init__(self, *, compiled: bool, compile_timeout: float) -> None:
        self.compiled = compiled
        self.compile_timeout = compile_timeout
        self._lock = threading.Lock()
        #: One compile or teardown at a time: the graphs of two jobs never overlap.
        self._compile_lock = threading.Lock()
        self._ranks: list[int] | None = None
        self._actors: list[Any] = []
        self._graph: Any = None
        self._retired: list[Any] = []
        self._gen = 0
        self._jobs: list[threading.Thread] = []
        self._retry_at: float | None = None
        self._closed = False
        #: Seconds of the last background compile (teardown, compile, probe), for the logs
        #: and benchmarks; "error" when it failed.
        self.last_compile: dict[str, Any] = {}

    # -- what serves -----------------------------------------------------------------------
    @property
    def ranks(self) -> list[int] | None:
        """Labels stepped now (in step order), None when there is no step path."""
        with self._lock:
            return None if self._ranks is None else list(self._ranks)

    def graph_live(self) -> bool:
        """A compiled graph carries the steps now (else plain calls do)."""
        with self._lock:
            return self._graph is not None

    def set(self, ranks: Sequence[int], actors: Sequence[Any]) -> None:
        """Step `actors` (labels `ranks`) from the next step on, through plain calls at once;
        in compiled mode a graph over them is compiled in the background and takes over."""
        with self._lock:
            self._retire_locked()
            self._ranks, self._actors = list(ranks), list(actors)
            self._gen += 1
            gen = self._gen
            self._retry_at = None
        if self.compiled:
            self._start_job(gen)

    def clear(self) -> None:
        """No step path (until the next `set`); the graph is retired."""
        with self._lock:
            self._retire_locked()
            self._ranks, self._actors = None, []
            self._gen += 1

    def _retire_locked(self) -> None:
        if self._graph is not None:
            self._retired.append(self._graph)
            self._graph = None

    # -- one step --------------------------------------------------------------------------
    def execute(self, step: step_mod.StepInput, *, timeout: float) -> list[step_mod.StepOutput]:
        """Run `step` on every stepped actor within `timeout` s; raises what the call raised."""
        with self._lock:
            ranks, actors, graph, gen = self._ranks, list(self._actors), self._graph, self._gen
            retry = (
                self.compiled
                and graph is None
                and self._retry_at is not None
                and time.monotonic() >= self._retry_at
            )
            if retry:
                self._retry_at = None
        if ranks is None:
            raise RuntimeError("no step path")
        if retry:
            self._start_job(gen)
        if graph is not None:
            return list(ray.get(graph.execute(step), timeout=timeout))
        refs = [a.execute_step.remote(step) for a in actors]
        outs: list[step_mod.StepOutput] = ray_actor.get_all(
            refs, list(ranks), what="execute_step", timeout=timeout
        )
        return outs

    # -- the background job ---------------------------------------------------------------
    def _start_job(self, gen: int) -> None:
        job = threading.Thread(target=self._run_job, args=(gen,), name="step-graph", daemon=True)
        with self._lock:
            if self._closed:
                return
            self._jobs = [j for j in self._jobs if j.is_alive()] + [job]
        job.start()

    def _current(self, gen: int) -> bool:
        with self._lock:
            return gen == self._gen and not self._closed

    def _run_job(self, gen: int) -> None:
        with self._compile_lock:
            started = time.monotonic()
            self._teardown_retired()
            torn = time.monotonic()
            with self._lock:
                actors = list(self._actors)
            if not self._current(gen):
                return
            try:
                graph = ray_graph.compile_graph(actors)
            except Exception as exc:  # noqa: BLE001 - plain calls keep serving; retried later
                log.exception(
                    "compiling the step graph over %d ranks failed; steps stay on plain actor "
                    "calls and the compile is tried again in %.0fs",
                    len(actors),
                    RETRY_SECONDS,
                )
                self.last_compile = {"error": f"{type(exc).__name__}: {exc}"}
                with self._lock:
                    if gen == self._gen:
                        self._retry_at = time.monotonic() + RETRY_SECONDS
                return
            compiled = time.monotonic()
            try:
                # The first execution of a fresh graph is slow: pay it before real steps.
                ray.get(graph.execute(_probe()), timeout=self.compile_timeout)
            except Exception:  # noqa: BLE001 - dropped below; plain calls keep serving
                log.exception("the probe step of a new step graph failed; dropping the graph")
                self._teardown(graph)
                with self._lock:
                    if gen == self._gen:
                        self._retry_at = time.monotonic() + RETRY_SECONDS
                return
            with self._lock:
                installed = gen == self._gen and not self._closed
                if installed:
                    self._graph = graph
            if not installed:
                self._teardown(graph)  # the step path changed meanwhile
                return
            done = time.monotonic()
            self.last_compile = {
                "teardown_s": torn - started,
                "compile_s": compiled - torn,
                "probe_s": done - compiled,
            }
            log.info(
                "step graph over %d ranks took over from plain calls: teardown %.3fs, "
                "compile %.3fs, probe %.3fs",
                len(actors),
                torn - started,
                compiled - torn,
                done - compiled,
            )

    def _teardown_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        for graph in retired:
            self._teardown(graph)

    @staticmethod
    def _teardown(graph: Any) -> None:
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
        """No more steps: stop the job (its graph is torn down) and tear every graph down."""
        with self._lock:
            self._closed = True
            self._retire_locked()
            self._ranks, self._actors = None, []
            self._gen += 1
        self.wait_idle(timeout)
        with self._compile_lock:
            self._teardown_retired()


def _probe() -> step_mod.StepInput:
    return step_mod.StepInput(step_id=PROBE_STEP_ID, batches={})
