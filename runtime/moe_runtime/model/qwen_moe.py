"""Qwen2-MoE and Qwen3-MoE: MoE layers where `(l + 1) % decoder_sparse_step == 0` and `l` is
not in `mlp_only_layers` (dense MLPs elsewhere), softmax top-k routing renormalised when
`norm_topk_prob`, `moe_intermediate_size` experts. Qwen2-MoE: q/k/v biases, a shared expert
behind a sigmoid gate, per-layer sliding windows (`layer_types`). Qwen3-MoE: per-head RMSNorm
of q and k before RoPE, an explicit `head_dim`, q/k/v/o biases when `attention_bias`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_runtime.model import config as config_mod
from moe_runtime.model import hf_config, layout


def _moe_layers(reader: hf_config.Reader, num_layers: int, num_experts: int) -> tuple[int, ...]:
    step = reader.integer("decoder_sparse_step", 1)
    dense = set(reader.integers("mlp_only_layers"))
    if step < 1:
        raise reader.error(f"decoder_sparse_step must be >= 1, got {step}")
    layers = tuple(
        layer
        for layer in range(num_layers)
        if layer not in dense and num_experts > 0 and (layer + 1) % step == 0
    )
    if not layers:
        raise reader.error("no MoE layer (mlp_only_layers / decoder_sparse_step leave none)")
    return layers


def _layer_windows(
    reader: hf_config.Reader, num_layers: int, window: int | None
) -> tuple[int | None, ...] | None:
    """Qwen2-MoE's `layer_types` (or the rule its config derives them by)."""
    use = reader.flag("use_sliding_window", False)
    types = reader.strings("layer_types")
    if types is None:
        last = reader.integer("max_window_layers", 28)
        types = [
            "sliding_attention" if (i + 1) % 2 and i < last and use else "full_attention"
            for i in range(num_layers)
        ]
    if len(types) != num_layers:
        raise reader.error(f"layer_types has {len(types)} entries for {num_layers} layers")
    out: list[int | None] = []
    for kind in types:
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention" and window:
            out.append(window)
        else:
            raise reader.error(
                f"layer type {kind!r} with sliding_window {window!r} is not supported"
            )
    return tuple(out)


def _parse(
    reader: hf_config.Reader,
    generation: Mapping[str, Any] | None,
    gen_path: str,
    *,
    qwen3: bool,
) -> config_mod.ModelConfig:
    fields = hf_config.common(reader, generation=generation, gen_path=gen_path)
    num_experts = reader.integer("num_experts", aliases=("num_local_experts",))
    moe_layers = _moe_layers(reader, fields["num_layers"], num_experts)
    window = (
        reader.integer("sliding_window", None) if reader.flag("use_sliding_window", False) else None
    )
    common = dict(
        fields,
        intermediate_size=reader.integer("intermediate_size"),
        moe_intermediate_size=reader.integer("moe_intermediate_size"),
        num_experts=num_experts,
        top_k=reader.integer("num_experts_per_tok"),
        norm_topk_prob=reader.flag("norm_topk_prob", False),
        moe_layers=moe_layers,
    )
    if qwen3:
        bias = reader.flag("attention_bias", False)
        return hf_config.build(
            reader,
            **common,
            family=QWEN3.name,
            sliding_window=window,
            attention_bias=bias,
            o_bias=bias,
            qk_norm="head",
        )
    return hf_config.build(
        reader,
        **common,
        family=QWEN2.name,
        layer_windows=_layer_windows(reader, fields["num_layers"], window),
        attention_bias=reader.flag("qkv_bias", True),
        shared_intermediate_size=reader.integer("shared_expert_intermediate_size"),
        shared_expert_gate=True,
    )


def parse_qwen2(
    reader: hf_config.Reader, generation: Mapping[str, Any] | None, gen_path: str
) -> config_mod.ModelConfig:
    return _parse(reader, generation, gen_path, qwen3=False)


def parse_qwen3(
    reader: hf_config.Reader, generation: Mapping[str, Any] | None, gen_path: str
) -> config_mod.ModelConfig:
    return _parse(reader, generation, gen_path, qwen3=True)


QWEN2 = layout.Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    parse=parse_qwen2,
    naming=layout.Naming(shared="shared_expert."),
)
QWEN3 = layout.Family(name="qwen3_moe", model_types=("qwen3_moe",), parse=parse_qwen3)
