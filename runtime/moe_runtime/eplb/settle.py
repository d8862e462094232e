"""Settling a placement: swaps of slots between ranks so that fewer experts must move.

A balanced placement for a resize or a rebalance (``policy.rebalance``) is chosen for the load
alone; many other placements are as balanced, and some leave far more experts where they are
already held (live, retained from an earlier placement, pre-staged on a warm spare). ``settle``
searches for one by greedy pairwise swaps under a load cap. Pure numpy, no torch, no ranks.

Shapes: rows (phy2log) [L, P] int64; load [L, E] float64; holds [L, E, N] bool (rank j holds
expert e); rank r of N holds slots [r * P/N, (r + 1) * P/N) (see ``policy``'s glossary).
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import numpy.typing as npt

_I64: TypeAlias = npt.NDArray[np.int64]
_F64: TypeAlias = npt.NDArray[np.float64]


def settle(
    rows: _I64,
    load: _F64,
    holds: npt.NDArray[np.bool_],
    *,
    num_ranks: int,
    tolerance: float = 0.0,
    nodes: int = 1,
    frozen: npt.NDArray[np.bool_] | None = None,
) -> _I64:
    """Swaps slots between ranks of ``rows`` (phy2log [L, P]) so that fewer experts must move
    to where they are placed, keeping every rank's load within ``tolerance`` of the busiest
    rank's under ``rows``. Pure; returns new rows [L, P].

    load [L, E] (an expert's load is split over its replicas); holds [L, E, N]: rank j holds
    expert e already. The moves of a placement are its (rank, expert) pairs that the rank does
    not hold (``moves.lower_bound_moves``, which ``moves.plan_moves`` achieves). Greedy, per
    layer: the swap of two slots on different ranks (of one node, ``nodes`` equal blocks of
    ranks) that saves the most moves, the one leaving the pair's busier rank least busy on
    ties, while both ranks stay within the cap (the busiest rank's load under ``rows`` x (1 +
    tolerance)) and neither gets a second copy of an expert; until no swap saves any. So the
    moves never grow, and balancedness never drops by more than ``tolerance`` (with 0, no
    layer's busiest rank gets busier). ``frozen`` [L] bool: layers left as they are.

    Vectorised across (layer, node) blocks, several swaps per block and round (on pairwise
    different ranks), over the slots whose rank lacks their expert against the block's slots
    ([L x nodes, M, P / nodes] per round).
    """
    num_layers, num_physical = rows.shape
    nodes = nodes if nodes >= 1 and num_ranks % nodes == 0 else 1
    layer = np.arange(num_layers)
    logcnt = np.zeros(load.shape, dtype=np.int64)
    np.add.at(logcnt, (layer[:, None], rows), 1)
    weight = np.take_along_axis(load / np.maximum(logcnt, 1), rows, axis=1)  # [L, P]
    per = num_physical // num_ranks
    top = weight.reshape(num_layers, num_ranks, per).sum(-1).max(axis=-1)  # [L]
    cap = top * (1.0 + tolerance) + 1e-9 * np.maximum(top, 1.0)
    # Swaps never leave a node: each (layer, node) block of ranks is settled on its own.
    ranks = num_ranks // nodes
    width = num_physical // nodes
    blocks = rows.reshape(num_layers * nodes, width)
    block_holds = (
        holds.reshape(num_layers, holds.shape[1], nodes, ranks)
        .transpose(0, 2, 1, 3)
        .reshape(num_layers * nodes, holds.shape[1], ranks)
    )
    stuck = np.zeros(num_layers, dtype=bool) if frozen is None else frozen
    settled = _settle_blocks(
        blocks,
        weight.reshape(num_layers * nodes, width),
        block_holds,
        num_ranks=ranks,
        cap=np.repeat(cap, nodes),
        frozen=np.repeat(stuck, nodes),
    )
    return settled.reshape(num_layers, num_physical)


def _settle_blocks(
    rows: _I64,
    weight: _F64,
    holds: npt.NDArray[np.bool_],
    *,
    num_ranks: int,
    cap: _F64,
    frozen: npt.NDArray[np.bool_],
) -> _I64:
    """``settle`` over independent blocks: rows [B, P] (slot weights [B, P], holds [B, E, N],
    cap [B]); the swaps of every block in rounds, vectorised across blocks."""
    num_layers, num_physical = rows.shape
    per = num_physical // num_ranks
    out = rows.copy()
    weight = weight.copy()
    layer = np.arange(num_layers)
    rank_of = np.arange(num_physical) // per  # [P]
    rank_load = weight.reshape(num_layers, num_ranks, per).sum(-1)  # [B, N]
    scale = np.where(cap > 0, cap, 1.0)
    in_pack = np.zeros((num_layers, holds.shape[1], num_ranks), dtype=np.int64)  # copies
    np.add.at(in_pack, (layer[:, None], out, rank_of[None, :]), 1)
    active = ~frozen
    while active.any():
        lay = np.flatnonzero(active)
        cur = out[lay]  # [A, P]
        # [A, P]: the slot's expert costs its rank a move (the rank neither holds it nor has
        # another slot of it), which taking it elsewhere saves
        lacks = ~holds[lay[:, None], cur, rank_of[None, :]] & (
            in_pack[lay[:, None], cur, rank_of[None, :]] == 1
        )
        width = int(lacks.sum(axis=1).max())
        if width == 0:
            break
        # p: the costly slots of each layer (padded with other slots, masked by `real`)
        order = np.argsort(~lacks, axis=1, kind="stable")[:, :width]  # [A, M]
        real = np.take_along_axis(lacks, order, axis=1)  # [A, M]
        e_p = np.take_along_axis(cur, order, axis=1)  # [A, M]
        r_p = rank_of[order]  # [A, M]
        # holds of p's expert on q's rank, and of q's expert on p's rank: [A, M, P]
        p_on_q = holds[lay[:, None], e_p][:, :, rank_of]
        q_on_p = np.take_along_axis(
            np.swapaxes(holds[lay[:, None], cur], 1, 2), r_p[:, :, None], axis=1
        )
        gain = 1 + lacks[:, None, :].astype(np.int8) - (~p_on_q) - (~q_on_p).astype(np.int8)
        w_p = np.take_along_axis(weight[lay], order, axis=1)[:, :, None]
        w_q = weight[lay][:, None, :]
        load_p = np.take_along_axis(rank_load[lay], r_p, axis=1)[:, :, None]
        load_q = rank_load[lay][:, rank_of][:, None, :]
        busier = np.maximum(load_p - w_p + w_q, load_q - w_q + w_p)
        copies = in_pack[lay]  # [A, E, N]
        ok = (
            real[:, :, None]
            & (gain > 0)
            & (r_p[:, :, None] != rank_of[None, None, :])
            & (e_p[:, :, None] != cur[:, None, :])
            & (busier <= cap[lay][:, None, None])
            & ~np.take_along_axis(
                np.swapaxes(copies[np.arange(len(lay))[:, None], cur] > 0, 1, 2),
                r_p[:, :, None],
                axis=1,
            )
            & ~(copies[np.arange(len(lay))[:, None], e_p] > 0)[:, :, rank_of]
        )
        score = np.where(ok, gain - 0.5 * busier / scale[lay][:, None, None], -np.inf)
        # Each costly slot's best partner; then several swaps per layer and round, on pairwise
        # different ranks (a swap changes only its two ranks' loads and packs, so the other
        # candidates stay true; one whose partner's rank was touched waits for the next round).
        partner = score.argmax(axis=2)  # [A, M]
        value = np.take_along_axis(score, partner[:, :, None], axis=2)[:, :, 0]  # [A, M]
        partner_rank = rank_of[partner]
        swapped = np.zeros(len(lay), dtype=bool)
        rows = np.arange(len(lay))
        for _ in range(max(1, num_ranks // 2)):
            best = value.argmax(axis=1)  # [A]
            found = np.isfinite(value[rows, best])
            if not found.any():
                break
            swapped |= found
            idx = np.flatnonzero(found)
            p = order[idx, best[idx]]
            q = partner[idx, best[idx]]
            at = lay[idx]
            a_, b_ = out[at, p], out[at, q]
            rp, rq = rank_of[p], rank_of[q]
            wp, wq = weight[at, p], weight[at, q]
            out[at, p], out[at, q] = b_, a_
            weight[at, p], weight[at, q] = wq, wp
            rank_load[at, rp] += wq - wp
            rank_load[at, rq] += wp - wq
            in_pack[at, a_, rp] -= 1
            in_pack[at, b_, rq] -= 1
            in_pack[at, b_, rp] += 1
            in_pack[at, a_, rq] += 1
            touched = np.zeros((len(lay), num_ranks), dtype=bool)
            touched[idx, rp] = True
            touched[idx, rq] = True
            stale = np.take_along_axis(touched, r_p, axis=1) | np.take_along_axis(
                touched, partner_rank, axis=1
            )
            value[stale] = -np.inf
        active[lay[~swapped]] = False  # no swap saves anything there any more
    return out
