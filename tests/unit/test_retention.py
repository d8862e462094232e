"""Retained experts (`retention.Retained`): what a confirmed change took off a rank's live slots
is kept within the most the rank held at once, oldest dropped first, placeholders never; and
the moves a resize still needs when ranks retain or pre-staged their experts
(`rebalance.outstanding`)."""

from __future__ import annotations

import torch

from moe_runtime.elastic import rebalance
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.model import experts as experts_mod
from moe_runtime.rank import retention


def _weights(tag: float) -> experts_mod.ExpertWeights:
    return experts_mod.ExpertWeights(
        w1=torch.full((2, 3), tag), w2=torch.full((3, 2), tag), w3=torch.full((2, 3), tag)
    )


def _experts(*keys: tuple[int, int]) -> dict[tuple[int, int], experts_mod.ExpertWeights]:
    return {k: _weights(10 * k[0] + k[1]) for k in keys}


def test_a_grow_leaves_what_it_took_retained_and_a_shrink_back_takes_it_again() -> None:
    kept = retention.Retained()
    at_two = _experts((0, 0), (0, 1), (0, 2), (0, 3))
    at_four = {k: at_two[k] for k in [(0, 0), (0, 1)]}
    assert kept.absorb(at_two, at_four) == 2
    assert kept.keys() == [(0, 2), (0, 3)]
    assert kept.experts[(0, 3)] is at_two[(0, 3)]  # the same weights, no copy
    back = {**at_four, (0, 2): kept.experts[(0, 2)], (0, 3): kept.experts[(0, 3)]}
    assert kept.absorb(at_four, back) == 0  # serving again: nothing left beside the live slots


def test_the_oldest_go_first_beyond_the_most_the_rank_held_at_once() -> None:
    kept = retention.Retained()
    first = _experts((0, 0), (0, 1), (0, 2))
    second = _experts((0, 3), (0, 4))  # a change that replaced every expert
    kept.absorb(first, second)
    assert kept.peak == 5 and kept.keys() == [(0, 0), (0, 1), (0, 2)]
    third = _experts((0, 5), (0, 6), (0, 7))
    kept.absorb(second, third)  # 3 live + at most 2 retained: the newest, the second's
    assert kept.peak == 5
    assert kept.keys() == [(0, 3), (0, 4)]
    assert len(kept) + len(third) <= kept.peak


def test_placeholders_are_never_retained_and_a_reload_forgets_all() -> None:
    kept = retention.Retained()
    zeros = _experts((1, 0), (1, 1))
    kept.reset(zeros.values())
    real = _experts((1, 2))
    assert kept.absorb(zeros, real) == 0
    kept.absorb(real, _experts((1, 3)))
    assert kept.keys() == [(1, 2)]
    kept.reset()
    assert kept.keys() == [] and kept.peak == 0


def test_outstanding_leaves_out_what_the_destination_holds() -> None:
    def move(logical: int, dst: int) -> moves_mod.ExpertMove:
        return moves_mod.ExpertMove(layer=0, logical=logical, src_rank=2, dst_rank=dst, dst_slot=0)

    planned = [move(1, 0), move(2, 0), move(3, 1), move(4, 1)]
    members = [10, 11, 12]  # member i (label) is rank i of the moves
    moves, prestaged, retained = rebalance.outstanding(
        planned, members, {11: {(0, 3)}}, {10: {(0, 1), (0, 3)}, 11: {(0, 3)}}
    )
    assert moves == [move(2, 0), move(4, 1)]
    assert (prestaged, retained) == (1, 1)  # pre-staged counts first where both hold it
