"""Serving benchmark: throughput and latency at DP=1 and DP=2, and compiled-graph overhead.

Runs the engine in process over a RayExecutor on a local Ray instance (loopback), so the
figures are the engine's and the ranks' (no HTTP). For each DP size: `--requests` completions
(prompt of `--prompt-len` tokens, exactly `--max-tokens` generated, EOS ignored) sent by
`--concurrency` client threads; prints output tokens/s, TTFT and inter-token latency (p50/p99)
and the mean step time. Then, on the last DP size, the per-step overhead of a step driven
through the Ray compiled graph versus plain actor calls (a `ray_step.StepPath` without a
graph), timed in the same run on empty batches (every rank still runs its forward pass and
expert collectives with no tokens), as a ratio.

    .venv/bin/python bench/serve.py                  # ~2-3 min on 2 CPU cores
    .venv/bin/python bench/serve.py --dp 1 2 4 --requests 64
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field

from moe_runtime import step as step_types
from moe_runtime.engine import core, seam
from moe_runtime.engine import request as req
from moe_runtime.eplb import policy
from moe_runtime.executor import cluster, ray_executor, ray_step
from moe_runtime.model import config as config_mod
from moe_runtime.model import source as source_mod


@dataclass
class Timings:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def run_load(engine: core.Engine, args: argparse.Namespace, vocab: int) -> tuple[Timings, float]:
    timings = Timings()
    lock = threading.Lock()
    next_index = iter(range(args.requests))

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            prompt = [(7 * i + 13 * k) % (vocab - 2) for k in range(args.prompt_len)]
            request = req.Request(
                request_id=f"bench-{i}",
                prompt_token_ids=prompt,
                max_tokens=args.max_tokens,
                ignore_eos=True,
            )
            start = time.monotonic()
            last = start
            first: float | None = None
            gaps: list[float] = []
            n = 0
            error = None
            for out in engine.add_request(request).iter_outputs(timeout=300):
                now = time.monotonic()
                if out.new_token_ids:
                    if first is None:
                        first = now - start
                    else:
                        gaps.append(now - last)
                    last = now
                    n += len(out.new_token_ids)
                error = out.error
            with lock:
                timings.tokens += n
                timings.itl.extend(gaps)
                if first is not None:
                    timings.ttft.append(first)
                if error is not None:
                    timings.errors += 1

    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return timings, time.monotonic() - started


@dataclass
class Measured:
    """One executor under `run_load`: the clients' timings, the load's wall seconds, the mean
    step time under it and the engine's step count after it."""

    timings: Timings
    wall: float
    step_s: float
    last_step: int

    def columns(self) -> str:
        """tok/s, TTFT p50/p99, ITL p50/p99 and step time, as the tables print them."""
        t = self.timings
        return (
            f"{t.tokens / self.wall:>8.1f} {pct(t.ttft, 50) * 1e3:>7.0f}ms"
            f" {pct(t.ttft, 99) * 1e3:>7.0f}ms {pct(t.itl, 50) * 1e3:>6.0f}ms"
            f" {pct(t.itl, 99) * 1e3:>6.0f}ms {self.step_s * 1e3:>6.1f}ms"
        )


COLUMNS = f"{'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'step':>8}"


def start(executor: ray_executor.RayExecutor, model: str, cfg: config_mod.ModelConfig) -> None:
    """Load `model` on the executor's ranks, its experts spread evenly (identity placement)."""
    dp = executor.num_ranks
    num_physical = -(-cfg.num_experts // dp) * dp
    executor.start(
        model,
        placement=policy.identity(cfg.num_moe_layers, cfg.num_experts, num_physical, dp),
    )


def measure(
    executor: ray_executor.RayExecutor, src: source_mod.ModelSource, args: argparse.Namespace
) -> Measured:
    """An engine over the started executor: one warm-up request, then `run_load`."""
    cfg = src.config
    engine = core.Engine(
        executor, src.tokenizer(), seam.EngineConfig(max_model_len=cfg.max_position_embeddings)
    )
    with engine:
        warm = req.Request(request_id="warm", prompt_token_ids=[1, 2, 3], max_tokens=4)
        engine.add_request(warm).result(timeout=300)
        before = engine.stats().step_count
        clock = time.monotonic()
        timings, wall = run_load(engine, args, cfg.vocab_size)
        steps = engine.stats().step_count - before
        step_s = (time.monotonic() - clock) / max(1, steps)
        last_step = engine.stats().step_count
    return Measured(timings, wall, step_s, last_step)


def step_overhead(
    executor: ray_executor.RayExecutor, *, steps: int, first_id: int
) -> dict[str, float]:
    """Mean seconds of an empty lockstep step: compiled graph vs plain actor calls."""
    ranks = executor.ranks
    plain = ray_step.StepPath(compiled=False, compile_timeout=60)  # plain actor calls
    plain.set(ranks, [executor.roster.member(r).handle.actor for r in ranks])
    results: dict[str, float] = {}
    step_id = first_id
    for name, run in (
        ("compiled", executor.execute_step),
        ("actor calls", lambda step: plain.execute(step, timeout=60)),
        ("compiled again", executor.execute_step),
    ):
        samples = []
        for _ in range(steps):
            step_id += 1
            batches = {r: step_types.RankBatch() for r in ranks}
            t = time.perf_counter()
            run(step_types.StepInput(step_id=step_id, batches=batches))
            samples.append(time.perf_counter() - t)
        results[name] = statistics.median(samples)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic://small?seed=0")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--overhead-steps", type=int, default=50)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    src = source_mod.open_source(args.model)
    cfg = src.config
    t0 = time.monotonic()
    owns = cluster.connect(num_rank_slots=max(8, *args.dp))
    print(
        f"model {args.model}: {cfg.num_layers} layers, {cfg.num_experts} experts, top-{cfg.top_k}"
    )
    print(
        f"load: {args.requests} requests, {args.concurrency} concurrent, prompt {args.prompt_len}"
        f" tokens, {args.max_tokens} generated each"
    )
    header = f"{'DP':>3} {COLUMNS} {'load s':>7}"
    rows: list[str] = []
    overhead: dict[str, float] = {}
    try:
        for dp in args.dp:
            loaded = time.monotonic()
            executor = ray_executor.RayExecutor(dp)
            try:
                start(executor, args.model, cfg)
                load_s = time.monotonic() - loaded
                measured = measure(executor, src, args)
                errors = measured.timings.errors
                rows.append(
                    f"{dp:>3} {measured.columns()} {load_s:>7.1f}"
                    + (f"  ({errors} errors)" if errors else "")
                )
                if len(rows) == 1:
                    print(header)
                print(rows[-1], flush=True)
                if dp == args.dp[-1]:
                    overhead = step_overhead(
                        executor, steps=args.overhead_steps, first_id=measured.last_step + 1000
                    )
            finally:
                executor.shutdown()
    finally:
        if owns:
            cluster.disconnect()
    if overhead:
        compiled = min(overhead["compiled"], overhead["compiled again"])
        plain = overhead["actor calls"]
        print(
            f"\nempty-step overhead at DP={args.dp[-1]} (median of {args.overhead_steps}): "
            f"compiled graph {compiled * 1e3:.2f} ms, plain actor calls {plain * 1e3:.2f} ms, "
            f"ratio actor/compiled = {plain / compiled:.2f}x"
        )
    print(f"total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
