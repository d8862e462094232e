"""Step value objects and the empty step: StepOutput pickles its expert load as bytes (same
tensor back), and a step in which no rank has a token runs no forward pass on any rank while
the ranks stay in lockstep for the next real step."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest
import torch

from moe_runtime import step as step_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import local
from moe_runtime.model import generate
from moe_runtime.model import source as source_mod

SOURCE = "synthetic://tiny?seed=0"


@pytest.mark.parametrize(
    "load",
    [
        pytest.param(torch.arange(32, dtype=torch.int64).view(4, 8), id="int64-L4-E8"),
        pytest.param(torch.zeros(58, 256, dtype=torch.int64), id="int64-deepseek-shape"),
        pytest.param(torch.rand(3, 5, dtype=torch.float32), id="float32"),
        pytest.param(torch.arange(12, dtype=torch.int64).view(3, 4).t(), id="non-contiguous"),
        pytest.param(torch.ones(2, 3, dtype=torch.bfloat16), id="bfloat16-kept-as-tensor"),
    ],
)
def test_step_output_pickles_expert_load_to_an_equal_tensor(load: torch.Tensor):
    out = step_mod.StepOutput(
        rank=1, step_id=7, tokens={"a": 3}, expert_load=load, error="e", committed=2
    )
    back = pickle.loads(pickle.dumps(out))
    assert isinstance(back.expert_load, torch.Tensor)
    assert back.expert_load.dtype == load.dtype
    assert torch.equal(back.expert_load, load)
    assert (back.rank, back.step_id, back.tokens, back.error, back.committed) == (
        1,
        7,
        {"a": 3},
        "e",
        2,
    )
    back.expert_load += 1  # writable, and not shared with the original
    assert not torch.equal(back.expert_load, load)
    assert out.expert_load is load  # pickling left the original alone


@pytest.mark.parametrize("load", [None, [[1, 2]], "x"], ids=["none", "list", "str"])
def test_step_output_pickles_other_expert_loads_as_they_are(load: object):
    back = pickle.loads(pickle.dumps(step_mod.StepOutput(rank=0, step_id=1, expert_load=load)))
    assert back.expert_load == load


@pytest.fixture()
def two_ranks() -> Iterator[local.LocalExecutor]:
    cfg = source_mod.open_source(SOURCE).config
    ex = local.LocalExecutor(2)
    physical = policy.num_physical_for(cfg.num_experts, 2)
    ex.start(SOURCE, placement=policy.identity(cfg.num_layers, cfg.num_experts, physical, 2))
    yield ex
    ex.shutdown()


def _step(step_id: int, batches: dict[int, step_mod.RankBatch]) -> step_mod.StepInput:
    return step_mod.StepInput(step_id=step_id, batches=batches)


def test_step_with_no_token_on_any_rank_skips_the_forward_and_keeps_lockstep(
    two_ranks: local.LocalExecutor,
):
    prompt = [1, 5, 9, 23, 44]
    greedy = step_mod.SamplingParams()
    # A prefill on rank 0 (rank 1 idle: it still joins the expert collectives) ...
    first = two_ranks.execute_step(
        _step(1, {0: step_mod.RankBatch(seqs=[step_mod.SeqWork("a", prompt, 0, greedy)])})
    )
    assert [o.error for o in first] == [None, None]
    assert first[1].expert_load.sum().item() == 0
    # ... then steps where nobody has a token: frees only, and nothing at all.
    for step_id, batches in (
        (2, {1: step_mod.RankBatch(free=["nothing-here"])}),
        (3, {}),
        (4, {0: step_mod.RankBatch(), 1: step_mod.RankBatch()}),
    ):
        outs = two_ranks.execute_step(_step(step_id, batches))
        assert [(o.error, o.tokens, o.expert_load) for o in outs] == [(None, {}, None)] * 2
    # The ranks are still in lockstep: the decode that follows gives the single-process token.
    token = first[0].tokens["a"]
    after = two_ranks.execute_step(
        _step(5, {1: step_mod.RankBatch(seqs=[step_mod.SeqWork("b", prompt, 0, greedy)])})
    )
    decode = two_ranks.execute_step(
        _step(
            6, {0: step_mod.RankBatch(seqs=[step_mod.SeqWork("a", [token], len(prompt), greedy)])}
        )
    )
    want = generate.generate_greedy(SOURCE, [prompt], 2)[0]
    assert [token, decode[0].tokens["a"]] == want
    assert after[1].tokens["b"] == want[0]
