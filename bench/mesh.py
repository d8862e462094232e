"""The model-level mesh of one DP rank, (T, P) = (1, 1), (2, 1), (1, 2), (2, 2): decode latency
and tokens/s on one random Mixtral-shaped checkpoint, and the share of a step spent in the TP
collectives and in the pipeline stages' transfers.

Each of the T x P processes is spawned, one torch thread each; process s * T + t is TP rank t
of pipeline stage s (`tests/support/pp_ranks.py`): a gloo TP group per stage, a gloo
pipeline group per TP index (hidden states sent stage to stage, the last stage's tokens
broadcast back). One batch in flight: the stages of a pipeline run one after the other
(no consecutive batches overlapping them yet), so a stage waits while the other computes.
"stage link" is the time in send/recv/broadcast, that wait included (about (P-1)/P of a
step by construction); "transfer overhead" is the step less every stage's compute (its
step less its link time): what the transfers themselves add. Every process holds every routed expert of its
stage (replicated over its TP group).

Each mesh is measured `--repeats` times, the meshes interleaved (load from other work spreads
over all of them), after one warm-up run of every process; the median step is printed.

    .venv/bin/python bench/mesh.py [--hidden 256] [--streams 1 8] [--steps 32] [--repeats 3]
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

from bench import tensor_parallel as tp_bench  # noqa: E402
from moe_runtime.comm import group  # noqa: E402
from moe_runtime.model import kv as kv_mod  # noqa: E402
from moe_runtime.model import pipeline, source  # noqa: E402
from tests.support import ep_ranks, pp_ranks  # noqa: E402

PROMPT_TOKENS = 32
MESHES = ((1, 1), (2, 1), (1, 2), (2, 2))


class TimedLink:
    """A pipeline group that adds the seconds spent in send, recv and broadcast (waiting for
    the other stage included) to `seconds`."""

    def __init__(self, inner: group.StatelessGroup) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.seconds = 0.0

    def _timed(self, fn: Callable[[], None]) -> None:
        started = time.perf_counter()
        fn()
        self.seconds += time.perf_counter() - started

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._timed(lambda: self.inner.send(tensor, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self._timed(lambda: self.inner.recv(tensor, src, tag))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._timed(lambda: self.inner.broadcast(tensor, src))


class NoLink:
    """The pipeline of one stage: nothing to send; the tokens are this stage's own."""

    rank = 0
    world_size = 1
    seconds = 0.0

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        raise AssertionError("one stage sends nothing")

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        raise AssertionError("one stage receives nothing")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        pass


def task_decode(
    *,
    pp_spec: group.GroupSpec | None,
    tp_spec: group.GroupSpec | None,
    stage: int,
    tp_rank: int,
    path: str,
    streams: int,
    steps: int,
) -> dict[str, float]:
    """Prefill `streams` prompts, then `steps` decode steps; seconds per decode step, in the
    TP collectives and in the stage transfers."""
    src = source.open_source(path)
    pp_grp = None if pp_spec is None else group.StatelessGroup(pp_spec, stage, timeout=60)
    tp_grp = None if tp_spec is None else group.StatelessGroup(tp_spec, tp_rank, timeout=60)
    timed_tp = None if tp_grp is None else tp_bench.TimedGroup(tp_grp)
    link: TimedLink | NoLink = NoLink() if pp_grp is None else TimedLink(pp_grp)
    try:
        size = 1 if pp_spec is None else pp_spec.world_size
        plan = pipeline.plan(src.config, stage=stage, size=size)
        model = pp_ranks.stage_model(
            src,
            stage=plan,
            tp_group=timed_tp,
            tp_rank=tp_rank,
            tp_size=1 if tp_spec is None else tp_spec.world_size,
        )
        local = pipeline.local_experts(src, plan)
        kv = kv_mod.KVCache(model.local_config, layers=model.layers)
        ids = [f"s{i}" for i in range(streams)]
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, src.config.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist()
            for _ in ids
        ]
        batch = kv_mod.ForwardBatch(ids, prompts, [0] * streams)
        tokens = pp_ranks.pipeline_step(model, kv, local, link, batch)
        link.seconds = 0.0
        if timed_tp is not None:
            timed_tp.seconds = 0.0
        started = time.perf_counter()
        for step in range(steps):
            batch = kv_mod.ForwardBatch(
                ids, [[t] for t in tokens], [PROMPT_TOKENS + step] * streams
            )
            tokens = pp_ranks.pipeline_step(model, kv, local, link, batch)
        elapsed = time.perf_counter() - started
        return {
            "step_s": elapsed / steps,
            "tp_s": 0.0 if timed_tp is None else timed_tp.seconds / steps,
            "link_s": link.seconds / steps,
        }
    finally:
        if tp_grp is not None:
            tp_grp.destroy()
        if pp_grp is not None:
            pp_grp.destroy()


TASKS: dict[str, Callable[..., Any]] = {"decode": task_decode}


def _print_row(tp: int, pp: int, streams: int, results: list[dict[str, float]]) -> None:
    step = max(r["step_s"] for r in results)
    tp_share = max(r["tp_s"] for r in results) / step
    link_share = sum(r["link_s"] for r in results) / len(results) / step
    compute = sum(
        max(r["step_s"] - r["link_s"] for r in results[s * tp : (s + 1) * tp]) for s in range(pp)
    )
    overhead = max(0.0, step - compute) / step if pp > 1 else 0.0
    print(
        f"{tp:>2} {pp:>2} {streams:>7} {step * 1e3:>8.2f} {streams / step:>8.1f} "
        f"{tp_share:>13.0%} {link_share:>9.0%} {overhead:>16.0%}",
        flush=True,
    )


def _run(
    pool: ep_ranks.RankPool,
    tmp: str,
    *,
    tp: int,
    pp: int,
    path: str,
    streams: int,
    steps: int,
    epoch: int,
) -> list[dict[str, float]]:
    pp_specs = [
        None if pp == 1 else group.GroupSpec.local(pp, epoch=epoch * 10 + t, directory=tmp)
        for t in range(tp)
    ]
    tp_specs = [
        None if tp == 1 else group.GroupSpec.local(tp, epoch=epoch * 10 + 5 + s, directory=tmp)
        for s in range(pp)
    ]
    kw = dict(path=path, streams=streams, steps=steps)
    return pool.run(
        "decode",
        [
            dict(kw, pp_spec=pp_specs[t], tp_spec=tp_specs[s], stage=s, tp_rank=t)
            for s in range(pp)
            for t in range(tp)
        ],
        timeout=600,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = tp_bench._checkpoint(pathlib.Path(tmp), args.hidden)
        pool = ep_ranks.RankPool(4, tasks_module="bench.mesh")
        try:
            print(f"Mixtral shape, hidden {args.hidden}, 4 layers, 8 experts top-2, fp32, CPU")
            print(
                f"{'T':>2} {'P':>2} {'streams':>7} {'step ms':>8} {'tok/s':>8} "
                f"{'TP collectives':>14} {'stage link':>10} {'transfer overhead':>17}"
            )
            kw = dict(path=path, steps=args.steps)
            _run(pool, tmp, tp=2, pp=2, streams=1, steps=2, path=path, epoch=0)  # warm-up
            for streams in args.streams:
                runs: dict[tuple[int, int], list[list[dict[str, float]]]] = {m: [] for m in MESHES}
                for repeat in range(args.repeats):
                    for tp, pp in MESHES:
                        epoch = ((repeat + 1) * 100 + streams) * 100 + tp * 10 + pp
                        runs[tp, pp].append(
                            _run(pool, tmp, tp=tp, pp=pp, streams=streams, epoch=epoch, **kw)
                        )
                for (tp, pp), repeats in runs.items():
                    results = sorted(repeats, key=lambda rs: max(r["step_s"] for r in rs))[
                        len(repeats) // 2
                    ]
                    _print_row(tp, pp, streams, results)
        finally:
            pool.close()


if __name__ == "__main__":
    main()
