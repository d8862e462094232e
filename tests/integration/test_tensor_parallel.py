"""Tensor parallelism at T = 2 over a real gloo group in two spawned processes gives the
greedy tokens of transformers' `generate` and of one process (T = 1), for the Mixtral,
Qwen3-MoE and DeepSeek-V3 (MLA) shapes; each TP rank reads and holds only its shard of the
non-expert weights. Then DP = 2 x TP = 2 in four processes, each DP rank serving other
requests, staggered, in both expert layouts: over the DP leaders (what `serve` runs) and over
all DP x T processes (`tensor_parallel.MESH`, each TP rank dispatching its half of the rows):
the tokens of one process. One pool of four processes for
the module; every family in one task per case.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moe_runtime.comm import group
from moe_runtime.eplb import policy
from moe_runtime.model import generate, names, source, tensor_parallel
from tests.support import ep_ranks, hf_families

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
PROMPTS = [[1, 5, 9, 200, 3], [1, 7], [1, *range(40, 58)]]
NEW_TOKENS = 8
TP = 2
DP = 2
TIMEOUT_S = 240.0
#: DP x TP case: (prompt, new tokens, arrival step) per request, spread over the DP ranks.
REQUESTS = hf_families.staggered_requests(
    [[1, 5, 9, 200, 3], [1, 7], [1, *range(40, 58)], [3, 4], [1, 250, 6]], DP
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per family: the saved checkpoint, transformers' tokens and one process's."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tp2")
    return hf_families.references(root, FAMILIES, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def pool() -> Iterator[ep_ranks.RankPool]:
    ranks = ep_ranks.RankPool(DP * TP, tasks_module="tests.support.tp_ranks")
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def per_rank(
    pool: ep_ranks.RankPool,
    checkpoints: dict[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[dict[str, Any]]:
    """TP = 2 alone: each TP rank's tokens and bytes read and held, per family."""
    spec = group.GroupSpec.local(TP, epoch=1, directory=str(tmp_path_factory.mktemp("tp2")))
    paths = {family: c["path"] for family, c in checkpoints.items()}
    return pool.run(
        "tp_generate",
        [
            dict(spec=spec, rank=r, checkpoints=paths, prompts=PROMPTS, new_tokens=NEW_TOKENS)
            for r in range(TP)
        ],
        timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_two_tp_ranks_give_transformers_tokens(
    family: str, checkpoints: dict[str, dict[str, Any]], per_rank: list[dict[str, Any]]
) -> None:
    expected = checkpoints[family]
    assert expected["one_process"] == expected["transformers"]
    for rank in range(TP):
        assert per_rank[rank][family]["tokens"] == expected["transformers"], f"TP rank {rank}"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_tp_rank_reads_and_holds_only_its_shard(
    family: str, checkpoints: dict[str, dict[str, Any]], per_rank: list[dict[str, Any]]
) -> None:
    cfg = source.open_source(checkpoints[family]["path"]).config
    whole = sum(
        4 * math.prod(names.tensor_shape(cfg, n)) for n in names.non_expert_tensor_names(cfg)
    )
    for rank in range(TP):
        got = per_rank[rank][family]
        assert got["read"] == got["held"] < whole, f"TP rank {rank}"
    # the sliced tensors' bytes are split between the ranks: together they hold less than
    # twice the whole (the replicated embeddings, norms and routers are held by both)
    assert sum(per_rank[r][family]["held"] for r in range(TP)) < 2 * whole


@pytest.mark.parametrize("layout", tensor_parallel.EXPERT_LAYOUTS)
def test_dp_by_tp_with_expert_parallelism_gives_the_tokens_of_one_process(
    layout: str,
    pool: ep_ranks.RankPool,
    checkpoints: dict[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`leader`: experts over the DP leaders (what `serve` runs). `mesh`: one expert-parallel
    group of all four processes, the experts placed over all of them, each TP rank
    dispatching its half of its DP rank's rows (vLLM's layout)."""
    mesh = layout == tensor_parallel.MESH
    store = str(tmp_path_factory.mktemp(f"dp-tp-{layout}"))
    tp_specs = [group.GroupSpec.local(TP, epoch=10 + d, directory=store) for d in range(DP)]
    if mesh:
        ep_specs = [group.GroupSpec.local(DP * TP, epoch=30, directory=store)] * TP
    else:
        ep_specs = [group.GroupSpec.local(DP, epoch=20 + t, directory=store) for t in range(TP)]
    paths = {family: c["path"] for family, c in checkpoints.items()}
    processes = [(d, t) for d in range(DP) for t in range(TP)]
    results = pool.run(
        "dp_tp_generate",
        [
            dict(
                tp_spec=tp_specs[d],
                ep_spec=ep_specs[t],
                dp_rank=d,
                tp_rank=t,
                checkpoints=paths,
                requests=REQUESTS,
                layout=layout,
            )
            for d, t in processes
        ],
        timeout=TIMEOUT_S,
    )
    for family, c in checkpoints.items():
        longest = max(r["max_new"] for r in REQUESTS)
        alone = generate.generate_greedy(c["path"], [r["prompt"] for r in REQUESTS], longest)
        expected = {r["seq_id"]: t[: r["max_new"]] for r, t in zip(REQUESTS, alone, strict=True)}
        cfg = source.open_source(c["path"]).config
        quarter = cfg.num_moe_layers * policy.num_physical_for(cfg.num_experts, DP * TP) // 4
        for (d, t), got in zip(processes, results, strict=True):
            mine = {r["seq_id"] for r in REQUESTS if r["rank"] == d}
            assert got[family]["tokens"] == {s: expected[s] for s in mine}, (family, d, t)
            if mesh:  # every process holds its quarter of the slots and runs its rows
                assert got[family]["slots"] == quarter, (family, d, t)
                assert got[family]["rows"] > 0, (family, d, t)
            elif t:
                assert got[family]["slots"] == got[family]["rows"] == 0, (family, d, t)
