"""Tensor parallelism at the model level: decode latency and tokens/s at T = 1 and T = 2 on
one random Mixtral-shaped checkpoint, and the share of the step spent in the TP collectives.

T = 2 runs two spawned processes over a gloo group on loopback (`model.tensor_parallel`), each
with one torch thread, its TP collectives either over gloo or through shared memory
(`comm.shm`, what a CPU rank of `serve` uses; the `TP comm` column); T = 1 runs one process
without a TP part. First it prints one all-reduce's latency both ways. Two expert layouts at T = 2
(docs/TENSOR-PARALLEL.md): `leader` (`serve`'s default): only TP rank 0 runs the routed
experts, the other adds zeros to the MoE reduce, so the expert GEMMs cost the same at every
T and TP divides only attention, the dense/shared MLPs and lm_head; `mesh` (vLLM's, `serve
--expert-layout mesh`): the experts are split over both TP ranks, one expert-parallel group
of the two, each TP rank dispatching half of the rows (`collectives` then counts the all-to-alls too). On a 2-core
machine shared with other work the T = 2 figures are an upper bound of what the collectives
cost; on GPUs with NVLink the all-reduces are microseconds.

    .venv/bin/python bench/tensor_parallel.py [--hidden 256] [--streams 1 8] [--steps 16]
"""

from __future__ import annotations

import pathlib
import sys

# This folder holds a bench/operator.py: off the path, or it shadows the standard library's
# `operator` (transformers imports it); the repository root goes on it instead.
BENCH = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(BENCH.parent))

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from moe_runtime.comm import ep, group, shm  # noqa: E402
from moe_runtime.eplb import policy  # noqa: E402
from moe_runtime.model import decoder, source, tensor_parallel, tp_shard  # noqa: E402
from moe_runtime.model import experts as experts_mod  # noqa: E402
from moe_runtime.model import kv as kv_mod  # noqa: E402
from tests.support import ep_ranks, hf_families  # noqa: E402

PROMPT_TOKENS = 32


class TimedGroup:
    """A TP group that adds the seconds spent in its collectives to `seconds`."""

    def __init__(self, inner: group.StatelessGroup) -> None:
        self.inner = inner
        self.seconds = 0.0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        started = time.perf_counter()
        self.inner.all_reduce(tensor, op)
        self.seconds += time.perf_counter() - started

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        self.inner.all_gather_into(output, tensor)
        self.seconds += time.perf_counter() - started


class TimedExperts:
    """An expert-parallel backend whose all-to-alls add their seconds to `timed.seconds`."""

    def __init__(self, grp: group.StatelessGroup, timed: TimedGroup, src: Any) -> None:
        cfg, size = src.config, grp.world_size
        physical = policy.num_physical_for(cfg.num_experts, size)
        placement = policy.identity(cfg.num_moe_layers, cfg.num_experts, physical, size)
        slots = {
            (layer, slot): experts_mod.load_expert(src, layer, int(placement.phy2log[layer, slot]))
            for layer in range(cfg.num_moe_layers)
            for slot in placement.slots_of_rank(grp.rank, size)
        }
        self.backend = ep.ExpertParallelBackend(grp, placement, slots)
        real, self.timed = grp.all_to_all_single, timed

        def all_to_all_single(*args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            real(*args, **kwargs)
            timed.seconds += time.perf_counter() - started

        grp.all_to_all_single = all_to_all_single  # type: ignore[method-assign]

    def __call__(self, *args: Any) -> torch.Tensor:
        return self.backend(*args)


def task_allreduce(
    *, spec: group.GroupSpec, rank: int, hidden: int, calls: int
) -> dict[str, float]:
    """Microseconds of one all-reduce of a [1, hidden] fp32 tensor (a decode step's of one
    stream) over gloo and through shared memory (`comm.shm`), the median of `calls`."""
    grp = group.StatelessGroup(spec, rank, timeout=60)
    try:
        out = {}
        for name, collective in (("gloo", grp), ("shm", shm.collective(grp))):
            times = []
            for _ in range(calls):
                x = torch.ones(1, hidden)
                started = time.perf_counter()
                collective.all_reduce(x)
                times.append(time.perf_counter() - started)
            out[name] = sorted(times)[len(times) // 2] * 1e6
        return out
    finally:
        grp.destroy()


def task_decode(
    *,
    spec: group.GroupSpec | None,
    ep_spec: group.GroupSpec | None = None,
    rank: int,
    path: str,
    streams: int,
    steps: int,
    comm: str = "shm",
) -> dict[str, float]:
    """Prefill `streams` prompts, then `steps` decode steps; seconds per decode step and in
    the collectives (T from spec; None: T = 1, no TP part). `ep_spec`: the `mesh` layout, the
    experts over an expert-parallel group of the TP ranks; None: `leader`. `comm`: how the
    TP collectives go, "gloo" or "shm" (`comm.shm`, what a CPU rank of `serve` uses)."""
    src = source.open_source(path)
    grp = None if spec is None else group.StatelessGroup(spec, rank, timeout=60)
    ep_grp = None if ep_spec is None else group.StatelessGroup(ep_spec, rank, timeout=60)
    timed = None
    if grp is not None:
        timed = TimedGroup(shm.collective(grp) if comm == "shm" else grp)
    try:
        tp = None
        if timed is not None and spec is not None:
            shard = tp_shard.plan(src.config, rank=rank, size=spec.world_size)
            layout = tensor_parallel.LEADER if ep_grp is None else tensor_parallel.MESH
            tp = tensor_parallel.TensorParallel(shard, timed, expert_layout=layout)
        model = decoder.MoEModel.from_source(src, tp=tp)
        local: Any = experts_mod.LocalExperts.from_source(src)
        if ep_grp is not None and timed is not None:
            local = TimedExperts(ep_grp, timed, src)
        kv = kv_mod.KVCache(model.local_config)
        ids = [f"s{i}" for i in range(streams)]
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, src.config.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist()
            for _ in ids
        ]
        logits = model.forward(kv_mod.ForwardBatch(ids, prompts, [0] * streams), kv, local)
        if timed is not None:
            timed.seconds = 0.0
        started = time.perf_counter()
        for step in range(steps):
            tokens = [[int(t)] for t in logits.argmax(-1).tolist()]
            batch = kv_mod.ForwardBatch(ids, tokens, [PROMPT_TOKENS + step] * streams)
            logits = model.forward(batch, kv, local)
        elapsed = time.perf_counter() - started
        return {
            "step_s": elapsed / steps,
            "collective_s": 0.0 if timed is None else timed.seconds / steps,
        }
    finally:
        if grp is not None:
            grp.destroy()
        if ep_grp is not None:
            ep_grp.destroy()


TASKS: dict[str, Callable[..., Any]] = {"decode": task_decode, "allreduce": task_allreduce}


def _checkpoint(root: pathlib.Path, hidden: int) -> str:
    model = hf_families.build(
        "mixtral",
        hidden_size=hidden,
        head_dim=hidden // 8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=hidden * 2,
        num_hidden_layers=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=8000,
        sliding_window=None,
    )
    return str(hf_families.save(model, root / "mixtral"))


#: (T, expert layout, how the TP collectives go) of each row
MESHES = (
    (1, "-", "-"),
    (2, "leader", "gloo"),
    (2, "leader", "shm"),
    (2, "mesh", "gloo"),
    (2, "mesh", "shm"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = _checkpoint(pathlib.Path(tmp), args.hidden)
        pool = ep_ranks.RankPool(2, tasks_module="bench.tensor_parallel")
        try:
            spec = group.GroupSpec.local(2, epoch=1, directory=tmp)
            kw = dict(spec=spec, hidden=args.hidden, calls=500)
            one = pool.run("allreduce", [dict(kw, rank=r) for r in range(2)], timeout=600)[0]
            print(
                f"one all-reduce of [1, {args.hidden}] fp32 between 2 processes (median of 500): "
                f"gloo {one['gloo']:.0f} us, shared memory {one['shm']:.0f} us"
            )
            print(f"Mixtral shape, hidden {args.hidden}, 4 layers, 8 experts top-2, fp32, CPU")
            print(
                f"{'T':>2} {'experts':>7} {'TP comm':>7} {'streams':>7} {'step ms':>8} "
                f"{'tok/s':>8} {'collectives':>11}"
            )
            epoch = 2
            for streams in args.streams:
                for size, layout, comm in MESHES:
                    epoch += 2
                    spec = ep_spec = None
                    if size > 1:
                        spec = group.GroupSpec.local(size, epoch=epoch, directory=tmp)
                    if layout == "mesh":
                        ep_spec = group.GroupSpec.local(size, epoch=epoch + 1, directory=tmp)
                    kw = dict(
                        spec=spec,
                        ep_spec=ep_spec,
                        path=path,
                        streams=streams,
                        steps=args.steps,
                        comm=comm,
                    )
                    results = pool.run(
                        "decode", [dict(kw, rank=r) for r in range(size)], timeout=600
                    )
                    step = max(r["step_s"] for r in results)
                    share = max(r["collective_s"] for r in results) / step
                    print(
                        f"{size:>2} {layout:>7} {comm:>7} {streams:>7} {step * 1e3:>8.2f} "
                        f"{streams / step:>8.1f} {share:>10.0%}"
                    )
        finally:
            pool.close()


if __name__ == "__main__":
    main()
