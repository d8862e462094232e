"""A forward pass's batch (`ForwardBatch`), the paged cache of attention state (`KVCache`) and
one forward pass's view of it (`BatchKV`).

The cache holds, per sequence and decoder layer, what attention needs of past positions:
keys and values [kv_heads, D] (grouped-query attention), or the latent of multi-head latent
attention (one row of kv_lora_rank + rope dims per position: DeepSeek caches the latent and
expands it at each step, much less memory than the keys and values it expands to).

Paging: every layer's state lives in one pool of fixed-size blocks (`block_size` positions),
pool [layers, parts, num_blocks * block_size, heads, dim]; a sequence owns a list of blocks
(its block table), position p at slot `table[p // block_size] * block_size + p % block_size`.
A forward pass writes all its new tokens of a layer with one `index_copy_` and reads the keys
of a whole group of sequences with one `index_select` (`BatchKV`). The pool starts small and
grows (doubling, one copy) up to `max_blocks`; past it `reserve` raises `KVCacheFull`: the
budget is enforced before that, by the engine's admission (docs/ENGINE.md).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from moe_runtime.model import config as config_mod

#: Positions per KV block.
BLOCK_SIZE = 16
#: Keys of a batched attention call are padded to a multiple of SHORT_KEY_PAD up to KEY_PAD,
#: to a multiple of KEY_PAD past it. torch's CPU attention kernel (measured on 2.15) reduces
#: a row's keys in the same order for every such length (up to 256, and at multiples of 256),
#: not for others (320 and 512 differ), so a row's numbers do not depend on the batch's
#: longest sequence (batch invariance, tests/unit/test_batch_invariance.py).
KEY_PAD = 256
SHORT_KEY_PAD = 16


class KVCacheFull(RuntimeError):
    """The pool holds `max_blocks` blocks and none is free."""


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


def bytes_per_token(
    config: config_mod.ModelConfig,
    dtype: torch.dtype,
    *,
    layers: tuple[int, int] | None = None,
) -> int:
    """KV cache bytes one position of one sequence takes over all layers (`layers`: over
    decoder layers [first, stop) only, a pipeline stage's)."""
    parts, heads, dim = cache_shape(config)
    count = config.num_layers if layers is None else layers[1] - layers[0]
    return count * parts * heads * dim * torch.empty((), dtype=dtype).element_size()


def serving_dtype(name: str, *, cuda: bool) -> torch.dtype:
    """The torch dtype of a `--dtype` value ("auto": bfloat16 on GPUs, float32 on CPUs)."""
    named = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    return named.get(name, torch.bfloat16 if cuda else torch.float32)


@dataclasses.dataclass
class Group:
    """Sequences attended together in one call: `rows` [B] their index in the batch,
    `queries` [B, Nmax] the batch token of each new token (padding: row 0), `valid` [B * Nmax]
    which padded query rows are real, `block_table` [B, P / block_size] the pool block of
    every block of key positions (padding: block 0; P, the keys of the call, as `KEY_PAD`
    says), `q_pos` [B, Nmax] / `k_len` the positions for the mask."""

    rows: list[int]
    queries: torch.Tensor
    valid: torch.Tensor
    token_index: torch.Tensor
    block_table: torch.Tensor
    num_keys: int
    q_pos: torch.Tensor
    k_len: torch.Tensor
    _masks: dict[int | None, torch.Tensor] = dataclasses.field(default_factory=dict)
    _row_masks: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = dataclasses.field(
        default_factory=dict
    )

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, Nmax, P] bool: key j visible to query i (causal, within `window`); padded
        query rows see key 0 only (their output is dropped)."""
        if window not in self._masks:
            keys = torch.arange(self.num_keys, device=self.block_table.device)
            q = self.q_pos[:, :, None]
            visible = keys[None, None, :] <= q
            if window is not None:
                visible = visible & (keys[None, None, :] > q - window)
            pad = ~self.valid.view(self.q_pos.shape)
            visible[..., 0] |= pad
            self._masks[window] = visible[:, None]
        return self._masks[window]

    def attention_mask(self, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """`mask` as `attention.attend` takes it, made once a forward pass (the layers of one
        window share it): additive (0: visible, -inf: hidden) in `dtype`, over the query rows
        of a KV head's `groups` query heads ordered (head, position): [B, 1, groups * Nmax, P],
        or [B, 1, 1, P] when each sequence has one query (decodes: every row of a sequence
        sees the same keys). SDPA turns a boolean mask into this form itself (the same
        numbers, bit for bit); made here it is made once instead of in every call."""
        key = (window, groups, dtype)
        if key not in self._row_masks:
            visible = self.mask(window)  # [B, 1, N, P]
            b, _, n, total = visible.shape
            if n > 1:
                visible = visible[:, :, None].expand(b, 1, groups, n, total)
                visible = visible.reshape(b, 1, groups * n, total)
            hidden = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._row_masks[key] = hidden.masked_fill_(~visible, float("-inf"))
        return self._row_masks[key]


class BatchKV:
    """One forward pass's view of the cache: where its new tokens go (`write`), and the
    groups of sequences attended together (`groups`: the one-token decodes in one group, the
    longer chunks in another), each read with one gather per layer (`read`)."""

    def __init__(self, kv: KVCache, spans: list[tuple[str, int, int, int]]) -> None:
        """spans: (seq_id, batch offset, new tokens, start position) of each sequence."""
        self.kv = kv
        device = kv.device
        bs = kv.block_size
        slots: list[int] = []
        for seq_id, _, n, start in spans:
            table = kv._tables[seq_id]
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        self.write_slots = torch.tensor(slots, dtype=torch.int64, device=device)
        decodes = [i for i, s in enumerate(spans) if s[2] == 1]
        chunks = [i for i, s in enumerate(spans) if s[2] > 1]
        self.groups = [self._group(spans, rows) for rows in (decodes, chunks) if rows]

    def _group(self, spans: list[tuple[str, int, int, int]], rows: list[int]) -> Group:
        kv, bs, device = self.kv, self.kv.block_size, self.kv.device
        n_max = max(spans[i][2] for i in rows)
        totals = [spans[i][3] + spans[i][2] for i in rows]
        longest = max(totals)
        step = SHORT_KEY_PAD if longest <= KEY_PAD else KEY_PAD
        padded = math.ceil(longest / step) * step
        width = padded // bs
        tables = [kv._tables[spans[i][0]] for i in rows]
        table = torch.tensor(
            [t[:width] + [0] * (width - min(len(t), width)) for t in tables],
            dtype=torch.int64,
            device=device,
        )
        queries, q_pos, valid = [], [], []
        for i in rows:
            _, offset, n, start = spans[i]
            queries.append(list(range(offset, offset + n)) + [0] * (n_max - n))
            q_pos.append(list(range(start, start + n)) + [0] * (n_max - n))
            valid.append([True] * n + [False] * (n_max - n))
        valid_t = torch.tensor(valid, dtype=torch.bool, device=device).view(-1)
        queries_t = torch.tensor(queries, dtype=torch.int64, device=device)
        return Group(
            rows=rows,
            queries=queries_t,
            valid=valid_t,
            token_index=queries_t.view(-1)[valid_t],
            block_table=table,
            num_keys=padded,
            q_pos=torch.tensor(q_pos, dtype=torch.int64, device=device),
            k_len=torch.tensor(totals, dtype=torch.int64, device=device),
        )

    def write(self, layer: int, *parts: torch.Tensor) -> None:
        """Store each part [T, heads, dim] of the batch's new tokens in layer `layer`."""
        pool = self.kv.pool[layer - self.kv.layers[0]]
        width = self.kv.heads * self.kv.dim
        for i, part in enumerate(parts):
            pool[i].view(-1, width).index_copy_(
                0, self.write_slots, part.to(self.kv.dtype).reshape(-1, width)
            )

    def read(self, layer: int, group: Group) -> tuple[torch.Tensor, ...]:
        """Each part of the group's keys, [B, P, heads, dim] (a copy)."""
        b, p = group.block_table.shape[0], group.num_keys
        flat = group.block_table.view(-1)
        pool = self.kv.pool[layer - self.kv.layers[0]]
        # whole blocks, each a row of block_size * heads * dim: CPU's index_select copies a
        # 2-D row at once (per position 2x faster than over [slots, heads, dim], per block a
        # further ~20 %: the same bytes, fewer and longer copies)
        width = self.kv.block_size * self.kv.heads * self.kv.dim
        return tuple(
            pool[i].view(-1, width).index_select(0, flat).view(b, p, self.kv.heads, self.kv.dim)
            for i in range(self.kv.parts)
        )


class KVCache:
    """Attention state of every sequence and layer in a pool of fixed-size blocks (module
    docstring). max_blocks: the most blocks the pool may hold (None: no bound). layers: the
    decoder layers [first, stop) it holds (a pipeline stage's; None: all), indexed by their
    model index."""

    def __init__(
        self,
        config: config_mod.ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        block_size: int = BLOCK_SIZE,
        max_blocks: int | None = None,
        initial_capacity: int = 1024,
        layers: tuple[int, int] | None = None,
    ) -> None:
        if layers is not None and not 0 <= layers[0] < layers[1] <= config.num_layers:
            raise ValueError(f"KVCache: layers {layers} not within [0, {config.num_layers}]")
        if block_size < 1 or SHORT_KEY_PAD % block_size:
            raise ValueError(f"block_size must divide {SHORT_KEY_PAD}, got {block_size}")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_blocks = max_blocks
        #: the decoder layers [first, stop) held
        self.layers = (0, config.num_layers) if layers is None else layers
        self.parts, self.heads, self.dim = cache_shape(config)
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}
        blocks = max(1, math.ceil(initial_capacity / block_size))
        if max_blocks is not None:
            blocks = max(1, min(blocks, max_blocks))
        self.pool = self._alloc(blocks)
        self._free: list[int] = list(range(blocks - 1, -1, -1))

    @classmethod
    def with_budget(
        cls,
        config: config_mod.ModelConfig,
        budget_bytes: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        block_size: int = BLOCK_SIZE,
        layers: tuple[int, int] | None = None,
    ) -> KVCache:
        """A cache of at most `budget_bytes` (whole blocks, at least one)."""
        per_block = bytes_per_token(config, dtype, layers=layers) * block_size
        return cls(
            config,
            dtype=dtype,
            device=device,
            block_size=block_size,
            max_blocks=max(1, budget_bytes // per_block),
            layers=layers,
        )

    def _alloc(self, blocks: int) -> torch.Tensor:
        # zeros: padded key slots read unused positions, which must hold finite numbers
        return torch.zeros(
            (
                self.layers[1] - self.layers[0],
                self.parts,
                blocks * self.block_size,
                self.heads,
                self.dim,
            ),
            dtype=self.dtype,
            device=self.device,
        )

    @property
    def num_blocks(self) -> int:
        """Blocks the pool holds now (used or free)."""
        return self.pool.shape[2] // self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks free now, or that the pool may still grow by."""
        bound = self.num_blocks if self.max_blocks is None else self.max_blocks
        return len(self._free) + max(0, bound - self.num_blocks)

    def num_tokens(self, seq_id: str) -> int:
        """Tokens of `seq_id` held (0 for an unknown sequence)."""
        return self._lengths.get(seq_id, 0)

    def free(self, seq_id: str) -> None:
        """Drop a sequence's state (no error if it holds none)."""
        self._lengths.pop(seq_id, None)
        self._free.extend(reversed(self._tables.pop(seq_id, [])))

    def clear(self) -> None:
        for seq_id in list(self._tables):
            self.free(seq_id)

    def seq_ids(self) -> list[str]:
        return list(self._tables)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def memory_bytes(self) -> int:
        """Bytes of the blocks sequences hold."""
        used = sum(len(t) for t in self._tables.values())
        return (
            used
            * self.block_size
            * self.pool[0, 0, 0].numel()
            * self.pool.element_size()
            * ((self.layers[1] - self.layers[0]) * self.parts)
        )

    def _grow(self, need: int) -> None:
        """At least `need` more free blocks (KVCacheFull past max_blocks)."""
        have = self.num_blocks
        target = max(2 * have, have + need - len(self._free))
        if self.max_blocks is not None:
            target = min(target, self.max_blocks)
        if target - have + len(self._free) < need:
            raise KVCacheFull(
                f"KV cache full: {need} more blocks of {self.block_size} positions needed, "
                f"{len(self._free)} free of {self.max_blocks}"
            )
        pool = self._alloc(target)
        pool[:, :, : self.pool.shape[2]] = self.pool
        self.pool = pool
        self._free[:0] = list(range(target - 1, have - 1, -1))

    def reserve(self, seq_id: str, start_pos: int, num_new: int) -> None:
        """Make room for tokens [start_pos, start_pos + num_new) of `seq_id`.

        start_pos may not exceed the tokens held (that context would be missing); a smaller one
        drops the cached tail. After this, `num_tokens(seq_id) == start_pos + num_new`: if the
        forward pass that follows fails, free the sequence. KVCacheFull (nothing changed) when
        the pool cannot hold them.
        """
        held = self.num_tokens(seq_id)
        if start_pos > held:
            raise ValueError(
                f"sequence {seq_id!r}: start_pos {start_pos} but the KV cache holds only "
                f"{held} tokens of it"
            )
        need = start_pos + num_new
        table = self._tables.get(seq_id, [])
        blocks = math.ceil(need / self.block_size)
        if blocks > len(table):
            more = blocks - len(table)
            if more > len(self._free):
                self._grow(more)
            table = table + [self._free.pop() for _ in range(more)]
        elif blocks < len(table) and seq_id in self._tables:
            self._free.extend(reversed(table[blocks:]))
            table = table[:blocks]
        self._tables[seq_id] = table
        self._lengths[seq_id] = need

    def batch(self, spans: list[tuple[str, int, int, int]]) -> BatchKV:
        """The view of one forward pass over reserved sequences (`BatchKV`)."""
        return BatchKV(self, spans)

    def write(self, seq_id: str, layer: int, start_pos: int, *parts: torch.Tensor) -> None:
        """Store each part [n, heads, dim] (keys and values, or the latent) of positions
        [start_pos, start_pos + n) of one sequence (reserved)."""
        slots = self._slots(seq_id, start_pos, start_pos + parts[0].shape[0])
        for i, part in enumerate(parts):
            self.pool[layer - self.layers[0], i].index_copy_(0, slots, part.to(self.dtype))

    def read(self, seq_id: str, layer: int) -> tuple[torch.Tensor, ...]:
        """Each part [heads, num_tokens, dim] of one sequence's layer (copies)."""
        slots = self._slots(seq_id, 0, self.num_tokens(seq_id))
        return tuple(
            self.pool[layer - self.layers[0], i].index_select(0, slots).transpose(0, 1)
            for i in range(self.parts)
        )

    def _slots(self, seq_id: str, start: int, end: int) -> torch.Tensor:
        table, bs = self._tables[seq_id], self.block_size
        return torch.tensor(
            [table[p // bs] * bs + p % bs for p in range(start, end)],
            dtype=torch.int64,
            device=self.device,
        )
