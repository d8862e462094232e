"""Routers: which experts each token goes to and with what weight (`ModelConfig.router`).

Every router returns (topk_ids [T, k] int64 logical ids, topk_weights [T, k] float32), as
the family's transformers router computes them:

- "softmax" (Mixtral, Qwen, OLMoE): softmax over all experts in float32, top-k, divided by
  their sum when `norm_topk_prob`;
- "softmax_group" (DeepSeek-V2): softmax in float32; with n_group > 1 only the experts of
  the `topk_group` groups with the best single expert compete; weights times
  `routed_scaling_factor`;
- "sigmoid_group" (DeepSeek-V3): sigmoid scores; experts are *chosen* by score +
  `e_score_correction_bias` within the `topk_group` groups with the best sum of their top two,
  and *weighted* by the score alone (renormalised when `norm_topk_prob`), times
  `routed_scaling_factor`;
- "topk_softmax" (gpt-oss): top-k of the logits (router with bias), softmax over those k.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from moe_runtime.model import config as config_mod


def _group_mask(cfg: config_mod.ModelConfig, group_scores: torch.Tensor) -> torch.Tensor:
    """[T, E] bool: experts of the `topk_group` best groups."""
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    per = cfg.num_experts // cfg.n_group
    return group_mask.unsqueeze(-1).expand(-1, cfg.n_group, per).reshape(-1, cfg.num_experts).bool()


def route(
    cfg: config_mod.ModelConfig, w: Mapping[str, torch.Tensor], hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids, topk_weights) of hidden [T, H] under the layer's router weights `w`."""
    k = cfg.top_k
    if cfg.router == "softmax":
        probs = torch.softmax(F.linear(hidden, w["router"]).to(torch.float32), dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights
    if cfg.router == "topk_softmax":
        logits = F.linear(hidden, w["router"], w["router_bias"])
        top, ids = torch.topk(logits, k, dim=-1)
        return ids, torch.softmax(top, dim=1, dtype=top.dtype).to(torch.float32)
    logits = F.linear(hidden.to(torch.float32), w["router"].to(torch.float32))
    per = cfg.num_experts // cfg.n_group
    if cfg.router == "softmax_group":
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if cfg.n_group > 1:
            group_scores = scores.view(-1, cfg.n_group, per).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(cfg, group_scores), 0.0)
        weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
        return ids, weights * cfg.routed_scaling_factor
    scores = logits.sigmoid()
    choice = scores + w["correction_bias"].to(torch.float32)
    group_scores = choice.view(-1, cfg.n_group, per).topk(2, dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(cfg, group_scores), float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor
