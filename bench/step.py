"""Step overhead at DP=2: an empty RayExecutor step versus a bare Ray compiled graph and plain
actor calls, and where the difference goes.

Measured in one run, one phase after the other (a live compiled graph keeps its actors
busy-waiting, so two phases never overlap on this machine's cores), medians of `--steps`:

1. plain actor calls: ``ray.get([a.noop.remote(i) for a in actors])`` over 2 actors that do
   nothing (an int in, the int out);
2. bare compiled graph over those 2 actors: ``InputNode -> [a.noop] -> MultiOutputNode``;
3. the same bare graph carrying the executor's payload, no work: the empty StepInput in and
   out the [L, E] expert-load tensor in a dict (Ray serialises the tensor: what a StepOutput
   cost before), a StepOutput (which now packs it as bytes), a StepOutput without it;
4. RayExecutor at DP=2 serving `--model`: an empty step (every rank's batch empty) through its
   compiled graph, then through plain actor calls (a `ray_step.StepPath` without a graph);
   then a step in which rank 0 decodes one token and rank 1 is idle (it still joins the
   expert collectives).

Then the breakdown, in this process without Ray: pickling StepInput/StepOutput, and a
RankWorker's `execute_step` with no tokens at DP=2 over a gloo group (two worker processes,
as on Ray), split into the model's forward over zero tokens, the expert collectives inside it
(every MoE layer's all-to-alls, run even for zero rows) and the rest.

    .venv/bin/python bench/step.py                  # ~1 min on 2 busy cores
    .venv/bin/python bench/step.py --steps 200 --model synthetic://small?seed=0
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.dag
import torch

from moe_runtime import step as step_types
from moe_runtime.comm import ep, group
from moe_runtime.eplb import policy
from moe_runtime.executor import cluster, ray_executor, ray_step
from moe_runtime.model import decoder
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import source as source_mod

DP = 2


class Bare:
    """An actor that does nothing: the floor of what one step can cost on Ray."""

    def noop(self, value: Any) -> Any:
        return value

    def step_like(self, step: step_types.StepInput) -> step_types.StepOutput:
        """What a rank answers to an empty step, with no work: the same object sizes."""
        return step_types.StepOutput(rank=0, step_id=step.step_id, expert_load=self.load)

    def step_like_tensor(self, step: step_types.StepInput) -> dict[str, Any]:
        """The same fields in a dict, so Ray serialises the tensor itself (what a StepOutput
        cost before it packed its expert load as bytes)."""
        return {"rank": 0, "step_id": step.step_id, "tokens": {}, "expert_load": self.load}

    def step_like_no_load(self, step: step_types.StepInput) -> step_types.StepOutput:
        """The same answer without the expert-load tensor: what the tensor costs to send."""
        return step_types.StepOutput(rank=0, step_id=step.step_id)

    def set_load_shape(self, layers: int, experts: int) -> None:
        self.load = torch.zeros(layers, experts, dtype=torch.int64)


def median_ms(fn: Callable[[int], object], steps: int) -> float:
    for i in range(5):  # warm-up
        fn(-1 - i)
    samples = []
    for i in range(steps):
        start = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def empty_step(step_id: int) -> step_types.StepInput:
    return step_types.StepInput(
        step_id=step_id, batches={r: step_types.RankBatch() for r in range(DP)}
    )


def bare_figures(steps: int, layers: int, experts: int) -> dict[str, float]:
    remote_bare = ray.remote(num_cpus=0)(Bare)
    actors = [remote_bare.remote() for _ in range(DP)]  # type: ignore[attr-defined]
    ray.get([a.set_load_shape.remote(layers, experts) for a in actors])
    out: dict[str, float] = {}
    out["plain actor calls"] = median_ms(
        lambda i: ray.get([a.noop.remote(i) for a in actors]), steps
    )
    for name, method, make in (
        ("bare compiled graph", "noop", lambda i: i),
        ("bare graph, tensor as is", "step_like_tensor", empty_step),
        ("bare graph, StepOutput", "step_like", empty_step),
        ("bare graph, no expert load", "step_like_no_load", empty_step),
    ):
        with ray.dag.InputNode() as inp:
            dag = ray.dag.MultiOutputNode([getattr(a, method).bind(inp) for a in actors])
        graph = dag.experimental_compile()
        try:
            out[name] = median_ms(
                lambda i, g=graph, mk=make: ray.get(g.execute(mk(i))),  # type: ignore[misc]
                steps,
            )
        finally:
            graph.teardown()
    for a in actors:
        ray.kill(a)
    return out


def executor_figures(model: str, steps: int) -> dict[str, float]:
    cfg = source_mod.open_source(model).config
    executor = ray_executor.RayExecutor(DP)
    try:
        physical = policy.num_physical_for(cfg.num_experts, DP)
        executor.start(
            model, placement=policy.identity(cfg.num_moe_layers, cfg.num_experts, physical, DP)
        )
        first = 10_000
        compiled = median_ms(lambda i: executor.execute_step(empty_step(first + i)), steps)
        plain = ray_step.StepPath(compiled=False, compile_timeout=60)  # plain actor calls
        plain.set(executor.ranks, [executor.roster.member(r).handle.actor for r in executor.ranks])
        remote = median_ms(lambda i: plain.execute(empty_step(2 * first + i), timeout=60), steps)
        # Rank 0 decodes one token per step, rank 1 is idle (its batch is empty, but it must
        # join the expert collectives): the per-step cost a lightly loaded deployment pays.
        greedy = step_types.SamplingParams()
        prompt = [1, 5, 9, 23, 44]
        prefill = step_types.SeqWork("bench", prompt, 0, greedy)
        executor.execute_step(
            step_types.StepInput(step_id=3 * first, batches={0: step_types.RankBatch([prefill])})
        )
        position = [len(prompt)]

        def one_decode(i: int) -> object:
            work = step_types.SeqWork("bench", [7], position[0], greedy, position[0] - len(prompt))
            position[0] += 1
            batches = {0: step_types.RankBatch([work]), 1: step_types.RankBatch()}
            return executor.execute_step(
                step_types.StepInput(step_id=4 * first + position[0], batches=batches)
            )

        busy = median_ms(one_decode, steps)
    finally:
        executor.shutdown()
    return {
        "RayExecutor compiled": compiled,
        "RayExecutor actor calls": remote,
        "RayExecutor, 1 token on rank 0": busy,
    }


def pickle_figures(layers: int, experts: int, steps: int) -> dict[str, float]:
    load = torch.zeros(layers, experts, dtype=torch.int64)
    output = step_types.StepOutput(rank=0, step_id=1, expert_load=load)
    return {
        "pickle StepInput": median_ms(lambda i: pickle.loads(pickle.dumps(empty_step(i))), steps),
        "pickle StepOutput": median_ms(lambda i: pickle.loads(pickle.dumps(output)), steps),
        "pickle StepOutput, load as list": median_ms(
            lambda i: pickle.loads(pickle.dumps(load.tolist())), steps
        ),
    }


class TimedGroup:
    """Delegates to a StatelessGroup; adds up the seconds of every collective call."""

    def __init__(self, inner: group.StatelessGroup) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def _rank_process(rank: int, model: str, spec: group.GroupSpec, steps: int, results: Any) -> None:
    """One rank: the model's forward over zero tokens with every layer's expert collectives."""
    torch.set_num_threads(1)
    src = source_mod.open_source(model)
    cfg = src.config
    timed = TimedGroup(group.StatelessGroup(spec, rank))
    physical = policy.num_physical_for(cfg.num_experts, DP)
    placement = policy.identity(cfg.num_moe_layers, cfg.num_experts, physical, DP)
    slots = placement.slots_of_rank(rank, DP)
    local = {
        (layer, slot): experts_mod.load_expert(src, layer, int(placement.phy2log[layer, slot]))
        for layer in range(cfg.num_moe_layers)
        for slot in slots
    }
    backend = ep.ExpertParallelBackend(timed, placement, local, rank=rank)  # type: ignore[arg-type]
    model_ = decoder.MoEModel.from_source(src)
    kv = kv_mod.KVCache(cfg)
    empty = kv_mod.ForwardBatch(seq_ids=[], token_ids=[], start_pos=[])
    for _ in range(5):
        model_.forward(empty, kv, backend)
    timed.barrier()
    timed.seconds, timed.calls = 0.0, 0
    samples, in_collectives = [], []
    for _ in range(steps):
        load = torch.zeros(cfg.num_moe_layers, cfg.num_experts, dtype=torch.int64)
        before = timed.seconds
        start = time.perf_counter()
        model_.forward(empty, kv, backend, expert_load=load)
        samples.append(time.perf_counter() - start)
        in_collectives.append(timed.seconds - before)
    results.put(
        {
            "rank": rank,
            "forward_ms": 1e3 * statistics.median(samples),
            "collective_ms": 1e3 * statistics.median(in_collectives),
            "collective_calls": timed.calls / steps,
        }
    )
    timed.inner.destroy()


def forward_figures(model: str, steps: int) -> list[dict[str, float]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench-step-") as directory:
        spec = group.GroupSpec.local(DP, epoch=0, backend="gloo", directory=directory)
        procs = [
            ctx.Process(target=_rank_process, args=(r, model, spec, steps, results))
            for r in range(DP)
        ]
        for p in procs:
            p.start()
        figures = [results.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    return sorted(figures, key=lambda f: f["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="synthetic://tiny?seed=0")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = source_mod.open_source(args.model).config
    print(
        f"{args.model}: {cfg.num_layers} layers ({cfg.num_moe_layers} MoE), {cfg.num_experts} "
        f"experts; DP={DP}; medians of {args.steps} steps"
    )
    owns = cluster.connect(num_rank_slots=8)
    try:
        figures = bare_figures(args.steps, cfg.num_moe_layers, cfg.num_experts)
        figures.update(executor_figures(args.model, args.steps))
    finally:
        if owns:
            cluster.disconnect()
    bare = figures["bare compiled graph"]
    for name, ms in figures.items():
        print(f"  {name:<32} {ms:7.2f} ms   x{ms / bare:5.1f} the bare graph")
    print(
        "  ratio RayExecutor compiled / bare compiled graph = "
        f"{figures['RayExecutor compiled'] / bare:.1f}x; plain actor calls / bare graph = "
        f"{figures['plain actor calls'] / bare:.1f}x"
    )

    print("\nwhere an empty step's time goes (no Ray):")
    for name, ms in pickle_figures(cfg.num_moe_layers, cfg.num_experts, args.steps * 10).items():
        print(f"  {name:<36} {1e3 * ms:8.1f} us (dumps + loads)")
    for f in forward_figures(args.model, args.steps):
        print(
            f"  rank {f['rank']:.0f}: forward over 0 tokens {f['forward_ms']:6.2f} ms, of which "
            f"expert collectives {f['collective_ms']:6.2f} ms "
            f"({f['collective_calls']:.0f} calls, {cfg.num_moe_layers} MoE layers)"
        )


if __name__ == "__main__":
    main()
