"""Where weights come from: `open_source(str) -> ModelSource`.

Two kinds of source, both loading one tensor at a time so a rank reads only what it holds:

- `synthetic://NAME?seed=S[&FIELD=VALUE...]`: a randomly initialised model (`tiny`, `small`)
  whose every tensor is a function of (seed, tensor name) alone, so any rank can build any
  tensor without the others. FIELD overrides a `ModelConfig` field (e.g. `num_experts=16`).
- a local directory holding a Hugging Face Mixtral checkpoint: `config.json` and one
  `*.safetensors` file, or several with `model.safetensors.index.json`. Both the classic
  per-expert layout (`block_sparse_moe.experts.{e}.w1/w2/w3`) and the fused layout of
  transformers 5 (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`,
  `mlp.gate`) are read; tensors are always exposed under the classic names (see `names`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import urllib.parse
from typing import Any, Protocol

import safetensors
import torch

from moe_runtime.model import config as config_mod
from moe_runtime.model import errors, names, tokenizer

SYNTHETIC_SCHEME = "synthetic://"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"


class ModelSource(Protocol):
    """A model's configuration, tensors (by Hugging Face Mixtral name) and tokenizer."""

    @property
    def config(self) -> config_mod.ModelConfig: ...

    @property
    def description(self) -> str: ...

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, loaded now; KeyError for a name the model does not have."""
        ...

    def tensor_names(self) -> list[str]: ...

    def tokenizer(self) -> tokenizer.Tokenizer: ...


# ---------------------------------------------------------------------------------------------
# Synthetic models

SYNTHETIC_PRESETS: dict[str, config_mod.ModelConfig] = {
    # Seconds on one CPU core: unit tests, the demo, integration tests.
    "tiny": config_mod.ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=8,
        top_k=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.BYTE_BOS_ID,
        eos_token_id=tokenizer.BYTE_EOS_ID,
    ),
    # Benchmarks: enough experts and compute for EPLB and dispatch costs to show.
    "small": config_mod.ModelConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        num_experts=32,
        top_k=4,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.BYTE_BOS_ID,
        eos_token_id=tokenizer.BYTE_EOS_ID,
    ),
}

# Scales of the synthetic initialisation (see `_synthetic_values`). They are chosen so greedy
# decoding is robust to ~1e-6 numeric noise (different batch composition, process, placement):
# the final logits have a standard deviation of about LM_HEAD_GAIN, so the top-1/top-2 gap is
# typically ~1 while float32 noise is ~1e-6; and so the text is varied, not one repeated token.
EMBED_STD = 1.0
LM_HEAD_GAIN = 6.0
# Ids outside printable ASCII get a smaller lm_head row, so decoded text is readable gibberish.
NON_PRINTABLE_GAIN = 0.3
ROUTER_GAIN = 2.0
# Sharper attention and a stronger attention output: the next token depends on the history,
# not only on the current token, so greedy text does not settle into one repeated token.
QK_GAIN = 2.5
ATTN_OUT_GAIN = 3.0
# Skewed expert popularity (a shared direction in every embedding that the router reads with a
# per-expert weight), so expert load is uneven as in trained models and EPLB has work to do.
POPULARITY_STD = 0.5
COMMON_DIRECTION_WEIGHT = 0.3


def _generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen


def _randn(seed: int, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed, key), dtype=torch.float32)


def _common_direction(seed: int, hidden: int) -> torch.Tensor:
    """A unit vector shared by all embeddings (drives the skewed expert popularity)."""
    u = _randn(seed, "synthetic:common-direction", (hidden,))
    unit: torch.Tensor = u / u.norm()
    return unit


def _synthetic_values(
    cfg: config_mod.ModelConfig, seed: int, name: str, shape: tuple[int, ...]
) -> torch.Tensor:
    """The value of tensor `name`, from (seed, name) and the config alone."""
    hidden = cfg.hidden_size
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return 1.0 + 0.1 * _randn(seed, name, shape)
    base = _randn(seed, name, shape)
    if name == "model.embed_tokens.weight":
        common = _common_direction(seed, hidden) * (COMMON_DIRECTION_WEIGHT * math.sqrt(hidden))
        return base * EMBED_STD + common
    if name == "lm_head.weight":
        gain = torch.full((shape[0], 1), NON_PRINTABLE_GAIN)
        gain[32:127] = 1.0
        return base * gain * (LM_HEAD_GAIN / math.sqrt(hidden))
    if name.endswith("block_sparse_moe.gate.weight"):
        popularity = _randn(seed, name + ":popularity", (shape[0], 1)) * POPULARITY_STD
        common = _common_direction(seed, hidden)[None, :]
        return base * (ROUTER_GAIN / math.sqrt(hidden)) + popularity * common
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return base * (QK_GAIN / math.sqrt(shape[1]))
    if name.endswith("o_proj.weight"):
        return base * (ATTN_OUT_GAIN / math.sqrt(shape[1]))
    # Values and experts: unit gain, 1/sqrt(fan_in).
    return base / math.sqrt(shape[1])


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(config_mod.ModelConfig)}


def _parse_override(source: str, key: str, raw: str) -> Any:
    kind = str(_FIELD_TYPES[key])
    try:
        if raw.lower() in ("none", "null") and "None" in kind:
            return None
        if kind.startswith("bool"):
            if raw.lower() not in ("1", "0", "true", "false"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true")
        if kind.startswith("float"):
            return float(raw)
        return int(raw)
    except ValueError:
        raise errors.SourceError(f"{source}: option {key}={raw!r} is not a valid {kind}") from None


class SyntheticSource:
    """A seeded random Mixtral; see the module docstring."""

    def __init__(self, name: str, *, seed: int = 0, config: config_mod.ModelConfig) -> None:
        self.name = name
        self.seed = seed
        self._config = config

    @classmethod
    def parse(cls, source: str) -> SyntheticSource:
        """Parse `synthetic://NAME?seed=S&FIELD=VALUE`."""
        parts = urllib.parse.urlsplit(source)
        name = parts.netloc or parts.path.lstrip("/")
        if name not in SYNTHETIC_PRESETS:
            raise errors.SourceError(
                f"{source}: unknown synthetic model {name!r}; "
                f"choose one of {sorted(SYNTHETIC_PRESETS)}"
            )
        seed = 0
        overrides: dict[str, Any] = {}
        for key, raw in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
            if key == "seed":
                if not re.fullmatch(r"\d+", raw):
                    raise errors.SourceError(
                        f"{source}: seed must be a non-negative integer, got {raw!r}"
                    )
                seed = int(raw)
            elif key in _FIELD_TYPES:
                overrides[key] = _parse_override(source, key, raw)
            else:
                raise errors.SourceError(
                    f"{source}: unknown option {key!r}; allowed: seed, {', '.join(_FIELD_TYPES)}"
                )
        try:
            cfg = dataclasses.replace(SYNTHETIC_PRESETS[name], **overrides)
        except ValueError as exc:
            raise errors.SourceError(f"{source}: {exc}") from exc
        return cls(name, seed=seed, config=cfg)

    @property
    def config(self) -> config_mod.ModelConfig:
        return self._config

    @property
    def description(self) -> str:
        return f"{SYNTHETIC_SCHEME}{self.name}?seed={self.seed}"

    def tensor(self, name: str) -> torch.Tensor:
        shape = names.tensor_shape(self._config, name)
        return _synthetic_values(self._config, self.seed, name, shape)

    def tensor_names(self) -> list[str]:
        return names.all_tensor_names(self._config)

    def tokenizer(self) -> tokenizer.Tokenizer:
        return tokenizer.ByteTokenizer()


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints

_SafetensorsErrors = (safetensors.SafetensorError, OSError)


@dataclasses.dataclass(frozen=True)
class _Location:
    """Where a classic-named tensor lives: stored name, file, and the slice of a fused tensor."""

    file: pathlib.Path
    stored: str
    index: tuple[int | slice, ...] | None = None
    fused_shape: tuple[int, ...] | None = None


class CheckpointSource:
    """A local Hugging Face Mixtral checkpoint, read lazily with `safetensors.safe_open`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        if not self.path.is_dir():
            raise errors.CheckpointError(
                self.path, "no such checkpoint directory (or use synthetic://NAME)"
            )
        config_path = self.path / CONFIG_FILE
        if not config_path.is_file():
            raise errors.CheckpointError(
                config_path, "missing: a Hugging Face checkpoint needs config.json"
            )
        try:
            hf = json.loads(config_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise errors.CheckpointError(config_path, f"unreadable JSON: {exc}") from exc
        if not isinstance(hf, dict):
            raise errors.CheckpointError(config_path, "must hold a JSON object")
        self._config = config_mod.from_hf_config(hf, config_path)
        self._where = self._read_weight_map()
        self._weights_desc = (
            str(self.path / INDEX_FILE)
            if (self.path / INDEX_FILE).exists()
            else ", ".join(sorted(str(p) for p in set(self._where.values())))
        )
        for name in names.all_tensor_names(self._config):
            self._locate(name)  # fail now, naming the first missing tensor

    def _read_weight_map(self) -> dict[str, pathlib.Path]:
        """Stored tensor name -> the shard file holding it."""
        index_path = self.path / INDEX_FILE
        if index_path.exists():
            try:
                index = json.loads(index_path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise errors.CheckpointError(index_path, f"unreadable JSON: {exc}") from exc
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise errors.CheckpointError(
                    index_path, "no 'weight_map' object of tensor name -> shard file"
                )
            where: dict[str, pathlib.Path] = {}
            for shard in sorted(set(weight_map.values())):
                shard_path = self.path / shard
                if pathlib.PurePath(shard).is_absolute() or ".." in pathlib.PurePath(shard).parts:
                    raise errors.CheckpointError(
                        index_path, f"shard {shard!r} is not a file name inside the checkpoint"
                    )
                if not shard_path.is_file():
                    raise errors.CheckpointError(
                        index_path, f"points to shard {shard!r}, which does not exist"
                    )
            for key, shard in weight_map.items():
                where[key] = self.path / shard
            return where
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise errors.CheckpointError(self.path, "no *.safetensors weights file")
        where = {}
        for file in files:
            try:
                with safetensors.safe_open(str(file), framework="pt") as handle:
                    keys = list(handle.keys())
            except _SafetensorsErrors as exc:
                raise errors.CheckpointError(
                    file, f"not a readable safetensors file: {exc}"
                ) from exc
            for key in keys:
                if key in where:
                    raise errors.CheckpointError(
                        file, f"tensor {key!r} is also in {where[key]}; add {INDEX_FILE}"
                    )
                where[key] = file
        return where

    def _locate(self, name: str) -> _Location:
        """Find a classic-named tensor in the stored layout; CheckpointError when absent."""
        file = self._where.get(name)
        if file is not None:
            return _Location(file=file, stored=name)
        cfg = self._config
        expert = names.parse_expert_tensor_name(name)
        if expert is not None:
            layer, index, part = expert
            inter = cfg.intermediate_size
            prefix = f"model.layers.{layer}.mlp.experts."
            if part == "w2":
                stored = prefix + "down_proj"
                fused: tuple[int, ...] = (cfg.num_experts, cfg.hidden_size, inter)
                where: tuple[int | slice, ...] = (index,)
            else:
                stored = prefix + "gate_up_proj"
                fused = (cfg.num_experts, 2 * inter, cfg.hidden_size)
                rows = slice(0, inter) if part == "w1" else slice(inter, 2 * inter)
                where = (index, rows)
            file = self._where.get(stored)
            if file is not None:
                return _Location(file=file, stored=stored, index=where, fused_shape=fused)
        elif ".block_sparse_moe.gate." in name:
            stored = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
            file = self._where.get(stored)
            if file is not None:
                return _Location(file=file, stored=stored)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return self._locate("model.embed_tokens.weight")
        raise errors.CheckpointError(self._weights_desc, f"missing tensor {name!r}")

    @property
    def config(self) -> config_mod.ModelConfig:
        return self._config

    @property
    def description(self) -> str:
        return str(self.path)

    def tensor(self, name: str) -> torch.Tensor:
        expected = names.tensor_shape(self._config, name)
        loc = self._locate(name)
        try:
            with safetensors.safe_open(str(loc.file), framework="pt") as handle:
                if loc.stored not in handle.keys():
                    raise errors.CheckpointError(
                        loc.file, f"tensor {loc.stored!r} (listed in {INDEX_FILE}) is not in it"
                    )
                value: torch.Tensor
                if loc.index is None:
                    value = handle.get_tensor(loc.stored)
                else:
                    view = handle.get_slice(loc.stored)
                    shape = tuple(view.get_shape())
                    if shape != loc.fused_shape:
                        raise errors.CheckpointError(
                            loc.file,
                            f"tensor {loc.stored!r} has shape {list(shape)}, but config.json "
                            f"implies {list(loc.fused_shape or ())}",
                        )
                    value = view[loc.index]
        except _SafetensorsErrors as exc:
            raise errors.CheckpointError(
                loc.file, f"cannot read tensor {loc.stored!r}: {exc}"
            ) from exc
        if tuple(value.shape) != expected:
            raise errors.CheckpointError(
                loc.file,
                f"tensor {name!r} has shape {list(value.shape)}, but config.json implies "
                f"{list(expected)}",
            )
        return value

    def tensor_names(self) -> list[str]:
        return names.all_tensor_names(self._config)

    def tokenizer(self) -> tokenizer.Tokenizer:
        path = self.path / TOKENIZER_FILE
        if path.is_file():
            return tokenizer.HFTokenizer(
                path,
                bos_token_id=self._config.bos_token_id,
                eos_token_id=self._config.eos_token_id,
            )
        if self._config.vocab_size < tokenizer.BYTE_VOCAB_SIZE:
            # Too small for the byte-level fallback: serve token ids only (vLLM's
            # --skip-tokenizer-init), rather than refuse to start.
            return tokenizer.NoTokenizer(
                vocab_size=self._config.vocab_size,
                bos_token_id=self._config.bos_token_id,
                eos_token_id=self._config.eos_token_id,
                reason=f"{path} is missing and vocab_size {self._config.vocab_size} is below "
                f"the {tokenizer.BYTE_VOCAB_SIZE} ids of the byte-level fallback",
            )
        return tokenizer.ByteTokenizer()


def open_source(source: str) -> ModelSource:
    """Open `synthetic://NAME?seed=S` or a local Hugging Face Mixtral checkpoint directory."""
    if source.startswith(SYNTHETIC_SCHEME):
        return SyntheticSource.parse(source)
    if source.startswith("file://"):
        source = source[len("file://") :]
    elif re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", source):
        raise errors.SourceError(
            f"{source}: unsupported scheme; use synthetic://NAME?seed=S or a local directory"
        )
    return CheckpointSource(source)
