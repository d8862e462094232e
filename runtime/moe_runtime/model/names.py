"""Tensor names (Hugging Face Mixtral naming) and their shapes for a given ModelConfig.

Names: `model.embed_tokens.weight`, `model.layers.{l}.input_layernorm.weight`,
`model.layers.{l}.self_attn.{q,k,v,o}_proj.weight`, `model.layers.{l}.post_attention_layernorm.weight`,
`model.layers.{l}.block_sparse_moe.gate.weight` (the router),
`model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w2,w3}.weight`, `model.norm.weight`,
`lm_head.weight` (absent when the embeddings are tied).
"""

from __future__ import annotations

import re

from moe_runtime.model import config as config_mod

EXPERT_PARTS = ("w1", "w2", "w3")
_EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$"
)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def expert_tensor_name(layer: int, expert: int, part: str) -> str:
    """Name of one expert matrix; part is "w1" (gate), "w2" (down) or "w3" (up)."""
    if part not in EXPERT_PARTS:
        raise ValueError(f"expert part must be one of {EXPERT_PARTS}, got {part!r}")
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{part}.weight"


def expert_tensor_names(layer: int, expert: int) -> list[str]:
    """The three tensors of one logical expert of one layer: [w1, w2, w3]."""
    return [expert_tensor_name(layer, expert, part) for part in EXPERT_PARTS]


def parse_expert_tensor_name(name: str) -> tuple[int, int, str] | None:
    """(layer, expert, part) of an expert tensor name, or None for any other name."""
    match = _EXPERT_RE.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), match.group(3)


def is_expert_tensor(name: str) -> bool:
    """True for the w1/w2/w3 matrices of an expert (the tensors EPLB moves between ranks)."""
    return _EXPERT_RE.match(name) is not None


def router_tensor_name(layer: int) -> str:
    """The router (gate) matrix of a layer, [num_experts, hidden]."""
    return f"model.layers.{layer}.block_sparse_moe.gate.weight"


def layer_tensor_names(layer: int) -> list[str]:
    """The non-expert tensors of one decoder layer."""
    prefix = f"model.layers.{layer}."
    return [
        prefix + "input_layernorm.weight",
        prefix + "self_attn.q_proj.weight",
        prefix + "self_attn.k_proj.weight",
        prefix + "self_attn.v_proj.weight",
        prefix + "self_attn.o_proj.weight",
        prefix + "post_attention_layernorm.weight",
        router_tensor_name(layer),
    ]


def non_expert_tensor_names(config: config_mod.ModelConfig) -> list[str]:
    """Every tensor every rank holds (all but experts), in a fixed order."""
    names = ["model.embed_tokens.weight"]
    for layer in range(config.num_layers):
        names.extend(layer_tensor_names(layer))
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def all_tensor_names(config: config_mod.ModelConfig) -> list[str]:
    """Non-expert tensors, then every expert tensor by (layer, expert)."""
    names = non_expert_tensor_names(config)
    for layer in range(config.num_layers):
        for expert in range(config.num_experts):
            names.extend(expert_tensor_names(layer, expert))
    return names


def tensor_shape(config: config_mod.ModelConfig, name: str) -> tuple[int, ...]:
    """The shape `name` must have under `config`; KeyError for a name the model does not use."""
    h, i = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    if name == "model.embed_tokens.weight" or (
        name == "lm_head.weight" and not config.tie_word_embeddings
    ):
        return (config.vocab_size, h)
    if name == "model.norm.weight":
        return (h,)
    expert = parse_expert_tensor_name(name)
    if expert is not None:
        layer, index, part = expert
        if layer < config.num_layers and index < config.num_experts:
            return (h, i) if part == "w2" else (i, h)
        raise KeyError(f"{name}: layer or expert out of range for {config}")
    match = _LAYER_RE.match(name)
    if match is not None and int(match.group(1)) < config.num_layers:
        shapes = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q_dim, h),
            "self_attn.k_proj.weight": (kv_dim, h),
            "self_attn.v_proj.weight": (kv_dim, h),
            "self_attn.o_proj.weight": (h, q_dim),
            "block_sparse_moe.gate.weight": (config.num_experts, h),
        }
        shape = shapes.get(match.group(2))
        if shape is not None:
            return shape
    raise KeyError(f"{name!r} is not a tensor of this model")
