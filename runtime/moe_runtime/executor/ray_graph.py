"""The step graph of `RayExecutor`: a Ray compiled graph ``InputNode -> [rank.execute_step]
-> MultiOutputNode`` (at T > 1 and pipeline size 1 over every TP actor of each DP rank:
``InputNode -> leader.prepare_step -> [leader.finish_step, follower.graph_step ...]``; at
P > 1 over every pipeline stage: P micro-batch lanes ``leader -> stage 1 -> ... -> stage P-1
-> leader.finish_step``, `ray_mesh`), how a new one is made fit to carry steps (`build`: compiled, checked,
probed once), its hold while parked (`hold`, `release`: `ray_step`, "Parking"), and
the warm-up that pays an actor's first compile while it is not stepped yet (`WarmUp`, a part
of the executor: warm spare ranks, a grow's new ranks).

Two compiled graphs must never be live on the same actors (docs/INTERNALS.md, "Ray 2.60 rules"): `ray_step` tears the
old graph down before it compiles a new one, and warm-ups run over unstepped actors only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import ray.dag

from moe_runtime import step as step_mod
from moe_runtime.executor import guards, ray_actor

log = logging.getLogger(__name__)

#: Seconds a release of a held graph may take (the actors' calls, then the hold's output).
RELEASE_TIMEOUT_SECONDS = 10.0
#: StepInput.step_id of the probe a fresh graph executes once before it carries real steps;
#: `ray_actor.RankActor.execute_step` answers it without calling its worker.
PROBE_STEP_ID = ray_actor.PROBE_STEP_ID


def compile_graph(
    actors: Sequence[Any],
    followers: Sequence[Sequence[Any]] = (),
    stages: Sequence[Sequence[Any]] = (),
    transport: str = "pickle",
    interleave: bool = False,
) -> Any:
    """The step graph over `actors` (and `followers[i]`, the TP followers of `actors[i]`, as
    nodes of their own: `ray_mesh`; its outputs are then the leaders', then the followers'
    in order; or `stages[i]`, the pipeline stages 1..P-1 of `actors[i]`: P micro-batch lanes,
    each ``leader -> stage 1 -> ... -> stage P-1 -> leader.finish_step``, carrying their
    tensors by `transport`: `ray_mesh.TRANSPORT_ENV`; `interleave`: the last stage's lanes
    are outputs, after the leaders', P per leader: `_pipeline`). Blocks for the
    compile (~0.2 s over actors that were in a graph before, seconds over fresh ones):
    `ray_step` calls it from its background job, which has torn down every other graph over
    these actors first."""
    with ray.dag.InputNode() as inp:
        outs: list[Any] = []
        answers: list[Any] = []
        for i, actor in enumerate(actors):
            theirs = followers[i] if followers else ()
            chain = stages[i] if stages else ()
            if chain:
                out, lanes = _pipeline(inp, actor, chain, carrier(transport), interleave)
                outs.append(out)
                answers.extend(lanes)
                continue
            if not theirs:
                outs.append(actor.execute_step.bind(inp))
                continue
            work = actor.prepare_step.bind(inp)
            outs.append(actor.finish_step.bind(work))
            answers.extend(f.graph_step.bind(work) for f in theirs)
        dag = ray.dag.MultiOutputNode(outs + answers)
    return _compile(dag)


def _pipeline(
    inp: Any, leader: Any, stages: Sequence[Any], carry: Callable[[Any], Any], interleave: bool
) -> tuple[Any, list[Any]]:
    """One DP rank's pipeline in the graph: lane k's micro-batch leaves the leader (lane 0 from
    `prepare_step`, the others from `next_lane`, each after the one before: an actor runs its
    nodes in the order they were bound), goes through every stage's node of lane k, and the
    last stage's lanes meet in the leader's `finish_step`. A stage runs lane k + 1 after lane
    k, while its leader runs stage 0 of the next micro-batch. `carry` marks each lane's node
    for its transport (`carrier`). Returns the leader's output node and the lanes that are
    outputs too.

    `interleave` (vLLM's shape): lane 0 leaves `start_step`, the last stage samples and its
    lanes are outputs of the graph (tokens, no tensors: not carried), and the leader's
    `finish_step` follows its own last lane: it returns the leader's part of the output
    (`Stepper.start`) without waiting for any stage, and the driver merges the two
    (`ray_mesh.merged`). So no node of the leader waits for a later stage, and with two
    executions in flight its loop runs the next step's stage 0 while the stages run this
    one (an actor's loop runs one execution's nodes after the other's)."""
    first = leader.start_step if interleave else leader.prepare_step
    lane = carry(first.bind(inp))
    lasts: list[Any] = []
    for k in range(1 + len(stages)):
        if k:
            lane = carry(leader.next_lane.bind(lane, k))
        work = lane
        for s, stage in enumerate(stages, start=1):
            work = stage.graph_step.bind(work)
            if not (interleave and s == len(stages)):
                work = carry(work)
        lasts.append(work)
    if interleave:
        return leader.finish_step.bind(lane), lasts
    return leader.finish_step.bind(*lasts), []


def carrier(transport: str) -> Callable[[Any], Any]:
    """What marks a lane's node for `transport` (`ray_mesh.TRANSPORT_ENV`): Ray's tensor
    transport finds the tensors nested in the `StageLane` (not returned bare:
    ``_direct_return`` False) and sends them by it, the rest of the lane through the channel;
    "pickle": nothing (the channel pickles it all)."""
    if transport == "pickle":
        return lambda node: node
    return lambda node: node.with_tensor_transport(transport=transport)


def _compile(dag: Any) -> Any:
    """Ray's compile of `dag` (every graph of this module goes through here)."""
    return dag.experimental_compile()


def broken(graph: Any) -> str | None:
    """Why a just-compiled `graph` cannot carry steps, or None.

    Ray 2.60 starts a graph's failure monitor (the thread that tears the graph down when an
    actor's loop ends) before it creates the graph's input writer (`CompiledDAG.
    _get_or_compile`). An actor that died while the graph compiled ends its loop at once, so
    the monitor may tear down before the writer exists: its `teardown` raises
    (``AttributeError: 'NoneType' object has no attribute 'close'``, seen in a server log
    after a grow and a quick shrink), the monitor thread dies, and the graph is left
    half-live: nothing fails its reads, and an execution waits out its whole timeout. A live
    graph's monitor runs for as long as the graph does.
    """
    monitor = getattr(graph, "_monitor", None)
    if monitor is not None and not monitor.is_alive():
        return "its failure monitor has ended (an actor of it died while it compiled)"
    return None


def probe_step() -> step_mod.StepInput:
    """The step a fresh graph executes once before real steps (`build`)."""
    return step_mod.StepInput(step_id=PROBE_STEP_ID, batches={})


@dataclasses.dataclass(frozen=True)
class Built:
    """What `build` made: the graph to install (None: none), and its figures (``compile_s``,
    ``probe_s``) or, where it failed and should be tried again later, ``error``; `dropped`: a
    graph compiled and not fit, for the caller to tear down (once it has recorded why: a
    teardown can wait on the actors' loops)."""

    graph: Any = None
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    dropped: Any = None

    @property
    def failed(self) -> bool:
        return "error" in self.figures


def build(
    actors: Sequence[Any],
    *,
    probe_timeout: float,
    current: Callable[[], bool],
    retry_in: float,
    followers: Sequence[Sequence[Any]] = (),
    stages: Sequence[Sequence[Any]] = (),
    transport: str = "pickle",
    interleave: bool = False,
) -> Built:
    """A new step graph over `actors` (and their TP `followers`: `compile_graph`), fit to
    carry steps: compiled, checked (`broken`) and
    executed once with the probe step (the first execution of a fresh graph is slow: paid
    before real steps), within `probe_timeout` s. Not probed when `current()` says the step
    path moved on while it compiled (a switch, a removal: an actor of it may be gone, and its
    probe would wait for it). `retry_in` (s) only goes into the logs."""
    started = time.monotonic()
    try:
        graph = compile_graph(actors, followers, stages, transport, interleave)
    except Exception as exc:  # noqa: BLE001 - plain calls keep serving; retried later
        log.exception(
            "compiling the step graph over %d ranks failed; steps stay on plain actor calls "
            "and the compile is tried again in %.0fs (Ray %s; %s steps on plain calls only)",
            len(actors),
            retry_in,
            ray.__version__,
            guards.REMOTE_MODE_HINT,
        )
        return Built(figures={"error": f"{type(exc).__name__}: {exc}"})
    compiled = time.monotonic()
    if not current():
        log.info("a step graph compiled for a step path since replaced: dropped unprobed")
        return Built(dropped=graph)
    why = broken(graph)
    if why is not None:
        log.warning(
            "the new step graph over %d ranks cannot carry steps: %s; dropping it, steps stay "
            "on plain actor calls and the compile is tried again in %.0fs",
            len(actors),
            why,
            retry_in,
        )
        return Built(figures={"error": f"broken: {why}"}, dropped=graph)
    try:
        ray.get(graph.execute(probe_step()), timeout=probe_timeout)
    except Exception as exc:  # noqa: BLE001 - dropped; plain calls keep serving
        log.exception(
            "the probe step of a new step graph failed (bound %.0fs); dropping the graph",
            probe_timeout,
        )
        return Built(figures={"error": f"probe: {type(exc).__name__}: {exc}"}, dropped=graph)
    figures = {
        "compile_s": compiled - started,
        "probe_s": time.monotonic() - compiled,
        "tensor_nodes": tensor_nodes(graph),
    }
    return Built(graph=graph, figures=figures)


def tensor_nodes(graph: Any) -> int:
    """The nodes of the compiled `graph` whose output goes by Ray's tensor transport (the
    pipeline lanes', `carrier`; resolved by the compile)."""
    from ray.experimental.channel.torch_tensor_type import TorchTensorType

    tasks = getattr(graph, "idx_to_task", {})
    return sum(isinstance(t.dag_node.type_hint, TorchTensorType) for t in tasks.values())


@dataclasses.dataclass(frozen=True)
class Held:
    """A parked graph's hold in flight: the graph, the hold's output, the actors it waits on."""

    graph: Any
    ref: Any
    actors: list[Any]


def hold(graph: Any, actors: Sequence[Any]) -> Held:
    """Send a hold through `graph` (`ray_actor.HOLD_STEP_ID`): each actor's graph loop waits
    in it, idle, until `release`. Its output is left unread (that costs the driver nothing)."""
    ref = graph.execute(step_mod.StepInput(step_id=ray_actor.HOLD_STEP_ID, batches={}))
    return Held(graph, ref, list(actors))


def release(held: Held) -> bool:
    """End a hold: each actor's `release_hold` on its health lane, then the hold's output;
    False (logged) when that fails (an actor lost meanwhile)."""
    lane = {"concurrency_group": ray_actor.HEALTH_LANE}
    try:
        ray.get(
            [a.release_hold.options(**lane).remote() for a in held.actors],
            timeout=RELEASE_TIMEOUT_SECONDS,
        )
        ray.get(held.ref, timeout=RELEASE_TIMEOUT_SECONDS)
    except Exception as exc:  # noqa: BLE001 - the graph is dropped instead
        log.warning(
            "releasing the parked step graph failed (%s: %s); it is torn down and compiled again",
            type(exc).__name__,
            exc,
        )
        return False
    return True


def warm_up(actors: Sequence[Any], *, timeout: float) -> None:
    """Compile, run once and tear down a throwaway graph over new actors.

    An actor's first compiled graph costs seconds of one-time setup (measured here: a
    switch onto 2 fresh actors compiled in 2.6-3.3 s, 0.17-0.21 s once they had been in a
    graph before). Paying it now, while the old graph keeps serving on the other actors,
    keeps it away from the step path's background compile after the switch that brings the
    actors in. It runs in a thread; `switch` waits for it. Best effort: a failure only costs
    that time later.
    """
    started = time.monotonic()
    try:
        with ray.dag.InputNode() as inp:
            dag = ray.dag.MultiOutputNode([a.echo.bind(inp) for a in actors])
        graph = _compile(dag)
        try:
            why = broken(graph)
            if why is not None:  # its execution would wait out `timeout`, and the switch too
                log.warning("warming up %d new actors: the graph %s; skipped", len(actors), why)
                return
            ray.get(graph.execute(0), timeout=timeout)
        finally:
            graph.teardown()
    except Exception:  # noqa: BLE001 - an optimisation; the switch compiles anyway
        log.exception("warming up %d new actors failed; the switch will be slower", len(actors))
        return
    log.info("warmed up %d new actors in %.2fs", len(actors), time.monotonic() - started)


class WarmUp:
    """The warm-up of new actors, one at a time in a thread (`warm_up`); a switch, a removal
    and `join` wait for it (a switch must not overlap it). timeout: seconds it may take."""

    def __init__(self, *, timeout: float) -> None:
        self.timeout = timeout
        self._thread: threading.Thread | None = None

    def start(self, actors: Sequence[Any]) -> None:
        """Warm `actors` up in a thread, once the last warm-up is over."""
        self.join()
        self._thread = threading.Thread(
            target=warm_up,
            args=(actors,),
            kwargs={"timeout": self.timeout},
            name="rank-warm-up",
            daemon=True,
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the running warm-up (at most `timeout` s; None: its own bound)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self.timeout if timeout is None else timeout)
