"""The paged KV cache: blocks taken and returned, growth that keeps the data, the bound
(`KVCacheFull`, nothing changed), the budget in bytes and in positions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_runtime.engine import scheduler as scheduler_mod
from moe_runtime.model import config as config_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import kv_budget, source


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

    def fixed(budget_bytes: int | None, fraction: float = 0.5) -> kv_budget.KVBudget:
        return kv_budget.KVBudget.measure(
            cfg, torch.float32, budget_bytes=budget_bytes, fraction=fraction, cuda=False
        )

    assert fixed(per_token * 5000).tokens(1) == 5000 // 16 * 16
    assert fixed(per_token * 5000).tokens(4) == 5000 // 16 * 16  # --kv-cache-bytes: any size
    assert fixed(per_token).tokens(1) == cfg.max_position_embeddings  # never under one context
    auto = fixed(None, 0.1).tokens(2)
    assert auto >= cfg.max_position_embeddings and auto % 16 == 0


def test_a_resize_re_derives_the_budget_from_the_experts_a_rank_holds(
    cfg: config_mod.ModelConfig,
) -> None:
    """A shrink gives each survivor more expert slots: on a GPU (memory per device) its KV
    room shrinks by exactly those experts' bytes (x fraction), a grow gives room back; on a
    CPU the host's room is shared by the ranks on it. The engine's admission bound follows the
    active ranks (`Scheduler.set_active`)."""
    non_expert, experts = kv_budget.weight_bytes(cfg, torch.float32)
    _, slot = kv_budget.weight_bytes(cfg, torch.float32, num_physical=1)
    per_token = kv_mod.bytes_per_token(cfg, torch.float32)
    gpu = kv_budget.KVBudget(
        per_token=per_token, context=16, fraction=0.5, cuda=True,
        available=non_expert + experts + 4000 * per_token,
        non_expert=non_expert, slot_bytes=slot, num_physical=cfg.num_experts,
    )  # fmt: skip
    assert gpu.device_bytes(1) == 2000 * per_token
    assert gpu.device_bytes(2) - gpu.device_bytes(1) == (experts - experts // 2) // 2
    assert gpu.tokens(4) > gpu.tokens(2) > gpu.tokens(1)
    cpu = dataclasses.replace(
        gpu, cuda=False, available=4 * non_expert + experts + 8000 * per_token
    )
    assert cpu.tokens(4) < cpu.tokens(2) < cpu.tokens(1)  # one host's room over more ranks

    sched = scheduler_mod.Scheduler(
        ranks=[0, 1], max_num_seqs_per_rank=8, max_tokens_per_step=64, kv_budget=gpu.per_rank
    )
    assert sched.kv_tokens_per_rank == gpu.tokens(2)
    sched.set_active([0])  # a shrink to one rank: the bound of one rank
    assert sched.kv_tokens_per_rank == gpu.tokens(1)
    assert sched.least_loaded(kv=gpu.tokens(1) + 16) is None  # no room: it would wait
    sched.set_active([0, 1, 2, 3])
    assert sched.kv_tokens_per_rank == gpu.tokens(4)
