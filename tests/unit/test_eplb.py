"""EPLB policy, load window and move planner: pure tensor functions."""

from __future__ import annotations

import zlib

import pytest
import torch

from moe_runtime.eplb import moves, policy, window
from tests.support import eplb_reference


def _uniform(layers: int, experts: int, seed: int) -> torch.Tensor:
    del seed
    return torch.full((layers, experts), 100, dtype=torch.int64)


def _zipf(layers: int, experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(layers)]) + 1
    return (10_000 / ranks.to(torch.float64) ** 1.2).round().to(torch.int64)


def _drifting(layers: int, experts: int, seed: int) -> torch.Tensor:
    """A hot spot that moves from expert to expert over the window, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros(layers, experts, dtype=torch.int64)
    for step in range(20):
        hot = (torch.arange(layers) * 3 + step) % experts
        step_load = torch.randint(0, 20, (layers, experts), generator=gen)
        step_load[torch.arange(layers), hot] += 200
        total += step_load
    return total


LOADS = {"uniform": _uniform, "zipf": _zipf, "drifting": _drifting}

# (layers, experts, physical, ranks, nodes, groups)
SHAPES = [
    pytest.param(2, 8, 8, 2, 1, 1, id="L2-E8-P8-r2"),
    pytest.param(3, 8, 12, 4, 1, 1, id="L3-E8-P12-r4-redundant"),
    pytest.param(2, 12, 16, 8, 2, 4, id="L2-E12-P16-r8-n2-g4-hier"),
    pytest.param(2, 12, 20, 4, 2, 3, id="L2-E12-P20-r4-n2-g3-global-fallback"),
    pytest.param(4, 16, 24, 6, 1, 1, id="L4-E16-P24-r6"),
    pytest.param(1, 6, 9, 3, 1, 1, id="L1-E6-P9-r3"),
    pytest.param(2, 16, 16, 1, 1, 1, id="L2-E16-P16-r1"),
]


def _assert_valid(placement: policy.Placement, layers: int, experts: int, phys: int, ranks: int):
    assert tuple(placement.phy2log.shape) == (layers, phys)
    assert tuple(placement.logcnt.shape) == (layers, experts)
    assert placement.phy2log.dtype == torch.int64
    assert (placement.logcnt >= 1).all()
    assert int(placement.logcnt.sum(-1).unique().item()) == phys
    for layer in range(layers):
        for expert in range(experts):
            slots = [s for s in placement.log2phy[layer, expert].tolist() if s >= 0]
            assert len(slots) == int(placement.logcnt[layer, expert])
            assert all(int(placement.phy2log[layer, s]) == expert for s in slots)
        held = sum(len(placement.experts_on_rank(layer, r, ranks)) for r in range(ranks))
        assert held == phys
        assert all(len(placement.slots_of_rank(r, ranks)) == phys // ranks for r in range(ranks))
    placement.validate(ranks)


@pytest.mark.parametrize("load_kind", list(LOADS))
@pytest.mark.parametrize(("layers", "experts", "phys", "ranks", "nodes", "groups"), SHAPES)
def test_rebalance_gives_valid_placement(load_kind, layers, experts, phys, ranks, nodes, groups):
    load = LOADS[load_kind](layers, experts, 1)
    placement = policy.rebalance(load, phys, ranks, nodes, groups)
    _assert_valid(placement, layers, experts, phys, ranks)


@pytest.mark.parametrize("load_kind", list(LOADS))
@pytest.mark.parametrize(("layers", "experts", "phys", "ranks", "nodes", "groups"), SHAPES)
def test_rebalance_is_at_least_as_balanced_as_identity(
    load_kind, layers, experts, phys, ranks, nodes, groups
):
    load = LOADS[load_kind](layers, experts, 2)
    balanced = policy.rebalance(load, phys, ranks, nodes, groups)
    plain = policy.identity(layers, experts, phys, ranks)
    assert policy.balancedness(load, balanced, ranks) >= policy.balancedness(load, plain, ranks)


def _random_load(kind: str, layers: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Loads that stress the greedy steps: ties (few distinct values), floats, cold layers."""
    if kind == "ties":
        return torch.randint(0, 3, (layers, experts), generator=gen)
    if kind == "float":
        return torch.rand(layers, experts, generator=gen, dtype=torch.float64) ** 4 * 1000
    if kind == "cold-layer":
        load = torch.randint(0, 1000, (layers, experts), generator=gen)
        load[int(torch.randint(0, layers, (1,), generator=gen))] = 0
        return load
    ranks = torch.rand(layers, experts, generator=gen).argsort(-1) + 1
    return (10_000 / ranks.to(torch.float64) ** 1.2).round().to(torch.int64)  # zipf


# (layers, experts, physical, ranks, nodes, groups): every path of the policy, global and
# hierarchical, with and without redundant slots, one pack per rank or several.
REFERENCE_SHAPES = [
    pytest.param(3, 16, 16, 4, 1, 1, id="global-no-redundant"),
    pytest.param(3, 16, 24, 4, 1, 1, id="global-redundant"),
    pytest.param(4, 32, 48, 8, 2, 4, id="hier-n2-g4"),
    pytest.param(2, 32, 40, 8, 4, 8, id="hier-n4-g8"),
    pytest.param(2, 16, 24, 4, 2, 2, id="hier-one-group-per-node"),
    pytest.param(2, 24, 30, 6, 2, 3, id="global-fallback-g3-n2"),
    pytest.param(2, 16, 17, 1, 1, 1, id="one-rank"),
    pytest.param(2, 12, 16, 16, 1, 1, id="one-slot-per-rank"),
]


@pytest.mark.parametrize("kind", ["ties", "float", "cold-layer", "zipf"])
@pytest.mark.parametrize(
    ("layers", "experts", "phys", "ranks", "nodes", "groups"), REFERENCE_SHAPES
)
def test_rebalance_matches_loop_reference_on_random_loads(
    kind, layers, experts, phys, ranks, nodes, groups
):
    """The vectorised policy gives the loop-by-loop reference's placement, ties included."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}-{layers}-{experts}-{phys}".encode()))
    for _ in range(25):
        load = _random_load(kind, layers, experts, gen)
        got = policy.rebalance(load, phys, ranks, nodes, groups)
        want = eplb_reference.rebalance(load, phys, ranks, nodes, groups)
        assert torch.equal(got.phy2log, want.phy2log), load.tolist()


@pytest.mark.parametrize(
    ("phys", "ranks", "groups"),
    [
        pytest.param(320, 64, 1, id="P320-r64-global"),
        pytest.param(320, 64, 8, id="P320-r64-g8-hier"),
        pytest.param(288, 32, 8, id="P288-r32-g8-hier"),
    ],
)
def test_rebalance_matches_loop_reference_at_deepseek_v3_shape(phys, ranks, groups):
    """58 MoE layers x 256 experts over 8 nodes, as bench/eplb.py times it."""
    load = _random_load("zipf", 58, 256, torch.Generator().manual_seed(phys + ranks + groups))
    got = policy.rebalance(load, phys, ranks, 8, groups)
    want = eplb_reference.rebalance(load, phys, ranks, 8, groups)
    assert torch.equal(got.phy2log, want.phy2log)
    assert policy.balancedness(load, got, ranks) == policy.balancedness(load, want, ranks)


def test_identity_is_round_robin_with_redundant_copies_of_first_experts():
    placement = policy.identity(2, 6, 9, 3)
    assert placement.phy2log[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert placement.logcnt[1].tolist() == [2, 2, 2, 1, 1, 1]
    assert placement.log2phy[0, 0].tolist() == [0, 6]
    assert placement.log2phy[0, 5].tolist() == [5, -1]
    assert placement.experts_on_rank(0, 2, 3) == [0, 1, 2]


def test_rebalance_matches_deepseek_reference_example():
    """The example of github.com/deepseek-ai/EPLB's README (2 layers, 12 experts, 16 slots)."""
    load = torch.tensor(
        [
            [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
        ]
    )
    placement = policy.rebalance(load, 16, 8, 2, 4)
    assert placement.phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]


@pytest.mark.parametrize("load_kind", list(LOADS))
def test_hierarchical_keeps_each_expert_group_on_one_node(load_kind):
    layers, experts, ranks, nodes, groups = 2, 16, 8, 2, 4
    load = LOADS[load_kind](layers, experts, 9)
    placement = policy.rebalance(load, 24, ranks, nodes, groups)
    per_node = ranks // nodes
    for layer in range(layers):
        node_of_group: dict[int, set[int]] = {}
        for rank in range(ranks):
            for expert in placement.experts_on_rank(layer, rank, ranks):
                node_of_group.setdefault(expert // (experts // groups), set()).add(rank // per_node)
        assert all(len(n) == 1 for n in node_of_group.values())
        assert sorted(
            len([g for g, n in node_of_group.items() if node in n]) for node in range(nodes)
        ) == [2, 2]


def test_redundant_slots_go_to_hot_experts():
    load = torch.tensor([[1000, 10, 10, 10, 10, 10, 10, 10, 500, 10, 10, 10]])
    placement = policy.rebalance(load, 16, 4)
    assert int(placement.logcnt[0, 0]) >= 2
    assert int(placement.logcnt[0, 8]) >= 2
    cold = [e for e in range(12) if e not in (0, 8)]
    assert all(int(placement.logcnt[0, e]) == 1 for e in cold)


def test_cold_start_spreads_redundant_slots():
    placement = policy.rebalance(torch.zeros(1, 4), 6, 3)
    assert sorted(placement.logcnt[0].tolist()) == [1, 1, 2, 2]


def test_balancedness_splits_replicated_load_evenly():
    # expert 0 has two replicas on ranks 0 and 1: each rank gets 50 from it
    placement = policy.Placement.from_phy2log(torch.tensor([[0, 1, 0, 2]]), 3)
    load = torch.tensor([[100, 50, 50]])
    assert policy.balancedness(load, placement, 2) == pytest.approx(1.0)
    assert policy.balancedness(torch.zeros(1, 3), placement, 2) == 1.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(lambda: policy.rebalance(torch.ones(1, 8), 6, 2), "num_physical", id="P<E"),
        pytest.param(lambda: policy.rebalance(torch.ones(1, 8), 9, 2), "divisible", id="P%N"),
        pytest.param(lambda: policy.rebalance(torch.ones(8), 8, 2), r"\[L, E\]", id="load-1d"),
        pytest.param(lambda: policy.rebalance(-torch.ones(1, 8), 8, 2), ">= 0", id="negative"),
        pytest.param(
            lambda: policy.rebalance(torch.full((1, 8), float("nan")), 8, 2),
            "finite",
            id="nan",
        ),
        pytest.param(lambda: policy.identity(1, 4, 4, 0), "num_ranks", id="zero-ranks"),
        pytest.param(
            lambda: policy.rebalance(torch.ones(1, 8), 8, 2, 1, 3), "num_groups", id="E%groups"
        ),
        pytest.param(
            lambda: policy.rebalance(torch.ones(1, 8), 9, 3, 2, 2), "num_nodes", id="ranks%nodes"
        ),
        pytest.param(
            lambda: policy.Placement.from_phy2log(torch.tensor([[0, 0]]), 2),
            "no slot",
            id="expert-without-slot",
        ),
    ],
)
def test_impossible_inputs_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    ("experts", "ranks", "redundant", "expected"),
    [
        pytest.param(8, 3, 0, 9, id="round-up"),
        pytest.param(8, 4, 0, 8, id="exact"),
        pytest.param(8, 3, 2, 12, id="redundant"),
    ],
)
def test_num_physical_for(experts, ranks, redundant, expected):
    assert policy.num_physical_for(experts, ranks, redundant) == expected


def test_min_ranks_for():
    assert policy.min_ranks_for(8, 3) == 3
    assert policy.min_ranks_for(8, 4) == 2


# --- load window ------------------------------------------------------------------------------


def test_load_window_sums_only_the_last_steps():
    win = window.LoadWindow(num_layers=2, num_experts=3, window_size=3)
    for step in range(5):
        win.record(torch.full((2, 3), step))
    assert win.total().tolist() == [[9, 9, 9], [9, 9, 9]]  # steps 2 + 3 + 4
    assert win.num_recorded == 3


def test_load_window_rejects_wrong_shape():
    win = window.LoadWindow(num_layers=2, num_experts=3, window_size=3)
    with pytest.raises(ValueError, match="load must be"):
        win.record(torch.zeros(3, 2))


# --- move planning ----------------------------------------------------------------------------


def _apply(
    old: policy.Placement,
    plan: list[moves.ExpertMove],
    new: policy.Placement,
    *,
    old_num_ranks: int,
    new_num_ranks: int,
) -> None:
    """Checks that after the moves every new rank holds every expert its new slots need."""
    for layer in range(new.num_layers):
        have = {
            r: set(old.experts_on_rank(layer, r, old_num_ranks)) if r < old_num_ranks else set()
            for r in range(new_num_ranks)
        }
        for move in plan:
            if move.layer != layer:
                continue
            assert move.src_rank < old_num_ranks
            assert move.logical in old.experts_on_rank(layer, move.src_rank, old_num_ranks)
            assert move.logical not in have[move.dst_rank]
            assert new.rank_of_slot(move.dst_slot, new_num_ranks) == move.dst_rank
            assert int(new.phy2log[layer, move.dst_slot]) == move.logical
            have[move.dst_rank].add(move.logical)
        for rank in range(new_num_ranks):
            assert set(new.experts_on_rank(layer, rank, new_num_ranks)) <= have[rank]


def test_unchanged_placement_needs_no_moves():
    placement = policy.rebalance(_zipf(3, 8, 0), 12, 4)
    plan = moves.plan_moves(placement, placement, old_num_ranks=4, new_num_ranks=4)
    assert plan == []
    assert moves.lower_bound_moves(placement, placement, old_num_ranks=4, new_num_ranks=4) == 0


def test_slot_reshuffle_inside_a_rank_is_not_a_move():
    old = policy.Placement.from_phy2log(torch.tensor([[0, 1, 2, 3]]), 4)
    new = policy.Placement.from_phy2log(torch.tensor([[1, 0, 3, 2]]), 4)
    assert moves.plan_moves(old, new, old_num_ranks=2, new_num_ranks=2) == []


def test_swap_between_two_ranks_moves_two_experts():
    old = policy.Placement.from_phy2log(torch.tensor([[0, 1, 2, 3]]), 4)
    new = policy.Placement.from_phy2log(torch.tensor([[0, 2, 1, 3]]), 4)
    plan = moves.plan_moves(old, new, old_num_ranks=2, new_num_ranks=2)
    assert plan == [
        moves.ExpertMove(layer=0, logical=2, src_rank=1, dst_rank=0, dst_slot=1),
        moves.ExpertMove(layer=0, logical=1, src_rank=0, dst_rank=1, dst_slot=2),
    ]


def test_two_replicas_on_one_rank_are_received_once():
    old = policy.Placement.from_phy2log(torch.tensor([[0, 1, 2, 3]]), 4)
    new = policy.Placement.from_phy2log(torch.tensor([[0, 1, 2, 3, 0, 0]]), 4)
    plan = moves.plan_moves(old, new, old_num_ranks=2, new_num_ranks=3)
    assert plan == [moves.ExpertMove(layer=0, logical=0, src_rank=0, dst_rank=2, dst_slot=4)]
    assert moves.bytes_moved(plan, bytes_per_expert=1000) == 1000


def test_sources_are_spread_over_holders():
    # expert 0 is on ranks 0 and 1; two new ranks need it: one each
    old = policy.Placement.from_phy2log(torch.tensor([[0, 1, 0, 2]]), 3)
    new = policy.Placement.from_phy2log(torch.tensor([[0, 1, 0, 2, 0, 1, 0, 2]]), 3)
    plan = moves.plan_moves(old, new, old_num_ranks=2, new_num_ranks=4)
    senders = [m.src_rank for m in plan if m.logical == 0]
    assert sorted(senders) == [0, 1]


def test_shrink_takes_experts_off_departing_ranks():
    old = policy.identity(2, 8, 8, 4)
    new = policy.rebalance(_zipf(2, 8, 3), 8, 2)
    plan = moves.plan_moves(old, new, old_num_ranks=4, new_num_ranks=2)
    assert all(m.dst_rank < 2 for m in plan)
    _apply(old, plan, new, old_num_ranks=4, new_num_ranks=2)


RESIZES = [
    pytest.param(4, 8, 16, 2, id="grow-4-to-8"),
    pytest.param(4, 2, 16, 2, id="shrink-4-to-2"),
    pytest.param(2, 3, 16, 1, id="grow-2-to-3"),
    pytest.param(3, 3, 16, 3, id="same-3"),
    pytest.param(4, 6, 32, 4, id="grow-4-to-6-E32"),
]


@pytest.mark.parametrize("load_kind", list(LOADS))
@pytest.mark.parametrize(("old_ranks", "new_ranks", "experts", "redundant"), RESIZES)
def test_plan_moves_reaches_new_placement_with_fewest_moves(
    load_kind, old_ranks, new_ranks, experts, redundant
):
    layers = 3
    load = LOADS[load_kind](layers, experts, 4)
    old = policy.rebalance(
        _drifting(layers, experts, 5), policy.num_physical_for(experts, old_ranks), old_ranks
    )
    phys = policy.num_physical_for(experts, new_ranks, redundant)
    new = policy.rebalance(load, phys, new_ranks)
    plan = moves.plan_moves(old, new, old_num_ranks=old_ranks, new_num_ranks=new_ranks)
    _apply(old, plan, new, old_num_ranks=old_ranks, new_num_ranks=new_ranks)
    assert len(plan) == moves.lower_bound_moves(
        old, new, old_num_ranks=old_ranks, new_num_ranks=new_ranks
    )


@pytest.mark.parametrize("load_kind", list(LOADS))
@pytest.mark.parametrize(("old_ranks", "new_ranks", "experts", "redundant"), RESIZES)
def test_rebalance_for_resize_keeps_balance_with_no_more_moves(
    load_kind, old_ranks, new_ranks, experts, redundant
):
    layers = 3
    load = LOADS[load_kind](layers, experts, 6)
    old = policy.rebalance(
        _zipf(layers, experts, 7), policy.num_physical_for(experts, old_ranks), old_ranks
    )
    phys = policy.num_physical_for(experts, new_ranks, redundant)
    kw = {"old_num_ranks": old_ranks, "new_num_ranks": new_ranks}
    plain = policy.rebalance(load, phys, new_ranks)
    kept = moves.rebalance_for_resize(load, old, num_physical=phys, **kw)
    _assert_valid(kept, layers, experts, phys, new_ranks)
    assert (
        policy.balancedness(load, kept, new_ranks)
        >= policy.balancedness(load, plain, new_ranks) - 1e-9
    )
    assert len(moves.plan_moves(old, kept, **kw)) <= len(moves.plan_moves(old, plain, **kw))


@pytest.mark.parametrize(
    ("old_ranks", "new_ranks", "experts", "redundant", "nodes", "groups", "tolerance"),
    [
        pytest.param(4, 8, 16, 4, 1, 1, 0.0, id="grow-4-to-8"),
        pytest.param(6, 3, 24, 3, 1, 1, 0.0, id="shrink-6-to-3"),
        pytest.param(4, 4, 16, 4, 1, 1, 0.0, id="same-size"),
        pytest.param(4, 4, 16, 4, 1, 1, 0.05, id="same-size-tolerance"),
        pytest.param(4, 8, 32, 8, 2, 4, 0.0, id="grow-hier-n2"),
        pytest.param(8, 8, 32, 8, 2, 4, 0.02, id="same-size-hier-n2-tolerance"),
        pytest.param(2, 4, 8, 8, 1, 1, 0.0, id="many-replicas-per-rank"),
    ],
)
def test_unsettled_rebalance_for_resize_matches_loop_reference(
    old_ranks, new_ranks, experts, redundant, nodes, groups, tolerance
):
    """The vectorised relabelling (overlap, matching, alignment) gives the per-layer loop's
    placement, with replicas of one expert on one rank and on departing ranks included."""
    gen = torch.Generator().manual_seed(old_ranks * 100 + new_ranks * 10 + redundant)
    old_phys = policy.num_physical_for(experts, old_ranks, redundant)
    new_phys = policy.num_physical_for(experts, new_ranks, redundant)
    kw = {
        "old_num_ranks": old_ranks,
        "new_num_ranks": new_ranks,
        "num_physical": new_phys,
        "num_nodes": nodes,
        "num_groups": groups,
        "tolerance": tolerance,
    }
    for trial in range(20):
        kind = ["ties", "zipf", "float", "cold-layer"][trial % 4]
        old = policy.rebalance(
            _random_load(kind, 3, experts, gen), old_phys, old_ranks, nodes, groups
        )
        load = _random_load(kind, 3, experts, gen)
        got = moves.rebalance_for_resize(load, old, **kw, settle=False)
        want = eplb_reference.rebalance_for_resize(load, old, **kw)
        assert torch.equal(got.phy2log, want.phy2log), (kind, load.tolist())


def test_rebalance_for_resize_to_same_load_and_size_moves_nothing():
    load = _zipf(3, 16, 8)
    old = policy.rebalance(load, 20, 4)
    # Relabel ranks of the old placement: a plain rebalance would not notice.
    shuffled = policy.Placement.from_phy2log(old.phy2log.view(3, 4, 5).flip(1).reshape(3, 20), 16)
    kept = moves.rebalance_for_resize(
        load, shuffled, old_num_ranks=4, new_num_ranks=4, num_physical=20
    )
    assert moves.plan_moves(shuffled, kept, old_num_ranks=4, new_num_ranks=4) == []
    assert torch.equal(kept.phy2log, shuffled.phy2log)


@pytest.mark.parametrize(
    ("noise", "tolerance", "expect_moves"),
    [
        pytest.param(0.01, 0.05, False, id="small-drift-within-tolerance-keeps-all"),
        pytest.param(0.5, 0.0, True, id="large-drift-rebalances"),
    ],
)
def test_periodic_rebalance_keeps_layers_within_tolerance(noise, tolerance, expect_moves):
    gen = torch.Generator().manual_seed(10)
    load = _zipf(4, 32, 11)
    old = policy.rebalance(load, 40, 8)
    drifted = (load.double() * (1 + noise * torch.randn(4, 32, generator=gen))).clamp(min=0)
    kept = moves.rebalance_for_resize(
        drifted, old, old_num_ranks=8, new_num_ranks=8, num_physical=40, tolerance=tolerance
    )
    plan = moves.plan_moves(old, kept, old_num_ranks=8, new_num_ranks=8)
    assert bool(plan) == expect_moves
    plain = policy.rebalance(drifted, 40, 8)
    floor = policy.balancedness(drifted, plain, 8) / (1 + tolerance)
    assert policy.balancedness(drifted, kept, 8) >= floor - 1e-9


def test_plan_moves_rejects_mismatched_placements():
    with pytest.raises(ValueError, match="same layers"):
        moves.plan_moves(
            policy.identity(1, 4, 4, 2),
            policy.identity(2, 4, 4, 2),
            old_num_ranks=2,
            new_num_ranks=2,
        )
