"""The Mixtral decoder: non-expert weights in `MixtralModel`, experts behind `ExpertBackend`.

One `forward` runs a batch of sequences of different lengths (prefill of a prompt, one decode
token, or re-prefill of prompt + generated tokens after a migration) against a `KVCache`:
linear layers run over all tokens of the batch at once, attention runs per sequence (causal,
grouped-query, rotary embeddings exactly as Hugging Face Mixtral). The router (softmax over all
experts in float32, top-k, renormalised) is here; the experts themselves run in an
`ExpertBackend` (`LocalExperts` here; the expert-parallel backend in `moe_runtime.comm.ep`),
which combines expert outputs in the fixed order of `combine_expert_outputs` so every backend
gives the same numbers.

Shapes: T tokens in the batch, H hidden size, I expert intermediate size, k experts per token,
E experts, D head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from moe_runtime.model import config as config_mod
from moe_runtime.model import names
from moe_runtime.model import source as source_mod

# The naming helpers, also reachable from this module (see docs/INTERNALS.md §model).
expert_tensor_names = names.expert_tensor_names
is_expert_tensor = names.is_expert_tensor
non_expert_tensor_names = names.non_expert_tensor_names


# ---------------------------------------------------------------------------------------------
# Batch and KV cache


@dataclasses.dataclass
class ForwardBatch:
    """The new tokens of several sequences for one forward pass.

    seq_ids: one id per sequence (unique in the batch).
    token_ids: the new tokens of each sequence (whole prompt on prefill, one token on decode,
    prompt + generated tokens on a re-prefill); never empty.
    start_pos: position of each sequence's first new token = tokens of it already in the KV
    cache that are kept (a smaller value drops the cached tail and recomputes it).
    """

    seq_ids: list[str]
    token_ids: list[list[int]]
    start_pos: list[int]

    def __post_init__(self) -> None:
        if not len(self.seq_ids) == len(self.token_ids) == len(self.start_pos):
            raise ValueError(
                f"ForwardBatch: seq_ids ({len(self.seq_ids)}), token_ids "
                f"({len(self.token_ids)}) and start_pos ({len(self.start_pos)}) differ in length"
            )
        if len(set(self.seq_ids)) != len(self.seq_ids):
            raise ValueError(f"ForwardBatch.seq_ids has duplicates: {self.seq_ids}")
        for seq_id, tokens, start in zip(self.seq_ids, self.token_ids, self.start_pos, strict=True):
            if not tokens:
                raise ValueError(f"ForwardBatch.token_ids of sequence {seq_id!r} is empty")
            if start < 0:
                raise ValueError(f"ForwardBatch.start_pos of sequence {seq_id!r} is {start} < 0")

    @classmethod
    def empty(cls) -> ForwardBatch:
        """No sequences: an idle rank's step (it still joins the experts' collectives)."""
        return cls(seq_ids=[], token_ids=[], start_pos=[])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


class _SeqKV:
    """Keys and values of one sequence: data [layers, 2, kv_heads, capacity, D]."""

    __slots__ = ("data", "length")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.length = 0


class KVCache:
    """Per-sequence keys/values for every layer; grows as needed (capacity doubles)."""

    def __init__(
        self,
        config: config_mod.ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        initial_capacity: int = 64,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.initial_capacity = max(1, initial_capacity)
        self._seqs: dict[str, _SeqKV] = {}

    def num_tokens(self, seq_id: str) -> int:
        """Tokens of `seq_id` held (0 for an unknown sequence)."""
        entry = self._seqs.get(seq_id)
        return 0 if entry is None else entry.length

    def free(self, seq_id: str) -> None:
        """Drop a sequence's keys and values (no error if it holds none)."""
        self._seqs.pop(seq_id, None)

    def clear(self) -> None:
        self._seqs.clear()

    def seq_ids(self) -> list[str]:
        return list(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def memory_bytes(self) -> int:
        return sum(e.data.numel() * e.data.element_size() for e in self._seqs.values())

    def reserve(self, seq_id: str, start_pos: int, num_new: int) -> None:
        """Make room for tokens [start_pos, start_pos + num_new) of `seq_id`.

        start_pos may not exceed the tokens held (that context would be missing); a smaller one
        drops the cached tail. After this, `num_tokens(seq_id) == start_pos + num_new`: if the
        forward pass that follows fails, free the sequence.
        """
        held = self.num_tokens(seq_id)
        if start_pos > held:
            raise ValueError(
                f"sequence {seq_id!r}: start_pos {start_pos} but the KV cache holds only "
                f"{held} tokens of it"
            )
        need = start_pos + num_new
        entry = self._seqs.get(seq_id)
        if entry is None or entry.data.shape[3] < need:
            cap = self.initial_capacity if entry is None else entry.data.shape[3]
            while cap < need:
                cap *= 2
            cfg = self.config
            data = torch.empty(
                (cfg.num_layers, 2, cfg.num_kv_heads, cap, cfg.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            if entry is not None:
                data[:, :, :, :start_pos] = entry.data[:, :, :, :start_pos]
                entry.data = data
            else:
                entry = self._seqs[seq_id] = _SeqKV(data)
        entry.length = need

    def write(
        self, seq_id: str, layer: int, start_pos: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store keys/values [n, kv_heads, D] of positions [start_pos, start_pos + n)."""
        data = self._seqs[seq_id].data
        end = start_pos + keys.shape[0]
        data[layer, 0, :, start_pos:end] = keys.transpose(0, 1)
        data[layer, 1, :, start_pos:end] = values.transpose(0, 1)

    def read(self, seq_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads, num_tokens, D] of a layer (views, not copies)."""
        entry = self._seqs[seq_id]
        return entry.data[layer, 0, :, : entry.length], entry.data[layer, 1, :, : entry.length]


# ---------------------------------------------------------------------------------------------
# Experts


@dataclasses.dataclass
class ExpertWeights:
    """One expert (one physical slot): w1 (gate) [I, H], w2 (down) [H, I], w3 (up) [I, H]."""

    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor

    def __post_init__(self) -> None:
        inter, hidden = self.w1.shape
        if tuple(self.w3.shape) != (inter, hidden) or tuple(self.w2.shape) != (hidden, inter):
            raise ValueError(
                f"ExpertWeights: w1 {list(self.w1.shape)}, w2 {list(self.w2.shape)}, "
                f"w3 {list(self.w3.shape)} are not [I, H], [H, I], [I, H]"
            )

    def to(self, *, dtype: torch.dtype, device: str | torch.device) -> ExpertWeights:
        return ExpertWeights(
            w1=self.w1.to(device=device, dtype=dtype),
            w2=self.w2.to(device=device, dtype=dtype),
            w3=self.w3.to(device=device, dtype=dtype),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """{"w1": ..., "w2": ..., "w3": ...}"""
        return {"w1": self.w1, "w2": self.w2, "w3": self.w3}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w1, self.w2, self.w3))


def expert_forward(weights: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert: w2(silu(w1 x) * w3 x); x [N, H] -> [N, H]."""
    return F.linear(F.silu(F.linear(x, weights.w1)) * F.linear(x, weights.w3), weights.w2)


def apply_experts(
    weights_for: Callable[[int], ExpertWeights], hidden: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """Run each row of hidden [N, H] through expert expert_ids[N]; returns [N, H].

    Rows are grouped by expert (one batched matmul per expert present); `weights_for(id)`
    gives the weights of an id (logical or physical, as the caller's ids are).
    """
    out = torch.empty_like(hidden)
    if hidden.shape[0] == 0:
        return out
    for expert in torch.unique(expert_ids).tolist():
        rows = (expert_ids == expert).nonzero().squeeze(1)
        out[rows] = expert_forward(weights_for(int(expert)), hidden[rows]).to(out.dtype)
    return out


def combine_expert_outputs(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * expert_out[t, k], summed in float32 in the order k = 0, 1, ...

    expert_out [T, k, H], topk_weights [T, k] -> [T, H] in expert_out's dtype. Every backend
    combines through this function, so results do not depend on the backend.
    """
    weights = topk_weights.to(torch.float32)
    acc = weights[:, 0, None] * expert_out[:, 0].to(torch.float32)
    for j in range(1, expert_out.shape[1]):
        acc = acc + weights[:, j, None] * expert_out[:, j].to(torch.float32)
    return acc.to(expert_out.dtype)


class ExpertBackend(Protocol):
    """Runs the routed experts of one layer and combines them (see `combine_expert_outputs`).

    hidden [T, H] (the normalised hidden state), topk_ids [T, k] logical expert ids (int64),
    topk_weights [T, k] (float32, each row sums to 1) -> [T, H]. Called with T = 0 too.
    """

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor: ...


def load_expert(
    source: source_mod.ModelSource,
    layer: int,
    expert: int,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> ExpertWeights:
    """Read one logical expert from a source (its three tensors only)."""
    w1, w2, w3 = (
        source.tensor(name).to(device=device, dtype=dtype)
        for name in names.expert_tensor_names(layer, expert)
    )
    return ExpertWeights(w1=w1, w2=w2, w3=w3)


class LocalExperts:
    """An ExpertBackend over experts held in this process, keyed by (layer, logical id)."""

    def __init__(self, weights: Mapping[tuple[int, int], ExpertWeights]) -> None:
        self.weights = dict(weights)

    @classmethod
    def from_source(
        cls,
        source: source_mod.ModelSource,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        experts: Sequence[tuple[int, int]] | None = None,
    ) -> LocalExperts:
        """Load `experts` ((layer, logical) pairs; default: every expert of every layer)."""
        cfg = source.config
        wanted = (
            list(experts)
            if experts is not None
            else [(layer, e) for layer in range(cfg.num_layers) for e in range(cfg.num_experts)]
        )
        return cls(
            {
                (layer, e): load_expert(source, layer, e, dtype=dtype, device=device)
                for layer, e in wanted
            }
        )

    def _weights_for(self, layer: int) -> Callable[[int], ExpertWeights]:
        def lookup(expert: int) -> ExpertWeights:
            try:
                return self.weights[(layer, expert)]
            except KeyError:
                raise KeyError(
                    f"LocalExperts holds no weights for layer {layer}, expert {expert}"
                ) from None

        return lookup

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        tokens, k = topk_ids.shape
        # Row t*k + j of the flattened problem is token t's j-th expert.
        rows = hidden.repeat_interleave(k, dim=0)
        out = apply_experts(self._weights_for(layer), rows, topk_ids.reshape(-1))
        return combine_expert_outputs(out.view(tokens, k, hidden.shape[1]), topk_weights)


# ---------------------------------------------------------------------------------------------
# The model


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face Mixtral RMSNorm: normalise in float32, scale in the input dtype."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclasses.dataclass
class _Layer:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor


class MixtralModel:
    """The non-expert part of a Mixtral model; `forward` calls an ExpertBackend for experts.

    Weights start empty (a rank that will receive them); `load_non_expert` fills them.
    """

    def __init__(
        self,
        config: config_mod.ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self._state: dict[str, torch.Tensor] = {}
        self._layers: list[_Layer] = []
        dim = config.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        self._inv_freq = (1.0 / (config.rope_theta**exponents)).to(self.device)

    @classmethod
    def from_source(
        cls,
        source: source_mod.ModelSource,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> MixtralModel:
        """A model with its non-expert weights read from `source`."""
        model = cls(source.config, dtype=dtype, device=device)
        model.load_non_expert(
            {name: source.tensor(name) for name in names.non_expert_tensor_names(source.config)}
        )
        return model

    @property
    def loaded(self) -> bool:
        return bool(self._state)

    def load_non_expert(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Set every non-expert weight (names from `non_expert_tensor_names`).

        All are checked (present, right shape) before any is set. Expert tensors and a tied
        `lm_head.weight` are ignored; unknown names are refused.
        """
        cfg = self.config
        wanted = names.non_expert_tensor_names(cfg)
        missing = [n for n in wanted if n not in tensors]
        if missing:
            raise ValueError(f"load_non_expert: missing {len(missing)} tensors: {missing[:5]}")
        for name in tensors:
            if name == "lm_head.weight" or names.is_expert_tensor(name):
                continue
            try:
                names.tensor_shape(cfg, name)
            except KeyError:
                raise ValueError(
                    f"load_non_expert: {name!r} is not a tensor of this model"
                ) from None
        state: dict[str, torch.Tensor] = {}
        for name in wanted:
            value = tensors[name]
            expected = names.tensor_shape(cfg, name)
            if tuple(value.shape) != expected:
                raise ValueError(
                    f"load_non_expert: {name!r} has shape {list(value.shape)}, "
                    f"expected {list(expected)}"
                )
            state[name] = value.to(device=self.device, dtype=self.dtype).contiguous()
        self._state = state
        self._layers = [
            _Layer(*(state[n] for n in names.layer_tensor_names(layer)))
            for layer in range(cfg.num_layers)
        ]

    def non_expert_state(self) -> dict[str, torch.Tensor]:
        """The non-expert weights by name (the tensors themselves: do not modify them)."""
        self._require_loaded()
        return dict(self._state)

    def _require_loaded(self) -> None:
        if not self._state:
            raise RuntimeError("MixtralModel: non-expert weights are not loaded yet")

    @property
    def _lm_head(self) -> torch.Tensor:
        key = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return self._state[key]

    def route(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixtral routing of hidden [T, H]: (topk_ids [T, k] int64, topk_weights [T, k] f32)."""
        logits = F.linear(hidden, self._layers[layer].router)
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        weights, ids = torch.topk(probs, self.config.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Causal GQA attention of q [n, heads, D] over keys/values [kv_heads, start + n, D].

        The query of position p sees keys 0..p (the last `sliding_window` of them when set).
        One sequence at a time, so a sequence's numbers do not depend on the rest of the batch.
        """
        cfg = self.config
        n = q.shape[0]
        total = keys.shape[1]
        window = cfg.sliding_window
        mask = None
        if n > 1 or (window is not None and total > window):
            q_pos = torch.arange(start, start + n, device=q.device)[:, None]
            k_pos = torch.arange(total, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask = mask & (k_pos > q_pos - window)
        # Grouped-query attention without copying keys/values: the g query heads that share a
        # key/value head become g * n query rows of that head (rows ordered (group, position)).
        groups = cfg.num_query_groups
        rows = q.reshape(n, cfg.num_kv_heads, groups, cfg.head_dim).permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(
            rows.reshape(1, cfg.num_kv_heads, groups * n, cfg.head_dim),
            keys[None],
            values[None],
            attn_mask=None if mask is None else mask.repeat(groups, 1),
            scale=cfg.head_dim**-0.5,
        )  # [1, kv_heads, groups * n, D]
        out = out.reshape(cfg.num_kv_heads, groups, n, cfg.head_dim).permute(2, 0, 1, 3)
        return out.reshape(n, cfg.num_heads * cfg.head_dim)

    @torch.no_grad()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        experts: ExpertBackend,
        *,
        expert_load: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [num_seqs, vocab] (float32) of the last new token of each sequence.

        Appends the new tokens' keys/values to `kv`. An empty batch still calls `experts` once
        per layer with T = 0 and returns a [0, vocab] tensor. `expert_load` (int64 [L, E]), if
        given, is incremented by the number of tokens routed to each logical expert.
        """
        self._require_loaded()
        cfg = self.config
        lengths = [len(t) for t in batch.token_ids]
        flat: list[int] = []
        positions: list[int] = []
        for seq_id, tokens, start in zip(
            batch.seq_ids, batch.token_ids, batch.start_pos, strict=True
        ):
            if start + len(tokens) > cfg.max_position_embeddings:
                raise ValueError(
                    f"sequence {seq_id!r}: {start + len(tokens)} tokens exceed "
                    f"max_position_embeddings {cfg.max_position_embeddings}"
                )
            if min(tokens) < 0 or max(tokens) >= cfg.vocab_size:
                raise ValueError(f"sequence {seq_id!r}: token ids must be in [0, {cfg.vocab_size})")
            if start > kv.num_tokens(seq_id):
                raise ValueError(
                    f"sequence {seq_id!r}: start_pos {start} but the KV cache holds only "
                    f"{kv.num_tokens(seq_id)} tokens of it"
                )
            flat.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
        for seq_id, n, start in zip(batch.seq_ids, lengths, batch.start_pos, strict=True):
            kv.reserve(seq_id, start, n)

        ids = torch.tensor(flat, dtype=torch.int64, device=self.device)
        cos, sin = self._rope(torch.tensor(positions, dtype=torch.int64, device=self.device))
        cos, sin = cos[:, None, :], sin[:, None, :]
        hidden = F.embedding(ids, self._state["model.embed_tokens.weight"])
        num_tokens = hidden.shape[0]
        for index, layer in enumerate(self._layers):
            x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            if num_tokens:
                q = F.linear(x, layer.q).view(num_tokens, cfg.num_heads, cfg.head_dim)
                k = F.linear(x, layer.k).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
                v = F.linear(x, layer.v).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
                parts = []
                offset = 0
                for seq_id, n, start in zip(batch.seq_ids, lengths, batch.start_pos, strict=True):
                    kv.write(seq_id, index, start, k[offset : offset + n], v[offset : offset + n])
                    keys, values = kv.read(seq_id, index)
                    parts.append(self._attend(q[offset : offset + n], keys, values, start))
                    offset += n
                hidden = hidden + F.linear(torch.cat(parts), layer.o)
            x = rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps)
            topk_ids, topk_weights = self.route(index, x)
            if expert_load is not None and num_tokens:
                expert_load[index] += torch.bincount(
                    topk_ids.reshape(-1), minlength=cfg.num_experts
                ).to(expert_load.device, expert_load.dtype)
            hidden = hidden + experts(index, x, topk_ids, topk_weights).to(hidden.dtype)
        if not lengths:
            return torch.empty((0, cfg.vocab_size), dtype=torch.float32, device=self.device)
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        final = rms_norm(hidden[last], self._state["model.norm.weight"], cfg.rms_norm_eps)
        return F.linear(final, self._lm_head).to(torch.float32)

    __call__ = forward


def generate_greedy(
    model: source_mod.ModelSource | MixtralModel | str,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    experts: ExpertBackend | None = None,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list[list[int]]:
    """Greedy tokens generated for each prompt (single process; all sequences in one batch).

    `model` is a source string, an opened source, or a loaded MixtralModel (then `experts` is
    required). Generation of a sequence stops after `max_new_tokens` or after `eos_token_id`
    (included).
    """
    if isinstance(model, MixtralModel):
        if experts is None:
            raise ValueError("generate_greedy: pass experts= with a loaded MixtralModel")
        net = model
    else:
        src = source_mod.open_source(model) if isinstance(model, str) else model
        net = MixtralModel.from_source(src, dtype=dtype, device=device)
        if experts is None:
            experts = LocalExperts.from_source(src, dtype=dtype, device=device)
    kv = KVCache(net.config, dtype=net.dtype, device=net.device)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = [i for i in range(len(prompts)) if max_new_tokens > 0]
    batch = ForwardBatch(
        seq_ids=[str(i) for i in active],
        token_ids=[list(prompts[i]) for i in active],
        start_pos=[0] * len(active),
    )
    while active:
        logits = net.forward(batch, kv, experts)
        next_tokens = torch.argmax(logits, dim=-1).tolist()
        still: list[int] = []
        for i, token in zip(active, next_tokens, strict=True):
            outputs[i].append(int(token))
            if len(outputs[i]) < max_new_tokens and token != eos_token_id:
                still.append(i)
        active = still
        batch = ForwardBatch(
            seq_ids=[str(i) for i in active],
            token_ids=[[outputs[i][-1]] for i in active],
            start_pos=[len(prompts[i]) + len(outputs[i]) - 1 for i in active],
        )
    return outputs
