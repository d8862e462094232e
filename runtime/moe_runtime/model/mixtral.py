"""Mixtral: every layer a MoE layer, softmax top-k routing renormalised, SwiGLU experts
named `block_sparse_moe.experts.{e}.w1/w2/w3` (or transformers 5's fused layout), an
optional sliding window."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_runtime.model import config as config_mod
from moe_runtime.model import hf_config, layout


def parse(
    reader: hf_config.Reader, generation: Mapping[str, Any] | None, gen_path: str
) -> config_mod.ModelConfig:
    fields = hf_config.common(
        reader, generation=generation, gen_path=gen_path, default_theta=1e6, default_eps=1e-5
    )
    return hf_config.build(
        reader,
        **fields,
        family=FAMILY.name,
        intermediate_size=reader.integer("intermediate_size"),
        num_experts=reader.integer("num_local_experts", aliases=("num_experts",)),
        top_k=reader.integer("num_experts_per_tok"),
        sliding_window=reader.integer("sliding_window", None),
    )


FAMILY = layout.Family(
    name="mixtral",
    model_types=("mixtral",),
    parse=parse,
    naming=layout.Naming(
        moe="block_sparse_moe.",
        expert={"gate": "w1.weight", "up": "w3.weight", "down": "w2.weight"},
        aliases={"mlp.gate.weight": "block_sparse_moe.gate.weight"},
    ),
)
