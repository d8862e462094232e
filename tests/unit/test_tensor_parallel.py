"""Tensor parallelism at the model level (`tp_shard`, `tensor_parallel`): the shard plan (what
each TP rank holds, what it refuses), sliced checkpoint reads, and TP groups of threads over a
fake collective giving the tokens of one process (KV heads split and replicated, uneven
vocabulary slices, every family that shards). The two-process gloo test with transformers'
tokens is tests/integration/test_tensor_parallel.py.
"""

from __future__ import annotations

import math

import pytest
import safetensors
import torch

from moe_runtime.model import generate, names, source, tensor_parallel, tp_shard
from tests.support import hf_families, read_counter, tp_ranks

PROMPTS = [[1, 5, 9, 200, 3], [1, 7], [1, *range(40, 58)]]
NEW_TOKENS = 6
#: Mixtral with 8 query heads over 2 KV heads: T = 4 and 8 replicate KV heads; T = 8 leaves
#: the vocabulary (300) in uneven slices (38 rows, the last 34).
WIDE = dict(num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, source.ModelSource]:
    root = tmp_path_factory.mktemp("tp")
    out = {family: hf_families.save_source(family, root) for family in hf_families.FAMILIES}
    out["mixtral_wide"] = hf_families.save_source("mixtral", root / "wide", **WIDE)
    return out


def test_size_one_is_the_whole_model(sources: dict[str, source.ModelSource]) -> None:
    cfg = sources["deepseek_v3"].config
    shard = tp_shard.plan(cfg, rank=0, size=1)
    assert shard.local is cfg
    assert all(shard.slice_of(n) is None for n in names.non_expert_tensor_names(cfg))


@pytest.mark.parametrize(
    ("family", "size"),
    [("mixtral", 2), ("qwen3_moe", 2), ("qwen2_moe", 2), ("deepseek_v3", 2), ("gpt_oss", 2)]
    + [("olmoe", 3), ("olmoe", 6), ("mixtral_wide", 4), ("mixtral_wide", 8)],
    ids=lambda v: str(v),
)
def test_shards_put_together_are_the_weights(
    sources: dict[str, source.ModelSource], family: str, size: int
) -> None:
    """A rank's part of a sliced tensor is that slice of the whole; the slices cover the
    sliced dimension (overlapping only for replicated KV heads); a replicated tensor is whole
    on every rank."""
    src = sources[family]
    shards = [tp_shard.plan(src.config, rank=r, size=size) for r in range(size)]
    whole = {n: src.tensor(n) for n in names.non_expert_tensor_names(src.config)}
    parts = [tensor_parallel.load_shard(src, s) for s in shards]
    for name, value in whole.items():
        slices = [s.slice_of(name) for s in shards]
        for shard, part, cut in zip(shards, parts, slices, strict=True):
            assert tuple(part[name].shape) == shard.shape(name), name
            expected = value if cut is None else value.narrow(cut.dim, cut.start, cut.length)
            assert torch.equal(part[name], expected), name
        if slices[0] is not None:
            covered = set().union(*(range(c.start, c.stop) for c in slices if c is not None))
            assert covered == set(range(value.shape[slices[0].dim])), name


def test_kv_heads_are_split_or_replicated(sources: dict[str, source.ModelSource]) -> None:
    cfg = sources["mixtral_wide"].config  # 8 query heads, 2 KV heads
    two = [tp_shard.plan(cfg, rank=r, size=2) for r in range(2)]
    assert [(s.heads, s.kv_heads) for s in two] == [((0, 4), (0, 1)), ((4, 8), (1, 2))]
    four = [tp_shard.plan(cfg, rank=r, size=4) for r in range(4)]
    assert [s.kv_heads for s in four] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert all(s.local.num_kv_heads == 1 and s.local.num_heads == 2 for s in four)
    eight = tp_shard.plan(cfg, rank=7, size=8)
    assert eight.vocab == (266, 300) and eight.vocab_chunk == 38


@pytest.mark.parametrize(
    ("family", "size", "field"),
    [
        ("mixtral", 4, "num_heads"),  # 6 heads
        ("mixtral_wide", 3, "num_heads"),
        ("deepseek_v3", 3, "intermediate_size"),  # 6 heads divide, the dense MLP's 56 not
        ("olmoe", 2, "num_kv_heads"),  # 3 KV heads
    ],
    ids=lambda v: str(v),
)
def test_sizes_that_do_not_shard_are_refused_naming_the_field(
    sources: dict[str, source.ModelSource], family: str, size: int, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        tp_shard.plan(sources[family].config, rank=0, size=size)


def test_a_rank_reads_only_its_slices(
    sources: dict[str, source.ModelSource], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = sources["qwen3_moe"]
    counter = read_counter.ReadCounter()
    monkeypatch.setattr(safetensors, "safe_open", counter.safe_open)
    for name in names.non_expert_tensor_names(src.config):
        src.tensor(name)
    whole = counter.nbytes
    counter.clear()
    shard = tp_shard.plan(src.config, rank=1, size=2)
    held = tensor_parallel.load_shard(src, shard)
    planned = sum(4 * math.prod(shard.shape(n)) for n in held)  # float32 checkpoint
    assert counter.nbytes == planned == sum(t.numel() * t.element_size() for t in held.values())
    assert counter.nbytes < whole


def test_tensor_slice_is_the_tensor_cut(sources: dict[str, source.ModelSource]) -> None:
    src = sources["qwen3_moe"]
    name = "model.layers.1.mlp.down_proj.weight"
    got = src.tensor_slice(name, dim=1, start=10, stop=30)
    assert torch.equal(got, src.tensor(name)[:, 10:30])
    with pytest.raises(ValueError, match="no slice"):
        src.tensor_slice(name, dim=1, start=10, stop=10_000)


@pytest.mark.parametrize(
    ("family", "size"),
    [
        ("mixtral", 2),
        ("qwen3_moe", 2),
        ("qwen2_moe", 2),
        ("deepseek_v2", 2),
        ("deepseek_v3", 2),
        ("gpt_oss", 2),
        ("olmoe", 3),  # q/k norms over the whole projection, split
        ("olmoe", 6),  # and KV heads replicated under them
        ("mixtral_wide", 4),  # KV heads replicated
        ("mixtral_wide", 8),  # and an uneven vocabulary
    ],
    ids=lambda v: str(v),
)
def test_tp_threads_give_the_tokens_of_one_process(
    sources: dict[str, source.ModelSource], family: str, size: int
) -> None:
    src = sources[family]
    reference = generate.generate_greedy(src, PROMPTS, NEW_TOKENS)
    got = tp_ranks.run_threads(
        size, lambda g: tp_ranks.tp_generate(src, g, g.rank, size, PROMPTS, NEW_TOKENS)
    )
    assert all(tokens == reference for tokens in got)
