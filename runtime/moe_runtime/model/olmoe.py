"""OLMoE: every layer a MoE layer, RMSNorm of q and k over the whole projection (not per
head), optional `clip_qkv`, softmax top-k routing (renormalised when `norm_topk_prob`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_runtime.model import config as config_mod
from moe_runtime.model import hf_config, layout


def parse(
    reader: hf_config.Reader, generation: Mapping[str, Any] | None, gen_path: str
) -> config_mod.ModelConfig:
    fields = hf_config.common(reader, generation=generation, gen_path=gen_path, default_eps=1e-5)
    if fields["head_dim"] * fields["num_heads"] != fields["hidden_size"]:
        # transformers sizes q_norm by hidden_size: another head_dim cannot load there either.
        raise reader.error(
            f"head_dim {fields['head_dim']} x num_attention_heads {fields['num_heads']} must be "
            f"hidden_size {fields['hidden_size']} for OLMoE"
        )
    bias = reader.flag("attention_bias", False)
    return hf_config.build(
        reader,
        **fields,
        family=FAMILY.name,
        intermediate_size=reader.integer("intermediate_size"),
        num_experts=reader.integer("num_experts", aliases=("num_local_experts",)),
        top_k=reader.integer("num_experts_per_tok"),
        norm_topk_prob=reader.flag("norm_topk_prob", False),
        attention_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=reader.number("clip_qkv", None),
    )


FAMILY = layout.Family(name="olmoe", model_types=("olmoe",), parse=parse)
