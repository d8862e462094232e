"""`synthetic://NAME?seed=S[&FIELD=VALUE...]`: randomly initialised models whose every tensor is
a function of (seed, tensor name) alone, so any rank can build any tensor without the others.

Presets: `tiny` and `small` (Mixtral shape); `deepseek-tiny` and `deepseek-small` (the
DeepSeek-V3 shape: MLA with a q low-rank, a dense first layer, shared experts, sigmoid
routing with groups and correction biases). FIELD overrides an integer, float or boolean
`ModelConfig` field (e.g. `num_experts=16`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import urllib.parse
from typing import Any

import torch

from moe_runtime.model import chat_template as chat_mod
from moe_runtime.model import config as config_mod
from moe_runtime.model import errors, names, tokenizer

SCHEME = "synthetic://"

_TINY = config_mod.ModelConfig(
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
)
_SMALL = dataclasses.replace(
    _TINY,
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    num_experts=32,
    top_k=4,
    max_position_embeddings=4096,
)
_DEEPSEEK_TINY = dataclasses.replace(
    _TINY,
    family="deepseek_v3",
    num_kv_heads=4,
    head_dim=8,
    intermediate_size=192,
    moe_intermediate_size=96,
    moe_layers=(1, 2, 3),
    shared_intermediate_size=96,
    router="sigmoid_group",
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-6,
    mla=config_mod.MLASpec(
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
    ),
    rope_layout="interleave",
)
_DEEPSEEK_SMALL = dataclasses.replace(
    _DEEPSEEK_TINY,
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=1024,
    shared_intermediate_size=1024,
    num_layers=8,
    moe_layers=tuple(range(1, 8)),
    num_heads=8,
    num_kv_heads=8,
    head_dim=32,
    num_experts=32,
    top_k=4,
    n_group=8,
    topk_group=4,
    max_position_embeddings=4096,
    mla=config_mod.MLASpec(
        q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64
    ),
)

PRESETS: dict[str, config_mod.ModelConfig] = {
    # Seconds on one CPU core: unit tests, the demo, integration tests.
    "tiny": _TINY,
    # Benchmarks: enough experts and compute for EPLB and dispatch costs to show.
    "small": _SMALL,
    # The DeepSeek-V3 shape at the sizes of the two above.
    "deepseek-tiny": _DEEPSEEK_TINY,
    "deepseek-small": _DEEPSEEK_SMALL,
}

# Scales of the synthetic initialisation (see `_values`). They are chosen so greedy decoding
# is robust to ~1e-6 numeric noise (different batch composition, process, placement): the
# final logits have a standard deviation of about LM_HEAD_GAIN, so the top-1/top-2 gap is
# typically ~1 while float32 noise is ~1e-6; and so the text is varied, not one repeated token.
EMBED_STD = 1.0
LM_HEAD_GAIN = 6.0
# Ids outside printable ASCII get a smaller lm_head row, so decoded text is readable gibberish.
NON_PRINTABLE_GAIN = 0.3
ROUTER_GAIN = 2.0
# Sharper attention and a stronger attention output: the next token depends on the history,
# not only on the current token, so greedy text does not settle into one repeated token.
QK_GAIN = 2.5
#: MLA's queries and keys (through q_b and kv_b) need sharper ones for varied text.
MLA_QK_GAIN = 4.0
ATTN_OUT_GAIN = 3.0
# Skewed expert popularity (a shared direction in every embedding that the router reads with a
# per-expert weight), so expert load is uneven as in trained models and EPLB has work to do.
POPULARITY_STD = 0.5
COMMON_DIRECTION_WEIGHT = 0.3
# DeepSeek-V3's correction biases (they move the choice of experts, not their weights).
CORRECTION_STD = 0.05
#: The chat template of synthetic models: roles marked in plain text (their byte-level
#: tokenizer has no special tokens), so the chat route can be tried on any of them.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_NORMS = {"input_norm", "post_norm", "norm", "q_norm", "k_norm", "q_a_norm", "kv_a_norm"}
_QK = {"q", "k", "q_b", "kv_b"}


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


def _values(cfg: config_mod.ModelConfig, seed: int, name: str) -> torch.Tensor:
    """The value of tensor `name`, from (seed, name) and the config alone."""
    entry = names.entry(cfg, name)
    role, shape = entry.role, entry.shape
    hidden = cfg.hidden_size
    if role in _NORMS:
        return 1.0 + 0.1 * _randn(seed, name, shape)
    base = _randn(seed, name, shape)
    if role == "embed":
        common = _common_direction(seed, hidden) * (COMMON_DIRECTION_WEIGHT * math.sqrt(hidden))
        return base * EMBED_STD + common
    if role == "lm_head":
        gain = torch.full((shape[0], 1), NON_PRINTABLE_GAIN)
        gain[32:127] = 1.0
        return base * gain * (LM_HEAD_GAIN / math.sqrt(hidden))
    if role == "router":
        popularity = _randn(seed, name + ":popularity", (shape[0], 1)) * POPULARITY_STD
        common = _common_direction(seed, hidden)[None, :]
        return base * (ROUTER_GAIN / math.sqrt(hidden)) + popularity * common
    if role == "correction_bias":
        return base * CORRECTION_STD
    if len(shape) == 1:  # biases, sinks
        return base * 0.1
    if role in _QK:
        qk_gain = QK_GAIN if cfg.mla is None else MLA_QK_GAIN
        return base * (qk_gain / math.sqrt(shape[1]))
    if role == "o":
        return base * (ATTN_OUT_GAIN / math.sqrt(shape[1]))
    # Values, MLPs and experts: unit gain, 1/sqrt(fan_in).
    return base / math.sqrt(shape[1])


def _override_kind(field: dataclasses.Field[Any]) -> str | None:
    kind = str(field.type)
    for base in ("bool", "int", "float"):
        if kind in (base, f"{base} | None"):
            return kind
    return None


_FIELD_KINDS = {
    f.name: kind
    for f in dataclasses.fields(config_mod.ModelConfig)
    if (kind := _override_kind(f)) is not None
}


def _parse_override(source: str, key: str, raw: str) -> Any:
    kind = _FIELD_KINDS[key]
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
    """A seeded random model; see the module docstring."""

    def __init__(self, name: str, *, seed: int = 0, config: config_mod.ModelConfig) -> None:
        self.name = name
        self.seed = seed
        self._config = config

    @classmethod
    def parse(cls, source: str) -> SyntheticSource:
        """Parse `synthetic://NAME?seed=S&FIELD=VALUE`."""
        parts = urllib.parse.urlsplit(source)
        name = parts.netloc or parts.path.lstrip("/")
        if name not in PRESETS:
            raise errors.SourceError(
                f"{source}: unknown synthetic model {name!r}; choose one of {sorted(PRESETS)}"
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
            elif key in _FIELD_KINDS:
                overrides[key] = _parse_override(source, key, raw)
            else:
                raise errors.SourceError(
                    f"{source}: unknown option {key!r}; allowed: seed, {', '.join(_FIELD_KINDS)}"
                )
        preset = PRESETS[name]
        if "num_layers" in overrides and preset.moe_layers is not None:
            # A dense first layer stays dense; every later layer is a MoE layer.
            first = preset.moe_layers[0]
            overrides["moe_layers"] = tuple(range(first, max(first + 1, overrides["num_layers"])))
        try:
            cfg = dataclasses.replace(preset, **overrides)
        except ValueError as exc:
            raise errors.SourceError(f"{source}: {exc}") from exc
        return cls(name, seed=seed, config=cfg)

    @property
    def config(self) -> config_mod.ModelConfig:
        return self._config

    @property
    def description(self) -> str:
        return f"{SCHEME}{self.name}?seed={self.seed}"

    def tensor(self, name: str) -> torch.Tensor:
        return _values(self._config, self.seed, name)

    def tensor_slice(self, name: str, *, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.tensor(name).narrow(dim, start, stop - start).clone()

    def tensor_names(self) -> list[str]:
        return names.all_tensor_names(self._config)

    def tokenizer(self) -> tokenizer.Tokenizer:
        return tokenizer.ByteTokenizer()

    def chat_template(self) -> chat_mod.ChatTemplate | None:
        return chat_mod.ChatTemplate(CHAT_TEMPLATE)
