"""Move planning: which expert weights travel between ranks to go from one placement to another.

Pure functions over ``policy.Placement``; every rank computes the same plan from the same inputs.

Glossary
--------
logical expert
    One of the model's E experts of a layer.
physical expert / slot
    A place holding one logical expert's weights; rank ``r`` of ``N`` holds slots
    ``[r * P/N, (r + 1) * P/N)``.
redundant expert
    A slot beyond the first E, holding an extra copy of a logical expert.
replica
    Any one of the slots holding the same logical expert.
move
    One transfer of one logical expert's weights (one layer) from a rank that holds it under the
    old placement to a rank that needs it under the new one and does not hold it yet. A rank that
    already holds the expert fills any of its new slots by a local copy, which is not a move; a
    rank that needs two replicas of an expert it lacks receives it once.

Shapes: placements carry phy2log [L, P], log2phy [L, E, R], logcnt [L, E] (int64); load is
[L, E]. Old and new placements may differ in P and in the number of ranks (resizes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from moe_runtime.eplb import policy
from moe_runtime.eplb import settle as settle_mod

_I64: TypeAlias = npt.NDArray[np.int64]
_F64: TypeAlias = npt.NDArray[np.float64]
Key: TypeAlias = tuple[int, int]


@dataclass(frozen=True)
class ExpertMove:
    """Send logical expert ``logical`` of ``layer`` from ``src_rank`` (old placement) to
    ``dst_rank``, into its new physical slot ``dst_slot`` (a global slot index of the new
    placement, inside dst_rank's slot range)."""

    layer: int
    logical: int
    src_rank: int
    dst_rank: int
    dst_slot: int


def _holders(placement: policy.Placement, num_ranks: int) -> list[list[set[int]]]:
    """[layer][rank] -> set of logical experts that rank holds."""
    per = placement.slots_per_rank(num_ranks)
    rows = placement.phy2log.tolist()
    return [[set(row[r * per : (r + 1) * per]) for r in range(num_ranks)] for row in rows]


def _check_pair(
    old: policy.Placement, new: policy.Placement, old_num_ranks: int, new_num_ranks: int
) -> None:
    if old.num_layers != new.num_layers or old.num_logical != new.num_logical:
        raise ValueError(
            "old and new placements must have the same layers and logical experts: "
            f"[L, E] = [{old.num_layers}, {old.num_logical}] vs "
            f"[{new.num_layers}, {new.num_logical}]"
        )
    old.slots_per_rank(old_num_ranks)
    new.slots_per_rank(new_num_ranks)


def plan_moves(
    old: policy.Placement,
    new: policy.Placement,
    *,
    old_num_ranks: int,
    new_num_ranks: int,
    senders: Sequence[int] | None = None,
) -> list[ExpertMove]:
    """The transfers that turn ``old`` (over old_num_ranks) into ``new`` (over new_num_ranks).

    One move per (layer, destination rank, logical expert) that the destination needs and did
    not hold, so the count equals ``lower_bound_moves``. The source is an old holder (rank <
    old_num_ranks) chosen to spread the sending: the holder with the fewest sends so far (ties:
    lowest rank). Ordered by layer, then destination slot.

    senders: the old ranks that can send (default: all). An expert that no sender holds gets no
    move: the destination must read it from the model source (a recovery after a rank loss).
    """
    _check_pair(old, new, old_num_ranks, new_num_ranks)
    can_send = set(range(old_num_ranks) if senders is None else senders)
    old_sets = _holders(old, old_num_ranks)
    new_per = new.slots_per_rank(new_num_ranks)
    sends = [0] * old_num_ranks
    moves: list[ExpertMove] = []
    for layer, row in enumerate(new.phy2log.tolist()):
        holders_of: dict[int, list[int]] = {}
        for rank, experts in enumerate(old_sets[layer]):
            if rank not in can_send:
                continue
            for expert in experts:
                holders_of.setdefault(expert, []).append(rank)
        received: set[tuple[int, int]] = set()
        for slot, logical in enumerate(row):
            dst = slot // new_per
            if dst < old_num_ranks and logical in old_sets[layer][dst]:
                continue
            if (dst, logical) in received:
                continue
            received.add((dst, logical))
            if logical not in holders_of:
                continue  # no sender holds it: read from the model source
            src = min(holders_of[logical], key=lambda r: (sends[r], r))
            sends[src] += 1
            moves.append(ExpertMove(layer, logical, src, dst, slot))
    return moves


def lower_bound_moves(
    old: policy.Placement,
    new: policy.Placement,
    *,
    old_num_ranks: int,
    new_num_ranks: int,
) -> int:
    """Number of (layer, rank, logical expert) triples held under ``new`` but not under ``old``:
    no plan can move fewer experts."""
    _check_pair(old, new, old_num_ranks, new_num_ranks)
    old_sets = _holders(old, old_num_ranks)
    new_sets = _holders(new, new_num_ranks)
    count = 0
    for layer in range(new.num_layers):
        for rank, experts in enumerate(new_sets[layer]):
            before = old_sets[layer][rank] if rank < old_num_ranks else set()
            count += len(experts - before)
    return count


@dataclass(frozen=True)
class RecoveryPlan:
    """How the survivors of a rank loss get every expert back.

    target: the placement over the survivors (survivor i becomes rank i); moves: transfers
    between survivors (src_rank / dst_rank are those new ranks); from_replicas: (layer, logical)
    pairs the lost ranks held that a survivor holds too (redundant replicas); from_source: pairs
    only the lost ranks held (the survivors that need them read them from the model source, or
    take a copy they retain); lost_only: those (layer, logical) pairs.
    """

    target: policy.Placement
    moves: list[ExpertMove]
    from_replicas: int
    from_source: int
    lost_only: frozenset[tuple[int, int]] = frozenset()


def plan_recovery(
    load: torch.Tensor,
    old: policy.Placement,
    *,
    old_num_ranks: int,
    survivors: Sequence[int],
    num_physical: int,
    held: Mapping[int, Iterable[Key]] | None = None,
    tolerance: float = 0.0,
    units: int = 1,
) -> RecoveryPlan:
    """The placement and moves that let `survivors` (old ranks, in their new order) serve alone.

    The old placement is seen with the survivors' slot blocks first and the lost ranks' last,
    which makes the recovery a shrink in which the lost ranks are the departing ones; then
    `rebalance_for_resize` (with `held`, keyed by new rank, and `tolerance`) keeps experts
    where they are and only survivors send. `units`: the devices of a rank that each hold a
    contiguous part of its slots (T in the mesh expert layout): the load is balanced over
    every device (packs of `units` per rank, `held` counted on each rank's first), the moves
    stay between ranks.
    """
    if not survivors:
        raise ValueError("a recovery needs at least one surviving rank")
    if len(set(survivors)) != len(survivors) or not set(survivors) <= set(range(old_num_ranks)):
        raise ValueError(f"survivors {list(survivors)} must be distinct ranks < {old_num_ranks}")
    order = list(survivors) + [r for r in range(old_num_ranks) if r not in survivors]
    per = old.slots_per_rank(old_num_ranks)
    blocks = old.phy2log.reshape(old.num_layers, old_num_ranks, per)[:, order]
    view = policy.Placement.from_phy2log(blocks.reshape(old.num_layers, -1), old.num_logical)
    n = len(survivors)
    if units < 1:
        raise ValueError(f"units must be >= 1, got {units}")
    target = rebalance_for_resize(
        load,
        view,
        old_num_ranks=old_num_ranks * units,
        new_num_ranks=n * units,
        num_physical=num_physical,
        tolerance=tolerance,
        held=None if held is None else {i * units: keys for i, keys in held.items()},
    )
    moves = plan_moves(view, target, old_num_ranks=old_num_ranks, new_num_ranks=n, senders=range(n))
    from_replicas = 0
    lost_only: set[tuple[int, int]] = set()
    for layer, layer_sets in enumerate(_holders(view, old_num_ranks)):
        kept = set().union(*layer_sets[:n])
        lost = set().union(*layer_sets[n:])
        from_replicas += len(lost & kept)
        lost_only |= {(layer, e) for e in lost - kept}
    return RecoveryPlan(target, moves, from_replicas, len(lost_only), frozenset(lost_only))


def bytes_moved(moves: list[ExpertMove], bytes_per_expert: int) -> int:
    """Bytes sent over the network by ``moves`` (each move carries one expert's weights)."""
    return len(moves) * bytes_per_expert


def rebalance_for_resize(
    load: torch.Tensor,
    old: policy.Placement,
    *,
    old_num_ranks: int,
    new_num_ranks: int,
    num_physical: int,
    num_nodes: int = 1,
    num_groups: int = 1,
    tolerance: float = 0.0,
    held: Mapping[int, Iterable[Key]] | None = None,
    settle: bool = True,
) -> policy.Placement:
    """The placement for new_num_ranks that a resize (or a periodic rebalance) takes.

    First ``policy.rebalance``, relabelled to keep experts where they are: the rank loads of a
    placement do not change when, within one layer, the packs of slots are given to different
    ranks, nor when slots are reordered inside a rank. So per layer this gives each new pack
    the rank (within the same node) that already holds most of its experts (greedy matching on
    the overlap), then puts each expert back at its old local offset when it can. Same
    balancedness as plain ``rebalance``, never more moves in practice, usually far fewer. Old
    ranks >= new_num_ranks (departing on a shrink) keep nothing. When the rank count and P are
    unchanged (a periodic rebalance), a layer keeps its old slots outright if its busiest rank
    would not be more than ``tolerance`` (a fraction) busier than under the new placement:
    balanced packing is chaotic, and a 1% drift in load would otherwise move most experts for
    no gain. Vectorised across layers and packs except for the greedy matching (one short loop
    per layer); with ``settle=False`` the placements equal those of the per-layer loops the
    tests keep as their oracle (``tests/support/eplb_reference.py``).

    Then (``settle``) ``eplb.settle``: swaps of slots between ranks that leave more experts
    where they are held, while no layer's busiest rank gets more than ``tolerance`` busier than
    under the relabelled rebalance.

    held: {new rank index: (layer, logical) keys it holds beyond its live slots in ``old``}
    (experts it retains from an earlier placement, or pre-staged on a warm spare): placing such
    an expert there costs no move either (both steps count it).
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    holds = _holdings(old, old_num_ranks=old_num_ranks, new_num_ranks=new_num_ranks, held=held)
    relabelled, kept = _relabel(
        load,
        old,
        holds,
        old_num_ranks=old_num_ranks,
        new_num_ranks=new_num_ranks,
        num_physical=num_physical,
        num_nodes=num_nodes,
        num_groups=num_groups,
        tolerance=tolerance,
    )
    if not settle:
        return relabelled
    rows = relabelled.phy2log.numpy()
    settled = settle_mod.settle(
        rows,
        _as_f64(load, rows.shape[0], old.num_logical),
        holds,
        num_ranks=new_num_ranks,
        tolerance=tolerance,
        nodes=num_nodes,
        frozen=kept,
    )
    if np.array_equal(settled, rows):
        return relabelled
    return policy.Placement.from_phy2log(torch.from_numpy(settled), old.num_logical)


def _relabel(
    load: torch.Tensor,
    old: policy.Placement,
    holds: npt.NDArray[np.bool_],
    *,
    old_num_ranks: int,
    new_num_ranks: int,
    num_physical: int,
    num_nodes: int,
    num_groups: int,
    tolerance: float,
) -> tuple[policy.Placement, npt.NDArray[np.bool_]]:
    """The relabelled rebalance of ``rebalance_for_resize`` (holds [L, E, N]: `_holdings`),
    and which layers kept their old slots outright ([L] bool)."""
    new = policy.rebalance(load, num_physical, new_num_ranks, num_nodes, num_groups)
    _check_pair(old, new, old_num_ranks, new_num_ranks)
    old_per = old.slots_per_rank(old_num_ranks)
    new_per = new.slots_per_rank(new_num_ranks)
    nodes = num_nodes if num_nodes >= 1 and new_num_ranks % num_nodes == 0 else 1
    num_layers = new.num_layers
    keep = np.zeros(num_layers, dtype=bool)
    if old_num_ranks == new_num_ranks and old.num_physical == new.num_physical:
        old_max = old.rank_slot_load(load, old_num_ranks).numpy().max(axis=-1)
        new_max = new.rank_slot_load(load, new_num_ranks).numpy().max(axis=-1)
        keep = old_max <= new_max * (1.0 + tolerance) + 1e-9
    # packs [L, N, S]: the new placement's slots of each rank; held_local [L, N, S_old]: what
    # new rank label j held before (-1 for labels that are new ranks).
    old_rows = old.phy2log.cpu().numpy()
    packs = new.phy2log.cpu().numpy().reshape(num_layers, new_num_ranks, new_per)
    held_local = np.full((num_layers, new_num_ranks, old_per), -1, dtype=np.int64)
    kept_ranks = min(old_num_ranks, new_num_ranks)
    held_local[:, :kept_ranks] = old_rows.reshape(num_layers, old_num_ranks, old_per)[
        :, :kept_ranks
    ]
    gain = _overlap(packs, holds)
    node = np.arange(new_num_ranks) // (new_num_ranks // nodes)
    gain[:, node[:, None] != node[None, :]] = -1  # a pack stays on its node
    label = np.stack([_match(layer_gain) for layer_gain in gain])  # [L, N]
    aligned = _align(packs, np.take_along_axis(held_local, label[:, :, None], axis=1))
    out = np.empty_like(packs)
    np.put_along_axis(out, label[:, :, None], aligned, axis=1)
    out_rows = out.reshape(num_layers, -1)
    if keep.any():  # only when P is unchanged
        out_rows[keep] = old_rows[keep]
    placement = policy.Placement.from_phy2log(torch.from_numpy(out_rows), new.num_logical)
    return placement, keep


def _holdings(
    old: policy.Placement,
    *,
    old_num_ranks: int,
    new_num_ranks: int,
    held: Mapping[int, Iterable[Key]] | None,
) -> npt.NDArray[np.bool_]:
    """holds [L, E, N]: new rank j holds logical expert e of layer l already: its live slots
    in ``old`` (ranks kept by the resize) or ``held[j]``."""
    num_layers, num_experts = old.num_layers, old.num_logical
    holds = np.zeros((num_layers, num_experts, new_num_ranks), dtype=bool)
    kept = min(old_num_ranks, new_num_ranks)
    per = old.slots_per_rank(old_num_ranks)
    rows = old.phy2log.cpu().numpy().reshape(num_layers, old_num_ranks, per)[:, :kept]
    layer = np.arange(num_layers)[:, None, None]
    holds[layer, rows, np.arange(kept)[None, :, None]] = True
    for rank, keys in (held or {}).items():
        if not 0 <= rank < new_num_ranks:
            continue
        pairs = np.array(sorted(keys), dtype=np.int64).reshape(-1, 2)
        holds[pairs[:, 0], pairs[:, 1], rank] = True
    return holds


def _as_f64(load: torch.Tensor, num_layers: int, num_experts: int) -> _F64:
    values: _F64 = load.detach().to(torch.float64).cpu().numpy().reshape(num_layers, num_experts)
    return values


def _overlap(packs: _I64, holds: npt.NDArray[np.bool_]) -> _I64:
    """gain [L, N, N]: distinct experts of pack i (packs [L, N, S]) that label j already holds
    (holds [L, E, N]).

    Gathers and sums of booleans, not a matrix product: numpy's BLAS threads made a [58, 64,
    256] product take ~0.9 s on a busy 2-core machine (~20 ms on one thread; this: ~9 ms).
    """
    num_layers, num_ranks, size = packs.shape
    layer = np.arange(num_layers)[:, None, None]
    earlier = np.tril(np.ones((size, size), dtype=bool), k=-1)
    repeat = ((packs[..., :, None] == packs[..., None, :]) & earlier).any(-1)  # [L, N, S]
    hits = holds[layer, packs] & ~repeat[..., None]  # [L, N, S, N]: count each expert once
    gain: _I64 = hits.sum(axis=2, dtype=np.int64)
    return gain


def _match(gain: _I64) -> _I64:
    """Rank label of each pack maximising the summed gain[pack, label] (gain [N, N], -1 =
    forbidden). Returns label [N].

    Greedy on the largest gains (ties: lowest pack, then lowest label), then passes of
    pairwise swaps in (a, b) order while they help; never worse than the identity labelling
    (which plain ``rebalance`` uses). The swap passes are found with whole-matrix tests, one
    per swap, instead of visiting every pair.
    """
    n = gain.shape[0]
    greedy = [-1] * n
    used = [False] * n
    flat = gain.ravel()
    order = np.argsort(-flat, kind="stable")  # gain descending, then (i, j) ascending
    order = order[flat[order] >= 0]
    assigned = 0
    for i, j in zip((order // n).tolist(), (order % n).tolist(), strict=True):
        if greedy[i] == -1 and not used[j]:
            greedy[i] = j
            used[j] = True
            assigned += 1
            if assigned == n:
                break
    label = np.array(greedy, dtype=np.int64)
    later = np.triu(np.ones((n, n), dtype=bool), k=1)  # pairs (a, b) with b > a
    pair_index = np.arange(n * n).reshape(n, n)
    for _ in range(4):
        position = -1  # the pass visits pairs in row-major (a, b) order
        improved = False
        while True:
            cross = gain[:, label]  # cross[a, b] = gain[a, label[b]]
            own = np.diagonal(cross)
            better = (
                later
                & (cross >= 0)
                & (cross.T >= 0)
                & (cross + cross.T > own[:, None] + own[None, :])
                & (pair_index > position)
            )
            hits = np.flatnonzero(better)
            if hits.size == 0:
                break
            position = int(hits[0])
            a, b = divmod(position, n)
            label[a], label[b] = label[b], label[a]
            improved = True
        if not improved:
            break
    if gain[np.arange(n), label].sum() < np.trace(gain):
        return np.arange(n, dtype=np.int64)
    return label


def _align(packs: _I64, old_local: _I64) -> _I64:
    """Orders each pack (packs [L, N, S]) so that its experts sit at the local offset they had
    in old_local [L, N, S_old] (-1 = empty): the k-th copy of an expert in a pack takes the
    offset of its k-th copy among old_local's first S offsets; the other experts fill the
    remaining offsets in ascending order, in pack order. Returns [L, N, S]."""
    size = packs.shape[-1]
    old = np.full(packs.shape, -1, dtype=np.int64)
    width = min(size, old_local.shape[-1])
    old[..., :width] = old_local[..., :width]
    before = np.tril(np.ones((size, size), dtype=bool), k=-1)  # [s, s'] with s' < s

    def copy_index(x: _I64) -> _I64:
        """How many earlier entries of the same pack hold the same expert, per entry."""
        count: _I64 = ((x[..., :, None] == x[..., None, :]) & before).sum(-1)
        return count

    match = (packs[..., :, None] == old[..., None, :]) & (
        copy_index(packs)[..., :, None] == copy_index(old)[..., None, :]
    )  # [L, N, s, o]: pack entry s goes to offset o; at most one o per s and one s per o
    matched = match.any(-1)
    free = ~match.any(-2)
    # The r-th unmatched entry goes to the r-th free offset.
    free_offsets = np.argsort(~free, axis=-1, kind="stable")
    rest_rank = np.cumsum(~matched, axis=-1) - 1
    target = np.where(
        matched,
        match.argmax(-1),
        np.take_along_axis(free_offsets, np.clip(rest_rank, 0, None), axis=-1),
    )
    out = np.empty_like(packs)
    np.put_along_axis(out, target, packs, axis=-1)
    return out
