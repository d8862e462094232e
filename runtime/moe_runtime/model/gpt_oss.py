"""gpt-oss: attention with q/k/v/o biases and a learned sink per head, sliding windows on the
layers `layer_types` says, YaRN; a router with a bias that takes the top-k logits then a
softmax over them; experts with biases and a clamped SwiGLU (`swiglu_alpha`,
`swiglu_limit`), stored fused only (`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up
interleaved, `down_proj` [E, I, H]; MXFP4 as `_blocks` / `_scales`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_runtime.model import config as config_mod
from moe_runtime.model import hf_config, layout

#: gpt-oss's rotary defaults (its config class fills them in when config.json has none).
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def parse(
    reader: hf_config.Reader, generation: Mapping[str, Any] | None, gen_path: str
) -> config_mod.ModelConfig:
    hf = dict(reader.hf)
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        hf["rope_parameters"] = dict(DEFAULT_ROPE)
    reader = hf_config.Reader(hf, reader.path)
    fields = hf_config.common(
        reader, generation=generation, gen_path=gen_path, default_theta=150000.0, default_eps=1e-5
    )
    num_layers = fields["num_layers"]
    window = reader.integer("sliding_window", 128)
    types = reader.strings("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise reader.error(f"layer_types {types} is not one of sliding/full per layer")
    bias = reader.flag("attention_bias", True)
    return hf_config.build(
        reader,
        **fields,
        family=FAMILY.name,
        intermediate_size=reader.integer("intermediate_size"),
        num_experts=reader.integer("num_local_experts", aliases=("num_experts",)),
        top_k=reader.integer("num_experts_per_tok"),
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        attention_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        expert_activation="gpt_oss",
        swiglu_alpha=reader.number("swiglu_alpha", 1.702),
        swiglu_limit=reader.number("swiglu_limit", 7.0),
        norm_scale_first=True,
    )


FAMILY = layout.Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    parse=parse,
    naming=layout.Naming(
        router="router.weight",
        router_bias="router.bias",
        expert={
            "gate": "gate_proj.weight",
            "up": "up_proj.weight",
            "down": "down_proj.weight",
            "gate_bias": "gate_proj.bias",
            "up_bias": "up_proj.bias",
            "down_bias": "down_proj.bias",
        },
        fused={
            "gate": layout.FusedPart("mlp.experts.gate_up_proj", select="even", transpose=True),
            "up": layout.FusedPart("mlp.experts.gate_up_proj", select="odd", transpose=True),
            "down": layout.FusedPart("mlp.experts.down_proj", transpose=True),
            "gate_bias": layout.FusedPart("mlp.experts.gate_up_proj_bias", select="even"),
            "up_bias": layout.FusedPart("mlp.experts.gate_up_proj_bias", select="odd"),
            "down_bias": layout.FusedPart("mlp.experts.down_proj_bias"),
        },
    ),
)
