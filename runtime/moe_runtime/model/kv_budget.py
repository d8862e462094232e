"""How many KV positions one rank may hold (`KVBudget`), at the size it starts with and at
every size a resize takes it to.

Measured once, at start-up, before any weight is loaded: the device's free memory less a
margin (a GPU: each rank has its own), or the host's available memory (CPU ranks share the
host). What is left for the KV cache at a rank count n is that memory less the weights:

- GPU, per device: ``(free - margin - rank_weights(n)) * fraction``, where a rank's weights
  are the non-expert weights (every rank holds them) and its share of the expert slots; a
  shrink gives each survivor more experts, so less KV room, and a grow more.
- CPU, per rank of the host: ``(available - n * non_expert - experts) / n * fraction``.
- ``--kv-cache-bytes``: that, at every size.

Never under one context (max_position_embeddings, in whole blocks): a prompt that fits the
model fits a rank. The engine re-derives its admission bound from `tokens(n)` whenever the
ranks that step change (`engine.scheduler.Scheduler.set_active`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from moe_runtime.model import config as config_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import names

#: Device memory kept free besides the weights and the KV cache (a GPU: CUDA's workspace).
GPU_MARGIN_BYTES = 1 << 30


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
    config: config_mod.ModelConfig, dtype: torch.dtype, *, num_physical: int | None = None
) -> tuple[int, int]:
    """(non-expert bytes, bytes of `num_physical` expert slots in every MoE layer) in `dtype`
    (`num_physical` None: one slot per expert)."""
    size = torch.empty((), dtype=dtype).element_size()
    non_expert = sum(
        math.prod(names.tensor_shape(config, n)) for n in names.non_expert_tensor_names(config)
    )
    one = sum(math.prod(shape) for shape in names.expert_parts(config).values())
    slots = config.num_experts if num_physical is None else num_physical
    return non_expert * size, one * slots * config.num_moe_layers * size


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """What a rank's KV cache may take at any rank count (see the module docstring)."""

    per_token: int
    context: int
    fraction: float
    cuda: bool = False
    #: Bytes measured at start-up: a GPU's free memory less the margin, or the host's available.
    available: int = 0
    non_expert: int = 0
    experts: int = 0
    #: ``--kv-cache-bytes``: the same budget at every size (None: derived).
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
        non_expert, experts = weight_bytes(config, dtype, num_physical=num_physical)
        block = kv_mod.BLOCK_SIZE
        return cls(
            per_token=kv_mod.bytes_per_token(config, dtype),
            context=-(-config.max_position_embeddings // block) * block,
            fraction=fraction,
            cuda=on_gpu,
            available=available,
            non_expert=non_expert,
            experts=experts,
            fixed_bytes=budget_bytes,
        )

    def bytes(self, num_ranks: int) -> int:
        """KV bytes one rank may use when `num_ranks` ranks serve."""
        n = max(1, num_ranks)
        if self.fixed_bytes is not None:
            return self.fixed_bytes
        if self.cuda:
            left = self.available - self.non_expert - self.experts // n
            return max(0, int(left * self.fraction))
        left = self.available - n * self.non_expert - self.experts
        return max(0, int(left // n * self.fraction))

    def tokens(self, num_ranks: int) -> int:
        """KV positions one rank may hold when `num_ranks` ranks serve, in whole blocks."""
        block = kv_mod.BLOCK_SIZE
        tokens = self.bytes(num_ranks) // self.per_token // block * block
        return max(tokens, self.context)
