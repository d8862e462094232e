"""Expert placement policy: which logical expert each physical slot of each layer holds.

Pure tensor functions, no side effects, no communication; the same inputs give the same
placement on every rank, so ranks can compute it independently.

Glossary
--------
logical expert
    One of the model's E experts of a layer (``block_sparse_moe.experts.{e}``); the router picks
    logical experts.
physical expert / slot
    A place that holds the weights of one logical expert on one rank. A layer has P >= E slots;
    rank ``r`` of ``N`` ranks holds slots ``[r * P/N, (r + 1) * P/N)`` (contiguous, equal count).
redundant expert
    A slot beyond the first E: it holds an extra copy of a logical expert that already has one.
    There are ``R = P - E`` redundant slots per layer.
replica
    Any one of the slots that hold the same logical expert; a logical expert with ``logcnt``
    replicas has its load split evenly over them.

Tensor shapes (all int64 unless said otherwise)
-----------------------------------------------
L = layers, E = logical experts per layer, P = physical slots per layer, R = most replicas of
one logical expert in any layer.

- ``load``: [L, E] tokens routed to each logical expert (any real dtype).
- ``Placement.phy2log``: [L, P] logical expert held by each slot.
- ``Placement.log2phy``: [L, E, R] slots holding each logical expert, ascending, -1 padded.
- ``Placement.logcnt``: [L, E] number of replicas of each logical expert (>= 1).

``rebalance`` follows DeepSeek's EPLB (github.com/deepseek-ai/EPLB): hierarchical when the
expert groups divide over the nodes (pack groups onto nodes, replicate inside each node, pack
slots onto ranks), global otherwise (one group, one node). The one deliberate difference: a
layer whose load is all zero is balanced as if its load were uniform, so a cold start spreads
redundant slots over experts 0, 1, ... instead of stacking them all on expert 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Placement:
    """Where each logical expert lives, for every layer (see the module glossary).

    phy2log: [L, P] int64, logical expert of each slot.
    log2phy: [L, E, R] int64, slots of each logical expert in ascending order, -1 padded.
    logcnt: [L, E] int64, replicas of each logical expert.

    Compare placements with ``equals`` (``==`` is identity: the fields are tensors).
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    def __post_init__(self) -> None:
        if self.phy2log.dim() != 2 or self.logcnt.dim() != 2 or self.log2phy.dim() != 3:
            raise ValueError(
                "Placement wants phy2log [L, P], log2phy [L, E, R], logcnt [L, E]; got "
                f"{tuple(self.phy2log.shape)}, {tuple(self.log2phy.shape)}, "
                f"{tuple(self.logcnt.shape)}"
            )
        layers, experts = self.logcnt.shape
        if self.phy2log.shape[0] != layers or tuple(self.log2phy.shape[:2]) != (layers, experts):
            raise ValueError(
                "Placement tensors disagree on L or E: "
                f"{tuple(self.phy2log.shape)}, {tuple(self.log2phy.shape)}, "
                f"{tuple(self.logcnt.shape)}"
            )

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_experts: int) -> Placement:
        """Builds log2phy and logcnt from phy2log [L, P]; every expert must have a slot."""
        if phy2log.dim() != 2:
            raise ValueError(f"phy2log must be [L, P], got shape {tuple(phy2log.shape)}")
        phy2log = phy2log.to(torch.int64).cpu().contiguous()
        num_layers, num_physical = phy2log.shape
        if num_physical and (phy2log.min() < 0 or phy2log.max() >= num_experts):
            raise ValueError(f"phy2log holds ids outside [0, {num_experts})")
        logcnt = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        if (logcnt == 0).any():
            layer, expert = (logcnt == 0).nonzero()[0].tolist()
            raise ValueError(f"logical expert {expert} of layer {layer} has no slot")
        max_rep = int(logcnt.max().item())
        # Replica index of each slot = how many earlier slots hold the same logical expert.
        order = torch.argsort(phy2log, dim=1, stable=True)  # slots grouped by expert, ascending
        sorted_log = phy2log.gather(1, order)
        starts = torch.cumsum(logcnt, dim=1) - logcnt  # first position of each expert's run
        rep_sorted = torch.arange(num_physical).expand(num_layers, -1) - starts.gather(
            1, sorted_log
        )
        log2phy = torch.full((num_layers, num_experts * max_rep), -1, dtype=torch.int64)
        log2phy.scatter_(1, sorted_log * max_rep + rep_sorted, order)
        return cls(phy2log, log2phy.view(num_layers, num_experts, max_rep), logcnt)

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logcnt.shape[1])

    def slots_per_rank(self, num_ranks: int) -> int:
        """P / num_ranks; ValueError when the slots do not divide evenly."""
        _check_divides(self.num_physical, num_ranks)
        return self.num_physical // num_ranks

    def slots_of_rank(self, rank: int, num_ranks: int) -> range:
        """Physical slots held by ``rank`` (the same range for every layer)."""
        per = self.slots_per_rank(num_ranks)
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
        return range(rank * per, (rank + 1) * per)

    def rank_of_slot(self, slot: int, num_ranks: int) -> int:
        return slot // self.slots_per_rank(num_ranks)

    def experts_on_rank(self, layer: int, rank: int, num_ranks: int) -> list[int]:
        """Logical experts held by ``rank`` in ``layer``, in slot order (repeats possible)."""
        slots = self.slots_of_rank(rank, num_ranks)
        return [int(x) for x in self.phy2log[layer, slots.start : slots.stop].tolist()]

    def rank_slot_load(self, load: torch.Tensor, num_ranks: int) -> torch.Tensor:
        """[L, num_ranks] float64: load per rank, each expert's load split over its replicas."""
        _check_load(load, self.num_layers, self.num_logical)
        per_replica = load.to(torch.float64).cpu() / self.logcnt.to(torch.float64)
        slot_load = per_replica.gather(1, self.phy2log)  # [L, P]
        return slot_load.view(self.num_layers, num_ranks, self.slots_per_rank(num_ranks)).sum(-1)

    def validate(self, num_ranks: int) -> None:
        """Raises ValueError unless the three tensors agree and P divides over num_ranks."""
        self.slots_per_rank(num_ranks)
        rebuilt = Placement.from_phy2log(self.phy2log, self.num_logical)
        if not torch.equal(rebuilt.logcnt, self.logcnt):
            raise ValueError("logcnt does not match phy2log")
        if not torch.equal(rebuilt.log2phy, self.log2phy):
            raise ValueError("log2phy does not match phy2log")

    def equals(self, other: Placement) -> bool:
        return torch.equal(self.phy2log, other.phy2log)


def min_ranks_for(num_experts: int, slots_per_rank: int) -> int:
    """Fewest ranks whose slots (slots_per_rank each) hold every logical expert once."""
    if slots_per_rank < 1:
        raise ValueError(f"slots_per_rank must be >= 1, got {slots_per_rank}")
    return -(-num_experts // slots_per_rank)


def num_physical_for(num_experts: int, num_ranks: int, num_redundant: int = 0) -> int:
    """The smallest P >= num_experts + num_redundant that divides over num_ranks."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if num_redundant < 0:
        raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
    need = num_experts + num_redundant
    return -(-need // num_ranks) * num_ranks


def identity(num_layers: int, num_experts: int, num_physical: int, num_ranks: int) -> Placement:
    """Slot p holds logical expert p (p < E); redundant slot E + i holds expert i % E."""
    _check_sizes(num_experts, num_physical, num_ranks)
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    row = torch.arange(num_physical, dtype=torch.int64) % num_experts
    return Placement.from_phy2log(row.expand(num_layers, -1).clone(), num_experts)


def rebalance(
    load: torch.Tensor,
    num_physical: int,
    num_ranks: int,
    num_nodes: int = 1,
    num_groups: int = 1,
) -> Placement:
    """DeepSeek EPLB: a placement of ``num_physical`` slots per layer over ``num_ranks`` ranks.

    load: [L, E] recent tokens per logical expert. Hierarchical (groups packed onto nodes,
    replicas made inside each node) when ``num_groups % num_nodes == 0``, global otherwise.
    Every rank gets exactly ``num_physical / num_ranks`` slots.
    """
    if load.dim() != 2:
        raise ValueError(f"load must be [L, E], got shape {tuple(load.shape)}")
    num_layers, num_experts = load.shape
    _check_sizes(num_experts, num_physical, num_ranks)
    if num_nodes < 1 or num_groups < 1:
        raise ValueError(f"num_nodes and num_groups must be >= 1, got {num_nodes}, {num_groups}")
    weight = load.to(torch.float64).cpu().clone()
    if (weight < 0).any():
        raise ValueError("load must be >= 0")
    weight[weight.sum(-1) == 0] = 1.0  # cold layers: balance as if uniform
    if num_experts % num_groups != 0:
        raise ValueError(
            f"num_groups ({num_groups}) must divide num_experts ({num_experts}) evenly"
        )
    if num_ranks % num_nodes != 0:
        raise ValueError(f"num_nodes ({num_nodes}) must divide num_ranks ({num_ranks}) evenly")
    # As DeepSeek: hierarchical when the groups divide over the nodes (then P divides too,
    # since P divides over the ranks and the ranks over the nodes).
    hierarchical = num_groups % num_nodes == 0
    if hierarchical:
        phy2log = _hierarchical(weight, num_physical, num_groups, num_nodes, num_ranks)
    else:
        phy2log = _hierarchical(weight, num_physical, 1, 1, num_ranks)
    return Placement.from_phy2log(phy2log, num_experts)


def balancedness(load: torch.Tensor, placement: Placement, num_ranks: int) -> float:
    """Mean rank load / max rank load, summed over layers (vLLM's definition); 1.0 when idle."""
    per_rank = placement.rank_slot_load(load, num_ranks)  # [L, N]
    max_sum = float(per_rank.max(dim=-1).values.sum().item())
    if max_sum == 0.0:
        return 1.0
    return float(per_rank.mean(dim=-1).sum().item()) / max_sum


# --- DeepSeek EPLB steps ----------------------------------------------------------------------


def _balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packs the items of each row of weight [n, m] into num_packs packs of m / num_packs items.

    Heaviest item first, into the lightest pack that still has room. Returns (pack [n, m],
    position in pack [n, m]).
    """
    rows, items = weight.shape
    per_pack = items // num_packs
    if per_pack == 1:
        pack = torch.arange(items, dtype=torch.int64).expand(rows, -1).clone()
        return pack, torch.zeros(rows, items, dtype=torch.int64)
    order = torch.argsort(weight, dim=-1, descending=True, stable=True).tolist()
    values = weight.tolist()
    pack_list = [[-1] * items for _ in range(rows)]
    rank_list = [[-1] * items for _ in range(rows)]
    for i in range(rows):
        pack_weight = [0.0] * num_packs
        pack_items = [0] * num_packs
        for item in order[i]:
            dest = min(
                (p for p in range(num_packs) if pack_items[p] < per_pack),
                key=pack_weight.__getitem__,
            )
            pack_list[i][item] = dest
            rank_list[i][item] = pack_items[dest]
            pack_weight[dest] += values[i][item]
            pack_items[dest] += 1
    return torch.tensor(pack_list, dtype=torch.int64), torch.tensor(rank_list, dtype=torch.int64)


def _replicate(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds num_phy - m replicas per row of weight [n, m], each to the expert with the largest
    load per replica. Returns (phy2log [n, num_phy], logcnt [n, m])."""
    rows, num_log = weight.shape
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(rows, 1)
    logcnt = torch.ones(rows, num_log, dtype=torch.int64)
    arange_rows = torch.arange(rows, dtype=torch.int64)
    for i in range(num_log, num_phy):
        hottest = (weight / logcnt).max(dim=-1).indices
        phy2log[:, i] = hottest
        logcnt[arange_rows, hottest] += 1
    return phy2log, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand(perm.shape))
    return inv


def _hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> torch.Tensor:
    """DeepSeek's rebalance_experts_hierarchical; returns phy2log [L, P]."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_rank = num_physical // num_ranks
    log_per_node = num_logical // num_nodes

    # 1. pack expert groups onto nodes; mlog = logical ids renumbered node by node
    tokens_per_group = weight.view(num_layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = _balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
        + torch.arange(group_size, dtype=torch.int64)
    ).flatten(-2)
    mlog2log = _inverse(log2mlog)

    # 2. replicate inside each node: rows are (layer, node) pairs
    tokens_per_mlog = weight.gather(-1, mlog2log).view(-1, log_per_node)
    phy2mlog, mlogcnt = _replicate(tokens_per_mlog, num_physical // num_nodes)

    # 3. pack the node's slots onto its ranks, P / N each
    tokens_per_phy = (tokens_per_mlog / mlogcnt).gather(-1, phy2mlog)
    pack, rank_in_pack = _balanced_packing(tokens_per_phy, num_ranks // num_nodes)
    phy2pphy = pack * slots_per_rank + rank_in_pack
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    pphy2mlog = (
        pphy2mlog.view(num_layers, num_nodes, -1)
        + torch.arange(0, num_logical, log_per_node, dtype=torch.int64).view(1, -1, 1)
    ).flatten(-2)
    return mlog2log.gather(-1, pphy2mlog)


# --- input checks ---------------------------------------------------------------------------


def _check_divides(num_physical: int, num_ranks: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if num_physical % num_ranks != 0:
        raise ValueError(
            f"num_physical ({num_physical}) must be divisible by num_ranks ({num_ranks}); "
            f"use num_physical_for() to pick one"
        )


def _check_sizes(num_experts: int, num_physical: int, num_ranks: int) -> None:
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_physical < num_experts:
        raise ValueError(
            f"num_physical ({num_physical}) must be >= num_experts ({num_experts}): "
            "every logical expert needs a slot"
        )
    _check_divides(num_physical, num_ranks)


def _check_load(load: torch.Tensor, num_layers: int, num_experts: int) -> None:
    if tuple(load.shape) != (num_layers, num_experts):
        raise ValueError(
            f"load must be [L, E] = [{num_layers}, {num_experts}], got {tuple(load.shape)}"
        )
