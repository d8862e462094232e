"""A forward pass's batch (`ForwardBatch`) and the per-sequence cache of attention state
(`KVCache`).

The cache holds, per sequence and decoder layer, what attention needs of past positions:
keys and values [kv_heads, D] (grouped-query attention), or the latent of multi-head latent
attention (one row of kv_lora_rank + rope dims per position: DeepSeek caches the latent and
expands it at each step, much less memory than the keys and values it expands to).
"""

from __future__ import annotations

import dataclasses

import torch

from moe_runtime.model import config as config_mod


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


def cache_shape(config: config_mod.ModelConfig) -> tuple[int, int, int]:
    """(parts, heads, dim) cached per position and layer: (2, kv_heads, head_dim) for keys
    and values, (1, 1, kv_lora_rank + qk_rope_head_dim) for an MLA latent."""
    if config.mla is not None:
        return 1, 1, config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
    return 2, config.num_kv_heads, config.head_dim


class _SeqKV:
    """The cache of one sequence: data [layers, parts, heads, capacity, dim]."""

    __slots__ = ("data", "length")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.length = 0


class KVCache:
    """Per-sequence attention state for every layer; grows as needed (capacity doubles)."""

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
        self.parts, self.heads, self.dim = cache_shape(config)
        self._seqs: dict[str, _SeqKV] = {}

    def num_tokens(self, seq_id: str) -> int:
        """Tokens of `seq_id` held (0 for an unknown sequence)."""
        entry = self._seqs.get(seq_id)
        return 0 if entry is None else entry.length

    def free(self, seq_id: str) -> None:
        """Drop a sequence's state (no error if it holds none)."""
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
            data = torch.empty(
                (self.config.num_layers, self.parts, self.heads, cap, self.dim),
                dtype=self.dtype,
                device=self.device,
            )
            if entry is not None:
                data[:, :, :, :start_pos] = entry.data[:, :, :, :start_pos]
                entry.data = data
            else:
                entry = self._seqs[seq_id] = _SeqKV(data)
        entry.length = need

    def write(self, seq_id: str, layer: int, start_pos: int, *parts: torch.Tensor) -> None:
        """Store each part [n, heads, dim] (keys and values, or the latent) of positions
        [start_pos, start_pos + n)."""
        data = self._seqs[seq_id].data
        end = start_pos + parts[0].shape[0]
        for i, part in enumerate(parts):
            data[layer, i, :, start_pos:end] = part.transpose(0, 1)

    def read(self, seq_id: str, layer: int) -> tuple[torch.Tensor, ...]:
        """Each part [heads, num_tokens, dim] of a layer (views, not copies)."""
        entry = self._seqs[seq_id]
        return tuple(entry.data[layer, i, :, : entry.length] for i in range(self.parts))
