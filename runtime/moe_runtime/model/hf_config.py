"""Reading a Hugging Face `config.json` as shipped: typed fields, rotary parameters in both
forms (`rope_parameters`, or the older `rope_theta` + `rope_scaling`), stop ids, the dtype.

`Reader` wraps the dict and names the file and field in every error (`CheckpointError`);
the family modules use it to fill a `ModelConfig`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from moe_runtime.model import config as config_mod
from moe_runtime.model import errors

log = logging.getLogger(__name__)

_REQUIRED = object()

#: `dtype` / `torch_dtype` names we serve in, by the names checkpoints use.
DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


class Reader:
    """Typed access to a config dict; `path` is named in every error."""

    def __init__(self, hf: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
        self.hf = hf
        self.path = path

    def error(self, problem: str) -> errors.CheckpointError:
        return errors.CheckpointError(self.path, problem)

    def has(self, key: str) -> bool:
        return self.hf.get(key) is not None

    def integer(self, key: str, default: Any = _REQUIRED, *, aliases: Sequence[str] = ()) -> Any:
        """An integer field (an integral float is accepted); `aliases` are read in turn."""
        return self._number(key, int, default, aliases)

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._number(key, float, default, ())

    def _number(
        self, key: str, kind: type[int] | type[float], default: Any, aliases: Sequence[str]
    ) -> Any:
        for name in (key, *aliases):
            if self.hf.get(name) is not None:
                key = name
                break
        value = self.hf.get(key, default)
        if value is None:
            if default is not _REQUIRED:
                return default
            if key not in self.hf:
                raise self.error(f"required field {key!r} is missing")
        if value is _REQUIRED:
            raise self.error(f"required field {key!r} is missing")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not float(value).is_integer())
        ):
            raise self.error(
                f"field {key!r} must be {'an integer' if kind is int else 'a number'}, "
                f"got {value!r}"
            )
        return int(value) if kind is int else float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.hf.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"field {key!r} must be true or false, got {value!r}")
        return value

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self.hf.get(key, default)
        if value is not None and not isinstance(value, str):
            raise self.error(f"field {key!r} must be a string, got {value!r}")
        return value

    def integers(self, key: str) -> list[int]:
        value = self.hf.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise self.error(f"field {key!r} must be a list of integers, got {value!r}")
        return list(value)

    def strings(self, key: str) -> list[str] | None:
        value = self.hf.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(f"field {key!r} must be a list of strings, got {value!r}")
        return list(value)

    def require(self, key: str, allowed: Sequence[Any], default: Any) -> Any:
        """A field whose only supported values are `allowed`; others are refused by name."""
        value = self.hf.get(key, default)
        if value is None:
            value = default
        if value not in allowed:
            raise self.error(
                f"{key} is {value!r}; supported: {', '.join(repr(a) for a in allowed)}"
            )
        return value


def token_ids(reader: Reader, key: str) -> list[int]:
    """A token id, a list of ids (several stop tokens) or null, as a list."""
    value = reader.hf.get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise reader.error(f"field {key!r} must be a token id or a list of them, got {value!r}")
    return list(values)


def stop_ids(reader: Reader, generation: Mapping[str, Any] | None, gen_path: str) -> list[int]:
    """Every eos id: generation_config.json's (what `generate` stops on) then config.json's."""
    ids: list[int] = []
    if generation is not None:
        ids.extend(token_ids(Reader(generation, gen_path), "eos_token_id"))
    ids.extend(token_ids(reader, "eos_token_id"))
    return list(dict.fromkeys(ids))


def dtype_name(reader: Reader) -> str | None:
    """The checkpoint's dtype (`dtype`, or the older `torch_dtype`), as a serving dtype name."""
    value = reader.hf.get("dtype") or reader.hf.get("torch_dtype")
    if value is None:
        return None
    if not isinstance(value, str):
        raise reader.error(f"field 'dtype' must be a string, got {value!r}")
    name = value.removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise reader.error(f"dtype {value!r} is not supported; use one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


def rope(
    reader: Reader, *, default_theta: float, max_positions: int
) -> tuple[float, config_mod.RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters` or `rope_theta` + `rope_scaling`.

    Types: "default", "linear", "yarn"; any other is refused naming it.
    """
    params = reader.hf.get("rope_parameters")
    if params is None:
        params = reader.hf.get("rope_scaling")
    params = {} if params is None else params
    if not isinstance(params, Mapping):
        raise reader.error(f"rope_parameters must be an object, got {params!r}")
    theta = params.get("rope_theta", reader.hf.get("rope_theta", default_theta))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise reader.error(f"rope_theta must be a positive number, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    sub = Reader(params, reader.path)
    if kind == "linear":
        return float(theta), config_mod.RopeScaling(kind="linear", factor=sub.number("factor"))
    if kind != "yarn":
        raise reader.error(
            f"rope_type {kind!r} is not supported (supported: 'default', 'linear', 'yarn')"
        )
    original = sub.integer(
        "original_max_position_embeddings",
        reader.integer("original_max_position_embeddings", None) or max_positions,
    )
    factor = sub.number("factor", None)
    if factor is None:
        factor = max_positions / original
    return float(theta), config_mod.RopeScaling(
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=sub.number("beta_fast", None) or 32.0,
        beta_slow=sub.number("beta_slow", None) or 1.0,
        mscale=sub.number("mscale", None),
        mscale_all_dim=sub.number("mscale_all_dim", None),
        attention_factor=sub.number("attention_factor", None),
        truncate=sub.flag("truncate", True),
    )


def common(
    reader: Reader,
    *,
    generation: Mapping[str, Any] | None,
    gen_path: str,
    default_theta: float = 10000.0,
    default_eps: float = 1e-6,
) -> dict[str, Any]:
    """The fields every family reads the same way (ModelConfig keyword arguments)."""
    hidden = reader.integer("hidden_size")
    heads = reader.integer("num_attention_heads")
    kv_heads = reader.integer("num_key_value_heads", None)
    max_positions = reader.integer("max_position_embeddings", 32768)
    theta, scaling = rope(reader, default_theta=default_theta, max_positions=max_positions)
    vocab = reader.integer("vocab_size")
    stops = stop_ids(reader, generation, gen_path)
    outside = [t for t in stops if not 0 <= t < vocab]
    if outside:
        # transformers only warns: such an id can never be generated, so it never stops.
        log.warning(
            "%s: eos ids %s are outside the vocabulary of %d: ignored", reader.path, outside, vocab
        )
        stops = [t for t in stops if 0 <= t < vocab]
    bos = [t for t in token_ids(reader, "bos_token_id") if 0 <= t < vocab]
    act = reader.string("hidden_act", "silu")
    if act != "silu":
        raise reader.error(f"hidden_act is {act!r}; only 'silu' is supported")
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_layers": reader.integer("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": heads if kv_heads is None else kv_heads,
        "head_dim": reader.integer("head_dim", None) or hidden // max(heads, 1),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rms_norm_eps": reader.number("rms_norm_eps", default_eps),
        "max_position_embeddings": max_positions,
        "bos_token_id": bos[0] if bos else None,
        "eos_token_id": stops[0] if stops else None,
        "stop_token_ids": tuple(stops),
        "tie_word_embeddings": reader.flag("tie_word_embeddings", False),
        "dtype": dtype_name(reader),
    }


def build(reader: Reader, **fields: Any) -> config_mod.ModelConfig:
    """ModelConfig(**fields), its ValueError as a CheckpointError naming the file."""
    try:
        return config_mod.ModelConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise reader.error(f"invalid model configuration: {exc}") from exc
