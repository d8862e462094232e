"""The supported model families by name and by Hugging Face `model_type`; `from_hf_config`
reads a `config.json` (and `generation_config.json`) with the right one."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from moe_runtime.model import config as config_mod
from moe_runtime.model import deepseek, errors, gpt_oss, hf_config, layout, mixtral, olmoe, qwen_moe

FAMILIES: tuple[layout.Family, ...] = (
    mixtral.FAMILY,
    qwen_moe.QWEN2,
    qwen_moe.QWEN3,
    olmoe.FAMILY,
    deepseek.V2,
    deepseek.V3,
    gpt_oss.FAMILY,
)
_BY_NAME = {f.name: f for f in FAMILIES}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
MODEL_TYPES = tuple(sorted(_BY_MODEL_TYPE))


def by_name(name: str) -> layout.Family:
    """The family a `ModelConfig.family` names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(_BY_NAME)}") from None


def from_hf_config(
    hf: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    generation: Mapping[str, Any] | None = None,
    generation_path: str | os.PathLike[str] = "generation_config.json",
) -> config_mod.ModelConfig:
    """A ModelConfig from a Hugging Face `config.json` dict (and `generation_config.json`'s).

    `path` is the config file, named in every error (`CheckpointError`); an unsupported
    `model_type` is refused naming it.
    """
    model_type = hf.get("model_type")
    family = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise errors.CheckpointError(
            path,
            f"model_type {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES)}",
        )
    return family.parse(hf_config.Reader(hf, path), generation, os.fspath(generation_path))
