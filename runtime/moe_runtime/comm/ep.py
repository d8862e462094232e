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
4. run the local slots' experts on their received rows, grouped by slot, in three grouped
   GEMMs (`apply_grouped`: `experts.grouped_forward`);
5. all_to_all of the outputs back, unsort to [T, k, H] and combine with
   ``experts.combine_expert_outputs`` (fixed order k = 0, 1, ...), exactly as ``LocalExperts``.

Host reads: one per layer (`_host_counts`: the split sizes of the all_to_alls, which c10d takes
as host integers, and the rows per local slot, in one copy), none per expert. Counting is
``scatter_add_`` (``bincount`` reads its maximum back on a GPU), and ``repeat_interleave`` is
given its output size. Each expert runs on the same rows in the same order as
``experts.apply_experts`` would give it (a stable sort by slot), so results are identical.

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
        self._stacked = experts_mod.Stacked()
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
        self._stacked.clear()
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
        send_counts = _count(slots, self.placement.num_physical)  # [W * S]
        rows = hidden.index_select(0, order // k)  # [N, H], grouped by slot
        base = self.local_slots().start

        def weights_for(local: int) -> experts_mod.ExpertWeights:
            return self.local_experts[(layer, base + local)]

        if self.num_ranks == 1:
            (per_slot,) = _host_counts(send_counts)
            out_sorted = apply_grouped(
                weights_for, rows, per_slot, stacked=self._stacked, key=layer
            )
        else:
            out_sorted = self._exchange(rows, send_counts, weights_for, width, layer)
        expert_out = torch.empty_like(out_sorted)
        expert_out[order] = out_sorted
        return experts_mod.combine_expert_outputs(expert_out.view(tokens, k, width), topk_weights)

    def _exchange(
        self,
        rows: torch.Tensor,
        send_counts: torch.Tensor,
        weights_for: Callable[[int], experts_mod.ExpertWeights],
        width: int,
        layer: int,
    ) -> torch.Tensor:
        """Steps 2-5 of the module docstring for rows [N, H] sorted by destination slot."""
        per = self.slots_per_rank
        recv_counts = torch.empty_like(send_counts)
        self.group.all_to_all_single(recv_counts, send_counts)  # [W * S]: chunk j from rank j
        by_source = recv_counts.view(self.num_ranks, per)
        in_splits, out_splits, per_slot = _host_counts(
            send_counts.view(self.num_ranks, per).sum(1), by_source.sum(1), by_source.sum(0)
        )
        total = sum(out_splits)
        received = rows.new_empty((total, width))
        self.group.all_to_all_single(received, rows, out_splits, in_splits)
        local_slot = torch.repeat_interleave(
            torch.arange(per, device=rows.device).repeat(self.num_ranks),
            recv_counts,
            output_size=total,
        )
        by_slot = torch.argsort(local_slot, stable=True)  # source order kept within a slot
        computed = torch.empty_like(received)
        computed[by_slot] = apply_grouped(
            weights_for,
            received.index_select(0, by_slot),
            per_slot,
            stacked=self._stacked,
            key=layer,
        )
        back = rows.new_empty((rows.shape[0], width))
        self.group.all_to_all_single(back, computed, in_splits, out_splits)
        return back


def apply_grouped(
    weights_for: Callable[[int], experts_mod.ExpertWeights],
    rows: torch.Tensor,
    counts: list[int],
    *,
    stacked: experts_mod.Stacked | None = None,
    key: object = None,
) -> torch.Tensor:
    """rows [N, H] grouped by expert (counts[e] rows of expert e, in order) through their
    experts in grouped GEMMs (`experts.grouped_forward`; the stacked weights kept in `stacked`
    under `key`); returns [N, H]. No host read: the counts are already on the host."""
    experts = [weights_for(e) for e in range(len(counts))]
    return experts_mod.grouped_forward(experts, rows, counts, stacked=stacked, key=key)


def _count(ids: torch.Tensor, size: int) -> torch.Tensor:
    """How many times each of 0..size-1 occurs in ids [N] (int64 [size]), on ids' device
    without a host read."""
    counts = torch.zeros(size, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int64))


def _host_counts(*counts: torch.Tensor) -> list[list[int]]:
    """1-D int64 tensors as host lists, in one copy (one wait for the device)."""
    sizes = [int(c.numel()) for c in counts]
    flat = torch.cat([c.reshape(-1) for c in counts]).tolist()
    out, start = [], 0
    for n in sizes:
        out.append([int(v) for v in flat[start : start + n]])
        start += n
    return out
