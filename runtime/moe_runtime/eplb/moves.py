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

from dataclasses import dataclass

import torch

from moe_runtime.eplb import policy


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
) -> list[ExpertMove]:
    """The transfers that turn ``old`` (over old_num_ranks) into ``new`` (over new_num_ranks).

    One move per (layer, destination rank, logical expert) that the destination needs and did
    not hold, so the count equals ``lower_bound_moves``. The source is an old holder (rank <
    old_num_ranks) chosen to spread the sending: the holder with the fewest sends so far (ties:
    lowest rank). Ordered by layer, then destination slot.
    """
    _check_pair(old, new, old_num_ranks, new_num_ranks)
    old_sets = _holders(old, old_num_ranks)
    new_per = new.slots_per_rank(new_num_ranks)
    sends = [0] * old_num_ranks
    moves: list[ExpertMove] = []
    for layer, row in enumerate(new.phy2log.tolist()):
        holders_of: dict[int, list[int]] = {}
        for rank, experts in enumerate(old_sets[layer]):
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
) -> policy.Placement:
    """``policy.rebalance`` for new_num_ranks, relabelled to keep experts where they are.

    The rank loads of a placement do not change when, within one layer, the packs of slots
    are given to different ranks, nor when slots are reordered inside a rank. So per layer this
    gives each new pack the rank (within the same node) that already holds most of its experts
    (greedy matching on the overlap), then puts each expert back at its old local offset when
    it can. Same balancedness as plain ``rebalance``, never more moves in practice, usually far
    fewer. Old ranks >= new_num_ranks (departing on a shrink) keep nothing.

    When the rank count and P are unchanged (a periodic rebalance), a layer keeps its old slots
    outright if its busiest rank would not be more than ``tolerance`` (a fraction) busier than
    under the new placement: balanced packing is chaotic, and a 1% drift in load would
    otherwise move most experts for no gain.
    """
    new = policy.rebalance(load, num_physical, new_num_ranks, num_nodes, num_groups)
    _check_pair(old, new, old_num_ranks, new_num_ranks)
    old_per = old.slots_per_rank(old_num_ranks)
    new_per = new.slots_per_rank(new_num_ranks)
    nodes = num_nodes if num_nodes >= 1 and new_num_ranks % num_nodes == 0 else 1
    ranks_per_node = new_num_ranks // nodes
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    old_rows = old.phy2log.tolist()
    keep = [False] * new.num_layers
    if old_num_ranks == new_num_ranks and old.num_physical == new.num_physical:
        old_max = old.rank_slot_load(load, old_num_ranks).max(dim=-1).values
        new_max = new.rank_slot_load(load, new_num_ranks).max(dim=-1).values
        keep = (old_max <= new_max * (1.0 + tolerance) + 1e-9).tolist()
    out_rows: list[list[int]] = []
    for layer, row in enumerate(new.phy2log.tolist()):
        old_row = old_rows[layer]
        if keep[layer]:
            out_rows.append(list(old_row))
            continue
        old_slots = [
            old_row[r * old_per : (r + 1) * old_per] if r < old_num_ranks else []
            for r in range(new_num_ranks)
        ]
        packs = [row[r * new_per : (r + 1) * new_per] for r in range(new_num_ranks)]
        gain = [
            [
                len(set(pack) & set(held)) if j // ranks_per_node == i // ranks_per_node else -1
                for j, held in enumerate(old_slots)
            ]
            for i, pack in enumerate(packs)
        ]
        label = _match(gain)
        out = [0] * len(row)
        for i, pack in enumerate(packs):
            out[label[i] * new_per : (label[i] + 1) * new_per] = _align(pack, old_slots[label[i]])
        out_rows.append(out)
    return policy.Placement.from_phy2log(torch.tensor(out_rows, dtype=torch.int64), new.num_logical)


def _match(gain: list[list[int]]) -> list[int]:
    """Rank label of each pack maximising the summed gain[pack][label] (-1 = forbidden).

    Greedy on the largest gains, then pairwise swaps while they help; never worse than the
    identity labelling (which plain ``rebalance`` uses).
    """
    n = len(gain)
    label = [-1] * n
    used: set[int] = set()
    for _, i, j in sorted((-gain[i][j], i, j) for i in range(n) for j in range(n)):
        if gain[i][j] >= 0 and label[i] == -1 and j not in used:
            label[i] = j
            used.add(j)
    for _ in range(4):
        improved = False
        for a in range(n):
            for b in range(a + 1, n):
                la, lb = label[a], label[b]
                if gain[a][lb] < 0 or gain[b][la] < 0:
                    continue
                if gain[a][lb] + gain[b][la] > gain[a][la] + gain[b][lb]:
                    label[a], label[b] = lb, la
                    improved = True
        if not improved:
            break
    if sum(gain[i][label[i]] for i in range(n)) < sum(gain[i][i] for i in range(n)):
        return list(range(n))
    return label


def _align(pack: list[int], old_local: list[int]) -> list[int]:
    """Orders ``pack`` so that experts sit at the local offset they had in ``old_local``."""
    out: list[int | None] = [None] * len(pack)
    rest: list[int] = []
    for expert in pack:
        spot = next(
            (o for o, e in enumerate(old_local[: len(pack)]) if e == expert and out[o] is None),
            None,
        )
        if spot is None:
            rest.append(expert)
        else:
            out[spot] = expert
    free = iter(o for o in range(len(pack)) if out[o] is None)
    for expert in rest:
        out[next(free)] = expert
    return [e for e in out if e is not None]
