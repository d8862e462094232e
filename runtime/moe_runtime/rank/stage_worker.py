"""A pipeline stage's side of its DP rank at serving time (stages 1..P-1, `StageWorker`):
its layers, KV cache and experts over its stage group, and, at T > 1, its own TP followers.
The leader's side, the rendezvous and the live token it follows: `pipeline_group`."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.model import decoder, pipeline
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import source as source_mod
from moe_runtime.model import tensor_parallel as tp_mod
from moe_runtime.rank import mesh as mesh_mod
from moe_runtime.rank import retention, stage_groups, tensor_group
from moe_runtime.rank import staging as staging_mod
from moe_runtime.rank.pipeline_group import (
    Live,
    Token,
    stage_placement,
)

log = logging.getLogger(__name__)


class StageWorker:
    """Pipeline stage `stage` of `size` of one DP rank: its layers, its KV cache, its experts
    over its stage group. At tensor-parallel size T > 1 it is TP rank 0 of its stage and leads
    the stage's TP followers (`followers`, `tensor_group.TensorLeader`): they hold their
    shards of its layers and run each of its forward passes with it; its routed experts stay
    here (as on stage 0's leader), or in the mesh expert layout (`expert_layout`, `rank.mesh`)
    it holds part 0 of its DP rank's slots of the stage's MoE layers and its followers the
    others, over the stage's mesh group (`parts`)."""

    def __init__(
        self,
        *,
        stage: int,
        size: int,
        device: str,
        label: int | None = None,
        followers: tensor_group.Followers | None = None,
        tensor_size: int = 1,
        expert_layout: str = tp_mod.LEADER,
    ) -> None:
        self.stage_index = stage
        self.size = size
        self.device = device
        self.label = label
        self.tensor: tensor_group.TensorLeader | None = None
        #: the mesh expert layout's followers' parts (None: the experts are all here)
        self.parts: mesh_mod.MeshParts | None = None
        if tensor_size > 1:
            if followers is None:
                raise ValueError(f"tensor_size {tensor_size} needs the stage's TP followers")
            self.tensor = tensor_group.TensorLeader(
                followers, size=tensor_size, device=device, expert_layout=expert_layout
            )
            if self.tensor.mesh:
                self.parts = mesh_mod.MeshParts(followers, size=tensor_size)
        elif expert_layout == tp_mod.MESH:
            raise ValueError("the mesh expert layout needs tensor_size > 1")
        self.model: decoder.MoEModel | None = None
        self.kv: kv_mod.KVCache | None = None
        self.stage: pipeline.PipelineStage | None = None
        self.placement: policy.Placement | None = None
        self.rank, self.num_ranks = -1, 0
        self.experts: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
        self.source: str | None = None
        self.dtype = torch.float32
        #: the leader's live token this stage serves (None: as loaded)
        self.token: Token | None = None
        #: experts earlier states served and the live one does not, by (local MoE layer,
        #: logical expert), bounded as a leader's (`retention.Retained`, absorbed at each
        #: `follow`): a revert, a switch back or a move the leaders' planner left out because
        #: the leader retains that expert takes them without reading the source
        self._retained = retention.Retained()
        #: experts of a placement the leader is staging (`prefetch`, while it moves its own
        #: slots), by (local MoE layer, logical expert): `follow` takes them from here
        self._prefetched: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
        #: experts a future placement will give this stage (a warm spare's: `prestage`, as
        #: its leader pre-stages its own), by (local MoE layer, logical expert): `prefetch`
        #: and `follow` take them from here; forgotten once the stage serves (`follow`)
        self._prestaged: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
        #: `prefetch` runs on the control lane while steps run (`follow` reads what it wrote)
        self._lock = threading.Lock()
        #: experts read from the model source inside a step (`follow`: none was prefetched)
        self.reads_in_step = 0
        #: experts read from the model source ahead of a placement change (`prefetch`)
        self.prefetched = 0
        #: experts read from the model source for a future placement (`prestage`)
        self.prestaged_reads = 0
        #: its groups by epoch, joined with the leaders' (`stage_groups.StageGroups`)
        self.groups = stage_groups.StageGroups(stage, self.where, self.parts)
        self.steps = 0

    def where(self) -> str:
        epochs = self.groups.epochs()
        return f"rank label={self.label} pp={self.stage_index}/{self.size} epochs={epochs}"

    def _member(self, rank: int, num_ranks: int) -> tuple[int, int]:
        """The (member, members) this stage's own slots are counted as (`rank.mesh`)."""
        if self.parts is None:
            return rank, num_ranks
        return mesh_mod.member(rank, num_ranks, self.parts.size)

    def join(self, spec: group_mod.GroupSpec, rank: int, role: str = "step") -> None:
        """Join the stage group of `spec.epoch` derived from the leaders' `role` group ("step":
        this stage's expert parallelism; "transfer": its expert moves, `prefetch`) as `rank`;
        in the mesh layout, with "step", the stage's mesh group beside it too (its followers
        with it)."""
        self.groups.join(spec, rank, role)

    def load(
        self,
        source: str,
        dtype: str,
        rank: int,
        num_ranks: int,
        placement: policy.Placement | None,
        placeholder: bool = False,
    ) -> int:
        """Read this stage's tensors and its routed experts of DP rank `rank` of `num_ranks`
        under `placement`; an empty KV cache of its layers. Returns the bytes held.
        placeholder: zeros for its non-expert tensors (and its TP followers' shards) instead: a
        new DP rank's stage, which receives them from its peers' (`transfer_non_expert`)."""
        started = time.monotonic()
        src = source_mod.open_source(source)
        cfg = src.config
        stage = pipeline.plan(cfg, stage=self.stage_index, size=self.size)
        torch_dtype = getattr(torch, dtype)
        local = None
        if placement is not None and stage.num_moe_layers:
            local = stage_placement(placement, stage)
        tp, following = None, None
        if self.tensor is not None:
            # The stage's followers read their shards of its layers (and in the mesh layout
            # their parts of its experts) meanwhile.
            theirs = (rank, num_ranks, local, placeholder)
            tp, following = self.tensor.start_load(source, cfg, dtype=torch_dtype, experts=theirs)
        model = decoder.MoEModel.from_source(
            src, dtype=torch_dtype, device=self.device, pp=stage, tp=tp, placeholder=placeholder
        )
        experts: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
        if local is not None:
            if self.parts is not None:
                mesh_mod.check_slots(local.num_physical, num_ranks, self.parts.size)
            slots = self._slots(local, rank, num_ranks)
            first = stage.moe_layers[0]
            read = experts_mod.load_experts(
                src, set(slots.values()), first=first, dtype=torch_dtype, device=self.device
            )
            experts = {slot: read[key] for slot, key in slots.items()}
        self.model, self.stage, self.placement = model, stage, local
        self.rank, self.num_ranks, self.experts = rank, num_ranks, experts
        self.source, self.dtype, self.token = source, torch_dtype, None
        self._retained = retention.Retained()
        self._prefetched, self._prestaged = {}, {}
        if self.tensor is not None:
            self.tensor.finish_load(following)
        self.kv = kv_mod.KVCache(
            model.local_config, dtype=torch_dtype, device=self.device, layers=model.layers
        )
        self.groups.forget_backends()
        nbytes = sum(t.numel() * t.element_size() for t in model.non_expert_state().values())
        nbytes += sum(w.nbytes for w in experts.values())
        log.info(
            "loaded pipeline stage of %s%s (layers %s, %d expert slots): %.1f MB in %.2fs (%s)",
            source,
            " (placeholder)" if placeholder else "",
            stage.layers,
            len(experts),
            nbytes / 1e6,
            time.monotonic() - started,
            self.where(),
        )
        return nbytes

    def transfer_non_expert(
        self, epoch: int, src_ranks: Sequence[int], dst_ranks: Sequence[int]
    ) -> int:
        """This stage's part of its leaders' non-expert transfer (`RankGroups.
        transfer_non_expert`): `StageGroups.transfer_non_expert` of its tensors and its TP
        followers' shards."""
        assert self.model is not None, "transfer_non_expert before load"
        return self.groups.transfer_non_expert(epoch, self.model, src_ranks, dst_ranks, self.tensor)

    def _backend(self, epoch: int) -> experts_mod.ExpertBackend:
        """This stage's experts over its group of `epoch` (`StageGroups.backend`)."""
        member, _ = self._member(self.rank, self.num_ranks)
        return self.groups.backend(epoch, self.placement, self.experts, member)

    def follow(self, token: Token, placement: policy.Placement | None) -> None:
        """Serve as the leader's live `token` says: its DP rank `token[2]` of `token[3]` under
        `placement` (this stage's rows of it). Experts held now or before are kept; the rest
        are read from the model source. A new token without a placement is refused."""
        stage = self.stage
        if token == self.token or stage is None:
            return
        if placement is None:
            raise RuntimeError(
                f"the leader serves {token}, this stage {self.token}, and no placement came "
                f"({self.where()})"
            )
        rank, num_ranks = token[2], token[3]
        if not stage.num_moe_layers:
            self.rank, self.num_ranks, self.token = rank, num_ranks, token
            return
        local = stage_placement(placement, stage)
        with self._lock:
            held = {**self._prestaged, **self._prefetched, **self._held()}
            self._prefetched, self._prestaged = {}, {}
        slots = self._slots(local, rank, num_ranks)
        fetched = self._read(set(slots.values()) - set(held))
        held.update(fetched)
        experts = {slot: held[key] for slot, key in slots.items()}
        read = len(fetched)
        with self._lock:
            if self.placement is not None:
                self._retained.absorb(self._live(), {key: held[key] for key in slots.values()})
            self.placement, self.rank, self.experts, self.token = local, rank, experts, token
            self.num_ranks = num_ranks
        self.reads_in_step += read
        self.groups.forget_backends()
        log.info(
            "pipeline stage serves %s: %d expert slots, %d read from the source (%s)",
            token,
            len(experts),
            read,
            self.where(),
        )

    def _slots(
        self, local: policy.Placement, rank: int, num_ranks: int
    ) -> dict[tuple[int, int], tuple[int, int]]:
        """{(local MoE layer, slot): (local MoE layer, logical)} of this stage's own slots of
        DP rank `rank` of `num_ranks` under `local` (its rows of the placement)."""
        return {
            (layer, slot): (layer, int(local.phy2log[layer, slot]))
            for layer in range(local.num_layers)
            for slot in local.slots_of_rank(*self._member(rank, num_ranks))
        }

    def _read(self, keys: set[tuple[int, int]]) -> dict[tuple[int, int], experts_mod.ExpertWeights]:
        """The experts `keys` (local MoE layer, logical) read from the model source."""
        if not keys:
            return {}
        assert self.stage is not None and self.source is not None
        src, first = source_mod.open_source(self.source), self.stage.moe_layers[0]
        return experts_mod.load_experts(
            src, keys, first=first, dtype=self.dtype, device=self.device
        )

    def _live(self) -> dict[tuple[int, int], experts_mod.ExpertWeights]:
        """The experts of its live slots, by (local MoE layer, logical)."""
        if (p := self.placement) is None:
            return {}
        return {(m, int(p.phy2log[m, s])): w for (m, s), w in self.experts.items()}

    def _held(self) -> dict[tuple[int, int], experts_mod.ExpertWeights]:
        """The experts this stage holds, live and retained, by (local MoE layer, logical)."""
        return {**self._retained.experts, **self._live()}

    def prefetch(
        self,
        placement: policy.Placement,
        rank: int | None,
        num_ranks: int,
        epoch: int | None = None,
        moves: Sequence[moves_mod.ExpertMove] = (),
    ) -> int:
        """Bring, ahead of the step that switches to it, the experts this stage lacks for DP
        rank `rank` of `num_ranks` under `placement` (the leader calls it while it stages its
        own slots: `ExpertSlots.stage_experts`), so that `follow` finds them and the switch's
        first step reads nothing. `moves` (the leaders' staging, every layer, over epoch's
        transfer group): this stage runs those of its layers over its own transfer group of
        `epoch`, peer to peer, sending what it holds and receiving what it lacks (every
        member of the staging calls it with the same moves; rank None: a DP rank that leaves
        only sends); what no move brings (a lost rank's experts) is read from the model
        source. In the mesh layout the followers are then handed their parts' experts (`mesh.
        relay`). Runs beside steps (the control lane); a later prefetch replaces an earlier
        one's. Returns the experts read from the source (by the followers too)."""
        stage = self.stage
        if stage is None or self.source is None or not stage.num_moe_layers:
            return 0
        started = time.monotonic()
        with self._lock:
            held = {**self._prestaged, **self._prefetched, **self._held()}
        moved = self._move(epoch, moves, held)
        if rank is None:
            log.info("pipeline stage sent its experts of a staging it leaves (%s)", self.where())
            return 0
        local = stage_placement(placement, stage)
        wanted = set(self._slots(local, rank, num_ranks).values())
        parts, available, relaying = self.parts, {**held, **moved}, None
        if parts is not None:  # the followers' parts, and what only they held of part 0
            relaying, available = mesh_mod.relay(parts, local, rank, num_ranks, available)
        fetched = self._read(wanted - set(available))
        new = {k: w for k, w in available.items() if k in wanted and k not in held}
        with self._lock:
            ahead = {**self._prestaged, **self._prefetched}
            kept = {k: w for k, w in ahead.items() if k in wanted}
            self._prefetched = kept | new | fetched
        self.prefetched += len(fetched)
        theirs = 0 if parts is None else parts.finish_prefetch(relaying)
        log.info(
            "pipeline stage prefetched %d experts for rank %d of %d in %.2fs: %d moved from "
            "peers, %d read from the source, %d by its followers (%s)",
            len(moved) + len(fetched),
            rank,
            num_ranks,
            time.monotonic() - started,
            len(moved),
            len(fetched),
            theirs,
            self.where(),
        )
        return len(fetched) + theirs

    def _move(
        self,
        epoch: int | None,
        moves: Sequence[moves_mod.ExpertMove],
        held: dict[tuple[int, int], experts_mod.ExpertWeights],
    ) -> dict[tuple[int, int], experts_mod.ExpertWeights]:
        """This stage's part of `moves` (those of its layers) over its transfer group of
        `epoch`, sending from `held`; what it received, by (local MoE layer, logical)."""
        assert self.stage is not None and self.model is not None
        first, stop = self.stage.moe_layers
        mine = [m for m in moves if first <= m.layer < stop]
        if not mine or epoch is None:
            return {}
        group = self.groups.transfer_group(epoch)
        if self.parts is not None:  # it sends from its followers' parts too
            sent = [(m.layer - first, m.logical) for m in mine if m.src_rank == group.rank]
            held = self.parts.with_held(held, sent)
        _, received = staging_mod.run_moves(
            group,
            mine,
            {(first + layer, logical): w for (layer, logical), w in held.items()},
            self.model,
            dtype=self.dtype,
            device=self.device,
            where=self.where(),
        )
        return {(layer - first, logical): w for (layer, logical), w in received.items()}

    def prestage(
        self,
        keys: Sequence[tuple[int, int]],
        epoch: int | None = None,
        moves: Sequence[moves_mod.ExpertMove] = (),
    ) -> int:
        """Bring the experts `keys` ((MoE layer, logical expert), the model's numbering) of
        this stage's layers that it lacks and keep them for a later placement change (a warm
        spare's: its leader pre-stages stage 0's layers meanwhile, `ExpertSlots.
        prestage_experts`): the pre-staging's `moves` of its layers run over its transfer
        group of `epoch` (a serving DP rank's stage sends, a spare's receives); what no move
        brings is read from the model source. Returns the experts read from the source."""
        stage = self.stage
        if stage is None or self.source is None or not stage.num_moe_layers:
            return 0
        first, stop = stage.moe_layers
        mine = {(int(a) - first, int(b)) for a, b in keys if first <= int(a) < stop}
        with self._lock:
            held = {**self._prestaged, **self._prefetched, **self._held()}
        moved = self._move(epoch, moves, held)
        fetched = self._read(mine - set(held) - set(moved))
        with self._lock:
            self._prestaged.update({k: w for k, w in moved.items() if k in mine})
            self._prestaged.update(fetched)
            count = len(self._prestaged)
        self.prestaged_reads += len(fetched)
        if mine:  # a spare's stage (a serving one only sent)
            got = (len(moved) + len(fetched), len(fetched), count, self.where())
            log.info(
                "pipeline stage pre-staged %d experts (%d from the source; %d held) (%s)", *got
            )
        return len(fetched)

    def drop_prestaged(self, keep: Sequence[tuple[int, int]] = ()) -> int:
        """Forget the pre-staged experts whose (MoE layer, logical) key, in the model's
        numbering, is not in `keep`; returns how many are left."""
        first = 0 if self.stage is None else self.stage.moe_layers[0]
        wanted = {(int(layer) - first, int(logical)) for layer, logical in keep}
        with self._lock:
            self._prestaged = {k: w for k, w in self._prestaged.items() if k in wanted}
            return len(self._prestaged)

    def step(
        self,
        epoch: int,
        frees: Sequence[str],
        batch: kv_mod.ForwardBatch,
        prev: Any,
        live: Live | None = None,
        *,
        on_device: bool = False,
    ) -> dict[str, Any]:
        """This stage's forward pass of `batch` given the previous stage's hidden states
        (`prev`: the tensor, or the previous stage's answer), serving as the leader's `live`
        says (`follow`). Returns {"out": hidden states, or the logits at the last stage,
        "loads": every stage's (first, stop, load) so far}; "out" on the host, or on_device:
        where it was computed (the step graph's tensor transport carries it from there)."""
        model, kv, stage = self.model, self.kv, self.stage
        if model is None or kv is None or stage is None:
            raise RuntimeError(f"no weights loaded ({self.where()})")
        reads_before = self.reads_in_step
        if live is not None:
            self.follow(*live)
        loads: list[Any] = []
        hidden = prev
        if isinstance(prev, dict):
            hidden, loads = prev["out"], list(prev["loads"])
        for seq_id in frees:
            kv.free(seq_id)
        # no token: no TP collective (in the mesh layout the followers join every step's
        # expert collectives, following the live token with this stage's rows)
        mesh = self.parts is not None
        tensor = self.tensor if batch.seq_ids or mesh else None
        if self.tensor is not None:
            self.tensor.free(frees)
        load = torch.zeros(
            stage.num_moe_layers, model.config.num_experts, dtype=torch.int64, device=model.device
        )
        following = None
        try:
            backend = self._backend(epoch)
            if tensor is not None:
                theirs = (live[0], self.placement) if mesh and live is not None else None
                following = tensor.begin(model, batch, hidden, live=theirs)
            out = model.forward(
                batch, kv, backend, hidden=hidden.to(model.device), expert_load=load
            )
            if tensor is not None:
                tensor.end(following)
                following = None
        except Exception as exc:
            tensor_group.restore_kv(kv, batch)
            self.abort("a pipeline stage's forward pass failed")
            if tensor is not None and following is not None:
                try:
                    tensor.end(following, failed=exc)
                except tensor_group.FollowerLost as lost:
                    log.error("pipeline stage lost a TP follower (%s): %s", self.where(), lost)
                    raise lost from exc
            log.exception("pipeline stage step failed (%s)", self.where())
            raise
        self.steps += 1
        loads.append((stage.moe_layers[0], stage.moe_layers[1], load.cpu()))
        reads = self.reads_in_step - reads_before
        if tensor is not None and mesh:
            reads += tensor.step_reads  # its followers' (a placement no prefetch prepared)
        return {"out": out if on_device else out.cpu(), "loads": loads, "reads": reads}

    def abort_join(self, epoch: int) -> None:
        """Call off this stage's joins of `epoch`, running or still to come (any thread)."""
        self.groups.abort_join(epoch)

    def abort(self, reason: str) -> None:
        """Abort every stage group (and the stage's TP group) now (any thread)."""
        self.groups.abort(reason)
        if self.tensor is not None:
            self.tensor.abort(reason)

    def ping(self) -> dict[str, Any]:
        """Alive; `lost` says why the stage cannot step again (a TP follower of it died or
        hangs: `RayFollowers.alive` reports its DP rank lost)."""
        out: dict[str, Any] = {"pid": os.getpid(), "pp_stage": self.stage_index}
        out["steps"] = self.steps
        out["reads_in_step"], out["prefetched"] = self.reads_in_step, self.prefetched
        out["prestaged"], out["prestaged_reads"] = len(self._prestaged), self.prestaged_reads
        if self.tensor is not None:
            try:
                self.tensor.check()
            except tensor_group.FollowerLost as exc:
                out["lost"] = str(exc)
        return out

    def pids(self) -> list[int]:
        """The process ids of the stage's TP followers."""
        return [] if self.tensor is None else self.tensor.followers.pids()

    def shutdown(self) -> None:
        if self.tensor is not None:
            self.tensor.close()
        self.groups.destroy()
