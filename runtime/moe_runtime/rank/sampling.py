"""Choosing the next tokens of a rank's batch on its device: greedy, or seeded sampling that any
rank reproduces. One host read per step (the chosen tokens), whatever the batch size."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from moe_runtime import step as step_mod


def sample(
    logits: torch.Tensor,
    params: Sequence[step_mod.SamplingParams],
    num_generated: Sequence[int],
) -> list[int]:
    """The next token of each row of logits [N, V] (on any device), by its params.

    temperature == 0: argmax. Otherwise softmax(logits / temperature) in float64, restricted
    to the smallest set of most likely tokens whose mass reaches top_p, sampled by inverse CDF
    with a uniform draw from a generator seeded by (seed, num_generated) alone, so any rank
    draws the same token for the same sequence position (seed None: a fresh random draw). The
    uniform draws are made on the host (no device read); the rest runs on the logits' device
    for every row at once, and the tokens come back in one read.
    """
    rows = logits.shape[0]
    if len(params) != rows or len(num_generated) != rows:
        raise ValueError(
            f"{rows} rows of logits, {len(params)} sampling params, {len(num_generated)} counts"
        )
    if rows == 0:
        return []
    # max's indices: argmax's (the first maximum, NaN as the maximum), 3x faster on a CPU
    tokens = logits.max(dim=-1).indices
    drawn = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if drawn:
        device = logits.device
        index = torch.tensor(drawn, device=device)
        temperature = torch.tensor(
            [params[i].temperature for i in drawn], dtype=torch.float64, device=device
        )
        top_p = torch.tensor([params[i].top_p for i in drawn], dtype=torch.float64)
        uniform = torch.tensor(
            [_uniform(params[i].seed, num_generated[i]) for i in drawn], dtype=torch.float64
        )
        chosen = _inverse_cdf(
            logits.index_select(0, index).to(torch.float64) / temperature[:, None],
            top_p.to(device),
            uniform.to(device),
        )
        tokens = tokens.index_copy(0, index, chosen)
    return [int(t) for t in tokens.tolist()]


def sample_token(logits: torch.Tensor, params: step_mod.SamplingParams, num_generated: int) -> int:
    """The next token from logits [V] (`sample` of one row)."""
    return sample(logits.reshape(1, -1), [params], [num_generated])[0]


def _inverse_cdf(scaled: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token ids [n] for scaled logits [n, V] (float64), top_p [n] and uniform draws [n]."""
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cdf = torch.cumsum(sorted_probs, dim=-1)
    vocab = cdf.shape[1]
    # the smallest prefix whose mass reaches top_p; the whole vocabulary for top_p >= 1
    keep = torch.searchsorted(cdf, top_p[:, None]).squeeze(1) + 1
    keep = torch.where(top_p < 1.0, keep, torch.full_like(keep, vocab)).clamp(1, vocab)
    total = cdf.gather(1, (keep - 1)[:, None]).squeeze(1)
    # u * total < cdf[keep - 1]: the position found in the whole row is the one in the prefix
    position = torch.searchsorted(cdf, (uniform * total)[:, None]).squeeze(1)
    position = torch.minimum(position, keep - 1)
    return order.gather(1, position[:, None]).squeeze(1)


def _uniform(seed: int | None, num_generated: int) -> float:
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling_seed(seed, num_generated))
    return float(torch.rand((), generator=generator, dtype=torch.float64).item())


def sampling_seed(seed: int, num_generated: int) -> int:
    """A 63-bit generator seed from (request seed, tokens generated so far), process-stable."""
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
