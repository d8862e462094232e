"""Quantised checkpoints, dequantised at load (the weights are served in the serving dtype).

- Block FP8 (`quantization_config.quant_method == "fp8"`, DeepSeek-V3, Qwen3-FP8): a weight
  [N, K] in float8_e4m3fn with `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] (float32, or
  UE8M0 bytes) holding each block's multiplier; W = w * scale of its block, as transformers'
  `Fp8Dequantize` (tests check it against that function).
- MXFP4 (`quant_method == "mxfp4"`, gpt-oss): fused expert tensors stored as `NAME_blocks`
  [E, R, G, 16] (two e2m1 values per byte) and `NAME_scales` [E, R, G] (E8M0 exponents,
  bias 127), dequantised to [E, G * 32, R] as transformers' `convert_moe_packed_tensors`.

Any other `quant_method` is refused when the checkpoint is opened, naming it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

from moe_runtime.model import errors

SUPPORTED = ("fp8", "mxfp4")
SCALE_SUFFIX = "_scale_inv"
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"

FP4_VALUES = (
    +0.0,
    +0.5,
    +1.0,
    +1.5,
    +2.0,
    +3.0,
    +4.0,
    +6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


@dataclasses.dataclass(frozen=True)
class Quantization:
    """What a checkpoint's `quantization_config` says (method None: not quantised)."""

    method: str | None = None
    block_size: tuple[int, int] | None = None

    @classmethod
    def read(cls, hf: Mapping[str, Any], path: str | os.PathLike[str]) -> Quantization:
        """From config.json; an unsupported method or scheme is a CheckpointError naming it."""
        qc = hf.get("quantization_config")
        if qc is None:
            return cls()
        if not isinstance(qc, Mapping):
            raise errors.CheckpointError(path, f"quantization_config must be an object: {qc!r}")
        method = qc.get("quant_method")
        if method not in SUPPORTED:
            raise errors.CheckpointError(
                path,
                f"quantization {method!r} (quantization_config.quant_method) is not supported; "
                f"supported: 'fp8' (block-wise, dequantised at load), 'mxfp4' (dequantised at "
                f"load)",
            )
        if method == "mxfp4":
            return cls(method="mxfp4")
        fmt = qc.get("fmt", "e4m3")
        scheme = qc.get("activation_scheme", "dynamic")
        if fmt != "e4m3" or scheme != "dynamic":
            raise errors.CheckpointError(
                path,
                f"fp8 quantization with fmt {fmt!r} and activation_scheme {scheme!r} is not "
                f"supported; supported: fmt 'e4m3' with activation_scheme 'dynamic'",
            )
        block = qc.get("weight_block_size")
        if block is not None and (
            not isinstance(block, list)
            or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise errors.CheckpointError(
                path, f"quantization_config.weight_block_size must be [rows, cols]: {block!r}"
            )
        return cls(method="fp8", block_size=None if block is None else (block[0], block[1]))


def scales_to_float(scales: torch.Tensor) -> torch.Tensor:
    """Block scales as float32 (UE8M0 bytes are exponents with bias 127)."""
    if scales.dtype == torch.uint8:
        return (scales.to(torch.float32) - 127.0).exp2()
    return scales.to(torch.float32)


def block_of(
    shape: tuple[int, ...], scale_shape: tuple[int, ...], block_size: tuple[int, int] | None
) -> tuple[int, int]:
    """The (rows, cols) of one scale's block of a weight `shape` [..., N, K] with scales
    `scale_shape` [..., ceil(N/bn), ceil(K/bk)]: `block_size` when the checkpoint gives one,
    else the grid's (N / scale rows by K / scale cols, which must divide)."""
    if block_size is not None:
        return block_size
    rows, cols = shape[-2:]
    srows, scols = scale_shape[-2:]
    if rows % srows or cols % scols:
        raise ValueError(f"weight {list(shape)} is not a grid of scales {list(scale_shape)}")
    return rows // srows, cols // scols


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] | None
) -> torch.Tensor:
    """A block-FP8 weight [..., N, K] times its block scales [..., ceil(N/bn), ceil(K/bk)], in
    float32. Without a block size the blocks are N / scale rows by K / scale cols (a single
    scale: per tensor)."""
    w = weight.to(torch.float32)
    s = scales_to_float(scale_inv)
    rows, cols = w.shape[-2:]
    if s.dim() < 2:
        return w * s.reshape(())
    bn, bk = block_of(tuple(w.shape), tuple(s.shape), block_size)
    need = (-(-rows // bn), -(-cols // bk))
    if tuple(s.shape[-2:]) != need:
        raise ValueError(
            f"scales {list(s.shape)} do not cover weight {list(w.shape)} in blocks {block_size}"
        )
    full = s.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)
    return w * full[..., :cols]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 `blocks` [*P, R, G, B] and `scales` [*P, R, G] -> float32 [*P, G * B * 2, R]
    (transformers' `_convert_moe_packed_tensors`: low nibble first, times 2^(scale - 127),
    then the last two axes swapped)."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}"
        )
    raw = blocks.to(torch.uint8)
    exp = scales.to(torch.int32) - 127
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    *prefix, groups, width = raw.shape
    out = torch.empty((*prefix, groups, width * 2), dtype=torch.float32)
    out[..., 0::2] = lut[(raw & 0x0F).to(torch.int64)]
    out[..., 1::2] = lut[(raw >> 4).to(torch.int64)]
    out = torch.ldexp(out, exp[..., None].to(torch.float32))
    out = out.reshape(*prefix, groups * width * 2)
    return out.transpose(-1, -2).contiguous()
