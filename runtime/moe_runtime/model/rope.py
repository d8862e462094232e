"""Rotary position embeddings as transformers computes them: default, linear and YaRN
frequencies (`modeling_rope_utils`), the attention scaling YaRN applies to cos/sin, and the
three layouts (rotate-half, DeepSeek-V3's interleaved pairs, DeepSeek-V2's complex pairs).
"""

from __future__ import annotations

import math

import torch

from moe_runtime.model import config as config_mod


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def frequencies(config: config_mod.ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention scaling of cos/sin) for rotary dim D = head_dim."""
    dim = config.head_dim
    base = config.rope_theta
    scaling = config.rope_scaling
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    if scaling is None:
        return 1.0 / (base**exponents), 1.0
    if scaling.kind == "linear":
        return (1.0 / (base**exponents)) / scaling.factor, 1.0
    return _yarn(dim, base, scaling)


def _yarn(dim: int, base: float, s: config_mod.RopeScaling) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters`, step for step."""
    factor = s.factor
    original = s.original_max_position_embeddings
    assert original is not None  # hf_config always sets it for YaRN
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(
                _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(s.beta_fast)
    high = correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def mla_softmax_scale(config: config_mod.ModelConfig) -> float:
    """DeepSeek's attention scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2
    under YaRN (transformers' `yarn_apply_mscale`)."""
    assert config.mla is not None
    scale = float(config.mla.qk_head_dim**-0.5)
    s = config.rope_scaling
    if s is not None and s.mscale_all_dim:
        mscale = _yarn_mscale(s.factor, s.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class Rotary:
    """cos/sin of positions for one model, applied in the model's layout."""

    def __init__(self, config: config_mod.ModelConfig, *, device: torch.device) -> None:
        inv_freq, self.attention_scaling = frequencies(config)
        self.inv_freq = inv_freq.to(device)
        self.layout = config.rope_layout

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] (D/2 for the pair layouts) of positions [T], in `dtype`."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        if self.layout == "half":
            freqs = torch.cat((freqs, freqs), dim=-1)
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        if self.layout != "pairs":
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by position."""
        if self.layout == "half":
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return x * cos + rotated * sin
        if self.layout == "interleave":
            # DeepSeek-V3 `apply_rotary_pos_emb_interleave`: pairs (x0, x1), (x2, x3), ...
            # rotated, the result laid out as [all first, all second].
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        # DeepSeek-V2 `apply_rotary_emb`: complex multiplication in float32, pairs kept.
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rotated = torch.view_as_real(pairs * torch.complex(cos, sin))
        return rotated.flatten(-2).type_as(x)
