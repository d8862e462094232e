"""Megatron-style sharding of a rank's non-expert weights over a tensor-parallel (TP) group of
T processes: which slice of each tensor TP rank r holds (`Shard.slice_of`), and the head
counts and MLP sizes its forward pass runs with (`Shard.local`, a `ModelConfig`). Pure: data
in, data out.

- Attention, column-parallel by heads: q (MLA: q or q_b; kv_b per head) holds the rank's
  query heads `[r * H/T, (r+1) * H/T)`; k and v the key/value heads those query heads read.
  KV heads are split where T divides them and replicated where they divide T (T > KV: each
  rank holds the one its query heads share). o_proj is row-parallel (its input columns of
  those heads); the partial outputs are summed by an all-reduce, then `o_bias` is added once.
  gpt-oss's sinks follow the query heads; so do OLMoE's q/k norms over the whole projection
  (`qk_norm == "full"`: split with their heads, the sums of squares all-reduced:
  `tensor_parallel.TensorParallel.rms_norm`). MLA's down projections (q_a, kv_a) and their norms
  are replicated, and so is its cached latent (one row per position shared by every head).
- Dense MLPs and shared experts: gate/up column-parallel by the intermediate dimension, down
  row-parallel, an all-reduce, then the down bias once.
- lm_head: rows of the vocabulary `[r * C, min(V, (r+1) * C))`, C = ceil(V / T); the logits
  are all-gathered (padded to C per rank) and trimmed to V. Embeddings, norms, routers and
  the shared-expert gate are replicated (held whole).
- Routed experts are not part of a shard: TP rank 0 (the DP rank's leader) runs them, the
  other TP ranks add zeros to the MoE block's all-reduce (`docs/TENSOR-PARALLEL.md`).

Not sharded (refused by `plan`, naming the field): a head count or MLP size T does not
divide, KV heads that neither divide nor are divided by T.
"""

from __future__ import annotations

import dataclasses

from moe_runtime.model import config as config_mod
from moe_runtime.model import names

#: Roles sharded by query heads along dim 0 (their rows) / dim 1 (their input columns).
_BY_HEAD_ROWS = frozenset({"q", "q_bias", "q_b", "kv_b", "sinks"})
_BY_KV_HEAD_ROWS = frozenset({"k", "k_bias", "v", "v_bias"})
#: q/k norms over the whole projection (`qk_norm == "full"`) follow their heads.
_FULL_NORMS = frozenset({"q_norm", "k_norm"})
_BY_HEAD_COLUMNS = frozenset({"o"})
#: Roles sharded by the MLP's intermediate dimension, by the MLP they belong to.
_MLP_ROWS = ("gate", "up", "gate_bias", "up_bias")
_MLP_COLUMNS = ("down",)
#: Biases of a row-parallel projection: held whole, added once after the all-reduce.
REDUCED_BIASES = frozenset({"o_bias", "mlp_down_bias", "shared_down_bias"})


@dataclasses.dataclass(frozen=True)
class Slice:
    """Elements [start, stop) of dimension `dim` of a tensor."""

    dim: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Shard:
    """What TP rank `rank` of `size` holds of `config`'s non-expert weights.

    local: `config` with this rank's head counts (`num_heads`, `num_kv_heads`) and MLP sizes
    (`intermediate_size` of dense layers, `shared_intermediate_size`); the expert size is kept
    (`moe_intermediate_size` set explicitly). Attention, the KV cache and tensor shapes of the
    shard are computed from it; vocabulary, layers and routing stay the model's.
    heads / kv_heads: the [start, stop) query and key/value heads of this rank.
    vocab: the [start, stop) rows of lm_head; vocab_chunk: the rows every rank's logits are
    padded to before they are gathered (ceil(V / T)).
    """

    config: config_mod.ModelConfig
    rank: int
    size: int
    local: config_mod.ModelConfig
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    vocab: tuple[int, int]
    vocab_chunk: int

    def slice_of(self, name: str) -> Slice | None:
        """The slice of non-expert tensor `name` this rank holds; None: it holds it whole."""
        entry = names.entry(self.config, name)
        if entry.is_expert:
            raise ValueError(f"{name!r} is a routed expert's tensor: not part of a TP shard")
        if self.size == 1:
            return None
        role, cfg = entry.role, self.config
        if name == names.LM_HEAD:
            return Slice(0, *self.vocab)
        h0, h1 = self.heads
        if cfg.qk_norm == "full" and role in _FULL_NORMS:
            k0, k1 = self.heads if role == "q_norm" else self.kv_heads
            return Slice(0, k0 * cfg.head_dim, k1 * cfg.head_dim)
        if role in _BY_HEAD_ROWS or role in _BY_HEAD_COLUMNS:
            unit = _head_unit(cfg, role)
            return Slice(1 if role in _BY_HEAD_COLUMNS else 0, h0 * unit, h1 * unit)
        if role in _BY_KV_HEAD_ROWS:
            k0, k1 = self.kv_heads
            return Slice(0, k0 * cfg.head_dim, k1 * cfg.head_dim)
        for mlp, local in (
            ("mlp", self.local.intermediate_size),
            ("shared", self.local.shared_intermediate_size),
        ):
            if role in {f"{mlp}_{part}" for part in _MLP_ROWS}:
                return Slice(0, self.rank * local, (self.rank + 1) * local)
            if role in {f"{mlp}_{part}" for part in _MLP_COLUMNS}:
                return Slice(1, self.rank * local, (self.rank + 1) * local)
        return None

    def shape(self, name: str) -> names.Shape:
        """The shape of this rank's part of `name`."""
        shape = list(names.tensor_shape(self.config, name))
        part = self.slice_of(name)
        if part is not None:
            shape[part.dim] = part.length
        return tuple(shape)

    def tensor_names(self) -> list[str]:
        """The non-expert tensors a shard holds part or all of (every one, in the model's
        order)."""
        return names.non_expert_tensor_names(self.config)


def _head_unit(cfg: config_mod.ModelConfig, role: str) -> int:
    """Elements per query head of a head-sharded role's sharded dimension."""
    if role == "sinks":
        return 1
    if cfg.mla is None:
        return cfg.head_dim
    if role in ("q", "q_b"):
        return cfg.mla.qk_head_dim
    if role == "kv_b":
        return cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim
    return cfg.mla.v_head_dim  # o


def _split(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(
            f"tensor parallel size {size} must divide {what} ({total}); "
            f"choose a size that divides it"
        )
    return total // size


def plan(config: config_mod.ModelConfig, *, rank: int, size: int) -> Shard:
    """The shard of TP rank `rank` of `size`; ValueError naming the field that `size` cannot
    shard (see the module docstring)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} of size {size}: need 0 <= rank < size")
    cfg = config
    heads = _split(cfg.num_heads, size, "num_heads (num_attention_heads)")
    h0 = rank * heads
    if cfg.mla is not None:
        kv_local, k0 = heads, h0
    elif cfg.num_kv_heads % size == 0:
        kv_local = cfg.num_kv_heads // size
        k0 = rank * kv_local
    elif size % cfg.num_kv_heads == 0:
        kv_local, k0 = 1, rank * cfg.num_kv_heads // size
    else:
        raise ValueError(
            f"tensor parallel size {size} and num_kv_heads (num_key_value_heads) "
            f"{cfg.num_kv_heads}: one must divide the other"
        )
    has_dense = cfg.num_moe_layers < cfg.num_layers
    intermediate = (
        _split(cfg.intermediate_size, size, "intermediate_size") if has_dense and size > 1 else 0
    )
    shared = (
        _split(cfg.shared_intermediate_size, size, "shared_intermediate_size (shared experts)")
        if cfg.shared_intermediate_size
        else 0
    )
    local = dataclasses.replace(
        cfg,
        num_heads=heads,
        num_kv_heads=kv_local,
        intermediate_size=intermediate or cfg.intermediate_size,
        moe_intermediate_size=cfg.expert_intermediate_size,
        shared_intermediate_size=shared,
    )
    chunk = -(-cfg.vocab_size // size)
    vocab = (min(cfg.vocab_size, rank * chunk), min(cfg.vocab_size, (rank + 1) * chunk))
    return Shard(
        config=cfg,
        rank=rank,
        size=size,
        local=local if size > 1 else cfg,
        heads=(h0, h0 + heads),
        kv_heads=(k0, k0 + kv_local),
        vocab=vocab,
        vocab_chunk=chunk,
    )
