"""Single-process greedy generation (all experts in this process): the reference the tests
and benches compare serving against; also the pipeline stages of one model chained in one
process (each stage's hidden states handed to the next)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_runtime.model import decoder
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import source as source_mod


def generate_greedy(
    model: source_mod.ModelSource | decoder.MoEModel | Sequence[decoder.MoEModel] | str,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    experts: experts_mod.ExpertBackend | Sequence[experts_mod.ExpertBackend] | None = None,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list[list[int]]:
    """Greedy tokens generated for each prompt (single process; all sequences in one batch).

    `model` is a source string, an opened source, or a loaded MoEModel (then `experts` is
    required), or the pipeline stages of one model in order, each with its experts (a list as
    long). Generation of a sequence stops after `max_new_tokens` or after `eos_token_id`
    (included).
    """
    stages: list[tuple[decoder.MoEModel, experts_mod.ExpertBackend]]
    if isinstance(model, decoder.MoEModel):
        if experts is None or isinstance(experts, Sequence):
            raise ValueError("generate_greedy: pass experts= with a loaded MoEModel")
        stages = [(model, experts)]
    elif isinstance(model, Sequence) and not isinstance(model, str):
        if not isinstance(experts, Sequence) or len(experts) != len(model):
            raise ValueError("generate_greedy: pass experts= (one per pipeline stage) with models")
        stages = list(zip(model, experts, strict=True))
    else:
        src = source_mod.open_source(model) if isinstance(model, str) else model
        net = decoder.MoEModel.from_source(src, dtype=dtype, device=device)
        if experts is None:
            experts = experts_mod.LocalExperts.from_source(src, dtype=dtype, device=device)
        if isinstance(experts, Sequence):
            raise ValueError("generate_greedy: one expert backend for one model")
        stages = [(net, experts)]
    indices = [net.pp.index for net, _ in stages]
    if indices != list(range(stages[0][0].pp.size)):
        raise ValueError(f"generate_greedy: pipeline stages {indices}: pass every one, in order")
    kvs = [
        kv_mod.KVCache(net.local_config, dtype=net.dtype, device=net.device, layers=net.layers)
        for net, _ in stages
    ]
    outputs: list[list[int]] = [[] for _ in prompts]
    active = [i for i in range(len(prompts)) if max_new_tokens > 0]
    batch = kv_mod.ForwardBatch(
        seq_ids=[str(i) for i in active],
        token_ids=[list(prompts[i]) for i in active],
        start_pos=[0] * len(active),
    )
    while active:
        hidden: torch.Tensor | None = None
        for (net, backend), kv in zip(stages, kvs, strict=True):
            hidden = net.forward(batch, kv, backend, hidden=hidden)
        assert hidden is not None
        logits = hidden
        next_tokens = torch.argmax(logits, dim=-1).tolist()
        still: list[int] = []
        for i, token in zip(active, next_tokens, strict=True):
            outputs[i].append(int(token))
            if len(outputs[i]) < max_new_tokens and token != eos_token_id:
                still.append(i)
        active = still
        batch = kv_mod.ForwardBatch(
            seq_ids=[str(i) for i in active],
            token_ids=[[outputs[i][-1]] for i in active],
            start_pos=[len(prompts[i]) + len(outputs[i]) - 1 for i in active],
        )
    return outputs
