"""The shape of a MoE decoder (`ModelConfig`): one frozen value every family fills in.

Fields past `sliding_window` say which shared building block a layer uses (attention with
biases, q/k norms, sinks, windows or MLA; the router; dense, shared and routed MLPs); each
family module (`mixtral`, `qwen_moe`, `olmoe`, `deepseek`, `gpt_oss`) reads a Hugging Face
`config.json` into it (`families.from_hf_config`). Layers are *decoder layers* (0..num_layers)
unless named MoE layers: placements, load counts and expert keys index the MoE layers only
(`num_moe_layers`, `moe_layer_ids`), in decoder order.
"""

from __future__ import annotations

import dataclasses
import functools

#: Routers (`routing.route`): softmax over all experts then top-k (Mixtral, Qwen, OLMoE;
#: renormalised when `norm_topk_prob`); DeepSeek-V2's softmax with optional group-limited
#: greedy selection; DeepSeek-V3's sigmoid + correction bias + group-limited selection;
#: gpt-oss's top-k of the logits (with bias) then softmax over the k.
ROUTERS = ("softmax", "softmax_group", "sigmoid_group", "topk_softmax")
#: Expert activations (`experts.Activation`): SwiGLU, or gpt-oss's clamped SwiGLU.
ACTIVATIONS = ("silu", "gpt_oss")
#: Rotary layouts: halves (rotate_half), DeepSeek-V3 interleaved pairs (output de-interleaved),
#: DeepSeek-V2 complex pairs (output interleaved).
ROPE_LAYOUTS = ("half", "interleave", "pairs")
#: Per-head RMSNorm of q and k (Qwen3-MoE) or over the whole projection (OLMoE).
QK_NORMS = ("head", "full")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling (Hugging Face `rope_parameters` other than "default").

    kind "linear": frequencies divided by `factor`; "yarn": YaRN as transformers'
    `_compute_yarn_parameters` (mscale / mscale_all_dim / attention_factor, beta_fast/slow,
    truncate, original_max_position_embeddings).
    """

    kind: str
    factor: float
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "yarn"):
            raise ValueError(f"RopeScaling.kind must be 'linear' or 'yarn', got {self.kind!r}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor!r}")


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): q through an optional low-rank
    (`q_lora_rank`), keys and values from a latent of `kv_lora_rank` plus one shared rotary
    key of `qk_rope_head_dim`; the KV cache holds the latent."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MLASpec.{name} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"MLASpec.q_lora_rank must be positive or None: {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLASpec.qk_rope_head_dim must be even: {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a MoE decoder; every field is checked on construction.

    head_dim: size of one attention head (q/k/v projections are [heads * head_dim, hidden]);
    with MLA the rotary part of a head (`mla.qk_rope_head_dim`).
    num_kv_heads: key/value heads (grouped-query attention); divides num_heads.
    top_k: experts per token; intermediate_size: hidden size of a dense MLP, and of an expert
    unless `moe_intermediate_size` is set.
    sliding_window: attend to at most this many latest positions (None: the whole sequence),
    in every layer unless `layer_windows` gives each layer's.
    moe_layers: the decoder layers with routed experts (None: all).
    shared_intermediate_size: hidden size of the shared expert(s) of a MoE layer (0: none);
    shared_expert_gate: Qwen2-MoE's sigmoid gate on the shared expert.
    stop_token_ids: every end-of-sequence id (config.json and generation_config.json);
    eos_token_id is the first.
    dtype: the checkpoint's dtype name ("bfloat16", ...), None when it does not say.
    skip_layers: decoder layers stored after the served ones that are not run (DeepSeek-V3's
    multi-token-prediction layers).
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
    family: str = "mixtral"
    moe_intermediate_size: int | None = None
    moe_layers: tuple[int, ...] | None = None
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False
    attention_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None
    clip_qkv: float | None = None
    attention_sinks: bool = False
    layer_windows: tuple[int | None, ...] | None = None
    mla: MLASpec | None = None
    rope_scaling: RopeScaling | None = None
    rope_layout: str = "half"
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mlp_bias: bool = False
    norm_scale_first: bool = False
    stop_token_ids: tuple[int, ...] = ()
    dtype: str | None = None
    skip_layers: int = 0

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
            "n_group",
            "topk_group",
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
        for tok in (self.bos_token_id, self.eos_token_id, *self.stop_token_ids):
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"ModelConfig: token id {tok} must be in [0, vocab_size={self.vocab_size})"
                )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"ModelConfig.sliding_window must be a positive integer or None, "
                f"got {self.sliding_window!r}"
            )
        self._check_choices()
        self._check_layers()

    def _check_choices(self) -> None:
        for name, allowed in (
            ("router", ROUTERS),
            ("expert_activation", ACTIVATIONS),
            ("rope_layout", ROPE_LAYOUTS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ValueError(f"ModelConfig.qk_norm must be one of {QK_NORMS} or None")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(
                f"ModelConfig: n_group ({self.n_group}) must divide num_experts "
                f"({self.num_experts}) and be at least topk_group ({self.topk_group})"
            )
        if self.mla is not None and self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"ModelConfig: MLA needs num_kv_heads == num_heads, got {self.num_kv_heads} "
                f"and {self.num_heads}"
            )
        if self.mla is not None and self.head_dim != self.mla.qk_rope_head_dim:
            raise ValueError("ModelConfig.head_dim must be mla.qk_rope_head_dim with MLA")
        if self.shared_intermediate_size < 0 or (
            self.moe_intermediate_size is not None and self.moe_intermediate_size <= 0
        ):
            raise ValueError("ModelConfig: expert sizes must be positive")

    def _check_layers(self) -> None:
        if self.moe_layers is not None:
            if not self.moe_layers or list(self.moe_layers) != sorted(set(self.moe_layers)):
                raise ValueError(
                    f"ModelConfig.moe_layers must be increasing and not empty: {self.moe_layers}"
                )
            if self.moe_layers[0] < 0 or self.moe_layers[-1] >= self.num_layers:
                raise ValueError(
                    f"ModelConfig.moe_layers {self.moe_layers} must be in [0, {self.num_layers})"
                )
        if self.layer_windows is not None:
            if len(self.layer_windows) != self.num_layers:
                raise ValueError(
                    f"ModelConfig.layer_windows has {len(self.layer_windows)} entries for "
                    f"{self.num_layers} layers"
                )
            if any(w is not None and w <= 0 for w in self.layer_windows):
                raise ValueError(f"ModelConfig.layer_windows: {self.layer_windows}")

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def expert_intermediate_size(self) -> int:
        """Hidden size of one routed expert."""
        return self.moe_intermediate_size or self.intermediate_size

    @functools.cached_property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The decoder layers with routed experts, in order (MoE layer m is `moe_layer_ids[m]`)."""
        return self.moe_layers if self.moe_layers is not None else tuple(range(self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        """Layers of a placement and of the expert load counts `[L, E]`."""
        return len(self.moe_layer_ids)

    def moe_index(self, layer: int) -> int | None:
        """The MoE layer index of decoder layer `layer`, None for a dense layer."""
        return self._moe_index.get(layer)

    @functools.cached_property
    def _moe_index(self) -> dict[int, int]:
        return {layer: m for m, layer in enumerate(self.moe_layer_ids)}

    def window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: full attention)."""
        if self.layer_windows is not None:
            return self.layer_windows[layer]
        return self.sliding_window

    @property
    def all_stop_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence (the stop ids, else the eos id)."""
        if self.stop_token_ids:
            return self.stop_token_ids
        return () if self.eos_token_id is None else (self.eos_token_id,)
