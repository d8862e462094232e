"""Settling a resize's placement (``eplb.settle``, through ``moves.rebalance_for_resize``):
fewer expert moves at the same balance, or within a tolerance of it."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from moe_runtime.eplb import moves, policy, settle

Key = tuple[int, int]


def _load(layers: int, experts: int, seed: int, spread: float = 0.6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.exp(torch.randn(layers, experts, generator=gen) * spread) * 100).round()


def _moves(old, new, old_n, new_n, held=None) -> int:
    """Expert moves from `old` to `new` once each rank's `held` keys (by new rank) count."""
    planned = moves.plan_moves(old, new, old_num_ranks=old_n, new_num_ranks=new_n)
    held = held or {}
    return sum((m.layer, m.logical) not in held.get(m.dst_rank, ()) for m in planned)


def _left_behind(old, old_n, new, new_n, ranks) -> dict[int, set[Key]]:
    """What each of `ranks` held under `old` and does not hold under `new` (what it retains)."""
    out: dict[int, set[Key]] = {}
    for rank in ranks:
        out[rank] = {
            (layer, e)
            for layer in range(old.num_layers)
            for e in set(old.experts_on_rank(layer, rank, old_n))
            - set(new.experts_on_rank(layer, rank, new_n))
        }
    return out


def _max_rank_load(load, placement, n) -> np.ndarray:
    return placement.rank_slot_load(load, n).numpy().max(axis=-1)


# (old ranks, new ranks, experts, redundant slots, nodes, groups)
CASES = [
    pytest.param(2, 4, 32, 0, 1, 1, id="grow-2-to-4"),
    pytest.param(4, 2, 32, 0, 1, 1, id="shrink-4-to-2"),
    pytest.param(4, 4, 32, 0, 1, 1, id="same-4"),
    pytest.param(3, 5, 20, 5, 1, 1, id="grow-3-to-5-redundant"),
    pytest.param(6, 3, 24, 6, 1, 1, id="shrink-6-to-3-redundant"),
    pytest.param(4, 8, 32, 8, 2, 4, id="grow-4-to-8-hier-n2"),
    pytest.param(8, 8, 32, 8, 2, 4, id="same-8-hier-n2"),
    pytest.param(2, 4, 8, 8, 1, 1, id="many-replicas-per-rank"),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("old_n", "new_n", "experts", "redundant", "nodes", "groups"), CASES)
def test_settling_never_moves_more_nor_makes_a_rank_busier(
    seed, old_n, new_n, experts, redundant, nodes, groups
):
    layers = 4
    old = policy.rebalance(
        _load(layers, experts, seed + 10),
        policy.num_physical_for(experts, old_n, redundant),
        old_n,
        nodes,
        groups,
    )
    load = _load(layers, experts, seed)
    kw = {
        "old_num_ranks": old_n,
        "new_num_ranks": new_n,
        "num_physical": policy.num_physical_for(experts, new_n, redundant),
        "num_nodes": nodes,
        "num_groups": groups,
    }
    relabelled = moves.rebalance_for_resize(load, old, **kw, settle=False)
    settled = moves.rebalance_for_resize(load, old, **kw)
    settled.validate(new_n)
    assert torch.equal(settled.logcnt, relabelled.logcnt)  # the same replicas, other ranks
    assert _moves(old, settled, old_n, new_n) <= _moves(old, relabelled, old_n, new_n)
    assert (
        _max_rank_load(load, settled, new_n) <= _max_rank_load(load, relabelled, new_n) + 1e-6
    ).all()
    if nodes > 1:  # hierarchical: every slot's expert stays on the node the policy gave it
        per_node = kw["num_physical"] // nodes
        for layer in range(layers):
            for node in range(nodes):
                block = slice(node * per_node, (node + 1) * per_node)
                assert collections.Counter(settled.phy2log[layer, block].tolist()) == (
                    collections.Counter(relabelled.phy2log[layer, block].tolist())
                )


def test_a_shrink_after_a_grow_keeps_experts_where_the_survivors_retain_them():
    """The first shrink back of a run: size 2 served on a placement the load no longer fits,
    so it cannot be taken again; a fresh balanced target still keeps most experts where the
    survivors hold them (live or retained from before the grow)."""
    layers, experts = 8, 32
    load = _load(layers, experts, 3)
    start = policy.Placement.from_phy2log(torch.arange(experts).repeat(layers, 1), experts)
    kw_grow = {"old_num_ranks": 2, "new_num_ranks": 4, "num_physical": experts}
    grown = moves.rebalance_for_resize(load, start, **kw_grow, tolerance=0.02)
    retained = _left_behind(start, 2, grown, 4, [0, 1])
    kw_shrink = {"old_num_ranks": 4, "new_num_ranks": 2, "num_physical": experts}
    before = moves.rebalance_for_resize(load, grown, **kw_shrink, settle=False)
    after = moves.rebalance_for_resize(load, grown, **kw_shrink, tolerance=0.02, held=retained)
    fresh_balance = policy.balancedness(load, before, 2)
    assert policy.balancedness(load, start, 2) < fresh_balance - 0.04  # start does not fit
    assert policy.balancedness(load, after, 2) >= fresh_balance / 1.02 - 1e-9
    moved_before = _moves(grown, before, 4, 2, retained)
    moved_after = _moves(grown, after, 4, 2, retained)
    assert moved_after <= moved_before // 3, (moved_before, moved_after)


def test_a_grow_moves_little_more_than_what_the_new_ranks_need():
    """New ranks hold nothing: their slots are the floor. Settling takes the moves between the
    old ranks (which balanced packing alone makes) nearly to none."""
    layers, experts = 8, 32
    load = _load(layers, experts, 5)
    start = policy.Placement.from_phy2log(torch.arange(experts).repeat(layers, 1), experts)
    kw = {"old_num_ranks": 2, "new_num_ranks": 4, "num_physical": experts}
    floor = layers * 2 * (experts // 4)  # every slot of ranks 2 and 3
    relabelled = _moves(start, moves.rebalance_for_resize(load, start, **kw, settle=False), 2, 4)
    settled = _moves(start, moves.rebalance_for_resize(load, start, **kw, tolerance=0.02), 2, 4)
    assert settled - floor <= (relabelled - floor) // 4, (floor, relabelled, settled)


@pytest.mark.parametrize("tolerance", [0.0, 0.02, 0.1])
def test_tolerance_bounds_the_balance_given_up(tolerance):
    layers, experts = 6, 32
    old = policy.rebalance(_load(layers, experts, 7, spread=1.0), experts, 4)
    load = _load(layers, experts, 8, spread=1.0)
    kw = {"old_num_ranks": 4, "new_num_ranks": 4, "num_physical": experts}
    fresh = policy.rebalance(load, experts, 4)
    settled = moves.rebalance_for_resize(load, old, **kw, tolerance=tolerance)
    floor = policy.balancedness(load, fresh, 4) / (1 + tolerance)
    assert policy.balancedness(load, settled, 4) >= floor - 1e-9


def test_frozen_layers_and_a_rank_that_holds_everything_are_left_alone():
    rows = np.tile(np.arange(8, dtype=np.int64), (3, 1))
    load = np.ones((3, 8))
    holds = np.zeros((3, 8, 2), dtype=bool)
    holds[:, :, 1] = True  # rank 1 holds every expert: any rows cost rank 0 its 4 slots
    holds[:, 0:4, 0] = True  # rank 0 holds what it has: nothing to gain
    assert np.array_equal(settle.settle(rows, load, holds, num_ranks=2), rows)
    swapped = holds.copy()
    swapped[:, :, 0] = False
    swapped[:, 4:8, 0] = True  # rank 0 holds the other half: four swaps per layer fix it
    frozen = np.array([False, True, False])
    out = settle.settle(rows, load, swapped, num_ranks=2, frozen=frozen)
    assert np.array_equal(out[1], rows[1])
    for layer in (0, 2):
        assert sorted(out[layer, :4].tolist()) == [4, 5, 6, 7]
        assert sorted(out[layer, 4:].tolist()) == [0, 1, 2, 3]


def test_the_load_cap_holds_a_swap_back():
    """Rank 0 holds the heavy expert 1 rank 1 was given: swapping it in would make rank 0 the
    busier one past the cap, so nothing moves at tolerance 0; a loose tolerance allows it."""
    rows = np.array([[0, 2, 1, 3]], dtype=np.int64)  # rank 0: experts 0, 2; rank 1: 1, 3
    load = np.array([[5.0, 6.0, 5.0, 4.0]])  # ranks: 10 and 10
    holds = np.zeros((1, 4, 2), dtype=bool)
    holds[0, [0, 1], 0] = True  # rank 0 holds 0 and 1 (not 2)
    holds[0, [2, 3], 1] = True  # rank 1 holds 2 and 3 (not 1)
    assert np.array_equal(settle.settle(rows, load, holds, num_ranks=2), rows)
    loose = settle.settle(rows, load, holds, num_ranks=2, tolerance=0.2)
    assert loose.tolist() == [[0, 1, 2, 3]]  # 11 vs 9: within 10 x 1.2
