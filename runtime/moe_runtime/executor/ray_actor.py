"""The rank actor of `RayExecutor` and the plain Ray calls around it.

- `RankActor`: the actor body, a `RankWorker` plus what only Ray knows (node id, address), with
  four concurrency lanes: the default one (the compiled step graph's loop and plain control
  calls made while no step runs), `CTL_LANE` (one thread: background control calls that overlap
  steps), `EXPORT_LANE` (one thread: experts a co-located peer asked for, so an export never
  waits behind a staging call that waits for exports) and `HEALTH_LANE` (pings, never queued
  behind a transfer);
- `RankHandle`: how the executor reaches one DP rank (its actor and placement group; the
  roster keeps it with the rank's info and health);
- starting a DP rank's actors: `ray_start`; reading results: `ray_calls`; the heartbeat's
  calls on the health lane are `ray_health`'s; a graph step over the TP followers or the
  pipeline stages: `ray_mesh`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
import ray.exceptions
import ray.util

from moe_contract import names
from moe_runtime import logs
from moe_runtime import step as step_mod
from moe_runtime.executor import (
    niceness,
    ray_calls,
    ray_mesh,
    ray_pipeline,
    ray_tensor,
    ray_transfer,
    roster,
)
from moe_runtime.rank import allocator
from moe_runtime.rank import hooks as hooks_mod
from moe_runtime.rank import worker as worker_mod

log = logging.getLogger(__name__)

#: The Ray resource of one rank slot (the contract's: the operator's worker pods offer one each).
RANK_RESOURCE = names.RANK_RESOURCE
CTL_LANE = "ctl"
EXPORT_LANE = "export"
HEALTH_LANE = ray_calls.HEALTH_LANE
#: The lane of `end_step` (`--pipeline-interleave`): it waits for a step's later stages while
#: `begin_step` runs the next step's stage 0 on the default lane.
END_LANE = ray_calls.END_LANE
#: StepInput.step_id of a probe step (`ray_step`): answered by the actor, not its worker.
PROBE_STEP_ID = -1
#: StepInput.step_id of a hold (`ray_step`, "Parking"): the actor's graph loop waits in it,
#: idle, until `RankActor.release_hold` (its TP followers' too: `ray_mesh`).
HOLD_STEP_ID = ray_tensor.HOLD_STEP_ID


class RankActor:
    """The actor body: a RankWorker plus what only Ray knows (node id and address)."""

    def __init__(
        self,
        *,
        label: int,
        device: str,
        dtype: str,
        spare: bool = False,
        hooks: hooks_mod.HooksFactory | None = None,
        followers: Sequence[Any] = (),
        stages: Sequence[Any] = (),
        micro_batch_tokens: int | None = None,
        expert_layout: str = "leader",
    ) -> None:
        logs.configure_rank()
        self._malloc = allocator.tune()
        if spare:  # its process began at SPARE_NICENESS already (`niceness.spare_setup`)
            niceness.set_niceness(label, niceness.SPARE_NICENESS, why="waits as a spare")
        tensor = None
        if followers:
            # TP ranks 1..T-1 of this DP rank (`ray_tensor`): this actor leads them.
            pids = ray.get([f.pid.remote() for f in followers])
            tensor = ray_tensor.RayFollowers(followers, pids)
        self._followers = tensor
        pipeline = None
        if stages:
            # pipeline stages 1..P-1 of this DP rank (`ray_pipeline`): this actor is stage 0.
            pipeline = ray_pipeline.RayStages(
                stages,
                ray.get([s.pid.remote() for s in stages]),
                [p for s in stages for p in ray.get(s.follower_pids.remote())],
            )
        self._stages = pipeline
        #: graph steps over the pipeline stages (P > 1), else over the TP followers (`ray_mesh`)
        self._mesh: ray_mesh.MeshStep | None = None
        if pipeline is not None:
            self._mesh = ray_mesh.MeshStep(
                self._step, stages=pipeline, lanes=1 + len(stages), start=self._start
            )
        elif tensor is not None:
            self._mesh = ray_mesh.MeshStep(self._step, tensor)
        self.worker = worker_mod.RankWorker(
            device=device,
            dtype=dtype,
            torch_threads=1,
            label=label,
            hooks=None if hooks is None else hooks(),
            tensor=tensor,
            tensor_size=1 + len(followers),
            pipeline=pipeline,
            pipeline_size=1 + len(stages),
            pipeline_micro_batch_tokens=micro_batch_tokens,
            expert_layout=expert_layout,
        )
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._serving = False
        #: Set by `release_hold`: the step graph's loop, parked in a hold, goes on.
        self._hold = threading.Event()
        self.holding = False
        #: native id of the thread that runs this rank's steps (the default lane), once it has
        self._step_thread: int | None = None

    def _in_background(self) -> None:
        """A call that overlaps steps (another lane than the steps'): on a rank that serves,
        its thread yields the CPU to the step thread (`niceness.BACKGROUND_NICENESS`). A rank that
        does not
        step yet (starting, a spare being claimed) keeps full priority: a grow waits on it."""
        tid = threading.get_native_id()
        if not self._serving or tid == self._step_thread:
            return
        niceness.thread_niceness(self.worker.label, tid, niceness.BACKGROUND_NICENESS, only_up=True)

    def promote(self) -> None:
        """A spare (warm, or a rank pool's process) that a grow takes: the serving ranks'
        priority for every thread (the grow waits for what it runs next); its TP followers
        too (a DP rank joins whole)."""
        niceness.set_niceness(self.worker.label, 0, why="joins a grow")
        if self._followers is not None:
            self._followers.promote(ray_tensor.PROMOTE_TIMEOUT_S)
        if self._stages is not None:  # each stage promotes its own TP followers
            self._stages.promote(ray_tensor.PROMOTE_TIMEOUT_S)

    def ready(self) -> dict[str, Any]:
        info = self.worker.info()
        info.update(node_id=self.node_id, ip=self.node_ip, malloc=self._malloc)
        return info

    def free_port(self) -> tuple[str, int]:
        return self.worker.groups.free_port(self.node_ip)

    def execute_method(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._in_background()
        return self.worker.call(method, *args, **kwargs)

    def execute_step(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        if step.step_id == PROBE_STEP_ID:
            # The first execution of a fresh step graph (`ray_step`): it may run while a plain
            # call steps the worker, so it must not touch the worker.
            return step_mod.StepOutput(rank=-1, step_id=step.step_id)
        if step.step_id == HOLD_STEP_ID:
            # A parked step graph (`ray_step`): its loop waits here, idle, instead of spinning
            # on its input channel, until the next step (or a teardown) releases it.
            return self._wait_hold(step)
        return self._step(step)

    def begin_step(self, step: step_mod.StepInput) -> None:
        """A step's stage 0 at P > 1 over plain calls (`--pipeline-interleave`); its output
        comes from `end_step` (`stepper.Stepper.begin`)."""
        self._stepping()
        self.worker.stepper.begin(step)

    def end_step(self, step_id: int) -> step_mod.StepOutput:
        """The output of a step `begin_step` started (on `END_LANE`)."""
        return self.worker.stepper.end(step_id)

    def prepare_step(self, step: step_mod.StepInput) -> Any:
        """The leader's first node of a graph step over its TP followers or its pipeline
        stages (`ray_mesh`): the step started, what its followers run of it (or its stages'
        first micro-batch lane) returned."""
        if step.step_id in (PROBE_STEP_ID, HOLD_STEP_ID) or self._mesh is None:
            if self._stages is not None:
                return ray_pipeline.StageLane(step.step_id, 0)
            return ray_tensor.FollowerStep(step.step_id)
        return self._mesh.prepare(step)

    def start_step(self, step: step_mod.StepInput) -> ray_pipeline.StageLane:
        """The leader's first node of an interleaved graph step over its pipeline stages
        (`ray_graph`): as `prepare_step`, the step a `Stepper.start` (its last stage samples;
        this leader's `finish_step` returns its part of the output without waiting for it)."""
        if step.step_id in (PROBE_STEP_ID, HOLD_STEP_ID) or self._mesh is None:
            return ray_pipeline.StageLane(step.step_id, 0)
        lane: ray_pipeline.StageLane = self._mesh.prepare(step, start=True)
        return lane

    def settle_step(self, step_id: int, error: str, lost: bool) -> str | None:
        """An interleaved graph step whose stages failed (`Stepper.settle`; health lane)."""
        return self.worker.stepper.settle(step_id, error, lost=lost)

    def next_lane(self, prev: ray_pipeline.StageLane, lane: int) -> ray_pipeline.StageLane:
        """The leader's node of micro-batch lane `lane` > 0 of a graph step over its pipeline
        stages (`ray_mesh`): that micro-batch once its stage 0 ran it (empty: none). A hold
        waits in the last lane's node (`ray_pipeline.hold_lane`: no actor of the pipeline
        is left reading a channel meanwhile)."""
        if prev.step_id == HOLD_STEP_ID and self._stages is not None:
            if lane == ray_pipeline.hold_lane(0, 1 + len(self._stages.pids())):
                self._wait_hold(step_mod.StepInput(step_id=HOLD_STEP_ID, batches={}))
        if prev.step_id in (PROBE_STEP_ID, HOLD_STEP_ID) or self._mesh is None:
            return ray_pipeline.StageLane(prev.step_id, lane)
        return self._mesh.lane(lane)

    def finish_step(self, *parts: Any) -> step_mod.StepOutput:
        """The leader's last node of a graph step (`ray_mesh`): the step's output. `parts`:
        its `prepare_step`'s output (TP followers), or its last stage's lanes."""
        step_id = parts[0].step_id
        if step_id == PROBE_STEP_ID:
            return step_mod.StepOutput(rank=-1, step_id=step_id)
        if step_id == HOLD_STEP_ID and self._stages is None:
            return self._wait_hold(step_mod.StepInput(step_id=step_id, batches={}))
        if step_id == HOLD_STEP_ID:  # held in `next_lane` already
            return step_mod.StepOutput(rank=-1, step_id=step_id)
        if self._mesh is None:
            raise RuntimeError("finish_step on a rank without TP followers or stages")
        return self._mesh.finish(parts if self._stages is not None else ())

    def _wait_hold(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        self.holding = True
        self._hold.wait()
        self._hold.clear()
        self.holding = False
        return step_mod.StepOutput(rank=-1, step_id=step.step_id)

    def graph_holding(self) -> bool:
        """Its step graph's loop waits in a parked graph's hold now (tests)."""
        return self.holding

    def _step(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        self._stepping()
        return self.worker.execute_step(step)

    def _start(self, step: step_mod.StepInput) -> step_mod.StepOutput:
        self._stepping()
        return self.worker.stepper.start(step)

    def _stepping(self) -> None:
        if not self._serving:
            self._serving = True
            niceness.set_niceness(self.worker.label, 0, why="steps")  # followers: their own
        tid = threading.get_native_id()
        if tid != self._step_thread:
            # Steps moved to another thread (plain calls while a new step graph compiles, then
            # the graph's): it may have run background calls before, at BACKGROUND_NICENESS
            # (the survivors of a shrink stepped at 10 after the grow before it).
            self._step_thread = tid
            niceness.thread_niceness(self.worker.label, tid, 0)

    def step_niceness(self) -> int | None:
        """The niceness of the thread that runs this rank's steps (None before the first)."""
        tid = self._step_thread
        return None if tid is None else os.getpriority(os.PRIO_PROCESS, tid)

    # -- weights through the object store (`ray_transfer`, co-located ranks) ---------------
    def export_experts(self, keys: list[tuple[int, int]]) -> ray_transfer.PackedExperts:
        """Live experts `keys` for a co-located peer (the return value goes to shared memory)."""
        self._in_background()
        return ray_transfer.pack_experts(self.worker.slots.held_experts(keys))

    def stage_experts_shared(
        self,
        epoch: int,
        moves: list[Any],
        new_placement: Any,
        parts: list[Any],
        **kwargs: Any,
    ) -> int:
        """`RankWorker.stage_experts` with the experts co-located peers export for this rank
        (`parts`: refs of `export_experts`, copied out as each arrives); returns the bytes
        received by both paths. A rank that will serve takes full CPU priority first."""
        if kwargs.get("new_rank") is not None and not self._serving:
            self._serving = True
            niceness.set_niceness(self.worker.label, 0, why="will serve")
        if kwargs.get("stage") is None and kwargs.get("new_rank") is not None:
            # A resize or a recovery waits for this copy (an EPLB rebalance passes its
            # staging id and does not): it takes the step threads' priority.
            niceness.thread_niceness(self.worker.label, threading.get_native_id(), 0)
        else:
            self._in_background()
        provided, shared_bytes = self._receive(parts)
        received = self.worker.slots.stage_experts(
            epoch, moves, new_placement, provided=provided, **kwargs
        )
        return int(received) + shared_bytes

    def prestage_experts_shared(
        self, epoch: int, moves: list[Any], parts: list[Any], every_move: list[Any]
    ) -> int:
        """`RankWorker.prestage_experts` with what co-located peers exported (refs);
        every_move: the pre-staging's moves, either way."""
        self._in_background()
        provided, shared_bytes = self._receive(parts)
        received = self.worker.prestaged.prestage_experts(
            epoch, moves, provided=provided, every_move=every_move
        )
        return int(received) + shared_bytes

    def _receive(self, parts: list[Any]) -> tuple[dict[Any, Any], int]:
        """Private copies of the exported experts behind `parts` (refs), each unpacked as soon
        as it is in the object store (the copy overlaps the peers' later exports)."""
        provided: dict[Any, Any] = {}
        nbytes = 0
        pending = list(parts)
        started = time.monotonic()
        waited = 0.0
        while pending:
            asked = time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1)
            got = time.monotonic()
            waited += got - asked
            experts, size = ray_transfer.unpack_experts(
                [ray.get(ready[0])], dtype=self.worker.dtype, device=self.worker.device
            )
            provided.update(experts)
            nbytes += size
        if parts:
            log.info(
                "rank %s: %d experts (%d B) from co-located peers in %.2fs (%.2fs waiting for "
                "their exports, %.2fs copying)",
                self.worker.label,
                len(provided),
                nbytes,
                time.monotonic() - started,
                waited,
                time.monotonic() - started - waited,
            )
        return provided, nbytes

    def export_non_expert(self) -> ray_transfer.PackedState:
        """This rank's non-expert weights for co-located new ranks."""
        self._in_background()
        return ray_transfer.pack_state(self._model().non_expert_state())

    def load_non_expert_shared(self, state: ray_transfer.PackedState) -> int:
        """Non-expert weights a co-located peer exported (a new rank); returns bytes."""
        tensors, nbytes = ray_transfer.unpack_state(state)
        self._model().load_non_expert(tensors)
        return nbytes

    def _model(self) -> Any:
        return self.worker.loaded.require(self.worker.where())[1]

    def release_hold(self) -> None:
        """End the hold the step graph's loop waits in (`execute_step`); on the health lane."""
        self._hold.set()

    def echo(self, value: Any) -> Any:
        """Does nothing: the method of the throwaway graph that warms a new actor up."""
        return value


RemoteRankActor: Any = ray.remote(  # type: ignore[call-overload]
    num_cpus=0, concurrency_groups={CTL_LANE: 1, EXPORT_LANE: 1, HEALTH_LANE: 1, END_LANE: 1}
)(RankActor)


@dataclasses.dataclass(frozen=True)
class RankHandle:
    """One DP rank's actor and the placement group it runs in."""

    actor: Any
    pg: Any
    #: Every other actor of the DP rank: stage 0's TP ranks 1..T-1 (`ray_tensor.FollowerActor`),
    #: pipeline stages 1..P-1 (`ray_pipeline.StageActor`), then their TP followers; the actor
    #: leads them (directly or through its stages).
    followers: tuple[Any, ...] = ()
    #: Its pipeline stages 1..P-1 alone (in `followers` too): nodes of the step graph.
    stages: tuple[Any, ...] = ()


Member = roster.Member[RankHandle]
