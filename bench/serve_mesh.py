"""Serve-level figures of the executor mesh (issue 22): one model served through the real
engine over a `RayExecutor` at DP = 1 and (T, P) = (1, 1), (2, 1), (1, 2), (2, 2) in one run.

T is the tensor-parallel size and P the pipeline-parallel size of the DP rank: it is then
T x P Ray actors (its leader, T-1 TP followers per stage, P-1 pipeline stage actors). For each
mesh the same load as bench/serve.py (`serve.run_load`: `--requests` completions of a
`--prompt-len`-token prompt, exactly `--max-tokens` generated, EOS ignored, from
`--concurrency` client threads; the engine in process, no HTTP) after one warm-up request,
and one row:

- tok/s: output tokens of all requests over the load's wall time;
- TTFT p50/p99: seconds from a request's submission to its first token;
- ITL p50/p99: seconds between two consecutive tokens of one request;
- step: the load's wall time over the engine steps it took (the mean step time);
- ratio: that step time over the (1, 1) row's (how much the mesh adds to a step; "-"
  without a (1, 1) row before it);
- load s: seconds to start the executor and load the model on its actors;
- graph: the actors with a node in the compiled step graph after the load (the leader and,
  at P = 1, its T - 1 TP followers, at P > 1 its P - 1 stage actors: `executor.ray_mesh`; 0:
  the steps went by plain calls; a mesh with a trailing "r", e.g. `1x2r`, steps by plain
  calls on purpose: the graph against Ray calls per stage).

A mesh that fails to start prints "(T, P): not served: <error>" and the run goes on. EPLB
is off: the bench drives the bare engine (no `ElasticService`, hence no rebalancing). The model must split over 2 pipeline stages
(layers) and 2 TP ranks (heads, KV heads, experts' width): the default `synthetic://small`
has 8 layers, 8 heads over 4 KV heads.

What 2 CPU cores can and cannot show: every actor runs one torch thread, and the T x P
actors of a mesh share the 2 cores with the engine's process, Ray and other work. A mesh
here is the executor as `RayExecutor` builds it by default, where P = 2 runs a decode step's
stages one after the other, so it cannot be faster than P = 1 there; interleaved steps
(`1x2i`, the serve command's default at P > 1: two sets of sequences in turn, a step's stage
0 beside the step before in stage 1; by plain calls on CPUs, down the step graph with
`MOE_STEP_GRAPH_STAGES=1` in the environment, as on GPUs) keep both stages busy; a
prefill goes through them as micro-batches, the stages at work at once (`1x2` against
`1x2m0`, every step whole: docs/PIPELINE-PARALLEL.md, "Micro-batches");
T = 2 could at best spread a step's arithmetic over both cores where (1, 1) uses one, but
the engine, Ray and other work need them too. So the ratios mostly show what a mesh costs
on shared cores (the TP all-reduces and all-gathers between processes, the hidden states
handed stage to stage through Ray's object store, a Ray call per stage per step, the stages'
turns), and a ratio under 1 says the mesh's processes got more of the cores during its load.
What a mesh gives on real devices (a model too large for one, T devices' memory bandwidth,
several batches in the stages at once) is not measurable here. The figures move by a factor
of 2 or more with the load of other work on the machine (its load average is printed before
and after): `--repeats N` runs every mesh N times, the meshes interleaved, and prints each
mesh's run of median step time. bench/mesh.py measures the model level alone, with the
shares of a step in TP collectives and stage transfers.

    .venv/bin/python bench/serve_mesh.py        # ~2-3 min on 2 CPU cores
    .venv/bin/python bench/serve_mesh.py --repeats 3    # ~7 min
    .venv/bin/python bench/serve_mesh.py --meshes 1x1 1x2 --requests 32 --max-tokens 64
    .venv/bin/python bench/serve_mesh.py --meshes 1x1 1x2m0 1x2 --requests 32 --concurrency 16 \
        --prompt-len 128 --max-tokens 4 --repeats 2    # prefills: micro-batches against whole
    .venv/bin/python bench/serve_mesh.py --meshes 1x1 1x2 1x2i --requests 32 --concurrency 16 \
        --prompt-len 8 --max-tokens 32 --repeats 3    # decodes: interleaved against the graph
"""

from __future__ import annotations

import pathlib
import sys

# This folder holds a bench/operator.py: off the path, or it shadows the standard library's
# `operator`; the repository root goes on it instead (for `bench.serve`).
BENCH = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(BENCH.parent))

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench import serve as serve_bench  # noqa: E402
from moe_runtime.executor import cluster, ray_executor, ray_mesh  # noqa: E402
from moe_runtime.model import source as source_mod  # noqa: E402

DEFAULT_MESHES = ("1x1", "2x1", "1x2", "2x2")


#: (T, P, the leader's micro-batch threshold: None for its default, then tags): "remote"
#: steps by plain actor calls (`--step-mode remote`) instead of the compiled step graph,
#: "shm" has the graph's lanes carry their tensors by Ray's tensor transport through shared
#: memory (`MOE_STEP_GRAPH_TRANSPORT=shm`) instead of pickling them (the default on CPUs)
Mesh = tuple[Any, ...]
REMOTE = "remote"
SHM = "shm"
INTERLEAVE = "interleave"
SUFFIXES = {"r": REMOTE, "s": SHM, "i": INTERLEAVE}


def parse_mesh(text: str) -> Mesh:
    """Parse "TxP" into (T, P, None), "TxPmN" into (T, P, N): `--pipeline-micro-batch-tokens
    N` (0: every step whole through the stages); a trailing "r" (1x2r, 1x2m8r): steps by
    plain actor calls, not the compiled step graph; a trailing "s" (1x2s): the graph's lanes
    carry their tensors by Ray's tensor transport; a trailing "i" (1x2i): interleaved steps
    (`--pipeline-interleave`: two sets of sequences in turn, a step's stage 0 beside the
    previous step's later stages)."""
    text = text.lower()
    tags: list[str] = []
    while text and text[-1] in SUFFIXES:
        tags.insert(0, SUFFIXES[text[-1]])
        text = text[:-1]
    try:
        shape, _, micro = text.partition("m")
        tp, pp = (int(part) for part in shape.split("x"))
        tokens = int(micro) if micro else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"mesh {text!r}: expected TxP or TxPmN, e.g. 2x1 or 1x2m0"
        ) from None
    if tp < 1 or pp < 1 or (tokens is not None and tokens < 0):
        raise argparse.ArgumentTypeError(f"mesh {text!r}: T and P must be >= 1, N >= 0")
    return (tp, pp, tokens, *tags)


def _label(mesh: Mesh) -> str:
    tp, pp, tokens = mesh[:3]
    label = f"({tp}, {pp})" if tokens is None else f"({tp}, {pp}) m{tokens}"
    label += " plain" if REMOTE in mesh else ""
    return label + (" shm" if SHM in mesh else "") + (" interleaved" if INTERLEAVE in mesh else "")


def _load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def serve_mesh(
    mesh: Mesh, src: source_mod.ModelSource, args: argparse.Namespace
) -> tuple[serve_bench.Measured, float, int] | str:
    """The load on a fresh executor of one DP rank of T x P actors, the seconds it took to
    start and the actors with a node in its step graph at the end (0: plain calls); or why
    the mesh could not be served."""
    tp, pp, tokens = mesh[:3]
    loaded = time.monotonic()
    before = os.environ.get(ray_mesh.TRANSPORT_ENV)
    if SHM in mesh:  # read once, by the executor
        os.environ[ray_mesh.TRANSPORT_ENV] = SHM
    try:
        executor = ray_executor.RayExecutor(
            1,
            tp_size=tp,
            pp_size=pp,
            pp_micro_batch_tokens=tokens,
            pp_interleave=INTERLEAVE in mesh,
            step_mode=REMOTE if REMOTE in mesh else None,
        )
    except Exception as exc:  # noqa: BLE001 - a mesh that cannot start is a result
        return str(exc)
    finally:
        os.environ.pop(ray_mesh.TRANSPORT_ENV, None)
        if before is not None:
            os.environ[ray_mesh.TRANSPORT_ENV] = before
    try:
        serve_bench.start(executor, args.model, src.config)
        load_s = time.monotonic() - loaded
        measured = serve_bench.measure(executor, src, args)
        return measured, load_s, executor.path.graph_nodes()
    except Exception as exc:  # noqa: BLE001 - report it, go on with the next mesh
        return f"{type(exc).__name__}: {exc}"
    finally:
        executor.shutdown()


def _row(
    mesh: Mesh, measured: serve_bench.Measured, load_s: float, nodes: int, base: float | None
) -> str:
    ratio = "-" if base is None else f"{measured.step_s / base:.2f}"
    errors = measured.timings.errors
    row = f"{_label(mesh):>12} {measured.columns()} {ratio:>6} {load_s:>7.1f} {nodes:>6}"
    return row + (f"  ({errors} errors)" if errors else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic://small?seed=0")
    parser.add_argument(
        "--meshes",
        type=parse_mesh,
        nargs="+",
        default=[parse_mesh(m) for m in DEFAULT_MESHES],
        help="executor meshes TxP at DP=1, TxPmN with --pipeline-micro-batch-tokens N "
        "(1x2m0: every step whole through the stages), a trailing r for plain actor calls "
        "instead of the compiled step graph (1x2r), a trailing s for lanes that carry their "
        "tensors by Ray's tensor transport instead of pickling them (1x2s), a trailing i for "
        "interleaved steps (1x2i: --pipeline-interleave; default: %(default)s)",
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over every mesh (each on a fresh executor); with more than one, the run "
        "of median step time of each mesh is printed at the end",
    )
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    src = source_mod.open_source(args.model)
    cfg = src.config
    t0 = time.monotonic()
    owns = cluster.connect(num_rank_slots=max(8, *(m[0] * m[1] for m in args.meshes)))
    print(
        f"model {args.model}: {cfg.num_layers} layers, {cfg.num_heads} heads over "
        f"{cfg.num_kv_heads} KV heads, {cfg.num_experts} experts, top-{cfg.top_k}; DP = 1"
    )
    print(
        f"load: {args.requests} requests, {args.concurrency} concurrent, prompt {args.prompt_len}"
        f" tokens, {args.max_tokens} generated each; load average {_load_average()}"
    )
    print(
        f"{'(T, P)':>12} {serve_bench.COLUMNS} {'ratio':>6} {'load s':>7} {'graph':>6}", flush=True
    )
    runs: dict[Mesh, list[tuple[serve_bench.Measured, float, int]]] = {m: [] for m in args.meshes}
    try:
        for round_ in range(args.repeats):
            if args.repeats > 1:
                print(f"round {round_ + 1} of {args.repeats}", flush=True)
            base: float | None = None
            for mesh in args.meshes:
                result = serve_mesh(mesh, src, args)
                if isinstance(result, str):
                    print(f"{_label(mesh):>12}: not served: {result}", flush=True)
                    continue
                runs[mesh].append(result)
                base = result[0].step_s if mesh == (1, 1, None) else base
                print(_row(mesh, *result, base), flush=True)
    finally:
        if owns:
            cluster.disconnect()
    if args.repeats > 1:
        medians = {
            mesh: sorted(rs, key=lambda r: r[0].step_s)[len(rs) // 2]
            for mesh, rs in runs.items()
            if rs
        }
        base = medians[(1, 1, None)][0].step_s if (1, 1, None) in medians else None
        print(f"the run of median step time of each mesh ({args.repeats} rounds, interleaved)")
        for mesh, result in medians.items():
            print(_row(mesh, *result, base))
    print(f"load average {_load_average()}; total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
