"""Pipeline stages in spawned processes, hidden states passed over gloo send/recv on loopback:
P = 2 gives the greedy tokens of transformers' `generate` and of one process (P = 1) for the
Mixtral, Qwen3-MoE and DeepSeek-V3 (MLA) shapes, each stage reading and holding only its
layers' tensors and experts; (T, P) = (2, 2) in four processes (a TP group of two inside each
stage) gives the same tokens; DP = 2 x PP = 2 with each stage's experts placed over its own
expert-parallel group (stage s of both DP ranks; different, staggered requests per DP rank)
gives the tokens of one process. One pool of four processes for the module; every family in
one task per case.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moe_runtime.comm import group
from moe_runtime.model import generate, names, pipeline, source
from tests.support import ep_ranks, hf_families

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
PROMPTS = [[1, 5, 9, 200, 3], [1, 7], [1, *range(40, 58)]]
NEW_TOKENS = 8
PP = 2
TP = 2
DP = 2
TIMEOUT_S = 240.0
#: DP x PP case: (prompt, new tokens, arrival step) per request, spread over the DP ranks.
REQUESTS = hf_families.staggered_requests(
    [[1, 5, 9, 200, 3], [1, 7], [1, *range(40, 58)], [3, 4], [1, 250, 6]], DP
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per family: the saved checkpoint, transformers' tokens and one process's."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("pp2")
    return hf_families.references(root, FAMILIES, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def pool() -> Iterator[ep_ranks.RankPool]:
    ranks = ep_ranks.RankPool(PP * TP, tasks_module="tests.support.pp_ranks")
    yield ranks
    ranks.close()


def _run(
    pool: ep_ranks.RankPool,
    checkpoints: dict[str, dict[str, Any]],
    directory: str,
    tp: int,
) -> list[dict[str, Any]]:
    """Process s * tp + t is TP rank t of pipeline stage s; results in that order."""
    pp_specs = [group.GroupSpec.local(PP, epoch=10 + t, directory=directory) for t in range(tp)]
    tp_specs = [group.GroupSpec.local(tp, epoch=20 + s, directory=directory) for s in range(PP)]
    paths = {family: c["path"] for family, c in checkpoints.items()}
    return pool.run(
        "pp_generate",
        [
            dict(
                pp_spec=pp_specs[t],
                tp_spec=tp_specs[s] if tp > 1 else None,
                stage=s,
                tp_rank=t,
                checkpoints=paths,
                prompts=PROMPTS,
                new_tokens=NEW_TOKENS,
            )
            for s in range(PP)
            for t in range(tp)
        ],
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def stages(
    pool: ep_ranks.RankPool,
    checkpoints: dict[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[dict[str, Any]]:
    """P = 2, T = 1: each stage's tokens and bytes read and held, per family."""
    return _run(pool, checkpoints, str(tmp_path_factory.mktemp("pp2-groups")), tp=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_pipeline_stages_give_transformers_tokens(
    family: str, checkpoints: dict[str, dict[str, Any]], stages: list[dict[str, Any]]
) -> None:
    expected = checkpoints[family]
    assert expected["one_process"] == expected["transformers"]
    for stage in range(PP):
        assert stages[stage][family]["tokens"] == expected["transformers"], f"stage {stage}"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_stage_reads_and_holds_only_its_layers(
    family: str, checkpoints: dict[str, dict[str, Any]], stages: list[dict[str, Any]]
) -> None:
    cfg = source.open_source(checkpoints[family]["path"]).config
    everything = names.all_tensor_names(cfg)
    whole = sum(4 * math.prod(names.tensor_shape(cfg, n)) for n in everything)
    for s in range(PP):
        plan = pipeline.plan(cfg, stage=s, size=PP)
        planned = _planned_bytes(cfg, plan)
        got = stages[s][family]
        assert got["read"] == got["held"] == planned < whole, f"stage {s}"
    assert sum(stages[s][family]["read"] for s in range(PP)) == whole  # untied: read once


def test_tp_inside_each_of_two_stages_gives_transformers_tokens(
    pool: ep_ranks.RankPool,
    checkpoints: dict[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    results = _run(pool, checkpoints, str(tmp_path_factory.mktemp("pp2-tp2")), tp=TP)
    for family, c in checkpoints.items():
        cfg = source.open_source(c["path"]).config
        for index, got in enumerate(results):
            stage, rank = divmod(index, TP)
            assert got[family]["tokens"] == c["transformers"], (family, stage, rank)
            # a TP rank of a stage reads and holds less than the stage does at T = 1
            plan = pipeline.plan(cfg, stage=stage, size=PP)
            alone = _planned_bytes(cfg, plan)
            assert got[family]["read"] == got[family]["held"] < alone, (family, stage, rank)


def _planned_bytes(cfg: Any, plan: pipeline.PipelineStage) -> int:
    """Bytes of every tensor the stage holds at T = 1 (float32 checkpoints)."""
    return sum(
        4 * math.prod(names.tensor_shape(cfg, n))
        for n in names.all_tensor_names(cfg)
        if plan.holds(n)
    )


def test_dp_by_pp_with_experts_per_stage_gives_the_tokens_of_one_process(
    pool: ep_ranks.RankPool,
    checkpoints: dict[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    store = str(tmp_path_factory.mktemp("dp-pp"))
    pp_specs = [group.GroupSpec.local(PP, epoch=30 + d, directory=store) for d in range(DP)]
    ep_specs = [group.GroupSpec.local(DP, epoch=40 + s, directory=store) for s in range(PP)]
    paths = {family: c["path"] for family, c in checkpoints.items()}
    processes = [(d, s) for d in range(DP) for s in range(PP)]
    results = pool.run(
        "dp_pp_generate",
        [
            dict(
                pp_spec=pp_specs[d],
                ep_spec=ep_specs[s],
                dp_rank=d,
                stage=s,
                checkpoints=paths,
                requests=REQUESTS,
            )
            for d, s in processes
        ],
        timeout=TIMEOUT_S,
    )
    for family, c in checkpoints.items():
        longest = max(r["max_new"] for r in REQUESTS)
        alone = generate.generate_greedy(c["path"], [r["prompt"] for r in REQUESTS], longest)
        expected = {r["seq_id"]: t[: r["max_new"]] for r, t in zip(REQUESTS, alone, strict=True)}
        for (d, s), got in zip(processes, results, strict=True):
            mine = {r["seq_id"] for r in REQUESTS if r["rank"] == d}
            assert got[family] == {q: expected[q] for q in mine}, (family, d, s)
