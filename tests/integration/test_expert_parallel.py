"""Expert parallelism over real gloo groups in spawned processes gives the tokens of one process.

Each case: N rank processes build a StatelessGroup, hold only their slots of a placement, run the
whole non-expert model, and generate greedily in lockstep; sequences are spread over the ranks,
arrive at different steps and stop at different lengths, so ranks are idle in some steps. The
tokens must equal single-process generation with LocalExperts.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moe_runtime.comm import ep, group
from moe_runtime.eplb import moves, policy
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import generate
from tests.support import ep_ranks

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
def pool() -> Iterator[ep_ranks.RankPool]:
    ranks = ep_ranks.RankPool(MAX_RANKS)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Single-process tokens (LocalExperts, all sequences in one batch)."""
    longest = max(r["max_new"] for r in REQUESTS)
    tokens = generate.generate_greedy(ep_ranks.MODEL, [r["prompt"] for r in REQUESTS], longest)
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


# --- in-process checks: ranks as threads of this process (gloo groups are independent objects)


def _threaded(num_ranks: int, fn: Any, spec: group.GroupSpec | None = None) -> list[Any]:
    """Runs fn(group) on num_ranks threads, each with its own StatelessGroup; results by rank."""
    spec = spec or group.GroupSpec.local(num_ranks, epoch=9)

    def member(rank: int) -> Any:
        grp = group.StatelessGroup(spec, rank, timeout=30)
        try:
            return fn(grp)
        finally:
            grp.destroy()

    with concurrent.futures.ThreadPoolExecutor(num_ranks) as ex:
        futures = [ex.submit(member, r) for r in range(num_ranks)]
        return [f.result(timeout=60) for f in futures]


def test_group_collectives_and_point_to_point():
    def body(grp: group.StatelessGroup) -> dict[str, Any]:
        r, w = grp.rank, grp.world_size
        summed = torch.tensor([r + 1.0])
        grp.all_reduce(summed)
        biggest = torch.tensor([float(r)])
        grp.all_reduce(biggest, op="max")
        gathered = grp.all_gather(torch.tensor([r, 10 * r]))
        shared = torch.tensor([float(r)])
        grp.broadcast(shared, src=w - 1)
        # rank r sends r + 1 rows to every rank
        out_splits = [j + 1 for j in range(w)]
        received = torch.empty(sum(out_splits), 2)
        grp.all_to_all_single(
            received, torch.full((w * (r + 1), 2), float(r)), out_splits, [r + 1] * w
        )
        ring = torch.empty(3)
        work = grp.isend(torch.full((3,), float(r)), (r + 1) % w, tag=5)
        grp.recv(ring, (r - 1) % w, tag=5)
        work.wait()
        grp.barrier()
        return {
            "sum": summed.item(),
            "max": biggest.item(),
            "gathered": [t.tolist() for t in gathered],
            "shared": shared.item(),
            "received": received[:, 0].tolist(),
            "ring": ring.tolist(),
        }

    results = _threaded(3, body)
    for r, res in enumerate(results):
        assert res["sum"] == 6.0
        assert res["max"] == 2.0
        assert res["gathered"] == [[0, 0], [1, 10], [2, 20]]
        assert res["shared"] == 2.0
        assert res["received"] == [0.0] * 1 + [1.0] * 2 + [2.0] * 3  # j + 1 rows from rank j
        assert res["ring"] == [float((r - 1) % 3)] * 3


def test_two_groups_coexist_and_the_survivor_works_after_the_other_is_destroyed():
    spec_a = group.GroupSpec.local(2, epoch=1)
    spec_b = group.GroupSpec.local(2, epoch=2)

    def member(rank: int) -> float:
        a = group.StatelessGroup(spec_a, rank, timeout=30)
        b = group.StatelessGroup(spec_b, rank, timeout=30)
        x = torch.ones(1)
        a.all_reduce(x)
        a.destroy()
        b.all_reduce(x)
        b.destroy()
        return float(x.item())

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        assert [f.result(timeout=60) for f in [ex.submit(member, r) for r in range(2)]] == [
            4.0,
            4.0,
        ]


def test_group_spec_refuses_bad_values_and_pickles():
    with pytest.raises(ValueError, match="backend"):
        group.GroupSpec.local(2, epoch=0, backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port"):
        group.GroupSpec.tcp(group.LOOPBACK, 0, 2, epoch=0)
    with pytest.raises(ValueError, match="world_size"):
        group.GroupSpec.local(0, epoch=0)
    spec = group.GroupSpec.tcp(group.LOOPBACK, 29500, 4, epoch=3)
    assert pickle.loads(pickle.dumps(spec)) == spec


@pytest.mark.parametrize(
    ("num_ranks", "make_placement"),
    [
        pytest.param(2, lambda: policy.rebalance(_load(11), 10, 2), id="r2-redundant"),
        pytest.param(3, lambda: policy.rebalance(_load(12), 12, 3), id="r3-redundant"),
    ],
)
def test_layer_output_matches_local_experts_with_an_idle_rank(num_ranks, make_placement):
    """One MoE layer: every rank's output equals LocalExperts on its rows; rank 0 has T = 0."""
    placement = make_placement()
    src = ep_ranks._source()
    hidden_size = src.config.hidden_size
    local_all = experts_mod.LocalExperts.from_source(src)
    gen = torch.Generator().manual_seed(3)
    layer = 1
    inputs = []
    for r in range(num_ranks):
        tokens = 0 if r == 0 else 5 + 3 * r
        hidden = torch.randn(tokens, hidden_size, generator=gen)
        scores = torch.rand(tokens, EXPERTS, generator=gen)
        weights, ids = torch.topk(torch.softmax(scores, -1), 2, dim=-1)
        inputs.append((hidden, ids, weights / weights.sum(-1, keepdim=True)))

    def body(grp: group.StatelessGroup) -> torch.Tensor:
        slots = {
            key: local_all.weights[(key[0], int(placement.phy2log[key]))]
            for key in (
                (lay, s)
                for lay in range(LAYERS)
                for s in placement.slots_of_rank(grp.rank, num_ranks)
            )
        }
        backend = ep.ExpertParallelBackend(grp, placement, slots)
        return backend(layer, *inputs[grp.rank])

    outputs = _threaded(num_ranks, body)
    for r, out in enumerate(outputs):
        expected = local_all(layer, *inputs[r])
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_backend_refuses_slots_it_does_not_own():
    placement = policy.identity(LAYERS, EXPERTS, 8, 2)

    def body(grp: group.StatelessGroup) -> str:
        weights = ep_ranks._expert(0, 0)
        wrong = {(lay, s): weights for lay in range(LAYERS) for s in range(8)}
        with pytest.raises(ValueError, match="exactly this rank's slots"):
            ep.ExpertParallelBackend(grp, placement, wrong)
        return "ok"

    assert _threaded(2, body) == ["ok", "ok"]
