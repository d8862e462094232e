"""Tensor parallelism inside a DP rank at serving time: the leader (TP rank 0, the DP rank's
`RankWorker`) and its followers (TP ranks 1..T-1, `TensorFollower`), docs/TENSOR-PARALLEL.md.

The DP rank stays one rank for everything elastic (roster, step and transfer groups, expert
parallelism, EPLB, resizes, spares, recovery): only its leader is seen. The leader holds its
TP shard of the non-expert weights and every routed expert of the DP rank; a follower holds
only its TP shard and a KV cache of its heads. Each forward pass of the leader with tokens is
sent to its followers first (`TensorLeader.begin`: the same sequences, start positions and KV
frees), then all run it together, synchronised by the TP group (`comm.group.StatelessGroup`
over loopback, gloo on CPU and NCCL on GPU); only the leader samples.

Failures: a follower that died, or whose step failed, fails the leader's step; a follower
that is dead or does not answer pings for `FOLLOWER_HANG_S` makes the leader's pings fail
(`FollowerLost`, `RankWorker.fail`), so the executor's recovery takes the whole DP rank out.
After a step that failed on a live TP group, the group is aborted (no follower waits in a
collective the leader left) and the next step forms a new one (a new TP epoch).

Nothing here knows about Ray: the leader reaches its followers through `Followers`
(`executor.ray_tensor` implements it over follower actors).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.comm import shm
from moe_runtime.model import decoder, pipeline, tp_shard
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import tensor_parallel as tp_mod
from moe_runtime.rank import mesh as mesh_mod

log = logging.getLogger(__name__)

#: Seconds a follower may leave a ping unanswered before its DP rank is reported lost.
FOLLOWER_HANG_S = float(os.environ.get("MOE_TP_FOLLOWER_HANG_SECONDS", "10"))
#: Seconds a TP group's join, and each of its collectives, may take.
GROUP_TIMEOUT_S = 60.0
#: Seconds the leader waits for its followers' load.
LOAD_TIMEOUT_S = 600.0


class FollowerLost(RuntimeError):
    """A follower died or hangs: its DP rank cannot step again."""


class Followers(Protocol):
    """How a leader reaches its followers (one call per follower, in TP rank order 1..T-1)."""

    def send(self, method: str, *args: Any) -> Any:
        """Start `TensorFollower.<method>(*args)` on every follower; a handle for `wait`."""

    def wait(self, pending: Any, timeout: float | None) -> list[Any]:
        """The followers' results; FollowerLost naming a dead one, RuntimeError for a call
        that raised, TimeoutError for one still running after `timeout` s."""

    def alive(self) -> str | None:
        """None while every follower answers pings (checked without blocking), else why
        not (dead, or no answer for FOLLOWER_HANG_S)."""

    def pids(self) -> list[int]:
        """The followers' process ids."""


class NoExperts:
    """A follower's expert backend: it never runs a routed expert (the leader does)."""

    def __call__(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        raise RuntimeError("a TP follower runs no routed expert")


def plan(config: Any, *, rank: int, size: int) -> tp_shard.Shard:
    """`tp_shard.plan` (ValueError naming the field when T does not fit the model)."""
    return tp_shard.plan(config, rank=rank, size=size)


def backend_for(device: str) -> group_mod.Backend:
    return "nccl" if device.startswith("cuda") else "gloo"


def restore_kv(kv: kv_mod.KVCache, batch: kv_mod.ForwardBatch) -> None:
    """The KV state before a failed forward pass of `batch` (the step may be sent again)."""
    for seq_id, start in zip(batch.seq_ids, batch.start_pos, strict=True):
        if start == 0:
            kv.free(seq_id)
        else:
            kv.reserve(seq_id, start, 0)


def follower_spec(spec: group_mod.GroupSpec, size: int) -> group_mod.GroupSpec:
    """The rendezvous of the followers' group beside the leaders' group `spec` at TP size
    `size`: DP x (T-1) members, TP rank t of DP rank d member d x (T-1) + t - 1; a FileStore
    beside the leaders' (one host), or keys of its own in their TCPStore."""
    world = spec.world_size * (size - 1)
    if spec.store_path is not None:
        return dataclasses.replace(
            spec, store_path=f"{spec.store_path}.followers", world_size=world
        )
    namespace = f"{spec.namespace}followers/"
    return dataclasses.replace(spec, namespace=namespace, hosted=False, world_size=world)


class TensorLeader:
    """The leader's side of its TP group: the group, the followers, KV frees still to send."""

    def __init__(
        self,
        followers: Followers,
        *,
        size: int,
        device: str,
        expert_layout: str = tp_mod.LEADER,
    ) -> None:
        self.followers = followers
        self.size = size
        self.device = device
        self.expert_layout = expert_layout
        self.group: group_mod.StatelessGroup | None = None
        #: what the model's TP part calls: the group, its small collectives through shared
        #: memory on a CPU host (`comm.shm`)
        self.collective: Any = None
        self.epoch = 0
        self._frees: list[str] = []
        self._lost: str | None = None
        #: the live token the followers were last sent with its placement (mesh layout)
        self._sent: mesh_mod.Token | None = None
        #: experts the followers read from the model source in the last step (mesh layout:
        #: a placement change no prefetch prepared)
        self.step_reads = 0

    @property
    def mesh(self) -> bool:
        """Whether the followers hold parts of the routed experts (`rank.mesh`)."""
        return self.expert_layout == tp_mod.MESH

    # -- the group ---------------------------------------------------------------------
    def ensure_group(self) -> Any:
        """The live TP group's collectives (`collective`), formed anew (next TP epoch) when
        there is none or it failed."""
        if self.group is not None and self.group.failure is None:
            return self.collective
        if self.group is not None:
            self.group.destroy()
            self.group = None
        self.epoch += 1
        spec = group_mod.GroupSpec.local(
            self.size, epoch=self.epoch, backend=backend_for(self.device)
        )
        pending = self.followers.send("join", spec)
        group = group_mod.StatelessGroup(spec, 0, timeout=GROUP_TIMEOUT_S)
        try:
            collective = shm.collective(group)  # with the followers' joins
        except Exception:
            group.destroy()
            raise
        self._wait(pending, GROUP_TIMEOUT_S)
        self.group, self.collective = group, collective
        return collective

    def abort(self, reason: str) -> None:
        """Let the TP group go now: a follower waiting in one of its collectives stops (and,
        in the mesh layout, the followers' mesh groups)."""
        if self.group is not None:
            self.group.abort(reason)
        if self.mesh:
            try:
                self.followers.send("abort", reason)
            except Exception:  # noqa: BLE001 - a dead follower has no group to abort
                log.debug("aborting the followers' mesh groups failed", exc_info=True)

    # -- loading -----------------------------------------------------------------------
    def start_load(
        self, source: str, cfg: Any, *, dtype: torch.dtype, experts: tuple[Any, ...] = ()
    ) -> tuple[tp_mod.TensorParallel, Any]:
        """TP rank 0's part (its shard plan over a fresh group) and its followers' load of
        `source` started (a handle for `finish_load`); `experts`: (DP rank, DP size,
        placement, placeholder): in the mesh layout each follower reads its part of the
        placement's slots; placeholder: zeros for their shards (`transfer_non_expert`)."""
        shard = plan(cfg, rank=0, size=self.size)
        group = self.ensure_group()
        name = str(dtype).removeprefix("torch.")
        if experts and not self.mesh:  # no placement: the leader holds every routed expert
            experts = (*experts[:2], None, *experts[3:])
        pending = self.followers.send("load", source, name, *experts)
        self._frees = []
        self._sent = None
        return tp_mod.TensorParallel(shard, group, expert_layout=self.expert_layout), pending

    def model(
        self,
        source: str,
        cfg: Any,
        *,
        dtype: torch.dtype,
        pp: pipeline.PipelineStage | None = None,
        experts: tuple[Any, ...] = (),
    ) -> tuple[decoder.MoEModel, tp_shard.Shard, Any]:
        """The leader's (empty) model of TP rank 0 (of pipeline stage `pp`) over a fresh
        group, and its followers' load of `source` started (a handle for `finish_load`)."""
        tp, pending = self.start_load(source, cfg, dtype=dtype, experts=experts)
        model = decoder.MoEModel(cfg, dtype=dtype, device=self.device, tp=tp, pp=pp)
        return model, tp.shard, pending

    def finish_load(self, pending: Any) -> None:
        self._wait(pending, LOAD_TIMEOUT_S)

    def transfer_non_expert(
        self, group: group_mod.StatelessGroup, src_ranks: Sequence[int], dst_ranks: Sequence[int]
    ) -> Callable[[], int]:
        """The followers' part of their leaders' non-expert transfer over `group` (the leaders'
        transfer group, or a stage's; its ranks): TP rank t of each DP rank of `dst_ranks`
        receives its shard from TP rank t of one of `src_ranks` (`TensorFollower.
        transfer_non_expert`, beside the steps). Returns the wait for it (bytes received)."""
        spec = follower_spec(group.spec, self.size)
        args = (spec, group.rank, list(src_ranks), list(dst_ranks))
        pending = self.followers.send("transfer_non_expert", *args)
        return lambda: sum(int(n) for n in self._wait(pending, LOAD_TIMEOUT_S))

    # -- steps -------------------------------------------------------------------------
    def free(self, seq_ids: Sequence[str]) -> None:
        """KV frees to send with the next forward pass (a follower frees them then)."""
        self._frees.extend(seq_ids)

    def begin(
        self,
        model: decoder.MoEModel,
        batch: kv_mod.ForwardBatch,
        hidden: torch.Tensor | None = None,
        live: tuple[mesh_mod.Token, Any] | None = None,
    ) -> Any:
        """Send the forward pass of `batch` (and the KV frees before it) to the followers,
        over a live TP group; a handle for `end`. `hidden`: the previous pipeline stage's
        hidden states (a stage after the first); `live`: the leader's (token, placement) in
        the mesh layout (the placement goes only with a token the followers were not sent)."""
        self.check()
        group = self.ensure_group()
        assert model.tp is not None
        model.tp.group = group
        frees, self._frees = self._frees, []
        if live is None:
            return self.followers.send("step", self.epoch, frees, batch, hidden)
        token, placement = live
        sent = (token, None if token == self._sent else placement)
        self._sent = None  # until the step is seen through (`end`)
        return (token, self.followers.send("step", self.epoch, frees, batch, hidden, sent))

    def end(self, pending: Any, *, failed: BaseException | None = None) -> None:
        """Wait for the followers' part of the step. After a failed forward pass of the
        leader (`failed`) the group is aborted first, so none of them waits for it."""
        token = None
        if isinstance(pending, tuple):
            token, pending = pending
        if failed is not None:
            self.abort(f"the leader's forward pass failed: {type(failed).__name__}")
            try:
                self._wait(pending, GROUP_TIMEOUT_S)
            except FollowerLost:
                raise
            except Exception:  # noqa: BLE001 - their step failed with the leader's
                log.debug("followers' step failed with the leader's", exc_info=True)
            return
        try:
            answers = self._wait(pending, GROUP_TIMEOUT_S)
        except FollowerLost:
            raise
        except Exception:
            self.abort("a follower's step failed")
            raise
        self._sent = token
        self.step_reads = sum(int(a.get("reads", 0)) for a in answers if isinstance(a, dict))

    # -- health ------------------------------------------------------------------------
    def check(self) -> None:
        """FollowerLost once a follower died or hangs (its DP rank cannot step again)."""
        if self._lost is None:
            self._lost = self.followers.alive()
        if self._lost is not None:
            raise FollowerLost(self._lost)

    def _wait(self, pending: Any, timeout: float) -> list[Any]:
        try:
            return self.followers.wait(pending, timeout)
        except FollowerLost as exc:
            self._lost = str(exc)
            raise

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
