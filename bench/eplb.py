"""EPLB compute: ``policy.rebalance`` at DeepSeek-V3's shape, vectorised versus the loop original.

DeepSeek-V3 has 58 MoE layers of 256 routed experts in 8 groups. The placements timed here,
all over 8 nodes:

- 64 ranks, 320 slots (5 per rank: 256 experts + 64 redundant; 288 slots do not divide over 64
  ranks, and ``rebalance`` needs equal slots per rank);
- 32 ranks, 288 slots (9 per rank: 256 + 32 redundant, DeepSeek's own count);

each with num_groups=1 (global policy: one node's worth of packing over all ranks) and
num_groups=8 (hierarchical, as DeepSeek runs it: groups packed onto nodes first). The load is a
Zipf(0.5) skew per layer, shuffled over the experts (the hottest expert ~8x the mean, printed). For each case: the median of
``--runs`` calls of ``policy.rebalance`` (vectorised across layers) and of
``eplb_reference.rebalance`` (the loop-by-loop original it replaced), their ratio, whether the
placements are identical, and the balancedness (mean / max rank load; 1.0 is perfect) of the
result and of the identity placement. Then the periodic path at an unchanged size after a 30%
load drift: ``moves.rebalance_for_resize(..., settle=False)`` (``rebalance``, then ranks
relabelled to keep experts in place; vectorised too; before =
``eplb_reference.rebalance_for_resize``) and ``moves.rebalance_for_resize`` (that, then ``settle``:
slot swaps that keep more experts in place within ``--tolerance`` of balance), with the expert
moves of each. Both tables are printed with torch's default thread count and with one thread:
on a busy machine torch's intra-op threads make every tiny op of the original cost
milliseconds, so the one-thread table is the fairer comparison of the algorithms.

    .venv/bin/python bench/eplb.py              # ~30 s on 2 busy cores
    .venv/bin/python bench/eplb.py --runs 21 --no-reference
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from moe_runtime.eplb import moves, policy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.support import eplb_reference  # noqa: E402  (the loop-by-loop original, the oracle)

LAYERS, EXPERTS, NODES = 58, 256, 8
CASES = [(64, 320, 1), (64, 320, 8), (32, 288, 1), (32, 288, 8)]  # (ranks, slots, groups)


def zipf_load(layers: int, experts: int, seed: int) -> torch.Tensor:
    """[L, E] int64: a random permutation of a Zipf(0.5) profile per layer, ~1M tokens a layer."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.rand(layers, experts, generator=gen).argsort(-1) + 1
    profile = 1.0 / order.to(torch.float64) ** 0.5
    noise = 1.0 + 0.1 * torch.rand(layers, experts, generator=gen, dtype=torch.float64)
    return (1e6 * profile * noise / profile.sum(-1, keepdim=True)).round().to(torch.int64)


def median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up (first-call allocations, imports)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def rebalance_table(load: torch.Tensor, args: argparse.Namespace) -> None:
    header = (
        f"{'ranks':>5} {'slots':>5} {'groups':>6} {'mode':>6} | {'new ms':>8} {'old ms':>8} "
        f"{'speedup':>7} {'same':>5} | {'balanced':>8} {'identity':>8}"
    )
    print(header)
    print("-" * len(header))
    for ranks, slots, groups in CASES:
        mode = "hier" if groups % NODES == 0 else "global"

        def new_fn(r: int = ranks, s: int = slots, g: int = groups) -> policy.Placement:
            return policy.rebalance(load, s, r, NODES, g)

        def old_fn(r: int = ranks, s: int = slots, g: int = groups) -> policy.Placement:
            return eplb_reference.rebalance(load, s, r, NODES, g)

        new = new_fn()
        new_ms = median_ms(new_fn, args.runs)
        old_text = speed_text = same_text = "-"
        if not args.no_reference:
            old_ms = median_ms(old_fn, max(3, args.runs // 2))
            old_text, speed_text = f"{old_ms:8.1f}", f"{old_ms / new_ms:6.1f}x"
            same_text = "yes" if new.equals(old_fn()) else "NO"
        plain = policy.identity(LAYERS, EXPERTS, slots, ranks)
        print(
            f"{ranks:>5} {slots:>5} {groups:>6} {mode:>6} | {new_ms:8.2f} {old_text:>8} "
            f"{speed_text:>7} {same_text:>5} | {policy.balancedness(load, new, ranks):8.4f} "
            f"{policy.balancedness(load, plain, ranks):8.4f}"
        )


def periodic_table(load: torch.Tensor, args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(args.seed + 1)
    drift = 1.0 + 0.3 * torch.randn(LAYERS, EXPERTS, generator=gen, dtype=torch.float64)
    drifted = (load.to(torch.float64) * drift).clamp(min=0)
    print(
        "periodic rebalance at the same size after a 30% drift, tolerance "
        f"{args.tolerance}: rebalance_for_resize with settle=False (policy.rebalance + "
        "relabelling), then with settle (swaps that keep experts in place):"
    )
    for ranks, slots, groups in CASES:
        old = policy.rebalance(load, slots, ranks, NODES, groups)
        kw: dict[str, Any] = {
            "old_num_ranks": ranks,
            "new_num_ranks": ranks,
            "num_physical": slots,
            "num_nodes": NODES,
            "num_groups": groups,
            "tolerance": args.tolerance,
        }

        def relabel_fn(o: policy.Placement = old, kw: dict[str, Any] = kw) -> policy.Placement:
            return moves.rebalance_for_resize(drifted, o, **kw, settle=False)

        def settle_fn(o: policy.Placement = old, kw: dict[str, Any] = kw) -> policy.Placement:
            return moves.rebalance_for_resize(drifted, o, **kw)

        def old_fn(o: policy.Placement = old, kw: dict[str, Any] = kw) -> policy.Placement:
            return eplb_reference.rebalance_for_resize(drifted, o, **kw)

        relabelled, settled = relabel_fn(), settle_fn()
        runs = max(3, args.runs // 2)
        old_text = "-"
        if not args.no_reference:
            same = "same" if relabelled.equals(old_fn()) else "DIFFERENT"
            old_text = f"{median_ms(old_fn, runs):6.1f} ms before ({same})"

        def moved(target: policy.Placement, o: policy.Placement = old, n: int = ranks) -> int:
            return len(moves.plan_moves(o, target, old_num_ranks=n, new_num_ranks=n))

        print(
            f"  ranks {ranks:>2} slots {slots} groups {groups}: relabel "
            f"{median_ms(relabel_fn, runs):6.1f} ms, {old_text}; with settle "
            f"{median_ms(settle_fn, runs):6.1f} ms; expert moves {moved(relabelled)} -> "
            f"{moved(settled)}; balancedness {policy.balancedness(drifted, old, ranks):.4f} -> "
            f"{policy.balancedness(drifted, relabelled, ranks):.4f} / "
            f"{policy.balancedness(drifted, settled, ranks):.4f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed calls per case (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the slow loop-by-loop original"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="the periodic path's tolerance (the runtime's eplb_min_gain, 0.02)",
    )
    args = parser.parse_args()
    load = zipf_load(LAYERS, EXPERTS, args.seed)
    hot = float((load.max(-1).values / load.to(torch.float64).mean(-1)).mean())
    print(
        f"load [L, E] = [{LAYERS}, {EXPERTS}], {NODES} nodes, median of {args.runs} runs; "
        f"hottest expert {hot:.1f}x the mean"
    )
    default_threads = torch.get_num_threads()
    for threads in sorted({default_threads, 1}, reverse=True):
        # torch's intra-op threads cost milliseconds per tiny op on a busy machine, which is
        # most of the original's time there: show both so the gain is not only that.
        torch.set_num_threads(threads)
        print(f"\n== torch threads {threads} ==")
        rebalance_table(load, args)
        periodic_table(load, args)
    torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
