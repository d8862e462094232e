"""Throughput of the expert-parallel forward pass on synthetic://small, at 1 and 2 ranks.

Each rank is a spawned process (one torch thread) holding the whole non-expert model and only
its slots of an identity placement (P = E = 32 slots per layer, so 16 per rank at 2 ranks); the
ranks talk over a local gloo StatelessGroup. Every rank runs its own batch (data parallel) and
the experts run where they live (expert parallel), so the ideal 2-rank throughput is twice the
1-rank one. Two workloads:

- prefill: 8 sequences x 32 new tokens per rank per forward (fresh KV cache each time);
- decode: 32 sequences x 1 token per rank per forward (after a 16-token prefill).

Prints tokens/s summed over ranks, the 2-rank / 1-rank ratio, tokens per CPU-second (which does
not depend on what else the machine runs: on a shared or oversubscribed machine the wall-clock
ratio mostly measures contention, since lockstep ranks wait for each other at every
all-to-all), and the share of rank 0's wall time spent in the all-to-alls (transfer plus
waiting for the other rank).

Run: .venv/bin/python bench/forward.py  (about a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import time
from typing import Any

import torch

from moe_runtime.comm import ep, group
from moe_runtime.eplb import policy
from moe_runtime.model import decoder, source
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod

MODEL = "synthetic://small?seed=0"


class TimedGroup:
    """Delegates to a StatelessGroup and adds up the seconds spent in all_to_all_single."""

    def __init__(self, inner: group.StatelessGroup) -> None:
        self.inner = inner
        self.a2a_seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        self.inner.all_to_all_single(*args, **kwargs)
        self.a2a_seconds += time.perf_counter() - start


def _random_batch(
    gen: torch.Generator, vocab: int, num_seqs: int, length: int, prefix: str
) -> kv_mod.ForwardBatch:
    tokens = torch.randint(3, vocab, (num_seqs, length), generator=gen).tolist()
    return kv_mod.ForwardBatch(
        seq_ids=[f"{prefix}{i}" for i in range(num_seqs)],
        token_ids=tokens,
        start_pos=[0] * num_seqs,
    )


def _rank_main(rank: int, spec: group.GroupSpec, args: dict[str, int], out: Any) -> None:
    torch.set_num_threads(1)
    src = source.open_source(MODEL)
    cfg = src.config
    num_ranks = spec.world_size
    placement = policy.identity(cfg.num_moe_layers, cfg.num_experts, cfg.num_experts, num_ranks)
    local = {
        (layer, slot): experts_mod.load_expert(src, layer, int(placement.phy2log[layer, slot]))
        for layer in range(cfg.num_moe_layers)
        for slot in placement.slots_of_rank(rank, num_ranks)
    }
    model = decoder.MoEModel.from_source(src)
    grp = group.StatelessGroup(spec, rank)
    timed = TimedGroup(grp)
    backend = ep.ExpertParallelBackend(timed, placement, local)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(rank)
    results: dict[str, float] = {}

    # prefill
    batch = _random_batch(gen, cfg.vocab_size, args["prefill_seqs"], args["prefill_len"], "p")
    model.forward(batch, kv_mod.KVCache(cfg), backend)  # warm-up
    grp.barrier()
    timed.a2a_seconds = 0.0
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args["prefill_iters"]):
        model.forward(batch, kv_mod.KVCache(cfg), backend)
    grp.barrier()
    results["prefill_s"] = time.perf_counter() - start
    results["prefill_cpu_s"] = time.process_time() - cpu
    results["prefill_a2a_s"] = timed.a2a_seconds
    results["prefill_tokens"] = args["prefill_iters"] * batch.num_tokens

    # decode
    kv = kv_mod.KVCache(cfg)
    prompt = _random_batch(gen, cfg.vocab_size, args["decode_seqs"], 16, "d")
    logits = model.forward(prompt, kv, backend)
    next_ids = torch.argmax(logits, dim=-1).tolist()
    grp.barrier()
    timed.a2a_seconds = 0.0
    start, cpu = time.perf_counter(), time.process_time()
    for step in range(args["decode_steps"]):
        batch = kv_mod.ForwardBatch(
            seq_ids=prompt.seq_ids,
            token_ids=[[t] for t in next_ids],
            start_pos=[16 + step] * len(next_ids),
        )
        next_ids = torch.argmax(model.forward(batch, kv, backend), dim=-1).tolist()
    grp.barrier()
    results["decode_s"] = time.perf_counter() - start
    results["decode_cpu_s"] = time.process_time() - cpu
    results["decode_a2a_s"] = timed.a2a_seconds
    results["decode_tokens"] = args["decode_steps"] * len(next_ids)
    grp.destroy()
    out.put((rank, results))


def run(num_ranks: int, args: dict[str, int]) -> list[dict[str, float]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    spec = group.GroupSpec.local(num_ranks, epoch=0)
    procs = [
        ctx.Process(target=_rank_main, args=(r, spec, args, out), daemon=True)
        for r in range(num_ranks)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, dict[str, float]] = {}
    deadline = time.monotonic() + 600
    while len(results) < num_ranks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{num_ranks} ranks did not finish")
        try:
            rank, res = out.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a rank process failed") from None
            continue
        results[rank] = res
    for proc in procs:
        proc.join(timeout=30)
    return [results[r] for r in range(num_ranks)]


def _summary(per_rank: list[dict[str, float]], kind: str) -> tuple[float, float, float]:
    """(tokens/s over all ranks, tokens per CPU-second, rank 0's all-to-all share of wall)."""
    tokens = sum(r[f"{kind}_tokens"] for r in per_rank)
    seconds = max(r[f"{kind}_s"] for r in per_rank)
    cpu = sum(r[f"{kind}_cpu_s"] for r in per_rank)
    return tokens / seconds, tokens / cpu, per_rank[0][f"{kind}_a2a_s"] / per_rank[0][f"{kind}_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prefill-iters", type=int, default=4)
    parser.add_argument("--decode-steps", type=int, default=24)
    opts = parser.parse_args()
    args = {
        "prefill_seqs": 8,
        "prefill_len": 32,
        "prefill_iters": opts.prefill_iters,
        "decode_seqs": 32,
        "decode_steps": opts.decode_steps,
    }
    print(f"model {MODEL}; torch threads per rank: 1; cores: {multiprocessing.cpu_count()}")
    table: dict[int, dict[str, tuple[float, float, float]]] = {}
    for num_ranks in opts.ranks:
        per_rank = run(num_ranks, args)
        table[num_ranks] = {k: _summary(per_rank, k) for k in ("prefill", "decode")}
        for kind, (tps, per_cpu, a2a) in table[num_ranks].items():
            print(
                f"ranks={num_ranks} {kind:8s} {tps:9.1f} tokens/s  {per_cpu:9.1f} tokens/CPU-s  "
                f"all-to-all share of rank 0 wall time {100 * a2a:5.1f}%",
                flush=True,
            )
    if 1 in table and len(table) > 1:
        for num_ranks in sorted(table):
            if num_ranks == 1:
                continue
            for kind in ("prefill", "decode"):
                ratio = table[num_ranks][kind][0] / table[1][kind][0]
                print(f"{kind}: {num_ranks} ranks / 1 rank = {ratio:.2f}x (ideal {num_ranks}x)")


if __name__ == "__main__":
    main()
