"""Tensor names and shapes of a model, by role, from its family's naming (`layout.Naming`).

Names are the Hugging Face ones of the family as `save_pretrained` writes them:
`model.embed_tokens.weight`, `model.layers.{l}.input_layernorm.weight`, `...self_attn.*`,
`...post_attention_layernorm.weight`, the dense MLP `...mlp.{gate,up,down}_proj.weight` of a
dense layer, the router and shared experts of a MoE layer, `model.norm.weight`,
`lm_head.weight` (absent when the embeddings are tied). A routed expert is named per expert
(`...experts.{e}.{part}`, e.g. Mixtral's `block_sparse_moe.experts.{e}.w1.weight`) even where
checkpoints store all experts of a layer in one fused tensor (`checkpoint` reads slices).

Roles (the keys the decoder reads): input_norm, post_norm; q, k, v, o (+ q_bias, k_bias,
v_bias, o_bias, q_norm, k_norm, sinks); MLA: q or q_a, q_a_norm, q_b (+ q_a_bias), kv_a
(+ kv_a_bias), kv_a_norm, kv_b; mlp_gate, mlp_up, mlp_down (+ _bias) of a dense layer;
router (+ router_bias, correction_bias), shared_gate, shared_up, shared_down (+ _bias),
shared_expert_gate of a MoE layer. Expert parts: `layout.EXPERT_PARTS` (+ biases).
"""

from __future__ import annotations

import dataclasses
import functools

from moe_runtime.model import config as config_mod
from moe_runtime.model import families, layout

Shape = layout.Shape
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor: its role, decoder layer (-1: global), MoE layer and expert (-1: none)."""

    role: str
    shape: Shape
    layer: int = -1
    moe_layer: int = -1
    expert: int = -1

    @property
    def is_expert(self) -> bool:
        return self.expert >= 0


def naming(config: config_mod.ModelConfig) -> layout.Naming:
    return families.by_name(config.family).naming


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def _attention(cfg: config_mod.ModelConfig, a: str) -> dict[str, tuple[str, Shape]]:
    h = cfg.hidden_size
    out: dict[str, tuple[str, Shape]] = {}
    if cfg.mla is not None:
        mla = cfg.mla
        q_out = cfg.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            out["q"] = (a + "q_proj.weight", (q_out, h))
        else:
            r = mla.q_lora_rank
            out["q_a"] = (a + "q_a_proj.weight", (r, h))
            out["q_a_norm"] = (a + "q_a_layernorm.weight", (r,))
            out["q_b"] = (a + "q_b_proj.weight", (q_out, r))
            if cfg.attention_bias:
                out["q_a_bias"] = (a + "q_a_proj.bias", (r,))
        latent = mla.kv_lora_rank + mla.qk_rope_head_dim
        out["kv_a"] = (a + "kv_a_proj_with_mqa.weight", (latent, h))
        if cfg.attention_bias:
            out["kv_a_bias"] = (a + "kv_a_proj_with_mqa.bias", (latent,))
        out["kv_a_norm"] = (a + "kv_a_layernorm.weight", (mla.kv_lora_rank,))
        kv_out = cfg.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        out["kv_b"] = (a + "kv_b_proj.weight", (kv_out, mla.kv_lora_rank))
        out["o"] = (a + "o_proj.weight", (h, cfg.num_heads * mla.v_head_dim))
        if cfg.o_bias:
            out["o_bias"] = (a + "o_proj.bias", (h,))
        return out
    q_dim = cfg.num_heads * cfg.head_dim
    kv_dim = cfg.num_kv_heads * cfg.head_dim
    for role, rows in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
        out[role] = (a + f"{role}_proj.weight", (rows, h))
        if cfg.attention_bias:
            out[role + "_bias"] = (a + f"{role}_proj.bias", (rows,))
    out["o"] = (a + "o_proj.weight", (h, q_dim))
    if cfg.o_bias:
        out["o_bias"] = (a + "o_proj.bias", (h,))
    if cfg.qk_norm == "head":
        out["q_norm"] = (a + "q_norm.weight", (cfg.head_dim,))
        out["k_norm"] = (a + "k_norm.weight", (cfg.head_dim,))
    elif cfg.qk_norm == "full":
        out["q_norm"] = (a + "q_norm.weight", (q_dim,))
        out["k_norm"] = (a + "k_norm.weight", (kv_dim,))
    if cfg.attention_sinks:
        out["sinks"] = (a + "sinks", (cfg.num_heads,))
    return out


def _mlp(prefix: str, role: str, h: int, i: int, bias: bool) -> dict[str, tuple[str, Shape]]:
    out: dict[str, tuple[str, Shape]] = {}
    for part, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        out[f"{role}_{part}"] = (prefix + f"{part}_proj.weight", shape)
        if bias:
            out[f"{role}_{part}_bias"] = (prefix + f"{part}_proj.bias", shape[:1])
    return out


def layer_tensors(config: config_mod.ModelConfig, layer: int) -> dict[str, tuple[str, Shape]]:
    """{role: (name, shape)} of the non-expert tensors of decoder layer `layer`."""
    cfg = config
    h = cfg.hidden_size
    p = layer_prefix(layer)
    out: dict[str, tuple[str, Shape]] = {"input_norm": (p + "input_layernorm.weight", (h,))}
    out.update(_attention(cfg, p + "self_attn."))
    out["post_norm"] = (p + "post_attention_layernorm.weight", (h,))
    if cfg.moe_index(layer) is None:
        out.update(_mlp(p + "mlp.", "mlp", h, cfg.intermediate_size, cfg.mlp_bias))
        return out
    n = naming(cfg)
    moe = p + n.moe
    out["router"] = (moe + n.router, (cfg.num_experts, h))
    if cfg.router_bias:
        out["router_bias"] = (moe + n.router_bias, (cfg.num_experts,))
    if cfg.router == "sigmoid_group":
        out["correction_bias"] = (moe + n.correction_bias, (cfg.num_experts,))
    if cfg.shared_intermediate_size:
        shared = moe + n.shared
        out.update(_mlp(shared, "shared", h, cfg.shared_intermediate_size, cfg.mlp_bias))
        if cfg.shared_expert_gate:
            out["shared_expert_gate"] = (moe + n.shared_gate, (1, h))
    return out


def global_tensors(config: config_mod.ModelConfig) -> dict[str, tuple[str, Shape]]:
    """{role: (name, shape)} of the embeddings, final norm and (untied) lm_head."""
    h = config.hidden_size
    out: dict[str, tuple[str, Shape]] = {
        "embed": (EMBED, (config.vocab_size, h)),
        "norm": (FINAL_NORM, (h,)),
    }
    if not config.tie_word_embeddings:
        out["lm_head"] = (LM_HEAD, (config.vocab_size, h))
    return out


def expert_parts(config: config_mod.ModelConfig) -> dict[str, Shape]:
    """{part: shape} of one routed expert (`layout.EXPERT_PARTS`, + biases)."""
    i, h = config.expert_intermediate_size, config.hidden_size
    out: dict[str, Shape] = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    if config.expert_bias:
        out.update(gate_bias=(i,), up_bias=(i,), down_bias=(h,))
    return out


def expert_tensors(
    config: config_mod.ModelConfig, moe_layer: int, expert: int
) -> dict[str, tuple[str, Shape]]:
    """{part: (name, shape)} of expert `expert` of MoE layer `moe_layer`."""
    if not 0 <= moe_layer < config.num_moe_layers or not 0 <= expert < config.num_experts:
        raise KeyError(
            f"no expert {expert} of MoE layer {moe_layer} ({config.num_moe_layers} MoE layers, "
            f"{config.num_experts} experts)"
        )
    n = naming(config)
    base = layer_prefix(config.moe_layer_ids[moe_layer]) + f"{n.moe}experts.{expert}."
    return {part: (base + n.expert[part], shape) for part, shape in expert_parts(config).items()}


def expert_tensor_names(config: config_mod.ModelConfig, moe_layer: int, expert: int) -> list[str]:
    """The tensors of one logical expert of one MoE layer (every part, biases included)."""
    return [name for name, _ in expert_tensors(config, moe_layer, expert).values()]


@functools.lru_cache(maxsize=16)
def index(config: config_mod.ModelConfig) -> dict[str, Entry]:
    """Every tensor of the model by name."""
    out: dict[str, Entry] = {}
    for role, (name, shape) in global_tensors(config).items():
        out[name] = Entry(role, shape)
    for layer in range(config.num_layers):
        m = config.moe_index(layer)
        for role, (name, shape) in layer_tensors(config, layer).items():
            out[name] = Entry(role, shape, layer=layer, moe_layer=-1 if m is None else m)
    for m, layer in enumerate(config.moe_layer_ids):
        for e in range(config.num_experts):
            for part, (name, shape) in expert_tensors(config, m, e).items():
                out[name] = Entry(part, shape, layer=layer, moe_layer=m, expert=e)
    return out


def non_expert_tensor_names(config: config_mod.ModelConfig) -> list[str]:
    """Every tensor every rank holds (all but routed experts), in a fixed order."""
    names = [EMBED]
    for layer in range(config.num_layers):
        names.extend(name for name, _ in layer_tensors(config, layer).values())
    names.append(FINAL_NORM)
    if not config.tie_word_embeddings:
        names.append(LM_HEAD)
    return names


def all_tensor_names(config: config_mod.ModelConfig) -> list[str]:
    """Non-expert tensors, then every expert tensor by (MoE layer, expert)."""
    names = non_expert_tensor_names(config)
    for m in range(config.num_moe_layers):
        for e in range(config.num_experts):
            names.extend(expert_tensor_names(config, m, e))
    return names


def entry(config: config_mod.ModelConfig, name: str) -> Entry:
    """The entry of `name`; KeyError for a name the model does not use."""
    found = index(config).get(name)
    if found is None:
        raise KeyError(f"{name!r} is not a tensor of this model")
    return found


def tensor_shape(config: config_mod.ModelConfig, name: str) -> Shape:
    """The shape `name` must have under `config`; KeyError for a name the model does not use."""
    return entry(config, name).shape


def is_expert_tensor(config: config_mod.ModelConfig, name: str) -> bool:
    """True for a routed expert's tensor (what EPLB moves between ranks)."""
    found = index(config).get(name)
    return found is not None and found.is_expert
