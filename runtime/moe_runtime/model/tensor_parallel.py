"""Tensor parallelism of a DP rank's non-expert compute (`TensorParallel`): what a TP rank's
`decoder.MoEModel` holds beside its shard (`tp_shard.Shard`) and the collectives it runs.

Per decoder layer: one all-reduce after attention (o_proj is row-parallel), one after a dense
MLP or the MoE block; per forward pass one all-gather of the logits (lm_head holds a slice of
the vocabulary). The biases of the row-parallel projections are added after the reduction,
once. Every TP rank of a group runs the same batch, so the hidden states stay identical on
all of them (an all-reduce gives every rank the same sum). Routed experts, by `expert_layout`:

- `LEADER` (what `serve` runs): on TP rank 0 only (`leads`); the MoE block's all-reduce sums
  its expert output (zeros on the other TP ranks) with every rank's partial of the shared
  experts (`decoder.MoEModel._moe_reduce`).
- `MESH` (vLLM's layout, expert parallelism over DP x T): every TP rank is a member of the
  expert-parallel group and dispatches the rows i with i mod T = its TP rank (`routed`),
  leaving the other rows' routed output at zero; one all-reduce then gives every TP rank the
  whole routed output exactly (each row has one non-zero term), and the shared experts'
  partials are reduced on their own and added after, so a row's arithmetic does not depend
  on which TP rank computed it (batch invariance).

The group is any object with `all_reduce` and `all_gather_into` (`Collective`):
`comm.group.StatelessGroup` in a rank, a fake in tests. The model package does not import
`comm` (it sits below it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Protocol

import torch
import torch.nn.functional as F

from moe_runtime.model import experts as experts_mod
from moe_runtime.model import names, source, tp_shard

#: Routed experts on TP rank 0 only (expert parallelism over the DP leaders).
LEADER: Final = "leader"
#: Routed experts over every TP rank (expert parallelism over DP x T, vLLM's layout).
MESH: Final = "mesh"
EXPERT_LAYOUTS = (LEADER, MESH)


class Collective(Protocol):
    """The collectives a TP group offers (what `comm.group.StatelessGroup` has)."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None: ...

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None: ...


class TensorParallel:
    """A TP rank's part of the forward pass: its shard plan, its group, the row-parallel
    biases of each layer and its rows of lm_head."""

    def __init__(
        self, shard: tp_shard.Shard, group: Collective, *, expert_layout: str = LEADER
    ) -> None:
        if expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert_layout {expert_layout!r}: one of {EXPERT_LAYOUTS}")
        self.shard = shard
        self.group = group
        self.expert_layout = expert_layout
        #: per decoder layer: {reduced bias role: tensor}, set by `take_biases`
        self._biases: list[dict[str, torch.Tensor]] = []
        self._lm_head: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def leads(self) -> bool:
        """TP rank 0, the DP rank's leader (it samples; it counts the expert load)."""
        return self.shard.rank == 0

    @property
    def runs_experts(self) -> bool:
        """Whether this TP rank calls the routed experts' backend: the leader alone, or every
        TP rank in the `MESH` layout."""
        return self.leads or self.expert_layout == MESH

    def routed(
        self,
        experts: experts_mod.ExpertBackend,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The `MESH` layout's routed output [N, H] of MoE layer `layer`, whole on every TP
        rank: this rank dispatches rows rank, rank + T, ... (every TP rank calls `experts`,
        with no row too: the expert-parallel group's collectives need every member), the
        other rows stay zero, and one all-reduce sums the T disjoint parts."""
        n = x.shape[0]
        rows = torch.arange(min(self.shard.rank, n), n, self.size, device=x.device)
        mine = experts(
            layer,
            x.index_select(0, rows),
            topk_ids.index_select(0, rows),
            topk_weights.index_select(0, rows),
        )
        out = torch.zeros_like(x)
        out.index_copy_(0, rows, mine.to(out.dtype))
        if out.shape[0]:
            self.group.all_reduce(out)
        return out

    def bias(self, layer: int, role: str) -> torch.Tensor | None:
        """The reduced bias `role` of decoder layer `layer`, if the model has one."""
        return self._biases[layer].get(role)

    def take(
        self, layers: list[dict[str, torch.Tensor]], global_: Mapping[str, torch.Tensor]
    ) -> None:
        """Take the row-parallel biases out of each layer's weights (the decoder adds them
        after the reduction, here) and this rank's lm_head rows (the embedding's rows when
        they are tied: a view, no copy; a last pipeline stage holds only those rows of it).
        A pipeline stage before the last has no lm_head."""
        self._biases = [
            {role: w.pop(role) for role in tp_shard.REDUCED_BIASES if role in w} for w in layers
        ]
        embed = global_.get("embed")
        if self.shard.config.tie_word_embeddings and embed is not None:
            v0, v1 = self.shard.vocab
            whole = embed.shape[0] == self.shard.config.vocab_size
            self._lm_head = embed[v0:v1] if whole else embed
        else:
            self._lm_head = global_.get("lm_head")

    def reduce(self, partial: torch.Tensor, layer: int, bias: str) -> torch.Tensor:
        """The sum over the group of a row-parallel projection's partial output [T, hidden],
        plus its bias `bias` of decoder layer `layer` (if the model has one)."""
        if partial.shape[0]:
            self.group.all_reduce(partial)
        added = self._biases[layer].get(bias)
        return partial if added is None else partial + added

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, which: str) -> torch.Tensor:
        """RMSNorm of a q or k projection ("q" / "k") over all heads when each rank holds
        some (OLMoE's `qk_norm == "full"`): the sums of squares all-reduced (a KV head held by
        several ranks counted once), then `attention.rms_norm`'s arithmetic."""
        cfg, shard = self.shard.config, self.shard
        xf = x.to(torch.float32)
        squares = xf.pow(2).sum(-1, keepdim=True)
        self.group.all_reduce(squares)
        if which == "q":
            width = cfg.num_heads * cfg.head_dim
        else:
            width = cfg.num_kv_heads * cfg.head_dim
            copies = shard.size * shard.local.num_kv_heads // cfg.num_kv_heads
            if copies > 1:
                squares = squares / copies
        xf = xf * torch.rsqrt(squares / width + cfg.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] float32 of the final hidden states [N, hidden]: this rank's rows
        of lm_head, padded to `vocab_chunk`, gathered from every rank."""
        assert self._lm_head is not None, "TensorParallel.take was not called"
        local = F.linear(final, self._lm_head).to(torch.float32)
        n, chunk = local.shape[0], self.shard.vocab_chunk
        padded = local.new_zeros((n, chunk))
        padded[:, : local.shape[1]] = local
        gathered = local.new_empty((self.size, n, chunk))
        self.group.all_gather_into(gathered, padded)
        return gathered.permute(1, 0, 2).reshape(n, self.size * chunk)[
            :, : self.shard.config.vocab_size
        ]


def load_shard(src: source.ModelSource, shard: tp_shard.Shard) -> dict[str, torch.Tensor]:
    """This rank's part of every non-expert tensor, read from `src` (sliced tensors through
    `tensor_slice`: a checkpoint reads only those bytes where it can). A tied lm_head is
    not read: `TensorParallel.take` cuts it from the embedding."""
    out: dict[str, torch.Tensor] = {}
    for name in shard.tensor_names():
        part = shard.slice_of(name)
        if part is None:
            out[name] = src.tensor(name)
        else:
            out[name] = src.tensor_slice(name, dim=part.dim, start=part.start, stop=part.stop)
    return out


def cut(state: Mapping[str, torch.Tensor], shard: tp_shard.Shard) -> dict[str, torch.Tensor]:
    """This rank's part of a whole non-expert state (names as `names.non_expert_tensor_names`):
    what a TP rank keeps of weights it was sent whole."""
    out: dict[str, torch.Tensor] = {}
    for name in names.non_expert_tensor_names(shard.config):
        part = shard.slice_of(name)
        value = state[name]
        out[name] = (
            value if part is None else value.narrow(part.dim, part.start, part.length).clone()
        )
    return out
