"""Choosing the next token on a rank: greedy, or seeded sampling that any rank reproduces."""

from __future__ import annotations

import hashlib

import torch

from moe_runtime import step as step_mod


def sample_token(logits: torch.Tensor, params: step_mod.SamplingParams, num_generated: int) -> int:
    """Next token from logits [V] (float32).

    temperature == 0: argmax. Otherwise softmax(logits / temperature), restricted to the
    smallest set of most likely tokens whose mass reaches top_p, sampled by inverse CDF with a
    uniform draw from a generator seeded by (seed, num_generated) alone, so any rank draws the
    same token for the same sequence position. seed None: a fresh random draw.
    """
    if params.temperature <= 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    cdf = torch.cumsum(sorted_probs, dim=0)
    if params.top_p < 1.0:
        keep = int(torch.searchsorted(cdf, torch.tensor([params.top_p], dtype=cdf.dtype)).item())
        keep = min(max(keep + 1, 1), cdf.numel())
    else:
        keep = cdf.numel()
    total = float(cdf[keep - 1].item())
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling_seed(params.seed, num_generated))
    u = float(torch.rand((), generator=generator, dtype=torch.float64).item()) * total
    index = int(torch.searchsorted(cdf[:keep], torch.tensor([u], dtype=cdf.dtype)).item())
    return int(order[min(index, keep - 1)].item())


def sampling_seed(seed: int, num_generated: int) -> int:
    """A 63-bit generator seed from (request seed, tokens generated so far), process-stable."""
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
