"""Small Hugging Face models with random weights, saved as checkpoints by the tests that
load them (`save_pretrained`)."""

from __future__ import annotations

from typing import Any

import torch
import transformers


def mixtral(**overrides: object) -> transformers.MixtralForCausalLM:
    """A tiny Mixtral (seed 0): 3 layers, 6 experts, vocabulary 320; `overrides` its config."""
    torch.manual_seed(0)
    settings: dict[str, Any] = dict(
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
    settings.update(overrides)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**settings))
    model.eval()  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
