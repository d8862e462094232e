"""Pipeline-parallel ranks for tests and the bench: one pipeline step of one process's stage
over a point-to-point link to its neighbours (`pipeline_step`, `pipeline_generate`), and the
task spawned rank processes run (`TASKS`, for `ep_ranks.RankPool(..., tasks_module=__name__)`).

A process is TP rank t of pipeline stage s. Its pipeline group holds TP rank t of every stage
(group rank = stage): stage s receives the hidden states of the batch's new tokens from s - 1
(gloo recv), runs its layers, sends its hidden states to s + 1; the last stage's tokens are
broadcast to every stage (the next step's batch is built from them on every stage, as a
driver would send it). Its TP group holds the TP ranks of its stage. With DP ranks, the
expert-parallel group of stage s holds stage s of every DP rank, under a placement of that
stage's MoE layers only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import safetensors
import torch

from moe_runtime.comm import ep, group
from moe_runtime.eplb import policy
from moe_runtime.model import decoder, pipeline, source, tensor_parallel, tp_shard
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from tests.support import ep_ranks, read_counter

GROUP_TIMEOUT_S = 60.0


class Link(Protocol):
    """What a pipeline group offers a stage (`comm.group.StatelessGroup` has it)."""

    rank: int
    world_size: int

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


def pipeline_step(
    model: decoder.MoEModel,
    kv: kv_mod.KVCache,
    experts: experts_mod.ExpertBackend,
    link: Link,
    batch: kv_mod.ForwardBatch,
) -> list[int]:
    """One forward pass of this process's stage in its pipeline; the greedy token of each
    sequence (the last stage's, broadcast over `link`)."""
    stage = model.pp
    hidden = None
    if not stage.is_first:
        hidden = torch.empty((batch.num_tokens, model.config.hidden_size), dtype=model.dtype)
        link.recv(hidden, stage.index - 1)
    out = model.forward(batch, kv, experts, hidden=hidden)
    if not stage.is_last:
        link.send(out.contiguous(), stage.index + 1)
    tokens = torch.zeros(batch.num_seqs, dtype=torch.int64)
    if stage.is_last:
        tokens = torch.argmax(out, dim=-1)
    link.broadcast(tokens, stage.size - 1)
    return [int(t) for t in tokens.tolist()]


def pipeline_generate(
    model: decoder.MoEModel,
    experts: experts_mod.ExpertBackend,
    link: Link,
    prompts: list[list[int]],
    new_tokens: int,
) -> list[list[int]]:
    """Greedy tokens of every prompt (one batch), every stage of the pipeline in lockstep."""
    kv = kv_mod.KVCache(model.local_config, layers=model.layers)
    out: list[list[int]] = [[] for _ in prompts]
    batch = kv_mod.ForwardBatch(
        [str(i) for i in range(len(prompts))], [list(p) for p in prompts], [0] * len(prompts)
    )
    for _ in range(new_tokens):
        for seq, token in zip(out, pipeline_step(model, kv, experts, link, batch), strict=True):
            seq.append(token)
        batch = kv_mod.ForwardBatch(
            batch.seq_ids,
            [[seq[-1]] for seq in out],
            [len(p) + len(seq) - 1 for p, seq in zip(prompts, out, strict=True)],
        )
    return out


def lockstep_pipeline_generate(
    ep_grp: group.StatelessGroup,
    dp_rank: int,
    model: decoder.MoEModel,
    experts: experts_mod.ExpertBackend,
    link: Link,
    requests: list[dict[str, Any]],
) -> dict[str, list[int]]:
    """Greedy generation of DP rank `dp_rank`'s requests (each: seq_id, prompt, max_new,
    start_step, rank) through its pipeline, every stage stepping in lockstep with the same
    stage of the other DP ranks (its EP group): a DP rank with nothing to do runs an empty
    batch through its stages. Ends when no DP rank has an unfinished request."""
    kv = kv_mod.KVCache(model.local_config, layers=model.layers)
    return ep_ranks.lockstep_generate(
        ep_grp,
        model,
        experts,
        requests,
        rank=dp_rank,
        kv=kv,
        step=lambda batch: pipeline_step(model, kv, experts, link, batch),
    )


def stage_experts(
    src: source.ModelSource,
    stage: pipeline.PipelineStage,
    ep_grp: group.StatelessGroup,
    dp_rank: int,
) -> experts_mod.ExpertBackend:
    """Stage `stage`'s experts over its EP group: an identity placement of its MoE layers
    only, this DP rank's slots read from `src` (by the model's MoE layer)."""
    cfg = src.config
    if stage.num_moe_layers == 0:
        return experts_mod.LocalExperts({})  # dense layers only: never called
    num_dp = ep_grp.world_size
    physical = policy.num_physical_for(cfg.num_experts, num_dp)
    placement = policy.identity(stage.num_moe_layers, cfg.num_experts, physical, num_dp)
    slots = {
        (layer, slot): experts_mod.load_expert(
            src, stage.moe_layers[0] + layer, int(placement.phy2log[layer, slot])
        )
        for layer in range(stage.num_moe_layers)
        for slot in placement.slots_of_rank(dp_rank, num_dp)
    }
    return ep.ExpertParallelBackend(ep_grp, placement, slots)


def stage_model(
    src: source.ModelSource,
    *,
    stage: pipeline.PipelineStage,
    tp_group: tensor_parallel.Collective | None,
    tp_rank: int,
    tp_size: int,
) -> decoder.MoEModel:
    """TP rank `tp_rank` of `tp_size` of pipeline stage `stage`: its tensors read from `src`."""
    tp = None
    if tp_group is not None:
        shard = tp_shard.plan(src.config, rank=tp_rank, size=tp_size)
        tp = tensor_parallel.TensorParallel(shard, tp_group)
    return decoder.MoEModel.from_source(src, tp=tp, pp=stage)


# --- spawned rank processes (ep_ranks.RankPool) ------------------------------------------------


def task_pp_generate(
    *,
    pp_spec: group.GroupSpec,
    tp_spec: group.GroupSpec | None,
    stage: int,
    tp_rank: int,
    checkpoints: dict[str, str],
    prompts: list[list[int]],
    new_tokens: int,
) -> dict[str, Any]:
    """Per checkpoint: the pipeline's greedy tokens as this process (TP rank `tp_rank` of
    pipeline stage `stage`) saw them, and the bytes of weights (non-expert and experts) it
    read and holds."""
    pp_grp = group.StatelessGroup(pp_spec, stage, timeout=GROUP_TIMEOUT_S)
    tp_grp = None if tp_spec is None else group.StatelessGroup(tp_spec, tp_rank, timeout=60)
    tp_size = 1 if tp_spec is None else tp_spec.world_size
    out: dict[str, Any] = {}
    try:
        for family, path in checkpoints.items():
            src = source.open_source(path)
            plan = pipeline.plan(src.config, stage=stage, size=pp_spec.world_size)
            counter = read_counter.ReadCounter()
            real = safetensors.safe_open
            safetensors.safe_open = counter.safe_open  # type: ignore[assignment]
            try:
                model = stage_model(
                    src, stage=plan, tp_group=tp_grp, tp_rank=tp_rank, tp_size=tp_size
                )
                local = pipeline.local_experts(src, plan)
            finally:
                safetensors.safe_open = real  # type: ignore[assignment]
            held = sum(t.numel() * t.element_size() for t in model.non_expert_state().values())
            held += sum(w.nbytes for w in local.weights.values())
            tokens = pipeline_generate(model, local, pp_grp, prompts, new_tokens)
            out[family] = {"tokens": tokens, "read": counter.nbytes, "held": held}
        return out
    finally:
        if tp_grp is not None:
            tp_grp.destroy()
        pp_grp.destroy()


def task_dp_pp_generate(
    *,
    pp_spec: group.GroupSpec,
    ep_spec: group.GroupSpec,
    dp_rank: int,
    stage: int,
    checkpoints: dict[str, str],
    requests: list[dict[str, Any]],
) -> dict[str, dict[str, list[int]]]:
    """DP x PP in miniature: this process is pipeline stage `stage` of DP rank `dp_rank`; its
    experts are those of its stage's MoE layers placed over its stage's EP group (stage
    `stage` of every DP rank). Returns this DP rank's tokens per checkpoint."""
    pp_grp = group.StatelessGroup(pp_spec, stage, timeout=GROUP_TIMEOUT_S)
    ep_grp = group.StatelessGroup(ep_spec, dp_rank, timeout=GROUP_TIMEOUT_S)
    out: dict[str, dict[str, list[int]]] = {}
    try:
        for family, path in checkpoints.items():
            src = source.open_source(path)
            plan = pipeline.plan(src.config, stage=stage, size=pp_spec.world_size)
            model = stage_model(src, stage=plan, tp_group=None, tp_rank=0, tp_size=1)
            backend = stage_experts(src, plan, ep_grp, dp_rank)
            out[family] = lockstep_pipeline_generate(
                ep_grp, dp_rank, model, backend, pp_grp, requests
            )
        return out
    finally:
        ep_grp.destroy()
        pp_grp.destroy()


TASKS: dict[str, Callable[..., Any]] = {
    "pp_generate": task_pp_generate,
    "dp_pp_generate": task_dp_pp_generate,
}
