"""The shape of a Mixtral-style model (`ModelConfig`) and its reading from a Hugging Face config."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from moe_runtime.model import errors


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Mixtral decoder; every field is checked on construction.

    head_dim: size of one attention head (q/k/v projections are [heads * head_dim, hidden]).
    num_kv_heads: key/value heads (grouped-query attention); divides num_heads.
    top_k: experts per token; intermediate_size: hidden size of one expert.
    sliding_window: attend to at most this many latest positions (None: the whole sequence),
    as Hugging Face Mixtral does when its config sets `sliding_window`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tie_word_embeddings: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_experts",
            "top_k",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"ModelConfig.top_k ({self.top_k}) must be at most num_experts ({self.num_experts})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (rotary), got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(
                f"ModelConfig.rope_theta and rms_norm_eps must be > 0, "
                f"got {self.rope_theta!r} and {self.rms_norm_eps!r}"
            )
        for name in ("bos_token_id", "eos_token_id"):
            tok = getattr(self, name)
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"ModelConfig.{name} ({tok}) must be in [0, vocab_size={self.vocab_size})"
                )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"ModelConfig.sliding_window must be a positive integer or None, "
                f"got {self.sliding_window!r}"
            )

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_heads // self.num_kv_heads


_REQUIRED = object()


def _first_token_id(hf: Mapping[str, Any], key: str, path: str | os.PathLike[str]) -> int | None:
    """HF configs give a token id, a list of ids (several stop tokens) or null."""
    value = hf.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.CheckpointError(path, f"field {key!r} must be a token id, got {value!r}")
    return value


def from_hf_config(hf: Mapping[str, Any], path: str | os.PathLike[str]) -> ModelConfig:
    """Build a ModelConfig from the dict of a Hugging Face Mixtral `config.json`.

    `path` is the config file, named in every error (`CheckpointError`).
    """
    model_type = hf.get("model_type")
    if model_type != "mixtral":
        raise errors.CheckpointError(
            path, f"model_type is {model_type!r}; only 'mixtral' checkpoints are supported"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise errors.CheckpointError(path, f"hidden_act is {act!r}; only 'silu' is supported")

    def number(key: str, kind: type[int] | type[float], default: Any = _REQUIRED) -> Any:
        value = hf.get(key, default)
        if value is _REQUIRED:
            raise errors.CheckpointError(path, f"required field {key!r} is missing")
        if value is None and default is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not float(value).is_integer())
        ):
            raise errors.CheckpointError(
                path,
                f"field {key!r} must be {'an integer' if kind is int else 'a number'}, "
                f"got {value!r}",
            )
        return kind(value)

    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise errors.CheckpointError(path, f"rope_parameters must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise errors.CheckpointError(
            path, f"rope_type {rope_type!r} is not supported (only 'default' rotary embeddings)"
        )
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 1e6))
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)):
        raise errors.CheckpointError(path, f"rope_theta must be a number, got {rope_theta!r}")
    hidden = number("hidden_size", int)
    heads = number("num_attention_heads", int)
    kv_heads = number("num_key_value_heads", int, None)
    head_dim = number("head_dim", int, None)
    try:
        return ModelConfig(
            vocab_size=number("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=number("intermediate_size", int),
            num_layers=number("num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=heads if kv_heads is None else kv_heads,
            head_dim=hidden // max(heads, 1) if head_dim is None else head_dim,
            num_experts=number("num_local_experts", int),
            top_k=number("num_experts_per_tok", int),
            rope_theta=float(rope_theta),
            rms_norm_eps=number("rms_norm_eps", float, 1e-5),
            max_position_embeddings=number("max_position_embeddings", int, 32768),
            bos_token_id=_first_token_id(hf, "bos_token_id", path),
            eos_token_id=_first_token_id(hf, "eos_token_id", path),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=number("sliding_window", int, None),
        )
    except errors.CheckpointError:
        raise
    except (TypeError, ValueError) as exc:
        raise errors.CheckpointError(path, f"invalid model configuration: {exc}") from exc
