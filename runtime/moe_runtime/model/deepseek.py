"""DeepSeek-V2 (and V2-Lite) and DeepSeek-V3: multi-head latent attention (q through a
low-rank `q_lora_rank` or not), YaRN with mscale, the first `first_k_dense_replace` layers
dense, shared experts (`n_shared_experts` x `moe_intermediate_size`), `routed_scaling_factor`.
V2 routes by softmax (optionally group-limited greedy: the best `topk_group` of `n_group`
groups by their best expert); V3 by sigmoid, choosing with `e_score_correction_bias` (which
never weighs), groups ranked by the sum of their top two, weights renormalised when
`norm_topk_prob`. V3's multi-token-prediction layers (stored after the last layer) are not
run: their tensors are skipped with one log line.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from moe_runtime.model import config as config_mod
from moe_runtime.model import hf_config, layout

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _mla(reader: hf_config.Reader, q_lora_default: int | None) -> config_mod.MLASpec:
    q_lora = reader.hf["q_lora_rank"] if "q_lora_rank" in reader.hf else q_lora_default
    if q_lora is not None:
        q_lora = reader.integer("q_lora_rank")
    try:
        return config_mod.MLASpec(
            q_lora_rank=q_lora,
            kv_lora_rank=reader.integer("kv_lora_rank", 512),
            qk_nope_head_dim=reader.integer("qk_nope_head_dim", 128),
            qk_rope_head_dim=reader.integer("qk_rope_head_dim", 64),
            v_head_dim=reader.integer("v_head_dim", 128),
        )
    except ValueError as exc:
        raise reader.error(f"invalid attention configuration: {exc}") from exc


def _parse(
    reader: hf_config.Reader,
    generation: Mapping[str, Any] | None,
    gen_path: str,
    *,
    v3: bool,
) -> config_mod.ModelConfig:
    fields = hf_config.common(reader, generation=generation, gen_path=gen_path)
    mla = _mla(reader, 1536)
    num_layers = fields["num_layers"]
    first_dense = reader.integer("first_k_dense_replace", 3 if v3 else 0)
    if first_dense >= num_layers:
        raise reader.error(
            f"first_k_dense_replace {first_dense} leaves no MoE layer of {num_layers}"
        )
    moe_inter = reader.integer("moe_intermediate_size", 2048 if v3 else 1407)
    shared = reader.integer("n_shared_experts", 1 if v3 else 2) or 0
    bias = reader.flag("attention_bias", False)
    num_experts = reader.integer("n_routed_experts", 256 if v3 else 64, aliases=("num_experts",))
    if v3:
        routing: dict[str, Any] = dict(
            router="sigmoid_group",
            n_group=reader.integer("n_group", 8),
            topk_group=reader.integer("topk_group", 4),
            norm_topk_prob=reader.flag("norm_topk_prob", True),
            routed_scaling_factor=reader.number("routed_scaling_factor", 2.5),
            rope_layout="interleave" if reader.flag("rope_interleave", True) else "half",
            skip_layers=reader.integer("num_nextn_predict_layers", 1, aliases=("num_mtp_layers",)),
        )
    else:
        method = reader.require("topk_method", ("greedy", "group_limited_greedy"), "greedy")
        grouped = method == "group_limited_greedy"
        routing = dict(
            router="softmax_group",
            n_group=reader.integer("n_group") if grouped else 1,
            topk_group=reader.integer("topk_group") if grouped else 1,
            # transformers' DeepSeek-V2 router never renormalises (norm_topk_prob unused).
            norm_topk_prob=False,
            routed_scaling_factor=reader.number("routed_scaling_factor", 1.0),
            rope_layout="pairs",
        )
    return hf_config.build(
        reader,
        **dict(fields, head_dim=mla.qk_rope_head_dim),
        family=(V3 if v3 else V2).name,
        intermediate_size=reader.integer("intermediate_size"),
        moe_intermediate_size=moe_inter,
        num_experts=num_experts,
        top_k=reader.integer("num_experts_per_tok"),
        moe_layers=tuple(range(first_dense, num_layers)),
        shared_intermediate_size=moe_inter * shared,
        attention_bias=bias,
        o_bias=bias,
        mla=mla,
        mlp_bias=False if v3 else reader.flag("mlp_bias", False),
        **routing,
    )


def parse_v2(
    reader: hf_config.Reader, generation: Mapping[str, Any] | None, gen_path: str
) -> config_mod.ModelConfig:
    return _parse(reader, generation, gen_path, v3=False)


def parse_v3(
    reader: hf_config.Reader, generation: Mapping[str, Any] | None, gen_path: str
) -> config_mod.ModelConfig:
    return _parse(reader, generation, gen_path, v3=True)


def skip_mtp(config: config_mod.ModelConfig, name: str) -> str | None:
    """DeepSeek-V3's multi-token-prediction layers: stored as the layers after the last."""
    match = _LAYER.match(name)
    if match is None or not config.skip_layers:
        return None
    layer = int(match.group(1))
    if config.num_layers <= layer < config.num_layers + config.skip_layers:
        return f"multi-token-prediction layer {layer} (not used to generate)"
    return None


V2 = layout.Family(name="deepseek_v2", model_types=("deepseek_v2",), parse=parse_v2)
V3 = layout.Family(name="deepseek_v3", model_types=("deepseek_v3",), parse=parse_v3, skip=skip_mtp)
