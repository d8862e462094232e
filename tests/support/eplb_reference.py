"""The loop-by-loop DeepSeek EPLB, kept as the oracle for ``policy.rebalance``.

This is the transcription of github.com/deepseek-ai/EPLB that ``policy`` used before it was
vectorised across layers (one Python loop per row in balanced packing), and the per-layer,
per-pack relabelling that ``moves.rebalance_for_resize`` used. Neither is used at run time;
the unit tests check that ``policy.rebalance`` and ``moves.rebalance_for_resize`` give the same
placements on many random loads, and ``bench/eplb.py`` times both.

Shapes as in ``policy``: load [L, E], phy2log [L, P], logcnt [L, E] (int64).
"""

from __future__ import annotations

import torch

from moe_runtime.eplb import policy


def rebalance(
    load: torch.Tensor,
    num_physical: int,
    num_ranks: int,
    num_nodes: int = 1,
    num_groups: int = 1,
) -> policy.Placement:
    """``policy.rebalance`` as it was (load [L, E] -> Placement); expects valid inputs, since
    ``policy.rebalance`` is the one that checks them."""
    weight = load.to(torch.float64).cpu().clone()
    weight[weight.sum(-1) == 0] = 1.0  # cold layers: balance as if uniform
    if num_groups % num_nodes == 0:
        phy2log = _hierarchical(weight, num_physical, num_groups, num_nodes, num_ranks)
    else:
        phy2log = _hierarchical(weight, num_physical, 1, 1, num_ranks)
    return policy.Placement.from_phy2log(phy2log, int(weight.shape[1]))


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
    """``moves.rebalance_for_resize`` as it was: one Python loop per layer and per pack.

    ``policy.rebalance`` for new_num_ranks, relabelled to keep experts where they are.

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
    new = rebalance(load, num_physical, new_num_ranks, num_nodes, num_groups)
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
