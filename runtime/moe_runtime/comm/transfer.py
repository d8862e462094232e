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

Paths (chosen by the group's backend, `executor`'s transfer group): NCCL moves GPU memory to GPU
memory; gloo moves host memory, so weights on a GPU are copied through page-locked (pinned)
host buffers (`to_group`, `recv_buffer`: DMA at full PCIe speed, no pageable staging). On a GPU
every copy and the transfer group's kernels run on a CUDA stream of their own (`side_stream`):
the steps' work on the default stream neither waits for a transfer nor holds it up. Buffers in
flight are bounded in bytes (`MAX_BYTES_IN_FLIGHT`) as well as in moves.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.model import experts as experts_mod

# Most bytes one broadcast bucket holds, to bound the extra memory of packing.
BUCKET_BYTES = 64 << 20
#: Most bytes of expert buffers one rank holds in flight (a window of moves is cut to fit; one
#: Mixtral-8x7B expert in bfloat16 is 352 MB, so 32 in flight would be 11 GB).
MAX_BYTES_IN_FLIGHT = 2 << 30


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
    numel = like.numel
    elem = like.dtype.itemsize
    window = max(1, min(max_in_flight, MAX_BYTES_IN_FLIGHT // max(1, numel * elem)))
    with side_stream():
        return _execute_moves(
            group,
            moves,
            read_expert=read_expert,
            write_expert=write_expert,
            like=like,
            window=window,
        )


def _execute_moves(
    group: group_mod.StatelessGroup,
    moves: Sequence[moves_mod.ExpertMove],
    *,
    read_expert: Callable[[int, int], experts_mod.ExpertWeights],
    write_expert: Callable[[moves_mod.ExpertMove, experts_mod.ExpertWeights], None],
    like: experts_mod.ExpertWeights,
    window: int,
) -> TransferStats:
    rank = group.rank
    numel = like.numel
    elem = like.dtype.itemsize
    sent = received = 0
    for start in range(0, len(moves), window):
        works: list[Any] = []
        incoming: list[tuple[moves_mod.ExpertMove, torch.Tensor]] = []
        for tag, move in enumerate(moves[start : start + window], start=start):
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
                works.append(group.isend(to_group(flat, group), move.dst_rank, tag))
                sent += 1
            if move.dst_rank == rank:
                buf = recv_buffer(numel, like.dtype, group)
                works.append(group.irecv(buf, move.src_rank, tag))
                incoming.append((move, buf))
                received += 1
        for work in works:
            work.wait()
        for move, buf in incoming:
            write_expert(move, experts_mod.ExpertWeights.unflatten(served(buf), like))
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
    with side_stream():
        return _broadcast_state(group, tensors, src=src)


def _broadcast_state(
    group: group_mod.StatelessGroup,
    tensors: Mapping[str, torch.Tensor] | None,
    *,
    src: int,
) -> dict[str, torch.Tensor]:
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
            for (name, _, shape), part in zip(
                bucket, torch.split(served(flat), sizes), strict=True
            ):
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


# -- the device side of a transfer ------------------------------------------------------------
_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def _cuda() -> torch.device | None:
    """The CUDA device this process serves on, or None (no GPU, or CUDA never used here)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return None
    return torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def side_stream() -> Iterator[None]:
    """Work issued inside runs on this process's transfer stream (a no-op without CUDA), which
    first waits for what the current stream queued so far; on exit the calling thread waits for
    the transfer stream, no other stream does (module docstring)."""
    device = _cuda()
    if device is None:
        yield
        return
    with _streams_lock:
        stream = _streams.get(device.index or 0)
        if stream is None:
            stream = _streams[device.index or 0] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def to_group(tensor: torch.Tensor, group: group_mod.StatelessGroup) -> torch.Tensor:
    """`tensor` where `group` sends from: itself when on the group's device; a GPU tensor for a
    host group through a pinned buffer (its copy waited for: gloo reads host memory at once)."""
    device = group.device
    if tensor.device == device:
        return tensor
    if device.type == "cpu" and tensor.is_cuda:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        return host
    return tensor.to(device)


def recv_buffer(numel: int, dtype: torch.dtype, group: group_mod.StatelessGroup) -> torch.Tensor:
    """An uninitialised [numel] buffer to receive into over `group`: on its device; pinned host
    memory for a host group when this process serves on a GPU (the copy up is a DMA)."""
    device = group.device
    pin = device.type == "cpu" and _cuda() is not None
    return torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)


def served(buf: torch.Tensor) -> torch.Tensor:
    """A received GPU buffer handed to the steps: the caching allocator is told the default
    stream uses it (it was allocated on the transfer stream), so its memory is not reused
    before the steps that read it are done."""
    if buf.is_cuda:
        buf.record_stream(torch.cuda.default_stream(buf.device))
    return buf
