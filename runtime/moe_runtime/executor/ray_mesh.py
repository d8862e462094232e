"""The step graph over a DP rank's mesh: at pipeline size 1 and T > 1 each TP follower is a
node of the compiled graph, as in vLLM's executor (``InputNode -> TP group ->
MultiOutputNode``), instead of a plain Ray call its leader makes in every step; at P > 1 each
pipeline stage actor is (below).

The leader's part of a graph step is two nodes on its actor:

- ``prepare_step(step)`` starts the step on the rank's step thread (`MeshStep`), where the
  worker runs it as in any step; when the worker sends its followers the forward pass
  (`tensor_group.TensorLeader.begin` -> `ray_tensor.RayFollowers.send("step", ...)`), the
  send is handed to this node instead (`RayFollowers.handoff`), which returns it: a
  `ray_tensor.FollowerStep` for the followers' `graph_step` nodes, through the graph's
  channels. A step without a forward pass for the followers ends before the node returns
  (``args`` None).
- ``finish_step(work)`` waits (on an event, idle) for the step thread's `StepOutput`.

So the followers start their part of the forward pass as soon as the leader has planned it,
and the TP collectives run between them as before; the followers' answers (``reads`` of the
mesh expert layout, or an ``error``) are outputs of the graph after the leaders' (`outputs`
adds them to their leader's). A probe passes through every node; a hold (parking) makes the
leader's ``finish_step`` and every follower's ``graph_step`` wait on their own event (none of
them spins on a channel read meanwhile), each released by its `release_hold`.

At pipeline size P > 1 the stage actors are the nodes instead (their TP followers are not):
P micro-batch lanes per DP rank. ``prepare_step`` returns lane 0 (a `ray_pipeline.StageLane`)
once the worker's pipeline leader sent its first micro-batch to the stages (`RayStages.chain`
hands it to this step's job instead of a Ray call), the leader's ``next_lane`` nodes return
lanes 1..P-1 the same way (empty once the step waits for an answer: it sends no more), each
stage's ``graph_step`` runs its lane and hands it on, and the last stage's lanes meet in
``finish_step``, which hands them to the step's waits (`RayStages.wait`) and returns the
output. So stage 1 runs micro-batch 0 while the leader runs micro-batch 1, and the hidden
states go stage to stage through the graph's channels. A wait ends early when the stages are
aborted (`RayStages.abort` -> `_Job.cancel`) or a stage stops answering its pings.

Plain calls (right after a switch, in remote mode) keep the leader's `execute_step`, which
reaches its followers (and its stages) by Ray calls per step; a follower or a stage runs the
two kinds of step one at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from moe_runtime import step as step_mod
from moe_runtime.executor import guards, ray_calls, ray_pipeline, ray_tensor
from moe_runtime.rank import pipeline_group

log = logging.getLogger(__name__)

#: Whether the pipeline stage actors are nodes of the step graph (P > 1): "auto" (the default)
#: on GPUs, and on CPUs where the DP rank has no TP followers (T = 1) and steps are not
#: interleaved; "1" always, "0" never (the leaders reach their stages by Ray calls per
#: micro-batch, the path before stages were nodes; interleaved steps: in two calls a step).
#: Why not interleaved on CPUs: the graph's spinning loops (below) take the cores the two
#: stages' steps run on at once: `bench/serve_mesh.py --meshes 1x2ir 1x2i` served 113-118
#: tok/s by plain calls against 83 down the graph on 2 cores (docs/PIPELINE-PARALLEL.md).
#: Why not at T > 1 on CPUs: each graph node's loop busy-waits on its channel between steps
#: (Ray 2.60), and a (T, P) = (2, 2) DP rank is 4 processes: at DP = 3 on the 2-core machine
#: six spinning loops beside twelve rank processes starved the server (its /health unanswered
#: for over 10 s under load, tests timing out), where at T = 1 (six processes) they do not.
STAGES_ENV = "MOE_STEP_GRAPH_STAGES"


def stage_nodes(tp_size: int, *, use_gpu: bool, interleave: bool = False) -> bool:
    """Whether the stage actors of a DP rank of `tp_size` TP ranks are nodes of the step graph
    (`STAGES_ENV`; ValueError naming it for another value); `interleave`: interleaved steps."""
    raw = guards.choice_from_env(STAGES_ENV, ("auto", "1", "0"), wanted="auto, 1 or 0")
    return raw == "1" or (raw == "auto" and (use_gpu or (tp_size == 1 and not interleave)))


#: How many interleaved step groups (sets of sequences, and steps in flight) at pipeline size
#: P > 1 with `--pipeline-interleave`: P by default (a step per stage, vLLM's), 2..P. Fewer
#: where the stages' processes share fewer cores than P: on the 2-core machine two sets
#: served 111 tok/s at P = 3 against 95-97 with three (`bench/serve_mesh.py --meshes 1x3i`).
STEP_GROUPS_ENV = "MOE_PIPELINE_STEP_GROUPS"


def step_groups(pp_size: int, *, interleave: bool) -> int:
    """The interleaved step groups of a RayExecutor at pipeline size `pp_size` (1: none;
    `STEP_GROUPS_ENV`; ValueError naming it for a value outside 2..P)."""
    if not interleave or pp_size < 2:
        return 1
    groups = guards.float_from_env(
        STEP_GROUPS_ENV,
        pp_size,
        valid=lambda v: v == int(v) and 2 <= v <= pp_size,
        wanted=f"a whole number from 2 to the pipeline size ({pp_size})",
    )
    return int(groups)


#: Seconds a leader may take to settle an interleaved graph step its stages failed.
SETTLE_TIMEOUT_S = 30.0

#: How the step graph's lanes carry the tensors in them (the hidden states a stage hands on,
#: the last stage's logits) from actor to actor: "auto" (the default) Ray's tensor transport
#: (`with_tensor_transport("auto")`, resolved per edge at compile time: the accelerator's,
#: NCCL, between actors on different GPUs, where the tensors stay on the device) when the
#: ranks run on GPUs, "pickle" on CPUs; "shm" Ray's tensor transport through host shared
#: memory (a GPU tensor copied to the host and back); "pickle" the channel pickling the whole
#: lane, tensors included. In every mode a host tensor over a quarter of the channel's buffer
#: goes through the object store instead (`ray_pipeline.Shipper`: a channel that grows hangs
#: the next teardown in Ray 2.60), so on CPUs the lanes' channels carry at most ~250 kB of
#: tensors, where "shm" saved 0.1-0.6 ms of a 1.3-2.2 ms lane on 2 cores
#: (`bench/graph_lanes.py`): not worth Ray's less used path by default. On GPUs keep "auto":
#: with "shm" or "pickle" the device tensors go through the channel itself (never shipped),
#: where a large one makes it grow.
TRANSPORT_ENV = "MOE_STEP_GRAPH_TRANSPORT"
TRANSPORTS = ("auto", "shm", "pickle")


def stage_transport(*, use_gpu: bool) -> str:
    """The transport of the step graph's lanes, "auto" resolved ("auto" on GPUs, else
    "pickle"), from `TRANSPORT_ENV`; ValueError naming it for another value."""
    raw = guards.choice_from_env(TRANSPORT_ENV, TRANSPORTS, wanted="one of auto, shm, pickle")
    return "pickle" if raw == "auto" and not use_gpu else raw


@dataclasses.dataclass(frozen=True)
class Stepped:
    """What a step path steps: the ranks' labels, their actors, each one's TP followers with a
    node of their own in the step graph, and each one's pipeline stages (lanes of nodes in the
    graph; () each where none)."""

    ranks: tuple[int, ...]
    actors: tuple[Any, ...]
    followers: tuple[tuple[Any, ...], ...]
    stages: tuple[tuple[Any, ...], ...] = ()

    @classmethod
    def of(
        cls,
        ranks: Sequence[int],
        actors: Sequence[Any],
        followers: Sequence[Sequence[Any]] = (),
        stages: Sequence[Sequence[Any]] = (),
    ) -> Stepped:
        theirs = tuple(tuple(f) for f in followers) or tuple(() for _ in actors)
        chains = tuple(tuple(s) for s in stages) or tuple(() for _ in actors)
        return cls(tuple(ranks), tuple(actors), theirs, chains)

    def graph_actors(self) -> list[Any]:
        """Every actor with a node in the graph: the stepped ones, their followers, their
        stages."""
        return [
            *self.actors,
            *(f for theirs in self.followers for f in theirs),
            *(s for chain in self.stages for s in chain),
        ]

    def counts(self) -> list[int]:
        """How many followers of each rank answer the graph (`outputs`)."""
        return [len(f) for f in self.followers]


class _Job:
    """One graph step on the step thread: the followers' forward pass (once handed out), the
    micro-batches down the stages' lanes (once handed), their answers (once the graph
    brought them to `finish_step`), the output (once done)."""

    def __init__(self, step: step_mod.StepInput, lanes: int = 0, *, start: bool = False) -> None:
        self.step = step
        self.start = start  # `MeshStep.prepare`
        self.args: tuple[Any, ...] | None = None
        self.output: step_mod.StepOutput | None = None
        self.error: BaseException | None = None
        self.handed = threading.Event()  # args set, or the step is over
        self.done = threading.Event()
        # pipeline stages (`ray_pipeline.Lanes`)
        self._lanes = lanes
        self._cond = threading.Condition()
        self._handed: list[ray_pipeline.StageLane] = []
        self._closed = False  # no more micro-batches this step
        self._answers: Sequence[ray_pipeline.StageLane] = ()
        self._cancelled: str | None = None
        self._answered = threading.Event()

    def hand(self, args: tuple[Any, ...]) -> None:
        if self.handed.is_set():
            raise RuntimeError(
                "a graph step hands its TP followers one forward pass (pipeline size 1)"
            )
        self.args = args
        self.handed.set()

    # -- the stages' lanes (`ray_pipeline.Lanes`) ------------------------------------------
    def hand_lane(self, args: tuple[Any, ...], sample: Any = None) -> ray_pipeline.LanePending:
        with self._cond:
            lane = len(self._handed)
            if self._closed or lane >= self._lanes:
                raise RuntimeError(
                    f"a graph step sends its stages at most {self._lanes} micro-batches, "
                    "all before it waits for any"
                )
            self._handed.append(ray_pipeline.StageLane(self.step.step_id, lane, args, sample))
            self._cond.notify_all()
        return ray_pipeline.LanePending(self, lane)

    def take_lane(self, lane: int) -> ray_pipeline.StageLane:
        """Lane `lane`'s micro-batch once handed; an empty lane once the step sends no more."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._handed) > lane or self._closed)
            if lane < len(self._handed):
                return self._handed[lane]
        return ray_pipeline.StageLane(self.step.step_id, lane)

    def close_lanes(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_lane(
        self, lane: int, timeout: float, check: Callable[[], None]
    ) -> ray_pipeline.StageLane:
        self.close_lanes()  # every micro-batch is sent before the first wait (`forward`)
        deadline = time.monotonic() + timeout
        while not self._answered.wait(ray_pipeline.LANE_PING_S):
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the step graph brought no answer of micro-batch {lane} within {timeout}s"
                )
        if self._cancelled is not None:
            raise RuntimeError(f"the step's stages were aborted: {self._cancelled}")
        if lane >= len(self._answers):
            raise RuntimeError(f"the step graph brought no answer of micro-batch {lane}")
        return self._answers[lane]

    def answer(self, lanes: Sequence[ray_pipeline.StageLane]) -> None:
        self._answers = lanes
        self._answered.set()

    def cancel(self, reason: str) -> None:
        if not self._answered.is_set():
            self._cancelled = reason
            self._answered.set()

    def over(self) -> None:
        self.close_lanes()
        self.handed.set()  # no forward pass for the followers: they skip it
        self.done.set()


class MeshStep:
    """A leader's graph steps on a thread of their own (module docstring). `run`: the actor's
    step (its worker's `execute_step`, with the actor's bookkeeping); `followers`: the DP
    rank's TP followers, whose "step" sends a graph step takes (pipeline size 1); `stages`:
    its pipeline stages (P > 1), whose micro-batches (`chain`) a graph step sends down its
    `lanes` (P: as many as a step's micro-batches may be)."""

    def __init__(
        self,
        run: Callable[[step_mod.StepInput], step_mod.StepOutput],
        followers: Any = None,
        *,
        stages: Any = None,
        lanes: int = 0,
        start: Callable[[step_mod.StepInput], step_mod.StepOutput] | None = None,
    ) -> None:
        self._run = run
        self._start = start
        self._followers = followers
        self._stages = stages
        self._lanes = lanes
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._job: _Job | None = None
        self._thread = threading.Thread(target=self._loop, name="mesh-step", daemon=True)
        self._thread.start()

    def prepare(self, step: step_mod.StepInput, *, start: bool = False) -> Any:
        """Start `step` on the step thread; what the followers run of it (once the worker
        handed it out, or once the step is over without a forward pass for them): a
        `ray_tensor.FollowerStep`; with stages, lane 0's `ray_pipeline.StageLane` (its
        micro-batch once handed, or empty once the step sends none). `start`: the step runs
        as `start` (an interleaved graph step: the last stage samples, `finish` returns the
        leader's part as soon as every micro-batch is handed)."""
        if start and self._start is None:
            raise RuntimeError("an interleaved graph step on a leader without stages")
        job = _Job(step, self._lanes if self._stages is not None else 0, start=start)
        self._job = job
        self._jobs.put(job)
        if self._stages is not None:
            return job.take_lane(0)
        job.handed.wait()
        return ray_tensor.FollowerStep(step.step_id, job.args)

    def lane(self, lane: int) -> ray_pipeline.StageLane:
        """Lane `lane`'s micro-batch of the step `prepare` started (empty: none)."""
        if self._job is None:
            raise RuntimeError("next_lane without prepare_step")
        return self._job.take_lane(lane)

    def finish(self, answers: Sequence[Any] = ()) -> step_mod.StepOutput:
        """The output of the step `prepare` started (raises what the step raised); with
        stages, `answers` are the last stage's lanes, handed to the step's waits first."""
        job, self._job = self._job, None
        if job is None:
            raise RuntimeError("finish_step without prepare_step")
        if self._stages is not None:
            job.answer(answers)
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.output is not None
        return job.output

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._followers is not None:
                self._followers.handoff = job.hand
            if self._stages is not None:
                self._stages.lanes, self._stages.lanes_thread = job, threading.get_ident()
            run = self._start if job.start and self._start is not None else self._run
            try:
                job.output = run(job.step)
            except BaseException as exc:  # noqa: BLE001 - raised by `finish`
                job.error = exc
            finally:
                if self._followers is not None:
                    self._followers.handoff = None
                if self._stages is not None:
                    self._stages.lanes = None
                job.over()

    def close(self) -> None:
        self._jobs.put(None)


def outputs(
    raw: Sequence[Any],
    ranks: Sequence[int],
    stepped: Stepped | None,
    step_id: int,
    answered: dict[int, float] | None = None,
) -> list[step_mod.StepOutput]:
    """The leaders' outputs of graph step `step_id` over `stepped` from the graph's `raw`
    output (the leaders', then each leader's followers' answers in order): their experts read
    from the model source (the mesh layout) added to their leader's `source_reads`; a
    follower's error logged (its leader's step failed with it: they share the TP
    collectives). `answered` (not None: an interleaved graph, `ray_graph._pipeline`): with
    pipeline stages, `interleaved`'s."""
    if answered is not None and stepped is not None and any(stepped.stages):
        return interleaved(raw, stepped, step_id, answered)
    followers = [] if stepped is None else stepped.counts()
    outs: list[step_mod.StepOutput] = list(raw[: len(ranks)])
    if not any(followers):
        return outs
    answers = iter(raw[len(ranks) :])
    for out, label, count in zip(outs, ranks, followers, strict=True):
        for tp_rank in range(1, count + 1):
            answer = next(answers)
            if not isinstance(answer, dict):
                continue
            if answer.get("error"):
                log.warning(
                    "step %d: TP follower %d of rank %d failed: %s",
                    out.step_id,
                    tp_rank,
                    label,
                    answer["error"],
                )
            out.source_reads += int(answer.get("reads", 0))
    return outs


@dataclasses.dataclass(frozen=True)
class LaneFailure:
    """A DP rank whose interleaved graph step failed in its stages (`merged`): its index in
    the step's ranks, the error, and whether a stage lost a TP follower (the rank is lost)."""

    index: int
    error: str
    lost: bool


def merged(
    raw: Sequence[Any], ranks: Sequence[int], lanes: Sequence[int], answered: dict[int, float]
) -> tuple[list[step_mod.StepOutput], list[LaneFailure]]:
    """The leaders' outputs of an interleaved graph step (`ray_graph._pipeline`) from the
    graph's `raw` output (the leaders' parts, then `lanes[i]` last-stage lanes of each): each
    leader's part with its last stage's tokens, the stages' expert load added at their MoE
    layers and their source reads; `overlapped` where the leader began the step before its
    last stage answered the step before (`answered`: each rank's latest answer, monotonic on
    its node, updated here); `seconds` up to the last stage's answer (`step_wait` learns the
    step's length from it). And the ranks whose lanes failed, for the leader to settle
    (`Stepper.settle`): their tokens are left out."""
    outs: list[step_mod.StepOutput] = list(raw[: len(ranks)])
    answers = iter(raw[len(ranks) :])
    failures: list[LaneFailure] = []
    for i, (out, label, count) in enumerate(zip(outs, ranks, lanes, strict=True)):
        mine = [next(answers) for _ in range(count)]
        failed = next((lane for lane in mine if lane.error is not None), None)
        if failed is not None:
            failures.append(LaneFailure(i, failed.error, failed.lost))
            continue
        last = 0.0
        for lane in mine:
            if lane.answer is None:
                continue
            out.tokens.update(lane.answer["tokens"])
            out.source_reads += lane.reads
            last = max(last, float(lane.answer["answered_at"]))
            if out.expert_load is not None:
                pipeline_group.add_loads(out.expert_load, lane.answer["loads"])
        if last:
            out.overlapped = out.started_at < answered.get(label, 0.0)
            answered[label] = last
            out.seconds = max(out.seconds, last - out.started_at)  # to its last stage's answer
    return outs, failures


def interleaved(
    raw: Sequence[Any], stepped: Stepped, step_id: int, answered: dict[int, float]
) -> list[step_mod.StepOutput]:
    """An interleaved graph step's outputs (`merged`); a rank whose stages failed is settled
    by its leader (`Stepper.settle`: its KV cache back to before the step, its groups let go,
    on its health lane) before the step's failure reaches the engine."""
    lanes = [len(chain) + 1 for chain in stepped.stages]
    outs, failures = merged(raw, stepped.ranks, lanes, answered)
    health = {"concurrency_group": ray_calls.HEALTH_LANE}
    for failed in failures:
        out, actor = outs[failed.index], stepped.actors[failed.index]
        try:
            ref = actor.settle_step.options(**health).remote(step_id, failed.error, failed.lost)
            out.failure = ray.get(ref, timeout=SETTLE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the rank is gone or stuck: lost
            log.warning("settling step %d on rank %d failed: %s", step_id, out.rank, exc)
            out.failure = step_mod.FAILURE_RANK
        out.tokens = {}
        errors = [e for e in (out.error, f"a pipeline stage failed: {failed.error}") if e]
        out.error = "; ".join(errors)
    return outs
