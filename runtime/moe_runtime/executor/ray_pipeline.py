"""The stage actors of a DP rank at pipeline-parallel size P > 1 (`rank.pipeline_group`).

- `StageActor`: pipeline stage s (1..P-1) of one DP rank, a `stage_worker.StageWorker` in
  its own actor, placed in bundle s x T of the DP rank's placement group (bundle 0 is the
  leader's, stage 0: STRICT_PACK, one node); at T > 1 it leads its stage's TP followers
  (`ray_tensor.FollowerActor`, bundles s x T + 1 .. s x T + T - 1). Three lanes: the default one (load, steps, in
  the order the leader sent them), `CTL_LANE` (joins of stage groups: a join waits for the
  other DP ranks' stages and must not hold the steps; expert reads ahead of a placement
  change: prefetch, pre-staging; a new DP rank's non-expert tensors from its peers) and `HEALTH_LANE` (pings, aborts).
- `RayStages`: the leader's `pipeline_group.Stages` over their handles
  (`ray_tensor.RayFollowers`' waits and pings, naming "pipeline stage s"). In the compiled
  step graph (`ray_mesh`) each stage has a node per micro-batch lane (`StageActor.graph_step`)
  and a step's micro-batches go through the graph's channels (`StageLane`: the hidden states
  from stage to stage, the last stage's answer back to the leader's `finish_step`; large
  host tensors by object reference, `Shipper`); `chain` then hands the micro-batch to its
  lane (`lanes`). Over plain calls
  a step is a chain of calls, each stage's given the previous one's result by reference (Ray
  passes the hidden states from actor to actor through its object store; the leader reads
  only the last).

The executor creates the stage actors with the leader (`ray_start.start_ranks`) and hands
their handles to it; removing the DP rank's placement group ends them with it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import ray
import ray.dag
import torch

from moe_runtime import logs
from moe_runtime.executor import niceness, ray_tensor
from moe_runtime.rank import allocator, pipeline_group, sampling, stage_worker, tensor_group

CTL_LANE = ray_tensor.CTL_LANE
HEALTH_LANE = ray_tensor.HEALTH_LANE
_METHODS = ("join", "load", "step", "shutdown")
#: methods run on `CTL_LANE`, beside the steps
CTL_METHODS = ("join", "prefetch", "prestage", "drop_prestaged", "transfer_non_expert")
#: Seconds between the pings of a leader waiting for a micro-batch's answer from the step
#: graph (`RayStages.wait`): a stage that died ends the wait within about that.
LANE_PING_S = 0.2
#: The share of a graph channel's buffer (`RAY_CGRAPH_buffer_size_bytes`, 1 MB by default)
#: from which a host tensor in a lane (hidden states, logits) goes through Ray's object store,
#: the lane carrying its reference (`Shipper`): a channel that once carried more than its
#: buffer grows, and in Ray 2.60 the graph's teardown (every switch) then hangs for good,
#: pickled or by tensor transport alike (`bench/graph_lanes.py`); the rest of a lane (the
#: micro-batch's token ids, a placement, expert loads) has the other three quarters. Device
#: tensors stay in the lane (NCCL carries them out of band).
LANE_INLINE_SHARE = 0.25
#: References a process keeps to the tensors it shipped, newest last (each is read within
#: its step: this covers P <= 8 lanes of two steps in flight).
LANE_KEPT_REFS = 16


class Shipper:
    """Ships a lane's large host tensors through the object store (`LANE_INLINE_SHARE`) and
    lands what it gets: `ship` on the writing side, `land` on the reading side of a lane."""

    def __init__(self) -> None:
        self._kept: collections.deque[Any] = collections.deque(maxlen=LANE_KEPT_REFS)
        #: bytes from which a host tensor is shipped: a share of this process's channel
        #: buffer (a larger `RAY_CGRAPH_buffer_size_bytes` keeps more in the lanes)
        buffer = ray.dag.DAGContext.get_current().buffer_size_bytes
        self.inline_bytes = int(buffer * LANE_INLINE_SHARE)

    def ship(self, value: Any) -> Any:
        """`value` (a tensor, or a stage's answer: its "out"), a large host tensor replaced
        by its object reference, kept alive here until `LANE_KEPT_REFS` later ones."""
        if isinstance(value, dict) and "out" in value:
            return {**value, "out": self.ship(value["out"])}
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            return value
        if value.numel() * value.element_size() < self.inline_bytes:
            return value
        ref = ray.put(value)
        self._kept.append(ref)
        return ref

    @staticmethod
    def land(value: Any) -> Any:
        """`value` with a shipped tensor read back from the object store."""
        if isinstance(value, dict) and "out" in value:
            return {**value, "out": Shipper.land(value["out"])}
        if isinstance(value, ray.ObjectRef):
            return ray.get(value, timeout=pipeline_group.STEP_TIMEOUT_S)
        return value


@dataclasses.dataclass(frozen=True)
class StageLane:
    """One micro-batch lane of a step through a DP rank's stages in the step graph
    (`ray_mesh`): the leader's `prepare_step` (lane 0) or `next_lane` node hands it to stage
    1's node of that lane, each stage's node to the next one's, the last stage's to the
    leader's `finish_step`. `args`: the arguments of `StageWorker.step` (epoch, frees, the
    micro-batch, the previous stage's hidden states or answer, the live token); None: nothing
    to run in this lane (no such micro-batch, a probe, a hold: `ray_tensor.HOLD_STEP_ID`).
    `answer`: the last stage's; `reads`: experts the stages read from the source so far;
    `error`: why a stage failed (the later stages pass it on); `lost`: it failed because
    one of its TP followers is lost (`tensor_group.FollowerLost`: so is the DP rank).
    `sample`: how the last stage samples each sequence of the micro-batch (an interleaved
    graph step, `Stepper.start`): its answer is then {"tokens" by sequence id, "loads",
    "reads", "answered_at" (monotonic)}, not the logits, and goes to the driver."""

    step_id: int
    lane: int
    args: tuple[Any, ...] | None = None
    sample: tuple[pipeline_group.Sampling, ...] | None = None
    answer: dict[str, Any] | None = None
    reads: int = 0
    error: str | None = None
    lost: bool = False


def hold_lane(stage: int, size: int) -> int:
    """The lane whose node holds a parked graph's loop on pipeline stage `stage` of `size` (the
    leader: stage 0, its `next_lane` nodes): P - 1 - s. A node holds after it read its input
    and before it writes, so each actor must hold in a node whose input its upstream wrote
    before holding itself: the leader in its last lane (its input is its own previous lane),
    stage s one lane earlier than stage s - 1, the last stage in lane 0. So every loop waits
    on its event, none spins on a channel read (`ray_step`, "Parking")."""
    return size - 1 - stage


class Lanes(Protocol):
    """A leader's graph step as its stages' `chain` sees it (`ray_mesh`'s job)."""

    def hand_lane(self, args: tuple[Any, ...], sample: Any = None) -> Any:
        """Send the next micro-batch (`StageWorker.step`'s arguments; `StageLane.sample`)
        down its lane; a handle for `wait_lane`."""

    def wait_lane(self, lane: int, timeout: float, check: Callable[[], None]) -> StageLane:
        """The last stage's `StageLane` of `lane`, within `timeout` s (TimeoutError); raises
        when the step was cancelled, and what `check()` raises (called every
        `LANE_PING_S`: a lost stage)."""

    def cancel(self, reason: str) -> None:
        """End every wait for a lane now (the stages' groups were aborted)."""


class StageActor:
    """Pipeline stage `stage` of `size` of DP rank `label` (module docstring)."""

    def __init__(
        self,
        *,
        label: int,
        stage: int,
        size: int,
        device: str,
        followers: Sequence[Any] = (),
        expert_layout: str = "leader",
    ) -> None:
        logs.configure_rank()
        allocator.tune()
        import torch

        torch.set_num_threads(1)
        self.label = label
        self._serving = False
        self._last = stage == size - 1
        self._hold_lane = hold_lane(stage, size)
        #: a graph step and a plain call's step never run at once (`ray_tensor.FollowerActor`)
        self._step_lock = threading.Lock()
        #: set by `release_hold`: the graph loop, parked in a hold, goes on
        self._hold = threading.Event()
        #: forward passes from graph nodes and from plain calls; whether the graph loop waits
        #: in a hold; the monotonic start of each lane's last forward pass (tests, benches)
        self.steps: dict[str, Any] = {"graph": 0, "plain": 0, "holding": 0, "started": {}}
        tensor = None
        if followers:
            # TP ranks 1..T-1 of this stage (`ray_tensor`): this actor leads them.
            pids = ray.get([f.pid.remote() for f in followers])
            tensor = ray_tensor.RayFollowers(followers, pids)
        self._followers = tensor
        self._shipper = Shipper()  # its lanes' large tensors
        self.worker = stage_worker.StageWorker(
            stage=stage,
            size=size,
            device=device,
            label=label,
            followers=tensor,
            tensor_size=1 + len(followers),
            expert_layout=expert_layout,
        )

    def promote(self) -> None:
        niceness.set_niceness(self.label, 0, why="serves (pipeline stage)")
        if self._followers is not None:
            self._followers.promote(ray_tensor.PROMOTE_TIMEOUT_S)

    def pid(self) -> int:
        import os

        return os.getpid()

    def follower_pids(self) -> list[int]:
        """The process ids of this stage's TP followers (none at T = 1)."""
        return self.worker.pids()

    def call(self, method: str, *args: Any) -> Any:
        if method not in _METHODS:
            raise AttributeError(f"a pipeline stage has no method {method!r}")
        if method == "step":
            self.steps["plain"] += 1
            return self._step(args)
        return getattr(self.worker, method)(*args)

    def _step(self, args: tuple[Any, ...], *, on_device: bool = False) -> dict[str, Any]:
        if not self._serving:
            self._serving = True
            niceness.set_niceness(self.label, 0, why="steps (pipeline stage)")
        with self._step_lock:
            return self.worker.step(*args, on_device=on_device)

    def graph_step(self, work: StageLane) -> StageLane:
        """Its node of one lane of the step graph (`ray_mesh`): the micro-batch the previous
        stage (or the leader) handed down, run, and handed on: the next stage gets this
        stage's answer as its `prev`, the leader (after the last stage) the answer. Nothing
        to run, or an error of an earlier stage: passed on. A hold waits in one lane's node
        (`hold_lane`; the other lanes' pass). Never raises (an error would fail every rank's
        output of the step): a failed forward pass answers ``error``; its leader's step fails
        with it."""
        if work.step_id == ray_tensor.HOLD_STEP_ID and work.lane == self._hold_lane:
            self.steps["holding"] = 1
            self._hold.wait()
            self._hold.clear()
            self.steps["holding"] = 0
            return work
        if work.args is None or work.error is not None:
            return work
        self.steps["graph"] += 1
        self.steps["started"][work.lane] = time.monotonic()
        epoch, frees, batch, prev, live = work.args
        try:
            args = (epoch, frees, batch, self._shipper.land(prev), live)
            answer = self._step(args, on_device=True)  # the graph's transport carries it
            if self._last and work.sample is not None:
                answer = _sampled(answer, batch.seq_ids, work.sample)
        except Exception as exc:  # noqa: BLE001 - answered; the leader's step fails with it
            lost = isinstance(exc, tensor_group.FollowerLost)
            error = f"{type(exc).__name__}: {exc}"
            return dataclasses.replace(work, args=None, error=error, lost=lost)
        reads = work.reads + int(answer.get("reads", 0))
        answer = self._shipper.ship(answer)
        if self._last:
            return dataclasses.replace(work, args=None, answer=answer, reads=reads)
        return dataclasses.replace(work, args=(epoch, frees, batch, answer, live), reads=reads)

    def step_counts(self) -> dict[str, Any]:
        """Forward passes from the step graph and from plain calls, whether the graph loop
        waits in a parked graph's hold now, and when each lane's last one started (tests,
        benchmarks)."""
        return {**self.steps, "started": dict(self.steps["started"])}

    def release_hold(self) -> None:
        """End the hold its graph loop waits in (`graph_step`); on the health lane."""
        self._hold.set()

    def echo(self, value: Any) -> Any:
        """Does nothing: the method of the throwaway graph that warms a new actor up."""
        return value

    def join(self, *args: Any) -> None:
        self.worker.join(*args)

    def prefetch(self, *args: Any) -> int:
        return self.worker.prefetch(*args)

    def prestage(self, *args: Any) -> int:
        return self.worker.prestage(*args)

    def drop_prestaged(self, *args: Any) -> int:
        return self.worker.drop_prestaged(*args)

    def transfer_non_expert(self, *args: Any) -> int:
        return self.worker.transfer_non_expert(*args)

    def ping(self) -> dict[str, Any]:
        return self.worker.ping()

    def abort(self, reason: str) -> None:
        self.worker.abort(reason)

    def abort_join(self, epoch: int) -> None:
        self.worker.abort_join(epoch)


def _sampled(
    answer: dict[str, Any], seq_ids: Sequence[str], sample: Sequence[pipeline_group.Sampling]
) -> dict[str, Any]:
    """The last stage's answer of an interleaved graph step: its logits sampled here (one host
    read), the tokens by sequence id instead of the logits."""
    params, generated = [p for p, _ in sample], [n for _, n in sample]
    tokens = sampling.sample(answer["out"], params, generated)
    return {
        "tokens": dict(zip(seq_ids, tokens, strict=True)),
        "loads": answer["loads"],
        "reads": answer.get("reads", 0),
        "answered_at": time.monotonic(),
    }


RemoteStage: Any = ray.remote(  # type: ignore[call-overload]
    num_cpus=0, concurrency_groups={CTL_LANE: 1, HEALTH_LANE: 1}
)(StageActor)


class RayStages(ray_tensor.RayFollowers):
    """`pipeline_group.Stages` over stage actor handles (stages 1..P-1, in order)."""

    def __init__(
        self, actors: Sequence[Any], pids: Sequence[int], follower_pids: Sequence[int] = ()
    ) -> None:
        super().__init__(actors, pids, what="pipeline stage", lost=pipeline_group.StageLost)
        self._follower_pids = list(follower_pids)
        #: While a graph step runs (`ray_mesh.MeshStep`): its job, which takes the `chain`s of
        #: its thread (`lanes_thread`) down the graph's lanes; None: plain calls.
        self.lanes: Lanes | None = None
        self.lanes_thread: int | None = None
        self._shipper = Shipper()

    def follower_pids(self) -> list[int]:
        return list(self._follower_pids)

    def send(self, method: str, *args: Any) -> Any:
        if method in CTL_METHODS:  # beside the steps (the control lane)
            ctl = {"concurrency_group": CTL_LANE}
            return [getattr(a, method).options(**ctl).remote(*args) for a in self._actors]
        return super().send(method, *args)

    def chain(
        self,
        epoch: int,
        frees: Sequence[str],
        batch: Any,
        hidden: Any,
        live: Any,
        sample: Sequence[pipeline_group.Sampling] | None = None,
    ) -> Any:
        lanes = self.lanes
        if lanes is not None and threading.get_ident() == self.lanes_thread:
            # a graph step (not the tail of a plain call's step): down its next lane
            args = (epoch, list(frees), batch, self._shipper.ship(hidden), live)
            return lanes.hand_lane(args, None if sample is None else tuple(sample))
        if sample is not None:
            raise RuntimeError("only a graph step's last stage samples (an interleaved step)")
        refs: list[Any] = []
        prev = hidden
        for actor in self._actors:
            prev = actor.call.remote("step", epoch, list(frees), batch, prev, live)
            refs.append(prev)
        return refs

    def wait(self, pending: Any, timeout: float | None) -> list[Any]:
        if not isinstance(pending, LanePending):
            return super().wait(pending, timeout)
        lane = pending.lanes.wait_lane(
            pending.lane,
            pipeline_group.STEP_TIMEOUT_S if timeout is None else timeout,
            self._check,
        )
        if lane.error is not None:
            if lane.lost:  # as `RayFollowers.wait` says of a plain call's FollowerLost
                raise self._lost_type(f"a pipeline stage lost a TP follower: {lane.error}")
            raise RuntimeError(f"a pipeline stage failed in the step graph: {lane.error}")
        if lane.answer is None:
            raise RuntimeError(f"lane {pending.lane} of the step graph came back empty")
        return [{**Shipper.land(lane.answer), "reads": lane.reads}]  # every stage's reads

    def _check(self) -> None:
        why = self.alive()
        if why is not None:
            raise self._lost_type(why)

    def abort(self, reason: str) -> None:
        lanes = self.lanes
        if lanes is not None:  # a leader waiting for the graph's answer stops
            lanes.cancel(reason)
        health = {"concurrency_group": HEALTH_LANE}
        refs = [a.abort.options(**health).remote(reason) for a in self._actors]
        ray.wait(refs, num_returns=len(refs), timeout=5.0)

    def abort_join(self, epoch: int) -> None:
        health = {"concurrency_group": HEALTH_LANE}
        for actor in self._actors:  # not awaited: it only marks the epoch
            actor.abort_join.options(**health).remote(epoch)


@dataclasses.dataclass(frozen=True)
class LanePending:
    """`RayStages.chain`'s handle of a micro-batch sent down lane `lane` of a graph step."""

    lanes: Lanes
    lane: int
