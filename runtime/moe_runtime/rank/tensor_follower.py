"""A tensor-parallel follower at serving time (`TensorFollower`): TP rank t (1..T-1) of one DP
rank, or of one of its pipeline stages; its leader's side: `tensor_group.TensorLeader`
(docs/TENSOR-PARALLEL.md)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.comm import shm
from moe_runtime.model import decoder, pipeline
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import source as source_mod
from moe_runtime.model import tensor_parallel as tp_mod
from moe_runtime.rank import mesh as mesh_mod
from moe_runtime.rank import staging as staging_mod
from moe_runtime.rank.tensor_group import GROUP_TIMEOUT_S, NoExperts, plan, restore_kv

log = logging.getLogger(__name__)


class TensorFollower:
    """TP rank `rank` of `size` of one DP rank (of its pipeline stage `stage` of `stages`): its
    shard, its KV cache, its TP group."""

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        device: str,
        label: int | None = None,
        stage: int = 0,
        stages: int = 1,
        expert_layout: str = tp_mod.LEADER,
    ) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.label = label
        self.stage = stage
        self.stages = stages
        self.expert_layout = expert_layout
        self.group: group_mod.StatelessGroup | None = None
        #: the group's collectives as the model calls them (`comm.shm`)
        self.collective: Any = None
        self.epoch = 0
        self.model: decoder.MoEModel | None = None
        self.kv: kv_mod.KVCache | None = None
        self.steps = 0
        #: its part of the DP rank's routed experts (the `mesh` layout), else None
        self.experts: mesh_mod.MeshExperts | None = None
        if expert_layout == tp_mod.MESH:
            # at P > 1: its part of its stage's MoE layers (the stage's rows of a placement)
            self.experts = mesh_mod.MeshExperts(
                part=rank, size=size, device=device, where=self.where
            )

    def where(self) -> str:
        pp = f" pp={self.stage}/{self.stages}" if self.stages > 1 else ""
        return f"rank label={self.label} tp={self.rank}/{self.size}{pp} tp_epoch={self.epoch}"

    def join(self, spec: group_mod.GroupSpec) -> None:
        """Join the leader's TP group of `spec.epoch` (the last one replaces any before it)."""
        group = group_mod.StatelessGroup(spec, self.rank, timeout=GROUP_TIMEOUT_S)
        try:
            collective = shm.collective(group)  # with the leader's `ensure_group`
        except Exception:
            group.destroy()
            raise
        old, self.group, self.epoch = self.group, group, spec.epoch
        self.collective = collective
        if old is not None:
            old.destroy()
        if self.model is not None and self.model.tp is not None:
            self.model.tp.group = collective

    def load(
        self,
        source: str,
        dtype: str,
        rank: int = 0,
        num_ranks: int = 1,
        placement: Any = None,
        placeholder: bool = False,
    ) -> int:
        """Read this TP rank's shard of `source` (only its bytes where the checkpoint allows;
        placeholder: zeros, a new DP rank's, which `transfer_non_expert` fills); an empty KV
        cache of its heads; in the mesh layout its part of DP rank `rank`'s slots under
        `placement` too (at P > 1 its stage's rows of it). Returns the bytes held."""
        if self.group is None:
            raise RuntimeError(f"no TP group joined ({self.where()})")
        started = time.monotonic()
        src = source_mod.open_source(source)
        shard = plan(src.config, rank=self.rank, size=self.size)
        stage = None
        if self.stages > 1:
            stage = pipeline.plan(src.config, stage=self.stage, size=self.stages)
        torch_dtype = getattr(torch, dtype)
        tp = tp_mod.TensorParallel(shard, self.collective, expert_layout=self.expert_layout)
        model = decoder.MoEModel.from_source(  # placeholder: a new DP rank's, from its peers
            src, dtype=torch_dtype, device=self.device, tp=tp, pp=stage, placeholder=placeholder
        )
        self.model = model
        self.kv = kv_mod.KVCache(
            model.local_config, dtype=torch_dtype, device=self.device, layers=model.layers
        )
        nbytes = sum(t.numel() * t.element_size() for t in model.non_expert_state().values())
        if self.experts is not None:
            self.experts.first = 0 if stage is None else stage.moe_layers[0]
            nbytes += self.experts.load(
                source, torch_dtype, rank, num_ranks, placement, placeholder=placeholder
            )
        log.info(
            "loaded TP shard of %s%s: %.1f MB in %.2fs (%s)",
            source,
            " (placeholder)" if placeholder else "",
            nbytes / 1e6,
            time.monotonic() - started,
            self.where(),
        )
        return nbytes

    def step(
        self,
        epoch: int,
        frees: Sequence[str],
        batch: kv_mod.ForwardBatch,
        hidden: torch.Tensor | None = None,
        live: Any = None,
    ) -> dict[str, int]:
        """The leader's forward pass of `batch` over TP group `epoch` (this rank's part of
        every collective; logits are discarded: the leader samples), from the previous
        pipeline stage's `hidden` states on a stage after the first; in the mesh layout as
        the leader's `live` (token, placement) says, over the mesh group of the token's
        epoch. Returns {"steps": the steps run, "reads": experts it read from the model
        source in this step (the mesh layout: a placement change no prefetch prepared)}."""
        model, kv = self.model, self.kv
        if model is None or kv is None:
            raise RuntimeError(f"no weights loaded ({self.where()})")
        if epoch != self.epoch:
            raise RuntimeError(f"step of TP epoch {epoch}, joined {self.epoch} ({self.where()})")
        for seq_id in frees:
            kv.free(seq_id)
        experts: Any = NoExperts()
        reads = 0 if self.experts is None else self.experts.reads_in_step
        if self.experts is not None:
            if live is None:
                raise RuntimeError(f"a mesh follower's step needs the live token ({self.where()})")
            self.experts.follow(*live)
            experts = self.experts.backend(live[0][0])
        try:
            model.forward(
                batch, kv, experts, hidden=None if hidden is None else hidden.to(model.device)
            )
        except Exception:
            restore_kv(kv, batch)
            if self.group is not None:
                self.group.abort("a follower's forward pass failed")
            if self.experts is not None:
                self.experts.abort("a follower's forward pass failed")
            log.exception("TP step failed (%s)", self.where())
            raise
        self.steps += 1
        read = 0 if self.experts is None else self.experts.reads_in_step - reads
        return {"steps": self.steps, "reads": read}

    def transfer_non_expert(
        self,
        spec: group_mod.GroupSpec,
        rank: int,
        src_ranks: Sequence[int],
        dst_ranks: Sequence[int],
    ) -> int:
        """Its part of the leaders' non-expert transfer (`TensorLeader.transfer_non_expert`;
        `rank`, `src_ranks`, `dst_ranks`: DP ranks as the leaders' group numbers them): over
        the followers' group `spec` (`follower_spec`, joined for this transfer only), its
        shard goes from TP rank t of a sending DP rank to TP rank t of a receiving one, as
        the leaders pair them. Returns the bytes received (control lane)."""
        if self.model is None:
            raise RuntimeError(f"transfer_non_expert before load ({self.where()})")
        t, n = self.rank - 1, self.size - 1
        grp = group_mod.StatelessGroup(spec, rank * n + t, timeout=GROUP_TIMEOUT_S)
        try:
            received = staging_mod.transfer_non_expert(
                grp, self.model, epoch=spec.epoch, src_ranks=[d * n + t for d in src_ranks],
                dst_ranks=[d * n + t for d in dst_ranks], what="TP shard", where=self.where(),
            )  # fmt: skip
            # nobody leaves before every member is done: a member that closed its pairs
            # while another still connected to it fails that one ("Connection closed by
            # peer" in gloo's connectFullMesh; seen with a member that had nothing to send)
            grp.barrier()
        finally:
            grp.destroy()
        return received

    # -- the mesh layout's experts (control lane: beside the steps) ------------------------
    def join_mesh(self, spec: group_mod.GroupSpec, rank: int) -> None:
        """Join the mesh group beside the leaders' step group `spec` (its DP rank: `rank`)."""
        self._mesh().join(spec, rank)

    def prefetch(
        self, placement: Any, rank: int | None, num_ranks: int, provided: Any = None
    ) -> int:
        return self._mesh().prefetch(placement, rank, num_ranks, provided)

    def lacks(self, placement: Any, rank: int, num_ranks: int) -> list[tuple[int, int]]:
        return self._mesh().lacks(placement, rank, num_ranks)

    def held(self, keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], Any]:
        return self._mesh().held(keys)

    def abort_join(self, epoch: int) -> None:
        if self.experts is not None:
            self.experts.abort_join(epoch)

    def abort(self, reason: str) -> None:
        if self.experts is not None:
            self.experts.abort(reason)

    def _mesh(self) -> mesh_mod.MeshExperts:
        if self.experts is None:
            raise RuntimeError(f"not in the mesh expert layout ({self.where()})")
        return self.experts

    def ping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pid": os.getpid(), "tp_rank": self.rank, "steps": self.steps}
        if self.experts is not None:
            out["expert_slots"] = len(self.experts.experts)
            out["reads_in_step"] = self.experts.reads_in_step
            out["prefetched"] = self.experts.prefetched
        return out

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
        if self.experts is not None:
            self.experts.close()
