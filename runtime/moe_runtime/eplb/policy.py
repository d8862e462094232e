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

The greedy steps are vectorised across layers (numpy; see the note above ``_balanced_packing``)
and give exactly the placements of the loop-by-loop original, which the tests keep as their
oracle (``tests/support/eplb_reference.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch

_F64: TypeAlias = npt.NDArray[np.float64]
_I64: TypeAlias = npt.NDArray[np.int64]


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
        p2l = phy2log.numpy()
        num_layers, num_physical = p2l.shape
        if num_physical and (p2l.min() < 0 or p2l.max() >= num_experts):
            raise ValueError(f"phy2log holds ids outside [0, {num_experts})")
        # numpy, not torch, for these small arrays: see the note on the EPLB steps below.
        flat_ids = p2l + np.arange(num_layers, dtype=np.int64)[:, None] * num_experts
        logcnt = np.bincount(flat_ids.ravel(), minlength=num_layers * num_experts).reshape(
            num_layers, num_experts
        )
        if (logcnt == 0).any():
            layer, expert = np.argwhere(logcnt == 0)[0].tolist()
            raise ValueError(f"logical expert {expert} of layer {layer} has no slot")
        max_rep = int(logcnt.max())
        # Replica index of each slot = how many earlier slots hold the same logical expert.
        order = np.argsort(p2l, axis=1, kind="stable")  # slots grouped by expert, ascending
        sorted_log = np.take_along_axis(p2l, order, axis=1)
        starts = np.cumsum(logcnt, axis=1) - logcnt  # first position of each expert's run
        rep_sorted = np.arange(num_physical) - np.take_along_axis(starts, sorted_log, axis=1)
        log2phy = np.full((num_layers, num_experts * max_rep), -1, dtype=np.int64)
        np.put_along_axis(log2phy, sorted_log * max_rep + rep_sorted, order, axis=1)
        return cls(
            phy2log,
            torch.from_numpy(log2phy.reshape(num_layers, num_experts, max_rep)),
            torch.from_numpy(logcnt.astype(np.int64, copy=False)),
        )

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

    def slot_counts(self, num_ranks: int) -> dict[int, int]:
        """rank -> how many slots it holds (each layer), over `num_ranks` ranks (the KV
        budget of a rank follows its expert memory: `model.kv_budget`)."""
        return {r: len(self.slots_of_rank(r, num_ranks)) for r in range(num_ranks)}

    def rank_of_slot(self, slot: int, num_ranks: int) -> int:
        return slot // self.slots_per_rank(num_ranks)

    def experts_on_rank(self, layer: int, rank: int, num_ranks: int) -> list[int]:
        """Logical experts held by ``rank`` in ``layer``, in slot order (repeats possible)."""
        slots = self.slots_of_rank(rank, num_ranks)
        return [int(x) for x in self.phy2log[layer, slots.start : slots.stop].tolist()]

    def rank_slot_load(self, load: torch.Tensor, num_ranks: int) -> torch.Tensor:
        """[L, num_ranks] float64: load per rank, each expert's load split over its replicas."""
        _check_load(load, self.num_layers, self.num_logical)
        per_replica = _as_f64(load) / self.logcnt.cpu().numpy()
        slot_load = np.take_along_axis(per_replica, self.phy2log.cpu().numpy(), axis=1)  # [L, P]
        per_rank = slot_load.reshape(self.num_layers, num_ranks, self.slots_per_rank(num_ranks))
        return torch.from_numpy(per_rank.sum(-1))

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
    if num_experts % num_groups != 0:
        raise ValueError(
            f"num_groups ({num_groups}) must divide num_experts ({num_experts}) evenly"
        )
    if num_ranks % num_nodes != 0:
        raise ValueError(f"num_nodes ({num_nodes}) must divide num_ranks ({num_ranks}) evenly")
    weight = _as_f64(load).copy()
    if not np.isfinite(weight).all() or (weight < 0).any():
        raise ValueError("load must be finite and >= 0")
    weight[weight.sum(-1) == 0] = 1.0  # cold layers: balance as if uniform
    # As DeepSeek: hierarchical when the groups divide over the nodes (then P divides too,
    # since P divides over the ranks and the ranks over the nodes).
    if num_groups % num_nodes == 0:
        phy2log = _hierarchical(weight, num_physical, num_groups, num_nodes, num_ranks)
    else:
        phy2log = _hierarchical(weight, num_physical, 1, 1, num_ranks)
    return Placement.from_phy2log(torch.from_numpy(phy2log), num_experts)


def balancedness(load: torch.Tensor, placement: Placement, num_ranks: int) -> float:
    """Mean rank load / max rank load, summed over layers (vLLM's definition); 1.0 when idle."""
    per_rank = placement.rank_slot_load(load, num_ranks).numpy()  # [L, N]
    max_sum = float(per_rank.max(axis=-1).sum())
    if max_sum == 0.0:
        return 1.0
    return float(per_rank.mean(axis=-1).sum()) / max_sum


# --- DeepSeek EPLB steps ----------------------------------------------------------------------
#
# Vectorised across rows (layers, or (layer, node) pairs): the greedy loops run once per item or
# per redundant slot, each iteration a handful of numpy operations over all rows at once. Numpy,
# not torch: these are tiny arrays, where torch's per-operation overhead (and its intra-op
# threads fighting over a busy machine) cost more than the arithmetic. Every step does the same
# float64 operations in the same order as the loop-by-loop original (the tests' oracle), so the
# placements are identical, ties included (argmin/argmax and stable argsort take the first).


def _balanced_packing(weight: _F64, num_packs: int) -> tuple[_I64, _I64]:
    """Packs the items of each row of weight [n, m] into num_packs packs of m / num_packs items.

    Heaviest item first (stable on ties), into the lightest pack that still has room (lowest
    index on ties). Returns (pack [n, m], position in pack [n, m]).
    """
    rows, items = weight.shape
    per_pack = items // num_packs
    if per_pack == 1:
        pack = np.broadcast_to(np.arange(items, dtype=np.int64), (rows, items)).copy()
        return pack, np.zeros((rows, items), dtype=np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")
    # Column j of these = the j-th heaviest item of every row (contiguous for the loop).
    order_t = np.ascontiguousarray(order.T)
    sorted_t = np.ascontiguousarray(np.take_along_axis(weight, order, axis=1).T)
    row = np.arange(rows)
    # Weight of each pack, +inf once it is full, so argmin picks the lightest with room.
    open_weight = np.zeros((rows, num_packs), dtype=np.float64)
    count = np.zeros((rows, num_packs), dtype=np.int64)
    pack = np.empty((rows, items), dtype=np.int64)
    position = np.empty((rows, items), dtype=np.int64)
    for j in range(items):
        item = order_t[j]
        dest = open_weight.argmin(axis=1)
        filled = count[row, dest]
        pack[row, item] = dest
        position[row, item] = filled
        filled += 1
        count[row, dest] = filled
        added = open_weight[row, dest] + sorted_t[j]
        open_weight[row, dest] = np.where(filled == per_pack, np.inf, added)
    return pack, position


def _replicate(weight: _F64, num_phy: int) -> tuple[_I64, _I64]:
    """Adds num_phy - m replicas per row of weight [n, m], each to the expert with the largest
    load per replica (lowest id on ties). Returns (phy2log [n, num_phy], logcnt [n, m])."""
    rows, num_log = weight.shape
    phy2log = np.empty((rows, num_phy), dtype=np.int64)
    phy2log[:, :num_log] = np.arange(num_log, dtype=np.int64)
    logcnt = np.ones((rows, num_log), dtype=np.int64)
    per_replica = weight.copy()  # weight / logcnt, updated where logcnt changes
    row = np.arange(rows)
    for i in range(num_log, num_phy):
        hottest = per_replica.argmax(axis=1)
        phy2log[:, i] = hottest
        count = logcnt[row, hottest] + 1
        logcnt[row, hottest] = count
        per_replica[row, hottest] = weight[row, hottest] / count
    return phy2log, logcnt


def _inverse(perm: _I64) -> _I64:
    """The inverse of each row's permutation: inv[i, perm[i, j]] = j."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _hierarchical(
    weight: _F64, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> _I64:
    """DeepSeek's rebalance_experts_hierarchical on weight [L, E]; returns phy2log [L, P]."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_rank = num_physical // num_ranks
    log_per_node = num_logical // num_nodes

    # 1. pack expert groups onto nodes; mlog = logical ids renumbered node by node. The group
    # sums use torch's reduction, as the reference does, so float loads sum bit for bit alike.
    grouped = torch.from_numpy(weight).view(num_layers, num_groups, group_size)
    tokens_per_group = grouped.sum(-1).numpy()
    group_pack, group_rank = _balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size)[:, :, None]
        + np.arange(group_size, dtype=np.int64)
    ).reshape(num_layers, num_logical)
    mlog2log = _inverse(log2mlog)

    # 2. replicate inside each node: rows are (layer, node) pairs
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, log_per_node)
    phy2mlog, mlogcnt = _replicate(tokens_per_mlog, num_physical // num_nodes)

    # 3. pack the node's slots onto its ranks, P / N each
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, axis=1)
    pack, rank_in_pack = _balanced_packing(tokens_per_phy, num_ranks // num_nodes)
    pphy2phy = _inverse(pack * slots_per_rank + rank_in_pack)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    node_offset = np.arange(0, num_logical, log_per_node, dtype=np.int64)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1) + node_offset).reshape(num_layers, -1)
    return np.take_along_axis(mlog2log, pphy2mlog, axis=1)


def _as_f64(load: torch.Tensor) -> _F64:
    """load [L, E] as a float64 numpy array (a view when it already is one on the CPU)."""
    array: _F64 = load.detach().to(torch.float64).cpu().numpy()
    return array


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
