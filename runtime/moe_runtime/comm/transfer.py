"""Weight transfer over a ``StatelessGroup``: expert moves between ranks, and non-expert state
broadcast to new ranks.

Glossary
--------
logical expert
    One of the model's E experts of a layer.
physical expert / slot
    A place holding one logical expert's weights on one rank.
redundant expert
    A slot beyond the first E: an extra copy of a logical expert.
replica
    Any one of the slots holding the same logical expert.
move
    ``eplb.moves.ExpertMove(layer, logical, src_rank, dst_rank, dst_slot)``: one expert's
    weights (every tensor of the expert: ``ExpertWeights``) from src_rank to dst_rank. Every rank of the group
    passes the same list of moves (computed from the same placements), so matching sends and
    receives are found by position in that list (used as the message tag).

Expert weights travel as one flat buffer per move (``ExpertWeights.flatten``, in the weights'
dtype); only the
two ranks of a move take part in it, the others skip it (point-to-point, no collective).
``broadcast_state`` is a collective over the whole group: metadata as JSON bytes, then one flat
buffer per dtype bucket.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.model import experts as experts_mod

# Most bytes one broadcast bucket holds, to bound the extra memory of packing.
BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class TransferStats:
    """What one rank did in ``execute_moves``."""

    sent: int
    received: int
    bytes_sent: int
    bytes_received: int


def execute_moves(
    group: group_mod.StatelessGroup,
    moves: Sequence[moves_mod.ExpertMove],
    *,
    read_expert: Callable[[int, int], experts_mod.ExpertWeights],
    write_expert: Callable[[moves_mod.ExpertMove, experts_mod.ExpertWeights], None],
    like: experts_mod.ExpertWeights,
    max_in_flight: int = 32,
) -> TransferStats:
    """Runs this rank's part of ``moves`` (the same list on every rank of ``group``).

    read_expert(layer, logical): weights this rank sends (it must hold them, old placement).
    write_expert(move, weights): called for each move this rank receives, with fresh tensors.
    like: any expert's weights, for the shapes and dtype of what is received.
    Moves are handled in windows of ``max_in_flight`` (bounds the receive buffers); within a
    window all sends and receives run at once. Returns counts for this rank.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    rank = group.rank
    numel = like.numel
    elem = like.dtype.itemsize
    sent = received = 0
    for start in range(0, len(moves), max_in_flight):
        works: list[Any] = []
        incoming: list[tuple[moves_mod.ExpertMove, torch.Tensor]] = []
        for tag, move in enumerate(moves[start : start + max_in_flight], start=start):
            if move.src_rank == move.dst_rank:
                if move.src_rank == rank:
                    flat = read_expert(move.layer, move.logical).flatten()
                    incoming.append((move, flat))
                continue
            if move.src_rank == rank:
                flat = read_expert(move.layer, move.logical).flatten()
                if flat.numel() != numel:
                    raise ValueError(
                        f"expert layer {move.layer} logical {move.logical} has {flat.numel()} "
                        f"elements, expected {numel} (like)"
                    )
                works.append(group.isend(flat.to(group.device), move.dst_rank, tag))
                sent += 1
            if move.dst_rank == rank:
                buf = torch.empty(numel, dtype=like.dtype, device=group.device)
                works.append(group.irecv(buf, move.src_rank, tag))
                incoming.append((move, buf))
                received += 1
        for work in works:
            work.wait()
        for move, buf in incoming:
            write_expert(move, experts_mod.ExpertWeights.unflatten(buf, like))
    return TransferStats(sent, received, sent * numel * elem, received * numel * elem)


def broadcast_state(
    group: group_mod.StatelessGroup,
    tensors: Mapping[str, torch.Tensor] | None,
    *,
    src: int,
) -> dict[str, torch.Tensor]:
    """Every rank gets rank ``src``'s ``tensors`` (name -> tensor; None on the other ranks).

    Collective over the whole group. Returns new tensors on the group's device (on ``src``, the
    given tensors themselves).
    """
    is_src = group.rank == src
    source: Mapping[str, torch.Tensor] = {}
    if is_src:
        if tensors is None:
            raise ValueError(f"rank {src} is the source: pass the tensors to send")
        source = tensors
        meta = [
            [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
            for name, t in tensors.items()
        ]
        blob = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
        size = torch.tensor([blob.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    device = group.device
    size = size.to(device)
    group.broadcast(size, src)
    if not is_src:
        blob = torch.empty(int(size.item()), dtype=torch.uint8)
    blob = blob.to(device)
    group.broadcast(blob, src)
    meta = json.loads(bytes(blob.cpu().tolist()).decode())
    out: dict[str, torch.Tensor] = {}
    for bucket in _buckets(meta):
        dtype = getattr(torch, bucket[0][1])
        sizes = [_numel(shape) for _, _, shape in bucket]
        if is_src:
            flat = torch.cat([source[name].reshape(-1).to(device) for name, _, _ in bucket])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        group.broadcast(flat, src)
        if not is_src:
            for (name, _, shape), part in zip(bucket, torch.split(flat, sizes), strict=True):
                out[name] = part.view(shape)
    return dict(source) if is_src else out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _buckets(meta: list[list[Any]]) -> list[list[list[Any]]]:
    """Consecutive runs of one dtype, each at most BUCKET_BYTES (a bigger tensor goes alone)."""
    buckets: list[list[list[Any]]] = []
    used = 0
    for entry in meta:
        nbytes = _numel(entry[2]) * getattr(torch, entry[1]).itemsize
        if not buckets or buckets[-1][0][1] != entry[1] or used + nbytes > BUCKET_BYTES:
            buckets.append([])
            used = 0
        buckets[-1].append(entry)
        used += nbytes
    return buckets
