"""The paged KV cache: blocks taken and returned, growth that keeps the data, the bound
(`KVCacheFull`, nothing changed), the budget in bytes and in positions."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.model import config as config_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import source


@pytest.fixture(scope="module")
def cfg() -> config_mod.ModelConfig:
    return source.open_source("synthetic://tiny?seed=0").config


def _fill(kv: kv_mod.KVCache, seq_id: str, start: int, n: int, value: float) -> None:
    kv.reserve(seq_id, start, n)
    part = torch.full((n, kv.heads, kv.dim), value)
    for layer in range(kv.config.num_layers):
        kv.write(seq_id, layer, start, part, part + 1)


def test_blocks_are_taken_returned_and_grown_without_losing_data(
    cfg: config_mod.ModelConfig,
) -> None:
    kv = kv_mod.KVCache(cfg, initial_capacity=32, block_size=16)
    assert kv.num_blocks == 2
    _fill(kv, "a", 0, 20, 1.0)  # two blocks
    _fill(kv, "b", 0, 40, 2.0)  # three more: the pool grows
    assert kv.num_blocks >= 5
    keys, values = kv.read("a", 3)
    assert torch.equal(keys, torch.full((cfg.num_kv_heads, 20, kv.dim), 1.0))
    assert torch.equal(values, torch.full((cfg.num_kv_heads, 20, kv.dim), 2.0))
    kv.reserve("b", 10, 0)  # drop the tail: two blocks return
    assert kv.num_tokens("b") == 10
    free = kv.free_blocks
    kv.free("a")
    assert kv.free_blocks == free + 2
    assert torch.equal(kv.read("b", 0)[0], torch.full((cfg.num_kv_heads, 10, kv.dim), 2.0))


def test_the_bound_refuses_and_changes_nothing(cfg: config_mod.ModelConfig) -> None:
    per_block = kv_mod.bytes_per_token(cfg, torch.float32) * kv_mod.BLOCK_SIZE
    kv = kv_mod.KVCache.with_budget(cfg, 3 * per_block)
    assert kv.max_blocks == 3
    _fill(kv, "a", 0, 33, 1.0)
    with pytest.raises(kv_mod.KVCacheFull):
        kv.reserve("b", 0, 16)
    assert "b" not in kv and kv.num_tokens("a") == 33
    kv.free("a")
    kv.reserve("b", 0, 48)  # all three blocks, once free


def test_budget_in_positions(cfg: config_mod.ModelConfig) -> None:
    per_token = kv_mod.bytes_per_token(cfg, torch.float32)
    tokens = kv_mod.budget_tokens(
        cfg, torch.float32, budget_bytes=per_token * 5000, fraction=0.5, cuda=False, num_ranks=1
    )
    assert tokens == 5000 // 16 * 16
    small = kv_mod.budget_tokens(
        cfg, torch.float32, budget_bytes=per_token, fraction=0.5, cuda=False, num_ranks=1
    )
    assert small == cfg.max_position_embeddings  # never under one context
    auto = kv_mod.budget_tokens(
        cfg, torch.float32, budget_bytes=None, fraction=0.1, cuda=False, num_ranks=2
    )
    assert auto >= cfg.max_position_embeddings and auto % 16 == 0
