"""Equality that means something on GPUs: logits within a relative tolerance, and greedy tokens
agreeing within a bound under teacher forcing (the reference's tokens fed back, so one near-tie
does not change every later position).

On CPUs in float32 our model and transformers' agree to ~1e-6 and the tests assert exact token
identity. On GPUs the matmuls differ with the batch shape and the kernels chosen, and bf16 keeps
8 bits of mantissa, so two correct bf16 implementations differ at the 1e-2 level and a few
near-tie argmaxes flip. The bounds (docs/GPU.md, "What changes on a GPU"), by dtype:

- relative L2 error of the last-token logits ``||ours - ref|| / ||ref||``: `LOGITS_RTOL`;
- teacher-forced top-1 agreement over the generated positions: at least `MIN_AGREEMENT`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

#: Relative L2 error bound of last-token logits, by dtype name.
LOGITS_RTOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
#: Fraction of teacher-forced greedy positions that must agree, by dtype name.
MIN_AGREEMENT = {"float32": 1.0, "float16": 0.95, "bfloat16": 0.9}


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``||ours - ref|| / ||ref||`` in float64 (0.0 for two zero tensors)."""
    a = ours.detach().to("cpu", torch.float64)
    b = ref.detach().to("cpu", torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    norm = float(torch.linalg.vector_norm(b))
    diff = float(torch.linalg.vector_norm(a - b))
    return 0.0 if norm == 0.0 and diff == 0.0 else diff / max(norm, 1e-30)


def agreement(ours: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> float:
    """Fraction of positions where ours[i][j] == ref[i][j] (sequences of equal lengths)."""
    total = same = 0
    for a, b in zip(ours, ref, strict=True):
        if len(a) != len(b):
            raise ValueError(f"lengths differ: {len(a)} vs {len(b)}")
        total += len(b)
        same += sum(int(x == y) for x, y in zip(a, b, strict=True))
    return 1.0 if total == 0 else same / total


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One comparison against the bounds of `dtype`."""

    dtype: str
    logits_rel_error: float
    token_agreement: float

    @property
    def rtol(self) -> float:
        return LOGITS_RTOL[self.dtype]

    @property
    def min_agreement(self) -> float:
        return MIN_AGREEMENT[self.dtype]

    @property
    def ok(self) -> bool:
        return self.logits_rel_error <= self.rtol and self.token_agreement >= self.min_agreement

    def figures(self) -> dict[str, object]:
        return {
            "dtype": self.dtype,
            "logits_rel_error": self.logits_rel_error,
            "logits_rtol": self.rtol,
            "token_agreement": self.token_agreement,
            "min_token_agreement": self.min_agreement,
            "ok": self.ok,
        }
