"""What a rank reads of a checkpoint on disk: the non-expert tensors once each and exactly
the experts of its own slots, for every family and layout (per-expert names, transformers 5's
fused expert tensors, gpt-oss's fused ones, sharded files with an index); the head process
(the model's config, tokenizer and chat template) reads no weight at all. Counted by wrapping
the reader (`tests/support/read_counter.py`)."""

from __future__ import annotations

import pathlib

import pytest
import safetensors
import torch

from moe_runtime.eplb import policy
from moe_runtime.model import names, source
from moe_runtime.rank import worker
from tests.support import hf_families, read_counter

CASES = [
    *(pytest.param(f, {}, 2, id=f"{f}-as-saved-dp2") for f in hf_families.FAMILIES),
    pytest.param("mixtral", {"save_original_format": False}, 2, id="mixtral-fused-dp2"),
    pytest.param("qwen3_moe", {"save_original_format": False}, 3, id="qwen3_moe-fused-dp3"),
    pytest.param("deepseek_v3", {"max_shard_size": "50KB"}, 3, id="deepseek_v3-sharded-dp3"),
    pytest.param("gpt_oss", {"max_shard_size": "50KB"}, 4, id="gpt_oss-sharded-dp4"),
]


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> read_counter.ReadCounter:
    made = read_counter.ReadCounter()
    monkeypatch.setattr(safetensors, "safe_open", made.safe_open)
    return made


@pytest.mark.parametrize(("family", "save", "num_ranks"), CASES)
def test_a_rank_reads_its_experts_and_the_non_expert_tensors_only(
    family: str,
    save: dict[str, object],
    num_ranks: int,
    tmp_path: pathlib.Path,
    counter: read_counter.ReadCounter,
) -> None:
    path = hf_families.save(hf_families.build(family), tmp_path / family, **save)
    if "max_shard_size" in save:
        assert (path / "model.safetensors.index.json").is_file()
    cfg = source.open_source(str(path)).config
    num_physical = policy.num_physical_for(cfg.num_experts, num_ranks, 0)
    placement = policy.identity(cfg.num_moe_layers, cfg.num_experts, num_physical, num_ranks)
    expert_reads: dict[int, set[int]] = {}
    for rank in range(num_ranks):
        counter.clear()
        w = worker.RankWorker(device="cpu", dtype="float32", torch_threads=1)
        w.load_weights(source=str(path), rank=rank, num_ranks=num_ranks, placement=placement)
        whole = [r.stored for r in counter.reads if r.whole_fused_experts]
        assert not whole, f"rank {rank} read every expert of {whole[:3]}"
        read = {r.expert for r in counter.reads if r.expert is not None}
        mine = {
            int(e)
            for layer in range(cfg.num_moe_layers)
            for e in placement.experts_on_rank(layer, rank, num_ranks)
        }
        assert read == mine, f"rank {rank} read experts {sorted(read - mine)} of other ranks"
        expert_reads[rank] = read
        plain = [r for r in counter.reads if r.expert is None]
        assert len({r.stored for r in plain}) == len(plain), "a non-expert tensor read twice"
        # bytes read = the non-expert tensors + this rank's expert slots, each once (float32
        # as stored and as held)
        slots = placement.slots_per_rank(num_ranks) * cfg.num_moe_layers
        per_expert = sum(
            t.numel() * t.element_size() for t in w.slots.experts[(0, 0)].tensors().values()
        )
        _, model = w.loaded.require("test")
        stored = sum(t.numel() * 4 for t in model.non_expert_state().values())
        assert sum(r.nbytes for r in plain) == stored
        assert sum(r.nbytes for r in counter.reads if r.expert is not None) == slots * per_expert
    assert set().union(*expert_reads.values()) == set(range(cfg.num_experts))


def test_the_head_reads_no_weight(
    tmp_path: pathlib.Path, counter: read_counter.ReadCounter
) -> None:
    """What `moe-runtime serve` opens in its own process: config, tokenizer, chat template."""
    path = hf_families.save(hf_families.build("qwen3_moe"), tmp_path / "m", max_shard_size="50KB")
    src = source.open_source(str(path))
    assert src.config.num_experts > 0
    src.tokenizer()
    src.chat_template()
    assert counter.reads == []
    # the same counter does see a rank's read
    assert torch.is_tensor(src.tensor(names.EMBED)) and len(counter.reads) == 1


@pytest.mark.parametrize("placeholder", [True, False], ids=["from-peers", "from-storage"])
def test_a_rank_of_a_grow_reads_no_expert(
    placeholder: bool, tmp_path: pathlib.Path, counter: read_counter.ReadCounter
) -> None:
    """A grow's new rank (`elastic.grow`: no placement): from its peers it reads nothing at all
    (placeholders, filled by the transfer); from storage only the non-expert tensors."""
    path = hf_families.save(hf_families.build("mixtral"), tmp_path / "m")
    cfg = source.open_source(str(path)).config
    w = worker.RankWorker(device="cpu", dtype="float32", torch_threads=1)
    w.load_weights(source=str(path), rank=2, num_ranks=3, placement=None, placeholder=placeholder)
    if placeholder:
        assert counter.reads == []
    else:
        assert all(r.expert is None for r in counter.reads)
        assert len(counter.reads) == len(names.non_expert_tensor_names(cfg))
