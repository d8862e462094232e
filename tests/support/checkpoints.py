"""The tiny Mixtral checkpoint of the CLI, server and e2e tests: built by transformers, written
with ``save_pretrained``, and the tokens transformers' own ``generate`` makes from it (the
reference the runtime must match). Every other family's tiny checkpoint: ``hf_families``."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import torch
import transformers

from tests.support import hf_families

#: A tiny Mixtral whose greedy tokens are robust to float noise (large initial weights give
#: wide logit gaps) and whose vocabulary holds the byte-level tokenizer's ids (256 bytes, BOS,
#: EOS), so text requests work without a tokenizer.json.
MIXTRAL_SETTINGS: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=6,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)


def mixtral(*, seed: int = 0, **overrides: Any) -> transformers.MixtralForCausalLM:
    """A randomly initialised tiny ``MixtralForCausalLM`` (eval mode, no EOS stop)."""
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**{**MIXTRAL_SETTINGS, **overrides})
    )
    model.eval()  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build(path: pathlib.Path, *, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """Write a tiny random Mixtral checkpoint to ``path`` (config.json + model.safetensors, as
    ``save_pretrained`` writes them); the model, for references."""
    model = mixtral(seed=seed, **overrides)
    model.save_pretrained(path)
    return model


def greedy_tokens(
    model: transformers.PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy ``generate``: the ``max_new_tokens`` new tokens of each prompt."""
    return [hf_families.greedy(model, prompt, max_new_tokens) for prompt in prompts]
