"""The pure half of the warm spares' pre-staging (`elastic.prestage`): which experts each spare
wants for the grows it may serve, and the moves that fetch the missing ones."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.elastic import prestage
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy

LAYERS, EXPERTS = 2, 8


def _grow_targets(n: int, most: int) -> tuple[policy.Placement, dict[int, policy.Placement]]:
    load = torch.arange(1, LAYERS * EXPERTS + 1, dtype=torch.float64).reshape(LAYERS, EXPERTS)
    live = policy.identity(LAYERS, EXPERTS, EXPERTS, n)
    targets = {
        k: moves_mod.rebalance_for_resize(
            load,
            live,
            old_num_ranks=n,
            new_num_ranks=n + k,
            num_physical=policy.num_physical_for(EXPERTS, n + k),
        )
        for k in range(1, most + 1)
    }
    return live, targets


def test_each_spare_wants_its_slots_of_every_grow_it_serves() -> None:
    _, targets = _grow_targets(2, 2)
    wanted = prestage.wanted_keys(targets, num_active=2, num_layers=LAYERS)
    for k, target in targets.items():
        for j in range(k):
            need = {
                (layer, e)
                for layer in range(LAYERS)
                for e in target.experts_on_rank(layer, 2 + j, 2 + k)
            }
            assert need <= wanted[j]
    assert set(wanted) == {0, 1}  # spare 1 serves only the grow by 2


@pytest.mark.parametrize("limit", [3, 100], ids=["one-batch", "all"])
def test_fetch_moves_bring_what_is_missing_from_holders(limit: int) -> None:
    live, targets = _grow_targets(2, 2)
    wanted = prestage.wanted_keys(targets, num_active=2, num_layers=LAYERS)
    missing = {j: sorted(keys) for j, keys in wanted.items()}
    moves = prestage.fetch_moves(missing, live, num_active=2, limit=limit)
    assert len(moves) == min(limit, sum(len(k) for k in missing.values()))
    for m in moves:
        assert m.logical in live.experts_on_rank(m.layer, m.src_rank, 2)  # the source holds it
        assert (m.layer, m.logical) in wanted[m.dst_rank - 2]
    if limit == 3:
        assert {m.dst_rank for m in moves} == {2, 3}  # both spares get some of every batch
