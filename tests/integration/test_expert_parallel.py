"""Expert parallelism over real gloo groups in spawned processes gives the tokens of one process.

Each case: N rank processes build a StatelessGroup, hold only their slots of a placement, run the
whole non-expert model, and generate greedily in lockstep; sequences are spread over the ranks,
arrive at different steps and stop at different lengths, so ranks are idle in some steps. The
tokens must equal single-process generation with LocalExperts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moe_runtime.comm import group
from moe_runtime.eplb import moves, policy
from moe_runtime.model import mixtral
from tests.integration import ep_worker

LAYERS, EXPERTS = 4, 8  # synthetic tiny
MAX_RANKS = 4
CASE_TIMEOUT_S = 90.0


def _requests() -> list[dict[str, Any]]:
    rng = random.Random(7)
    reqs = []
    for i in range(6):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(2, 12))]
        reqs.append(
            {"seq_id": f"s{i}", "prompt": prompt, "max_new": 3 + i % 4, "start_step": i % 3}
        )
    return reqs


REQUESTS = _requests()


def _assign(num_ranks: int) -> list[dict[str, Any]]:
    """Spread requests over ranks unevenly: rank 0 gets none when there are 3 or more ranks."""
    targets = list(range(1, num_ranks)) if num_ranks >= 3 else list(range(num_ranks))
    return [dict(r, rank=targets[i % len(targets)]) for i, r in enumerate(REQUESTS)]


def _load(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(EXPERTS, generator=gen) for _ in range(LAYERS)]) + 1
    return (1000 / ranks.to(torch.float64) ** 1.5).round().to(torch.int64)


@pytest.fixture(scope="module")
def pool() -> Iterator[ep_worker.RankPool]:
    ranks = ep_worker.RankPool(MAX_RANKS)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Single-process tokens (LocalExperts, all sequences in one batch)."""
    longest = max(r["max_new"] for r in REQUESTS)
    tokens = mixtral.generate_greedy(ep_worker.MODEL, [r["prompt"] for r in REQUESTS], longest)
    return {r["seq_id"]: t[: r["max_new"]] for r, t in zip(REQUESTS, tokens, strict=True)}


def _merge(per_rank: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    merged: dict[str, list[int]] = {}
    for tokens in per_rank:
        assert not set(tokens) & set(merged)
        merged.update(tokens)
    return merged


def _two_replicas_on_one_rank() -> policy.Placement:
    row = [0, 0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # rank 0 holds expert 0 twice
    return policy.Placement.from_phy2log(torch.tensor([row] * LAYERS), EXPERTS)


PLACEMENTS = [
    pytest.param(1, lambda: policy.identity(LAYERS, EXPERTS, 8, 1), False, id="r1-identity"),
    pytest.param(2, lambda: policy.identity(LAYERS, EXPERTS, 8, 2), False, id="r2-identity"),
    pytest.param(
        2, lambda: policy.rebalance(_load(1), 10, 2), False, id="r2-rebalanced-2-redundant"
    ),
    pytest.param(
        3, lambda: policy.identity(LAYERS, EXPERTS, 9, 3), False, id="r3-identity-1-redundant"
    ),
    pytest.param(
        3, lambda: policy.rebalance(_load(2), 12, 3), False, id="r3-rebalanced-4-redundant"
    ),
    pytest.param(4, lambda: policy.rebalance(_load(3), 8, 4), False, id="r4-rebalanced"),
    pytest.param(4, _two_replicas_on_one_rank, True, id="r4-tcp-two-replicas-on-one-rank"),
]


@pytest.mark.parametrize(("num_ranks", "make_placement", "use_tcp"), PLACEMENTS)
def test_expert_parallel_generation_matches_single_process(
    pool, reference, num_ranks, make_placement, use_tcp
):
    placement = make_placement()
    placement.validate(num_ranks)
    if use_tcp:
        (port,) = pool.run("free_port", [{}], timeout=CASE_TIMEOUT_S)  # rank 0's host
        spec = group.GroupSpec.tcp(group.LOOPBACK, port, num_ranks, epoch=1)
    else:
        spec = group.GroupSpec.local(num_ranks, epoch=1)
    requests = _assign(num_ranks)
    results = pool.run(
        "generate",
        [
            {"spec": spec, "rank": r, "phy2log": placement.phy2log.tolist(), "requests": requests}
            for r in range(num_ranks)
        ],
        timeout=CASE_TIMEOUT_S,
    )
    assert _merge([res["tokens"] for res in results]) == reference


def test_grow_two_to_three_ranks_moves_experts_and_keeps_tokens(pool, reference):
    """Standby group beside the old one, state broadcast, expert moves, then serve on 3 ranks."""
    old = policy.rebalance(_load(4), 8, 2)
    new = moves.rebalance_for_resize(
        _load(5), old, old_num_ranks=2, new_num_ranks=3, num_physical=9
    )
    plan = moves.plan_moves(old, new, old_num_ranks=2, new_num_ranks=3)
    assert plan, "the case must move something"
    old_spec = group.GroupSpec.local(2, epoch=1)
    new_spec = group.GroupSpec.local(3, epoch=2)
    requests = _assign(3)
    results = pool.run(
        "grow_and_generate",
        [
            {
                "old_spec": old_spec if r < 2 else None,
                "old_num_ranks": 2,
                "new_spec": new_spec,
                "rank": r,
                "old_phy2log": old.phy2log.tolist(),
                "new_phy2log": new.phy2log.tolist(),
                "requests": requests,
            }
            for r in range(3)
        ],
        timeout=CASE_TIMEOUT_S,
    )
    assert [res.get("old_group_sum") for res in results] == [3.0, 3.0, None]
    assert all(res["state_identical"] for res in results)
    assert all(res["moved_identical"] for res in results)
    assert sum(res["received"] for res in results) == len(plan)
    assert sum(res["sent"] for res in results) == len(plan)
    new_rank_needs = {
        (layer, e) for layer in range(LAYERS) for e in new.experts_on_rank(layer, 2, 3)
    }
    assert results[2]["received"] == len(new_rank_needs)
    assert _merge([res["tokens"] for res in results]) == reference
