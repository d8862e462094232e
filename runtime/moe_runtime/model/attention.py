"""Attention blocks: grouped-query attention (biases, q/k norms per head or over the whole
projection, `clip_qkv`, sinks, sliding windows) and multi-head latent attention (MLA).

Linear layers run over all tokens of the batch at once; attention runs per sequence (causal,
the sequence's cached positions first), so a sequence's numbers do not depend on the rest of
the batch. Shapes: T tokens, H heads, D head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from moe_runtime.model import config as config_mod
from moe_runtime.model import kv as kv_mod
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


@dataclasses.dataclass(frozen=True)
class Span:
    """One sequence's rows in the batch: rows [offset, offset + n), positions from start."""

    seq_id: str
    offset: int
    n: int
    start: int


@dataclasses.dataclass
class Context:
    """What every attention layer of one forward pass shares."""

    spans: list[Span]
    kv: kv_mod.KVCache
    rotary: rope_mod.Rotary
    cos: torch.Tensor
    sin: torch.Tensor


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    start: int,
    window: int | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [n, H, D] over keys [KV, start + n, D], values [KV, start + n, Dv]
    (H a multiple of KV: grouped-query); returns [n, H * Dv].

    The query of position p sees keys 0..p (the last `window` of them when set). sinks [H]:
    one extra logit per head that takes probability mass and adds nothing (gpt-oss).
    """
    n, heads, dim = q.shape
    kv_heads, total, _ = keys.shape
    v_dim = values.shape[-1]
    groups = heads // kv_heads
    mask = None
    if n > 1 or (window is not None and total > window):
        q_pos = torch.arange(start, start + n, device=q.device)[:, None]
        k_pos = torch.arange(total, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (k_pos > q_pos - window)
    # Grouped-query attention without copying keys/values: the g query heads that share a
    # key/value head become g * n query rows of that head (rows ordered (group, position)).
    rows = (
        q.reshape(n, kv_heads, groups, dim).permute(1, 2, 0, 3).reshape(kv_heads, groups * n, dim)
    )
    row_mask = None if mask is None else mask.repeat(groups, 1)
    if sinks is None:
        out = F.scaled_dot_product_attention(
            rows[None], keys[None], values[None], attn_mask=row_mask, scale=scale
        )[0]
    else:
        scores = torch.matmul(rows, keys.transpose(1, 2)) * scale  # [KV, g * n, total]
        if row_mask is not None:
            scores = scores.masked_fill(~row_mask, float("-inf"))
        sink = sinks.to(scores.dtype).reshape(kv_heads, groups, 1, 1).expand(kv_heads, groups, n, 1)
        logits = torch.cat([scores, sink.reshape(kv_heads, groups * n, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        out = torch.matmul(probs.to(values.dtype), values)
    out = out.reshape(kv_heads, groups, n, v_dim).permute(2, 0, 1, 3)
    return out.reshape(n, heads * v_dim)


def _linear(x: torch.Tensor, w: Mapping[str, torch.Tensor], role: str) -> torch.Tensor:
    return F.linear(x, w[role], w.get(role + "_bias"))


def gqa(
    cfg: config_mod.ModelConfig,
    w: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    ctx: Context,
    layer: int,
) -> torch.Tensor:
    """Grouped-query self-attention of decoder layer `layer` over x [T, hidden] -> [T, hidden]."""
    t = x.shape[0]
    q, k, v = _linear(x, w, "q"), _linear(x, w, "k"), _linear(x, w, "v")
    if cfg.qk_norm == "full":
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
    parts = []
    for s in ctx.spans:
        rows = slice(s.offset, s.offset + s.n)
        ctx.kv.write(s.seq_id, layer, s.start, k[rows], v[rows])
        keys, values = ctx.kv.read(s.seq_id, layer)
        parts.append(
            attend(
                q[rows],
                keys,
                values,
                start=s.start,
                window=window,
                scale=cfg.head_dim**-0.5,
                sinks=sinks,
            )
        )
    return _linear(torch.cat(parts), w, "o")


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
        q = F.linear(x, w["q"])
    else:
        q_a = rms_norm(_linear(x, w, "q_a"), w["q_a_norm"], MLA_NORM_EPS)
        q = F.linear(q_a, w["q_b"])
    q = q.view(t, heads, spec.qk_head_dim)
    compressed = _linear(x, w, "kv_a")
    latent = rms_norm(compressed[:, :rank], w["kv_a_norm"], MLA_NORM_EPS)
    q_pe = ctx.rotary.apply(q[..., nope:], ctx.cos, ctx.sin)
    k_pe = ctx.rotary.apply(compressed[:, None, rank:], ctx.cos, ctx.sin)
    query = torch.cat((q[..., :nope], q_pe), dim=-1)
    cached = torch.cat((latent[:, None, :], k_pe), dim=-1)  # [T, 1, rank + rope]
    scale = rope_mod.mla_softmax_scale(cfg)
    parts = []
    for s in ctx.spans:
        rows = slice(s.offset, s.offset + s.n)
        ctx.kv.write(s.seq_id, layer, s.start, cached[rows])
        (held,) = ctx.kv.read(s.seq_id, layer)
        held = held[0]  # [total, rank + rope]
        total = held.shape[0]
        expanded = F.linear(held[:, :rank], w["kv_b"]).view(total, heads, nope + spec.v_head_dim)
        keys = torch.empty((heads, total, spec.qk_head_dim), dtype=x.dtype, device=x.device)
        keys[..., :nope] = expanded[..., :nope].transpose(0, 1)
        keys[..., nope:] = held[None, :, rank:]
        values = expanded[..., nope:].transpose(0, 1)
        parts.append(
            attend(query[rows], keys, values, start=s.start, window=cfg.window(layer), scale=scale)
        )
    return _linear(torch.cat(parts), w, "o")
