"""What a family description is: how it reads its config and names its tensors.

A `Family` is data: `parse` (Hugging Face config -> `ModelConfig`), `naming` (where the MoE
block, router, experts and shared experts sit under `model.layers.{l}.`, and how
transformers' fused expert layout stores each expert part), and `skip` (stored tensors the
family does not use, and why). The tensor names themselves are built from it by `names`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from moe_runtime.model import config as config_mod
from moe_runtime.model import hf_config

Shape = tuple[int, ...]

#: The parts of one routed expert: projections [I, H], [I, H], [H, I] and their biases.
EXPERT_PARTS = ("gate", "up", "down")
EXPERT_BIAS_PARTS = ("gate_bias", "up_bias", "down_bias")

#: How one expert's rows are taken from its slice of a fused tensor (after the transpose).
SELECTIONS = ("all", "first_half", "second_half", "even", "odd")


@dataclasses.dataclass(frozen=True)
class FusedPart:
    """Where one expert part lives in a fused tensor [E, ...] holding every expert of a layer.

    stored: the tensor's name under `model.layers.{l}.`; transpose: the expert's 2-D slice
    is stored transposed (gpt-oss: x @ W); select: which rows of it are this part.
    """

    stored: str
    select: str = "all"
    transpose: bool = False

    def __post_init__(self) -> None:
        if self.select not in SELECTIONS:
            raise ValueError(f"FusedPart.select must be one of {SELECTIONS}: {self.select!r}")


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


#: Per-expert names of the Qwen, OLMoE and DeepSeek checkpoints (under `experts.{e}.`).
PROJ_EXPERT_NAMES = _frozen(
    {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}
)
#: transformers 5's fused layout of SwiGLU experts (`save_original_format=False`).
GATE_UP_FUSED = _frozen(
    {
        "gate": FusedPart("mlp.experts.gate_up_proj", select="first_half"),
        "up": FusedPart("mlp.experts.gate_up_proj", select="second_half"),
        "down": FusedPart("mlp.experts.down_proj"),
    }
)


@dataclasses.dataclass(frozen=True)
class Naming:
    """Tensor names of a family's MoE block, relative to `model.layers.{l}.`.

    moe: prefix of the MoE block; router / router_bias / correction_bias: under it (the
    router's bias and DeepSeek-V3's `e_score_correction_bias`, used when the config has
    them); expert: per-expert part names under `{moe}experts.{e}.`; fused: the fused layout;
    shared: prefix of the shared expert(s) under `moe`; shared_gate: Qwen2-MoE's gate;
    aliases: other stored names of a non-expert tensor (stored suffix -> our suffix).
    """

    moe: str = "mlp."
    router: str = "gate.weight"
    router_bias: str = "gate.bias"
    correction_bias: str = "gate.e_score_correction_bias"
    expert: Mapping[str, str] = dataclasses.field(default_factory=lambda: PROJ_EXPERT_NAMES)
    fused: Mapping[str, FusedPart] = dataclasses.field(default_factory=lambda: GATE_UP_FUSED)
    shared: str = "shared_experts."
    shared_gate: str = "shared_expert_gate.weight"
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)


ParseFn = Callable[[hf_config.Reader, Mapping[str, Any] | None, str], config_mod.ModelConfig]
SkipFn = Callable[[config_mod.ModelConfig, str], "str | None"]


def no_skip(config: config_mod.ModelConfig, name: str) -> str | None:
    """No stored tensor is left unused on purpose."""
    return None


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its `model_type` names, config reader, tensor naming, skip rule.

    parse(reader, generation_config or None, generation_config path) -> ModelConfig (with
    `family` = name). skip(config, stored name) -> why the tensor is not used, or None.
    """

    name: str
    model_types: tuple[str, ...]
    parse: ParseFn
    naming: Naming = dataclasses.field(default_factory=Naming)
    skip: SkipFn = no_skip
