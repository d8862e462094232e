"""The stage actors of a DP rank at pipeline-parallel size P > 1 (`rank.pipeline_group`).

- `StageActor`: pipeline stage s (1..P-1) of one DP rank, a `stage_worker.StageWorker` in
  its own actor, placed in bundle s x T of the DP rank's placement group (bundle 0 is the
  leader's, stage 0: STRICT_PACK, one node); at T > 1 it leads its stage's TP followers
  (`ray_tensor.FollowerActor`, bundles s x T + 1 .. s x T + T - 1). Three lanes: the default one (load, steps, in
  the order the leader sent them), `CTL_LANE` (joins of stage groups: a join waits for the
  other DP ranks' stages and must not hold the steps; expert reads ahead of a placement
  change: prefetch, pre-staging; a new DP rank's non-expert tensors from its peers) and `HEALTH_LANE` (pings, aborts).
- `RayStages`: the leader's `pipeline_group.Stages` over their handles
  (`ray_tensor.RayFollowers`' waits and pings, naming "pipeline stage s"); a step is a chain
  of calls, each stage's given the previous one's result by reference (Ray passes the hidden
  states from actor to actor through its object store; the leader reads only the last).

The executor creates the stage actors with the leader (`ray_actor.start_ranks`) and hands
their handles to it; removing the DP rank's placement group ends them with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from moe_runtime import logs
from moe_runtime.executor import niceness, ray_tensor
from moe_runtime.rank import allocator, pipeline_group, stage_worker

CTL_LANE = ray_tensor.CTL_LANE
HEALTH_LANE = ray_tensor.HEALTH_LANE
_METHODS = ("join", "load", "step", "shutdown")
#: methods run on `CTL_LANE`, beside the steps
CTL_METHODS = ("join", "prefetch", "prestage", "drop_prestaged", "transfer_non_expert")


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
        tensor = None
        if followers:
            # TP ranks 1..T-1 of this stage (`ray_tensor`): this actor leads them.
            pids = ray.get([f.pid.remote() for f in followers])
            tensor = ray_tensor.RayFollowers(followers, pids)
        self._followers = tensor
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
        if method == "step" and not self._serving:
            self._serving = True
            niceness.set_niceness(self.label, 0, why="steps (pipeline stage)")
        return getattr(self.worker, method)(*args)

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

    def follower_pids(self) -> list[int]:
        return list(self._follower_pids)

    def send(self, method: str, *args: Any) -> Any:
        if method in CTL_METHODS:  # beside the steps (the control lane)
            ctl = {"concurrency_group": CTL_LANE}
            return [getattr(a, method).options(**ctl).remote(*args) for a in self._actors]
        return super().send(method, *args)

    def chain(
        self, epoch: int, frees: Sequence[str], batch: Any, hidden: Any, live: Any
    ) -> list[Any]:
        refs: list[Any] = []
        prev = hidden
        for actor in self._actors:
            prev = actor.call.remote("step", epoch, list(frees), batch, prev, live)
            refs.append(prev)
        return refs

    def abort(self, reason: str) -> None:
        health = {"concurrency_group": HEALTH_LANE}
        refs = [a.abort.options(**health).remote(reason) for a in self._actors]
        ray.wait(refs, num_returns=len(refs), timeout=5.0)

    def abort_join(self, epoch: int) -> None:
        health = {"concurrency_group": HEALTH_LANE}
        for actor in self._actors:  # not awaited: it only marks the epoch
            actor.abort_join.options(**health).remote(epoch)
