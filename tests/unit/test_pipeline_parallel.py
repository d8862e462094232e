"""Pipeline parallelism at the model level (`pipeline`, `MoEModel(pp=)`): the plan (every
layer, tensor and expert held by one pipeline stage, refusals naming the field), what a stage
reads and holds, its KV cache, and stages chained in one process giving the tokens of one
whole model, alone and with a TP group of threads inside each stage (tied embeddings too).
Spawned processes over gloo, against transformers: tests/integration/test_pipeline_parallel.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import pathlib

import pytest
import safetensors
import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.model import decoder, generate, names, pipeline, source, tensor_parallel, tp_shard
from moe_runtime.model import kv as kv_mod
from moe_runtime.rank import staging
from tests.support import hf_families, read_counter, tp_ranks

PROMPTS = [[1, 5, 9, 200, 3], [1, 7], [1, *range(40, 58)]]
NEW_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, source.ModelSource]:
    root = tmp_path_factory.mktemp("pp")
    out = {family: hf_families.save_source(family, root) for family in hf_families.FAMILIES}
    out["qwen3_moe_tied"] = hf_families.save_source(
        "qwen3_moe", root / "tied", tie_word_embeddings=True
    )
    return out


@pytest.mark.parametrize(
    ("layers", "size", "expected"),
    [
        (4, 1, [(0, 4)]),
        (4, 2, [(0, 2), (2, 4)]),
        (3, 2, [(0, 2), (2, 3)]),  # the extra layer before the last stage
        (4, 3, [(0, 1), (1, 3), (3, 4)]),
        (7, 3, [(0, 2), (2, 5), (5, 7)]),
        (10, 4, [(0, 2), (2, 5), (5, 8), (8, 10)]),  # extras counted back from the 2nd-to-last
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
    ids=lambda v: str(v),
)
def test_stages_split_the_layers_contiguously_and_evenly(
    sources: dict[str, source.ModelSource],
    layers: int,
    size: int,
    expected: list[tuple[int, int]],
) -> None:
    cfg = dataclasses.replace(sources["mixtral"].config, num_layers=layers)
    stages = [pipeline.plan(cfg, stage=s, size=size) for s in range(size)]
    assert [s.layers for s in stages] == expected
    assert [s.is_first for s in stages] == [True] + [False] * (size - 1)
    assert [s.is_last for s in stages] == [False] * (size - 1) + [True]


@pytest.mark.parametrize("family", [*hf_families.FAMILIES, "qwen3_moe_tied"])
@pytest.mark.parametrize("size", [2, 3])
def test_every_tensor_and_expert_belongs_to_one_stage(
    sources: dict[str, source.ModelSource], family: str, size: int
) -> None:
    """Each layer, non-expert tensor and routed expert is held by exactly one pipeline stage
    (a tied embedding by the first and the last); MoE layers are numbered from 0 per stage."""
    cfg = sources[family].config
    stages = [pipeline.plan(cfg, stage=s, size=size) for s in range(size)]
    covered = [layer for s in stages for layer in range(*s.layers)]
    assert covered == list(range(cfg.num_layers))
    assert [m for s in stages for m in range(*s.moe_layers)] == list(range(cfg.num_moe_layers))
    for name in names.all_tensor_names(cfg):
        holders = [s.index for s in stages if s.holds(name)]
        if name == names.EMBED and cfg.tie_word_embeddings:
            assert holders == [0, size - 1], name
        else:
            assert len(holders) == 1, (name, holders)
    for s in stages:
        assert s.holds(names.FINAL_NORM) == s.is_last
        assert len(s.experts()) == s.num_moe_layers * cfg.num_experts
        for m in range(*s.moe_layers):
            assert s.layers[0] <= cfg.moe_layer_ids[m] < s.layers[1]


@pytest.mark.parametrize(
    ("stage", "size", "field"),
    [
        (0, 5, "num_layers"),  # 3 decoder layers
        (2, 2, "stage"),
        (0, 0, "size"),
    ],
    ids=lambda v: str(v),
)
def test_plans_that_cannot_be_are_refused_naming_the_field(
    sources: dict[str, source.ModelSource], stage: int, size: int, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        pipeline.plan(sources["mixtral"].config, stage=stage, size=size)


def test_a_stage_reads_and_holds_only_its_tensors_and_experts(
    sources: dict[str, source.ModelSource], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = sources["qwen3_moe"]
    cfg = src.config
    counter = read_counter.ReadCounter()
    monkeypatch.setattr(safetensors, "safe_open", counter.safe_open)
    whole = sum(4 * math.prod(names.tensor_shape(cfg, n)) for n in names.all_tensor_names(cfg))
    per_stage = []
    for stage in [pipeline.plan(cfg, stage=s, size=2) for s in range(2)]:
        counter.clear()
        model = decoder.MoEModel.from_source(src, pp=stage)
        local = pipeline.local_experts(src, stage)
        held = sum(t.numel() * t.element_size() for t in model.non_expert_state().values())
        held += sum(w.nbytes for w in local.weights.values())
        planned = sum(
            4 * math.prod(names.tensor_shape(cfg, n))
            for n in names.all_tensor_names(cfg)
            if stage.holds(n)
        )
        assert counter.nbytes == held == planned, stage.index
        assert set(model.non_expert_state()) == set(stage.tensor_names())
        assert {layer for layer, _ in local.weights} == set(range(stage.num_moe_layers))
        per_stage.append(counter.nbytes)
    assert sum(per_stage) == whole  # untied: every byte read once, by one stage


def test_a_tied_last_stage_holds_only_its_tp_ranks_embedding_rows(
    sources: dict[str, source.ModelSource],
) -> None:
    cfg = sources["qwen3_moe_tied"].config
    last = pipeline.plan(cfg, stage=1, size=2)
    alone = pipeline.parts(cfg, stage=last, shard=None)
    assert alone[names.EMBED] is None  # T = 1: lm_head reads every row
    for rank in range(2):
        shard = tp_shard.plan(cfg, rank=rank, size=2)
        held = pipeline.parts(cfg, stage=last, shard=shard)
        assert held[names.EMBED] == tp_shard.Slice(0, *shard.vocab)
        first = pipeline.parts(cfg, stage=pipeline.plan(cfg, stage=0, size=2), shard=shard)
        assert first[names.EMBED] is None  # the lookup needs every row


def test_a_stage_kv_cache_holds_only_its_layers(sources: dict[str, source.ModelSource]) -> None:
    src = sources["deepseek_v3"]
    stage = pipeline.plan(src.config, stage=1, size=2)
    model = decoder.MoEModel.from_source(src, pp=stage)
    kv = kv_mod.KVCache(model.local_config, layers=model.layers)
    assert kv.pool.shape[0] == stage.layers[1] - stage.layers[0] == 2
    full = kv_mod.bytes_per_token(src.config, torch.float32)
    assert kv_mod.bytes_per_token(src.config, torch.float32, layers=stage.layers) == full // 2
    batch = kv_mod.ForwardBatch(["a"], [[1, 2, 3]], [0])
    hidden = torch.zeros(3, src.config.hidden_size)
    experts = pipeline.local_experts(src, stage)
    with pytest.raises(ValueError, match="layers=model.layers"):
        model.forward(batch, kv_mod.KVCache(model.local_config), experts, hidden=hidden)
    with pytest.raises(ValueError, match="hidden states"):
        model.forward(batch, kv, experts)
    with pytest.raises(ValueError, match=r"hidden states \[3, 48\]"):
        model.forward(batch, kv, experts, hidden=hidden[:2])
    logits = model.forward(batch, kv, experts, hidden=hidden)
    assert logits.shape == (1, src.config.vocab_size)
    assert kv.num_tokens("a") == 3


def test_the_first_stage_returns_hidden_states(sources: dict[str, source.ModelSource]) -> None:
    src = sources["mixtral"]
    stage = pipeline.plan(src.config, stage=0, size=2)
    model = decoder.MoEModel.from_source(src, pp=stage)
    kv = kv_mod.KVCache(model.local_config, layers=model.layers)
    batch = kv_mod.ForwardBatch(["a", "b"], [[1, 2, 3], [4]], [0, 0])
    out = model.forward(batch, kv, pipeline.local_experts(src, stage))
    assert out.shape == (4, src.config.hidden_size)
    with pytest.raises(ValueError, match="pass no hidden"):
        model.forward(batch, kv, pipeline.local_experts(src, stage), hidden=out)


@pytest.mark.parametrize("family", [*hf_families.FAMILIES, "qwen3_moe_tied"])
@pytest.mark.parametrize("size", [2, 3])
def test_chained_stages_give_the_tokens_of_one_process(
    sources: dict[str, source.ModelSource], family: str, size: int
) -> None:
    src = sources[family]
    reference = generate.generate_greedy(src, PROMPTS, NEW_TOKENS)
    stages = [pipeline.plan(src.config, stage=s, size=size) for s in range(size)]
    models = [decoder.MoEModel.from_source(src, pp=s) for s in stages]
    experts = [pipeline.local_experts(src, s) for s in stages]
    assert generate.generate_greedy(models, PROMPTS, NEW_TOKENS, experts=experts) == reference


@pytest.mark.parametrize(
    "family", ["mixtral", "qwen3_moe", "qwen3_moe_tied", "deepseek_v3", "gpt_oss"]
)
def test_tp_inside_each_stage_gives_the_tokens_of_one_process(
    sources: dict[str, source.ModelSource], family: str
) -> None:
    """(T, P) = (2, 2): each TP thread chains its rank of both pipeline stages (its shard of
    each stage's tensors), the two stages' collectives in turn over the thread group."""
    src = sources[family]
    reference = generate.generate_greedy(src, PROMPTS, NEW_TOKENS)
    stages = [pipeline.plan(src.config, stage=s, size=2) for s in range(2)]

    def chain(grp: tp_ranks.ThreadGroup) -> list[list[int]]:
        shard = tp_shard.plan(src.config, rank=grp.rank, size=2)
        models = [
            decoder.MoEModel.from_source(
                src, tp=tensor_parallel.TensorParallel(shard, grp), pp=stage
            )
            for stage in stages
        ]
        experts = [pipeline.local_experts(src, stage) for stage in stages]
        return generate.generate_greedy(models, PROMPTS, NEW_TOKENS, experts=experts)

    assert tp_ranks.run_threads(2, chain) == [reference, reference]


def test_stages_passed_out_of_order_are_refused(sources: dict[str, source.ModelSource]) -> None:
    src = sources["mixtral"]
    stages = [pipeline.plan(src.config, stage=s, size=2) for s in (1, 0)]
    models = [decoder.MoEModel.from_source(src, pp=s) for s in stages]
    experts = [pipeline.local_experts(src, s) for s in stages]
    with pytest.raises(ValueError, match="every one, in order"):
        generate.generate_greedy(models, PROMPTS, NEW_TOKENS, experts=experts)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_a_new_leader_gets_stage_0s_weights_from_a_peer_over_the_group(
    sources: dict[str, source.ModelSource], family: str, tmp_path: pathlib.Path
) -> None:
    """A grow's new DP rank on another host: its leader (pipeline stage 0) receives a serving
    leader's non-expert weights over the transfer group (`staging.exchange_non_expert`, the
    path of DP ranks on several hosts): exactly stage 0's tensors, equal to the sender's."""
    src = sources[family]
    stage = pipeline.plan(src.config, stage=0, size=2)
    sender = decoder.MoEModel.from_source(src, pp=stage)
    receiver = decoder.MoEModel(src.config, pp=stage)
    spec = group_mod.GroupSpec.local(2, epoch=1, directory=str(tmp_path))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        groups = list(pool.map(lambda r: group_mod.StatelessGroup(spec, r, timeout=60), [0, 1]))
        done = list(
            pool.map(
                lambda gm: staging.exchange_non_expert(
                    gm[0], gm[0].rank, gm[1], src_ranks=[0], dst_ranks=[1], tag=7,
                    dtype=torch.float32,
                ),
                zip(groups, [sender, receiver], strict=True),
            )
        )  # fmt: skip
    for g in groups:
        g.destroy()
    assert done[0] == ([1], 0) and done[1][1] > 0
    sent, got = sender.non_expert_state(), receiver.non_expert_state()
    assert set(got) == set(sent) == set(stage.tensor_names())
    assert all(torch.equal(sent[n], got[n]) for n in sent)
