"""How many KV positions one rank may hold (`KVBudget`), at the size it starts with and at
every size and placement a resize takes it to.

Measured once, at start-up, before any weight is loaded: the device's free memory less a
margin (a GPU: each rank has its own), or the host's available memory (CPU ranks share the
host). What is left for the KV cache is that memory less the weights; `device_bytes` is what
ONE device of a rank may cache (at tensor-parallel size T a rank is T devices, each caching
its shard's heads: `per_token` is one device's bytes a position, `tp_shard.plan(...).local`):

- GPU, per device: ``(free - margin - non_expert - slots * slot_bytes) * fraction``: the TP
  leader's device binds (it holds the rank's non-expert shard and every expert slot of the
  rank: docs/TENSOR-PARALLEL.md; in the mesh expert layout 1/T of them, `expert_parts`);
  ``slots`` are the slots this rank holds in the placement it serves (a shrink gives each
  survivor more, so less KV room; a grow fewer).
- CPU, per device of the host: ``(available - 2 * (n * rank_non_expert + total_slots *
  slot_bytes)) / (n * T) * fraction``: the host holds every rank's T shards and every slot,
  each twice (`HOST_WEIGHT_COPIES`: the copies the CPU's GEMMs run on).
- ``--kv-cache-bytes``: that, per device, at every size.

Positions = device bytes // per_token, in whole blocks, never under one context
(max_position_embeddings): a prompt that fits the model fits a rank. So at T = 2 a rank of a
GQA model whose KV heads split gets about twice the positions of T = 1 for the same bytes a
device; MLA's latent is replicated on every TP rank (no gain), and KV heads replicated where
T exceeds them gain only up to T = KV. The engine re-derives its admission bound per rank
(`per_rank`) whenever the ranks that step or their placement change
(`engine.scheduler.Scheduler.set_active`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import torch

from moe_runtime.model import config as config_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import names, pipeline, tp_shard

#: Device memory kept free besides the weights and the KV cache (a GPU: CUDA's workspace).
GPU_MARGIN_BYTES = 1 << 30
#: Copies of the weights a CPU rank holds: its expert slots and their stacked, transposed
#: copy for grouped GEMMs (`experts.Stacked`), its non-expert matrices and their transposed
#: copy (`linear`; an upper bound: norms and embeddings are held once).
HOST_WEIGHT_COPIES = 2


def host_available_bytes() -> int:
    """MemAvailable of this host (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weight_bytes(
    config: config_mod.ModelConfig,
    dtype: torch.dtype,
    *,
    num_physical: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> tuple[int, int]:
    """(non-expert bytes of TP rank `tp_rank`'s shard, bytes of `num_physical` expert slots in
    every MoE layer) in `dtype` (`num_physical` None: one slot per expert; `tp_size` 1: the
    whole non-expert weights)."""
    size = torch.empty((), dtype=dtype).element_size()
    shard = tp_shard.plan(config, rank=tp_rank, size=tp_size)
    non_expert = sum(math.prod(shard.shape(n)) for n in shard.tensor_names())
    one = sum(math.prod(shape) for shape in names.expert_parts(config).values())
    slots = config.num_experts if num_physical is None else num_physical
    return non_expert * size, one * slots * config.num_moe_layers * size


def per_token_bytes(
    config: config_mod.ModelConfig, dtype: torch.dtype, *, tp_size: int = 1, pp_size: int = 1
) -> int:
    """KV bytes one position takes on one device of a rank at tensor-parallel size `tp_size`
    (its shard's KV heads; MLA: the whole latent, replicated) and pipeline-parallel size
    `pp_size` (a stage's layers only; the stage with the most layers binds)."""
    local = tp_shard.plan(config, rank=0, size=tp_size).local
    if pp_size == 1:
        return kv_mod.bytes_per_token(local, dtype)
    return max(
        kv_mod.bytes_per_token(
            local, dtype, layers=pipeline.plan(config, stage=s, size=pp_size).layers
        )
        for s in range(pp_size)
    )


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """What one device of a rank may cache at any rank count and placement (see the module
    docstring).

    per_token: KV bytes of one position on one device (at T > 1: a TP rank's heads);
    context: one context in whole blocks (the floor); available: bytes measured at start-up (a
    GPU's free memory less the margin, or the host's available); non_expert: the non-expert
    bytes on the binding device (the TP leader's shard); rank_non_expert: a rank's over its T
    devices (CPU: the host holds them all; None: T x non_expert); slot_bytes: one expert slot
    over every MoE layer; num_physical: the slots at start-up (a rank count's even share when
    no placement is given); tp_size: devices a rank.
    """

    per_token: int
    context: int
    fraction: float
    cuda: bool = False
    available: int = 0
    non_expert: int = 0
    slot_bytes: int = 0
    num_physical: int = 0
    tp_size: int = 1
    rank_non_expert: int | None = None
    #: the devices a rank's expert slots are split over (T in the mesh expert layout, else 1)
    expert_parts: int = 1
    #: ``--kv-cache-bytes``: the same budget a device at every size (None: derived).
    fixed_bytes: int | None = None

    @classmethod
    def measure(
        cls,
        config: config_mod.ModelConfig,
        dtype: torch.dtype,
        *,
        budget_bytes: int | None,
        fraction: float,
        cuda: bool,
        num_physical: int | None = None,
        tp_size: int = 1,
        pp_size: int = 1,
        expert_parts: int = 1,
    ) -> KVBudget:
        """The budget of this process's device (its GPU when it sees one, else the host: ranks
        on GPUs this process cannot see get the host figure), measured now."""
        on_gpu = cuda and torch.cuda.is_available()
        available = 0
        if budget_bytes is None:
            if on_gpu:
                free, _ = torch.cuda.mem_get_info()
                available = free - GPU_MARGIN_BYTES
            else:
                available = host_available_bytes()
        slots = config.num_experts if num_physical is None else num_physical
        non_expert, _ = weight_bytes(config, dtype, num_physical=0, tp_size=tp_size)
        _, slot_bytes = weight_bytes(config, dtype, num_physical=1)
        rank_non_expert = sum(
            weight_bytes(config, dtype, num_physical=0, tp_rank=t, tp_size=tp_size)[0]
            for t in range(tp_size)
        )
        block = kv_mod.BLOCK_SIZE
        return cls(
            per_token=per_token_bytes(config, dtype, tp_size=tp_size, pp_size=pp_size),
            context=-(-config.max_position_embeddings // block) * block,
            fraction=fraction,
            cuda=on_gpu,
            available=available,
            non_expert=non_expert,
            slot_bytes=slot_bytes,
            num_physical=slots,
            tp_size=tp_size * pp_size,
            rank_non_expert=rank_non_expert,
            fixed_bytes=budget_bytes,
            expert_parts=expert_parts,
        )

    def even_slots(self, num_ranks: int) -> int:
        """Slots a rank holds when `num_ranks` share the start-up slots evenly (rounded up)."""
        return -(-self.num_physical // max(1, num_ranks))

    def device_bytes(
        self, num_ranks: int, slots: int | None = None, *, total_slots: int | None = None
    ) -> int:
        """KV bytes one device of a rank may use when `num_ranks` ranks serve and this rank
        holds `slots` expert slots of `total_slots` in all (None: the even share)."""
        n = max(1, num_ranks)
        if self.fixed_bytes is not None:
            return self.fixed_bytes
        if slots is None:
            slots = self.even_slots(n)
        if self.cuda:  # the leader's device: its part of the rank's slots
            here = -(-slots // max(1, self.expert_parts))
            left = self.available - self.non_expert - here * self.slot_bytes
            return max(0, int(left * self.fraction))
        if total_slots is None:
            total_slots = self.even_slots(n) * n
        rank_non_expert = (
            self.non_expert * self.tp_size if self.rank_non_expert is None else self.rank_non_expert
        )
        weights = n * rank_non_expert + total_slots * self.slot_bytes
        left = self.available - HOST_WEIGHT_COPIES * weights
        return max(0, int(left // (n * self.tp_size) * self.fraction))

    def tokens(
        self, num_ranks: int, slots: int | None = None, *, total_slots: int | None = None
    ) -> int:
        """KV positions one rank may hold (`device_bytes` // per_token), in whole blocks."""
        block = kv_mod.BLOCK_SIZE
        device = self.device_bytes(num_ranks, slots, total_slots=total_slots)
        tokens = device // self.per_token // block * block
        return max(tokens, self.context)

    def per_rank(
        self, ranks: Sequence[int], slots: Mapping[int, int] | None = None
    ) -> dict[int, int]:
        """KV positions each of `ranks` may hold when they serve, holding `slots[rank]` expert
        slots each (None, or a rank it omits: the even share of the start-up slots)."""
        n = len(ranks)
        held = {
            r: (self.even_slots(n) if slots is None else slots.get(r, self.even_slots(n)))
            for r in ranks
        }
        total = sum(held.values())
        return {r: self.tokens(n, held[r], total_slots=total) for r in ranks}
