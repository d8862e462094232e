"""Weight moves between rank actors of one Ray node through Ray's object store (shared
memory), instead of the transfer group's gloo connections.

Measured on this machine (2 cores, CPU ranks): gloo over loopback moves ~0.27 GB/s per
receiver and keeps both ends' CPUs busy in the TCP stack (docs/INTERNALS.md, "Ray 2.60 rules"), so the ~0.8 GB of
experts a 2→4 grow of synthetic `small` moves took seconds of Transferring and slowed the
serving steps meanwhile. Through the object store the sender copies each expert once into
shared memory (memcpy speed) and the receiver copies it out once; nothing crosses a socket.
Ranks on different nodes (different pods) and GPU ranks (NCCL) keep the transfer group.

- `split_moves`: the moves whose two ranks share a node (CPU ranks only), and the rest;
- `pack_experts` / `unpack_experts`: expert weights as raw byte arrays (any dtype, bfloat16
  included) and back into private tensors (copied out of the object store, so nothing the
  rank serves with stays pinned there);
- `pack_state` / `unpack_state`: the same for non-expert weights.

Every member is still called once per staging (`RankActor.stage_experts_shared`) with the
moves left for the transfer group (the same list on every member) plus the object refs of
what its co-located peers export for it, in chunks (`exporters`); the member copies each chunk
out as soon as it is in the object store, while its peers put the next ones in (measured on a
loaded 2-core machine: a receiver that waited for all its refs before copying spent ~1.3 s
waiting then ~3 s copying 0.55 GB; the copy, not the waiting, is the CPU cost).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from moe_runtime.eplb import moves as moves_mod
from moe_runtime.model import experts as experts_mod

#: (layer, logical) -> (dtype name, activation, [(part, shape, bytes) for every tensor]).
PackedExperts = dict[
    tuple[int, int],
    tuple[str, experts_mod.Activation, list[tuple[str, tuple[int, ...], np.ndarray]]],
]
PackedState = dict[str, tuple[str, tuple[int, ...], np.ndarray]]


def split_moves(
    moves: Sequence[moves_mod.ExpertMove],
    members: Sequence[int],
    node_of: Callable[[int], str],
) -> tuple[dict[tuple[int, int], list[moves_mod.ExpertMove]], list[moves_mod.ExpertMove]]:
    """({(src member, dst member): moves between ranks of one node}, the other moves).

    A move's src_rank / dst_rank index `members` (the transfer group's order); a move to
    itself stays with the rest (the worker copies it locally). Pure.
    """
    shared: dict[tuple[int, int], list[moves_mod.ExpertMove]] = {}
    rest: list[moves_mod.ExpertMove] = []
    for move in moves:
        src, dst = members[move.src_rank], members[move.dst_rank]
        if src != dst and node_of(src) == node_of(dst):
            shared.setdefault((src, dst), []).append(move)
        else:
            rest.append(move)
    return shared, rest


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy()


def _tensor_of(dtype: str, shape: Sequence[int], data: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # The array is a read-only view of the object store; it is copied at once.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data)
    return raw.view(getattr(torch, dtype)).view(tuple(shape)).clone()


def pack_experts(experts: Mapping[tuple[int, int], experts_mod.ExpertWeights]) -> PackedExperts:
    """Expert weights as byte arrays (Ray puts numpy arrays in the object store as they are)."""
    out: PackedExperts = {}
    for key, w in experts.items():
        dtype = str(w.dtype).removeprefix("torch.")
        parts = [(part, tuple(t.shape), _bytes_of(t)) for part, t in w.tensors().items()]
        out[key] = (dtype, w.activation, parts)
    return out


def unpack_experts(
    parts: Sequence[PackedExperts], *, dtype: torch.dtype, device: str
) -> tuple[dict[tuple[int, int], experts_mod.ExpertWeights], int]:
    """Private copies of the experts in `parts` (packed by peers), and their bytes."""
    out: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
    nbytes = 0
    for part in parts:
        for key, (name, activation, arrays) in part.items():
            tensors = {p: _tensor_of(name, shape, data) for p, shape, data in arrays}
            nbytes += sum(int(data.nbytes) for _, _, data in arrays)
            weights = experts_mod.ExpertWeights(activation, **tensors)
            out[key] = weights.to(dtype=dtype, device=device)
    return out, nbytes


def pack_state(tensors: Mapping[str, torch.Tensor]) -> PackedState:
    """Named tensors (non-expert weights) as byte arrays."""
    return {
        name: (str(t.dtype).removeprefix("torch."), tuple(t.shape), _bytes_of(t))
        for name, t in tensors.items()
    }


def unpack_state(state: PackedState) -> tuple[dict[str, torch.Tensor], int]:
    """Private copies of packed named tensors, and their bytes."""
    out = {name: _tensor_of(dtype, shape, data) for name, (dtype, shape, data) in state.items()}
    return out, sum(int(data.nbytes) for _, _, data in state.values())


#: Experts per export (~6 MB each in synthetic `small`): a receiver copies one chunk out while
#: its peers still put the next ones in.
EXPORT_CHUNK = 8


def exporters(
    shared: Mapping[tuple[int, int], Sequence[moves_mod.ExpertMove]],
    *,
    chunk: int = EXPORT_CHUNK,
) -> list[tuple[tuple[int, int], list[tuple[int, int]]]]:
    """[((src member, dst member), the (layer, logical) keys of one export)] in the order to
    submit them: each pair's keys (each once) in chunks of `chunk`, the pairs of one sender
    taken in turn, so that every receiver gets its first chunk early. Pure."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    per_pair = {
        pair: sorted({(m.layer, m.logical) for m in pair_moves})
        for pair, pair_moves in sorted(shared.items())
    }
    chunks = {
        pair: [keys[i : i + chunk] for i in range(0, len(keys), chunk)]
        for pair, keys in per_pair.items()
    }
    out: list[tuple[tuple[int, int], list[tuple[int, int]]]] = []
    for turn in range(max((len(c) for c in chunks.values()), default=0)):
        out += [(pair, c[turn]) for pair, c in chunks.items() if turn < len(c)]
    return out


def received_by(refs: Sequence[tuple[tuple[int, int], Any]], member: int) -> list[Any]:
    """The export refs addressed to `member`, in submission order."""
    return [ref for (_, dst), ref in refs if dst == member]
