"""The rank actor of `RayExecutor` and the plain Ray calls around it.

- `RankActor`: the actor body, a `RankWorker` plus what only Ray knows (node id, address), with
  four concurrency lanes: the default one (the compiled step graph's loop and plain control
  calls made while no step runs), `CTL_LANE` (one thread: background control calls that overlap
  steps), `EXPORT_LANE` (one thread: experts a co-located peer asked for, so an export never
  waits behind a staging call that waits for exports) and `HEALTH_LANE` (pings, never queued
  behind a transfer);
- `RankHandle`: how the executor reaches one DP rank (its actor and placement group; the
  roster keeps it with the rank's info and health);
- `start_ranks` (reading results: `ray_calls`); the heartbeat's calls on the health lane are
  `ray_health`'s; a graph step over the TP followers: `ray_mesh`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import ray.exceptions
import ray.util

from moe_contract import names, protocol
from moe_runtime import logs
from moe_runtime import step as step_mod
from moe_runtime.executor import (
    base,
    guards,
    niceness,
    ray_bundles,
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
HEALTH_LANE = "health"
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
            self._mesh = ray_mesh.MeshStep(self._step, stages=pipeline, lanes=1 + len(stages))
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


def start_ranks(
    count: int,
    *,
    first_label: int,
    use_gpu: bool,
    dtype: str,
    timeout: float,
    driver_node: str,
    existing: Sequence[Mapping[str, Any]],
    spare: bool = False,
    hooks: hooks_mod.HooksFactory | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    micro_batch_tokens: int | None = None,
    env: Mapping[str, str] | None = None,
    expert_layout: str = "leader",
) -> list[Member]:
    """Placement groups, then actors; wait until all answer; sort (`base.order_ranks`, with
    the nodes of existing ranks counted); label from first_label. `spare`: warm spares (below
    the serving ranks' CPU priority); `hooks`: the factory of their rank hooks. Each DP rank's
    placement group holds T x P bundles on one node (`bundles`), bundle s x T + t holding TP
    rank t of pipeline stage s: the leader in bundle 0 leads stage 0's TP followers
    (`ray_tensor`) and the stage actors (`ray_pipeline`), each leading its own stage's.
    `micro_batch_tokens`, `expert_layout`: the leader's (`pipeline_group.micro_batches`,
    `model.tensor_parallel`). `existing`: the infos of running ranks (`node_id`, `ip`); ranks on
    two nodes that report one IP are refused (`guards.check_node_ips`). `env`: the head's
    variables every actor gets (`guards.rank_env`)."""
    bundle_list = ray_bundles.bundles(tp_size * pp_size, use_gpu=use_gpu)
    bundle = bundle_list[0]
    pgs = [ray.util.placement_group(bundle_list, strategy="STRICT_PACK") for _ in range(count)]
    actors: list[Any] = []
    followers: list[tuple[Any, ...]] = []
    stage_actors: list[tuple[Any, ...]] = []
    try:
        try:
            ray.get([pg.ready() for pg in pgs], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"{count} placement groups of {len(bundle_list)} x {bundle} were not scheduled "
                f"within {timeout}s: the cluster offers {ray_bundles.free(RANK_RESOURCE)} free "
                f"{RANK_RESOURCE}"
            ) from None
        device = "cuda" if use_gpu else "cpu"
        # A spare's process lowers its priority before it imports the runtime (~3 s of CPU);
        # a grow's (ranks start beside serving ones: `existing`) takes the serving ranks'
        # priority (the grow waits for it; a no-op where the cluster's workers start there,
        # `cluster.WORKER_NICENESS`, but a worker at Ray's default niceness 15 beside busy
        # ranks took ~90 s to import). Either hook is a runtime_env of its own (a process of
        # its own, never a pooled idle worker), with the head's copied variables (`env`).
        hook = niceness.SPARE_SETUP_HOOK if spare else niceness.GROW_SETUP_HOOK
        leader_options = guards.actor_env_options(
            env or {}, {niceness.SETUP_HOOK_ENV: hook} if spare or existing else {}
        )
        mesh = {"device": device, "expert_layout": expert_layout}  # every actor of a DP rank
        follower = {**mesh, "tp_size": tp_size, "stages": pp_size, "spare": spare}
        for i, pg in enumerate(pgs):
            # Bundle s x T + t; the followers take the leader's options (a whole DP rank).
            label = first_label + i
            tp = [
                tuple(
                    ray_tensor.RemoteFollower.options(
                        **ray_bundles.options(pg, s * tp_size + t, use_gpu, leader_options)
                    ).remote(label=label, tp_rank=t, stage=s, **follower)
                    for t in range(1, tp_size)
                )
                for s in range(pp_size)
            ]
            stages = tuple(
                ray_pipeline.RemoteStage.options(
                    **ray_bundles.options(pg, s * tp_size, use_gpu, leader_options)
                ).remote(label=label, stage=s, size=pp_size, followers=tp[s], **mesh)
                for s in range(1, pp_size)
            )
            stage_actors.append(stages)
            # every actor of the DP rank besides its leader (killed with it)
            followers.append(tp[0] + stages + tuple(f for fs in tp[1:] for f in fs))
            actors.append(
                RemoteRankActor.options(
                    **ray_bundles.options(pg, 0, use_gpu, leader_options)
                ).remote(
                    label=label,
                    device=device,
                    dtype=dtype,
                    spare=spare,
                    hooks=hooks,
                    followers=tp[0],
                    stages=stages,
                    micro_batch_tokens=micro_batch_tokens,
                    expert_layout=expert_layout,
                )
            )
        infos = ray_calls.get_all(
            [a.ready.remote() for a in actors],
            list(range(first_label, first_label + count)),
            what="ready",
            timeout=timeout,
        )
        for label, info in zip(range(first_label, first_label + count), infos, strict=True):
            protocol.check(info, where=f"rank {label}")
        guards.check_node_ips(infos, existing=existing)
    except BaseException:
        for a in [*actors, *(f for fs in followers for f in fs)]:
            ray.kill(a)
        for pg in pgs:
            ray.util.remove_placement_group(pg)
        raise
    order = base.order_ranks(
        infos, driver_node=driver_node, existing_nodes=[str(i["node_id"]) for i in existing]
    )
    started = [
        roster.Member(
            label=first_label + offset,
            handle=RankHandle(actors[i], pgs[i], followers[i], stage_actors[i]),
            info=infos[i],
        )
        for offset, i in enumerate(order)
    ]
    ray.get([m.handle.actor.execute_method.remote("set_label", m.label) for m in started])
    log.info(
        "started ranks %s on nodes %s",
        [m.label for m in started],
        [m.info["node_id"][:8] for m in started],
    )
    return started
