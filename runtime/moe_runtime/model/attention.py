"""Attention blocks: grouped-query attention (biases, q/k norms per head or over the whole
projection, `clip_qkv`, sinks, sliding windows) and multi-head latent attention (MLA).

Linear layers run over all tokens of the batch at once, and so does attention: one call per
group of sequences (`kv.BatchKV`: the one-token decodes, the longer chunks), queries padded to
the group's longest chunk and keys to a multiple of `kv.KEY_PAD`, masked (causal, sliding
window). Shapes: T tokens, B sequences, N padded queries, P padded keys, H heads, D head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from moe_runtime.model import config as config_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import linear as linear_mod
from moe_runtime.model import rope as rope_mod

#: eps of DeepSeek's q_a / kv_a RMSNorms (transformers builds them without the config's eps).
MLA_NORM_EPS = 1e-6


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_first: bool = False
) -> torch.Tensor:
    """Hugging Face RMSNorm: normalise in float32, then `weight * x.to(dtype)`, or
    `(weight * x).to(dtype)` with scale_first (gpt-oss)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if scale_first:
        return (weight * xf).to(x.dtype)
    return weight * xf.to(x.dtype)


#: An RMSNorm over a projection split across tensor-parallel ranks: (x [T, local dim],
#: weight [local dim], "q" or "k") -> normalised x (`tensor_parallel.TensorParallel.rms_norm`).
SplitNorm = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]


@dataclasses.dataclass
class Context:
    """What every attention layer of one forward pass shares: the batch's view of the KV
    cache (where new tokens go, the groups attended together), the rotary tables, and on a
    tensor-parallel rank the norm of a q/k projection split over the ranks (`split_norm`)."""

    batch_kv: kv_mod.BatchKV
    rotary: rope_mod.Rotary
    cos: torch.Tensor
    sin: torch.Tensor
    split_norm: SplitNorm | None = None


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a padded group: q [B, N, H, D] over keys [B, KV, P, D], values
    [B, KV, P, Dv] (H a multiple of KV: grouped-query), mask the group's
    `kv.Group.attention_mask` (additive, over the rows of one KV head's query heads, in q's
    dtype); returns [B, N, H * Dv].

    sinks [H]: one extra logit per head that takes probability mass and adds nothing
    (gpt-oss).
    """
    b, n, heads, dim = q.shape
    kv_heads = keys.shape[1]
    v_dim = values.shape[-1]
    groups = heads // kv_heads
    # Grouped-query attention without copying keys/values: the g query heads that share a
    # key/value head become g * n query rows of that head (rows ordered (group, position)).
    rows = q.reshape(b, n, kv_heads, groups, dim).permute(0, 2, 3, 1, 4)
    rows = rows.reshape(b, kv_heads, groups * n, dim)
    if sinks is None:
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(rows, keys.transpose(-1, -2)) * scale  # [B, KV, g * n, P]
        scores = scores + mask
        sink = sinks.to(scores.dtype).reshape(1, kv_heads, groups, 1, 1)
        sink = sink.expand(b, kv_heads, groups, n, 1).reshape(b, kv_heads, groups * n, 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        out = torch.matmul(probs.to(values.dtype), values)
    out = out.reshape(b, kv_heads, groups, n, v_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(b, n, heads * v_dim)


def _scatter(out: torch.Tensor, group: kv_mod.Group, result: torch.Tensor) -> None:
    """Rows of a group's padded result [B, N, W] into out [T, W] (real query rows only)."""
    flat = result.reshape(-1, result.shape[-1])
    out.index_copy_(0, group.token_index, flat[group.valid].to(out.dtype))


def gqa(
    cfg: config_mod.ModelConfig,
    w: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    ctx: Context,
    layer: int,
) -> torch.Tensor:
    """Grouped-query self-attention of decoder layer `layer` over x [T, hidden] -> [T, hidden]."""
    t = x.shape[0]
    q, k, v = (
        linear_mod.linear(x, w, "q"),
        linear_mod.linear(x, w, "k"),
        linear_mod.linear(x, w, "v"),
    )
    if cfg.qk_norm == "full" and ctx.split_norm is not None:
        q, k = ctx.split_norm(q, w["q_norm"], "q"), ctx.split_norm(k, w["k_norm"], "k")
    elif cfg.qk_norm == "full":
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    if cfg.clip_qkv is not None:
        q, k, v = (a.clamp(min=-cfg.clip_qkv, max=cfg.clip_qkv) for a in (q, k, v))
    q = q.view(t, cfg.num_heads, cfg.head_dim)
    k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
    v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm == "head":
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    q = ctx.rotary.apply(q, ctx.cos, ctx.sin)
    k = ctx.rotary.apply(k, ctx.cos, ctx.sin)
    window = cfg.window(layer)
    sinks = w.get("sinks")
    batch_kv = ctx.batch_kv
    batch_kv.write(layer, k, v)
    out = q.new_empty((t, cfg.num_heads * cfg.head_dim))
    for group in batch_kv.groups:
        keys, values = batch_kv.read(layer, group)  # [B, P, KV, D]
        result = attend(
            q[group.queries],
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            group.attention_mask(window, cfg.num_heads // cfg.num_kv_heads, q.dtype),
            scale=cfg.head_dim**-0.5,
            sinks=sinks,
        )
        _scatter(out, group, result)
    return linear_mod.linear(out, w, "o")


def mla(
    cfg: config_mod.ModelConfig,
    w: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    ctx: Context,
    layer: int,
) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3) of decoder layer `layer`: the cache holds
    [normalised kv latent, rotated shared key] per position, expanded through kv_b."""
    spec = cfg.mla
    assert spec is not None
    t, heads = x.shape[0], cfg.num_heads
    nope, rank = spec.qk_nope_head_dim, spec.kv_lora_rank
    if "q" in w:
        q = linear_mod.linear(x, w, "q")
    else:
        q_a = rms_norm(linear_mod.linear(x, w, "q_a"), w["q_a_norm"], MLA_NORM_EPS)
        q = linear_mod.linear(q_a, w, "q_b")
    q = q.view(t, heads, spec.qk_head_dim)
    compressed = linear_mod.linear(x, w, "kv_a")
    latent = rms_norm(compressed[:, :rank], w["kv_a_norm"], MLA_NORM_EPS)
    q_pe = ctx.rotary.apply(q[..., nope:], ctx.cos, ctx.sin)
    k_pe = ctx.rotary.apply(compressed[:, None, rank:], ctx.cos, ctx.sin)
    query = torch.cat((q[..., :nope], q_pe), dim=-1)
    cached = torch.cat((latent[:, None, :], k_pe), dim=-1)  # [T, 1, rank + rope]
    scale = rope_mod.mla_softmax_scale(cfg)
    batch_kv = ctx.batch_kv
    batch_kv.write(layer, cached)
    out = x.new_empty((t, heads * spec.v_head_dim))
    for group in batch_kv.groups:
        (held,) = batch_kv.read(layer, group)
        held = held[:, :, 0].to(x.dtype)  # [B, P, rank + rope]
        b, total = held.shape[0], held.shape[1]
        expanded = F.linear(held[..., :rank], w["kv_b"]).view(
            b, total, heads, nope + spec.v_head_dim
        )
        keys = torch.empty((b, heads, total, spec.qk_head_dim), dtype=x.dtype, device=x.device)
        keys[..., :nope] = expanded[..., :nope].transpose(1, 2)
        keys[..., nope:] = held[:, None, :, rank:]
        values = expanded[..., nope:].transpose(1, 2)
        mask = group.attention_mask(cfg.window(layer), 1, x.dtype)
        result = attend(query[group.queries], keys, values, mask, scale=scale)
        _scatter(out, group, result)
    return linear_mod.linear(out, w, "o")
