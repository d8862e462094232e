"""Filling a rank's weights for a new placement: non-expert weights from a peer, expert slots
from what the rank holds, what moves brought and, after a rank was lost, the model source.

Pure helpers of the rank's parts (no state of their own): `groups.RankGroups` and
`slots.ExpertSlots` own the groups and the slot sets and call these with them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.comm import transfer as transfer_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.model import decoder
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import source as source_mod

log = logging.getLogger(__name__)

Experts = dict[tuple[int, int], experts_mod.ExpertWeights]
"""(layer, local slot) -> weights (a rank's slots) or (layer, logical) -> weights (what it holds)."""

#: Tags of a non-expert transfer: this plus the epoch (apart from expert moves' tags, which
#: are move indices).
NON_EXPERT_TAG = 1_000_000


def senders_for(src_ranks: Sequence[int], dst_ranks: Sequence[int]) -> dict[int, int]:
    """{receiver: sender}: receivers split over senders in order, the first
    ``len(dst) % len(src)`` senders taking one extra (as vLLM's elastic EP does)."""
    if not src_ranks:
        raise ValueError("non-expert transfer needs at least one sender")
    base, extra = divmod(len(dst_ranks), len(src_ranks))
    out: dict[int, int] = {}
    it = iter(dst_ranks)
    for i, src in enumerate(src_ranks):
        for _ in range(base + (1 if i < extra else 0)):
            out[next(it)] = src
    return out


def exchange_non_expert(
    grp: group_mod.StatelessGroup,
    me: int,
    model: decoder.MoEModel,
    *,
    src_ranks: Sequence[int],
    dst_ranks: Sequence[int],
    tag: int,
    dtype: torch.dtype,
) -> tuple[list[int], int]:
    """Send this rank's non-expert weights to its receivers and/or load them from its sender.

    Ranks are ranks of `grp`; each sender sends its whole state as one flat buffer to each of
    its receivers at once (`senders_for`). Returns (receivers this rank sent to, bytes received).
    """
    sender_of = senders_for(list(src_ranks), list(dst_ranks))
    # a pipeline stage's: its layers only (every member of the group is the same stage)
    tensor_names = model.pp.tensor_names()
    shapes = [model.tensor_shape(n) for n in tensor_names]  # a TP leader's: its part
    numel = sum(_numel(s) for s in shapes)
    mine = sorted(dst for dst, src in sender_of.items() if src == me)
    works: list[Any] = []
    recv: torch.Tensor | None = None
    with transfer_mod.side_stream():  # pinned host buffers, the transfer stream: `comm.transfer`
        if mine:
            state = model.non_expert_state()
            flat = transfer_mod.to_group(
                _flatten([state[n] for n in tensor_names]).to(model.transfer_dtype), grp
            )
            works.extend(grp.isend(flat, dst, tag) for dst in mine)
        if me in sender_of:
            recv = transfer_mod.recv_buffer(numel, model.transfer_dtype, grp)
            works.append(grp.irecv(recv, sender_of[me], tag))
        for work in works:
            work.wait()
    if recv is None:
        return mine, 0
    recv = transfer_mod.served(recv)
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in zip(tensor_names, shapes, strict=True):
        n = _numel(shape)
        tensors[name] = recv[offset : offset + n].view(shape)
        offset += n
    model.load_non_expert(tensors)
    return mine, recv.numel() * recv.element_size()


def transfer_non_expert(
    grp: group_mod.StatelessGroup,
    model: decoder.MoEModel,
    *,
    epoch: int,
    src_ranks: Sequence[int],
    dst_ranks: Sequence[int],
    what: str,
    where: str,
) -> int:
    """`exchange_non_expert` of `model` over `grp` as its member `grp.rank`, tagged by `epoch`
    and logged (`what`: whose tensors; `where`: the log context). Returns the bytes received."""
    started = time.monotonic()
    sent_to, received = exchange_non_expert(
        grp,
        grp.rank,
        model,
        src_ranks=src_ranks,
        dst_ranks=dst_ranks,
        tag=NON_EXPERT_TAG + epoch,
        dtype=model.dtype,
    )
    log.info(
        "%s non-expert transfer epoch %d: sent to members %s, received %d B in %.2fs (%s)",
        what,
        epoch,
        sent_to,
        received,
        time.monotonic() - started,
        where,
    )
    return received


def held_experts(
    placement: policy.Placement | None,
    rank: int | None,
    num_ranks: int | None,
    experts: Mapping[tuple[int, int], experts_mod.ExpertWeights],
) -> Experts:
    """{(layer, logical): weights} of a rank's slots `experts` under `placement`."""
    if placement is None or rank is None or num_ranks is None:
        return {}
    out: Experts = {}
    for layer in range(placement.num_layers):
        for slot, logical in enumerate(placement.experts_on_rank(layer, rank, num_ranks)):
            if (layer, slot) in experts:
                out.setdefault((layer, logical), experts[(layer, slot)])
    return out


def fill_slots(
    placement: policy.Placement,
    *,
    rank: int,
    num_ranks: int,
    available: Experts,
    source: source_mod.ModelSource | None,
    dtype: torch.dtype,
    device: str,
    where: str,
) -> Experts:
    """The slots (layer, local slot) -> weights of `rank` under `placement` from `available`
    ((layer, logical) -> weights), reading what is missing from `source` when given (a logical
    expert needed twice is read once); RuntimeError naming what is still missing."""
    slots: Experts = {}
    missing: list[tuple[int, int]] = []
    loaded = 0
    pool = dict(available)
    for layer in range(placement.num_layers):
        for slot, logical in enumerate(placement.experts_on_rank(layer, rank, num_ranks)):
            weights = pool.get((layer, logical))
            if weights is None and source is not None:
                weights = experts_mod.load_expert(
                    source, layer, logical, dtype=dtype, device=device
                )
                pool[(layer, logical)] = weights
                loaded += 1
            if weights is None:
                missing.append((layer, logical))
            else:
                slots[(layer, slot)] = weights
    if loaded:
        log.info("read %d experts from the model source (%s)", loaded, where)
    if missing:
        raise RuntimeError(
            f"stage_experts: the moves bring no weights for (layer, expert) {missing[:5]} "
            f"({len(missing)} missing) that new rank {rank} needs ({where})"
        )
    return slots


def later_layers(model: decoder.MoEModel) -> int | None:
    """At pipeline-parallel size P > 1, on stage 0's leader: the first MoE layer of a later
    stage (the leader never computes those: its slots of them hold one shared zero expert,
    and the stages hold and move their own); None at P = 1."""
    stop = model.pp.moe_layers[1]
    return stop if stop < model.config.num_moe_layers else None


def elsewhere(model: decoder.MoEModel, *, dtype: torch.dtype, device: str) -> Experts:
    """{(layer, logical): one shared zero expert} for every MoE layer of a later pipeline
    stage (`later_layers`; nothing at P = 1): what a staging fills a leader's slots of them
    with, never moved or read."""
    later, config = later_layers(model), model.config
    if later is None:
        return {}
    zero = experts_mod.zero_expert(config, dtype=dtype, device=device)
    return {
        (layer, logical): zero
        for layer in range(later, config.num_moe_layers)
        for logical in range(config.num_experts)
    }


def run_moves(
    grp: group_mod.StatelessGroup,
    moves: Sequence[moves_mod.ExpertMove],
    held: Experts,
    model: decoder.MoEModel,
    *,
    dtype: torch.dtype,
    device: str,
    where: str,
) -> tuple[transfer_mod.TransferStats, Experts]:
    """One member's part of `moves` over `grp`: sends from `held` ((layer, logical) ->
    weights), returns the stats and what it received (cast to dtype, on device). Moves of
    later pipeline stages' layers (`later_layers`) are left out: every member leaves out the same
    ones, and the slots take the shared zero expert for them (`elsewhere`)."""
    received: Experts = {}
    later = later_layers(model)
    if later is not None:
        moves = [m for m in moves if m.layer < later]

    def read_expert(layer: int, logical: int) -> experts_mod.ExpertWeights:
        weights = held.get((layer, logical))
        if weights is None:
            raise RuntimeError(
                f"a move names this rank as source of expert {logical} of layer {layer}, "
                f"which it does not hold ({where})"
            )
        return weights

    def write_expert(move: moves_mod.ExpertMove, weights: experts_mod.ExpertWeights) -> None:
        received[(move.layer, move.logical)] = weights.to(dtype=dtype, device=device)

    stats = transfer_mod.execute_moves(
        grp,
        list(moves),
        read_expert=read_expert,
        write_expert=write_expert,
        like=experts_mod.zero_expert(model.config, dtype=dtype, device=grp.device),
    )
    return stats, received


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.reshape(-1) for t in tensors])


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
