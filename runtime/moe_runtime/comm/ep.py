"""Expert-parallel MoE backend: dispatch tokens to the ranks holding their experts, combine back.

Glossary
--------
logical expert
    One of the model's E experts of a layer; the router's ``topk_ids`` are logical ids.
physical expert / slot
    A place holding one logical expert's weights. Each layer has P slots; rank ``r`` of ``W``
    holds slots ``[r * S, (r + 1) * S)``, ``S = P / W``. This backend holds only its own slots.
redundant expert
    A slot beyond the first E: an extra copy of a logical expert.
replica
    Any one of the slots holding the same logical expert. Each (token, choice) pair goes to one
    replica, picked deterministically: replica ``(rank + i) % logcnt`` for flattened pair ``i``,
    which spreads a hot expert's tokens over its replicas.

One call of one layer (every rank of the group calls it, in lockstep, T may be 0):

1. flatten the T x k choices (N = T * k pairs), pick each pair's slot, sort pairs by slot;
2. all_to_all of the per-slot counts (int64 [W * S]) so every rank knows what it receives;
3. all_to_all of the hidden rows ([N, H] out, [sum received, H] in);
4. run each local slot's expert on its received rows (``experts.apply_experts``);
5. all_to_all of the outputs back, unsort to [T, k, H] and combine with
   ``experts.combine_expert_outputs`` (fixed order k = 0, 1, ...), exactly as ``LocalExperts``.

Shapes: hidden [T, H], topk_ids [T, k] int64 logical ids, topk_weights [T, k] float32,
result [T, H]; local_experts maps (layer, global slot index) -> ``ExpertWeights`` (every
tensor of one expert).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import policy
from moe_runtime.model import experts as experts_mod


class ExpertParallelBackend:
    """An ``ExpertBackend`` whose experts are spread over the ranks of a ``StatelessGroup``."""

    def __init__(
        self,
        group: group_mod.StatelessGroup,
        placement: policy.Placement,
        local_experts: Mapping[tuple[int, int], experts_mod.ExpertWeights],
        *,
        rank: int | None = None,
    ) -> None:
        if rank is not None and rank != group.rank:
            raise ValueError(f"rank {rank} is not the group's rank {group.rank}")
        self.group = group
        self.rank = group.rank
        self.num_ranks = group.world_size
        self.placement = placement
        self.local_experts: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
        self._log2phy = placement.log2phy
        self._logcnt = placement.logcnt
        self.set_placement(placement, local_experts)

    @property
    def slots_per_rank(self) -> int:
        return self.placement.slots_per_rank(self.num_ranks)

    def local_slots(self) -> range:
        """This rank's physical slots (global indices, the same for every layer)."""
        return self.placement.slots_of_rank(self.rank, self.num_ranks)

    def set_placement(
        self,
        placement: policy.Placement,
        local_experts: Mapping[tuple[int, int], experts_mod.ExpertWeights],
    ) -> None:
        """Swap in a new placement and this rank's slots of it (call at a step boundary, on
        every rank). local_experts: (layer, slot) -> weights for every layer and every slot in
        ``placement.slots_of_rank(rank, num_ranks)``; nothing else."""
        slots = placement.slots_of_rank(self.rank, self.num_ranks)
        want = {(layer, s) for layer in range(placement.num_layers) for s in slots}
        have = set(local_experts)
        if want != have:
            missing = sorted(want - have)[:4]
            extra = sorted(have - want)[:4]
            raise ValueError(
                f"rank {self.rank}: local_experts must hold exactly this rank's slots "
                f"{slots.start}..{slots.stop - 1} of every layer; missing {missing}, "
                f"not ours {extra}"
            )
        device = self.group.device
        self.placement = placement
        self.local_experts = dict(local_experts)
        self._log2phy = placement.log2phy.to(device)
        self._logcnt = placement.logcnt.to(device)

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        tokens, k = topk_ids.shape
        width = hidden.shape[1]
        num = tokens * k
        ids = topk_ids.reshape(-1)
        cnt = self._logcnt[layer].index_select(0, ids)  # [N]
        replica = (torch.arange(num, device=ids.device) + self.rank) % cnt
        slots = self._log2phy[layer][ids, replica]  # [N] global slot of each pair
        order = torch.argsort(slots, stable=True)
        send_counts = torch.bincount(slots, minlength=self.placement.num_physical)  # [W * S]
        rows = hidden.index_select(0, order // k)  # [N, H], grouped by slot
        base = self.local_slots().start

        def weights_for(local: int) -> experts_mod.ExpertWeights:
            return self.local_experts[(layer, base + local)]

        if self.num_ranks == 1:
            out_sorted = experts_mod.apply_experts(weights_for, rows, slots[order])
        else:
            out_sorted = self._exchange(rows, send_counts, weights_for, width)
        expert_out = torch.empty_like(out_sorted)
        expert_out[order] = out_sorted
        return experts_mod.combine_expert_outputs(expert_out.view(tokens, k, width), topk_weights)

    def _exchange(
        self,
        rows: torch.Tensor,
        send_counts: torch.Tensor,
        weights_for: Callable[[int], experts_mod.ExpertWeights],
        width: int,
    ) -> torch.Tensor:
        """Steps 2-5 of the module docstring for rows [N, H] sorted by destination slot."""
        per = self.slots_per_rank
        recv_counts = torch.empty_like(send_counts)
        self.group.all_to_all_single(recv_counts, send_counts)  # [W * S]: chunk j from rank j
        in_splits = send_counts.view(self.num_ranks, per).sum(1).tolist()
        out_splits = recv_counts.view(self.num_ranks, per).sum(1).tolist()
        received = rows.new_empty((sum(out_splits), width))
        self.group.all_to_all_single(received, rows, out_splits, in_splits)
        local_slot = torch.repeat_interleave(
            torch.arange(per, device=rows.device).repeat(self.num_ranks), recv_counts
        )
        computed = experts_mod.apply_experts(weights_for, received, local_slot)
        back = rows.new_empty((rows.shape[0], width))
        self.group.all_to_all_single(back, computed, in_splits, out_splits)
        return back
