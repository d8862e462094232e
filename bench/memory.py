"""Memory per rank against the shard it holds: each rank's peak RSS while it loads a
checkpoint on disk, against (non-expert bytes + the bytes of its own experts), at DP=1, 2, 4.

A tiny-random checkpoint (transformers ``save_pretrained``, sized by the flags: the default is
about 330 MB in float32, most of it experts) is written once; then every rank of every DP size
loads it in a fresh process of its own (``RankWorker.load_weights``, as a Ray rank actor does),
and reports:

- ``base``: the process's RSS before the load (Python, torch and the runtime imported, the
  worker built): the runtime's fixed overhead, the same for every rank;
- ``peak``: its peak RSS (``VmHWM``) once the load is done and every weight was touched
  once (as the first steps do), and ``held``: its RSS then, of which ``anon`` is the
  process's own memory and ``file`` the checkpoint's pages: safetensors maps the file, and a
  tensor read in the dtype it is stored in stays backed by those pages (``lazy``: the RSS
  growth before the touch, when only what the load itself copied counts);
- ``shard``: non-expert bytes + its experts' bytes (in the dtype it serves in).

``peak - base`` against ``shard`` is the figure the goal is about (within 10 %). Run:

    .venv/bin/python -m bench.memory [--hidden 512] [--intermediate 1536] [--experts 8]
        [--layers 4] [--vocab 4096] [--sizes 1,2,4] [--family mixtral]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

MB = 1e6


def _status_kb(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rank(path: str, rank: int, num_ranks: int) -> dict[str, Any]:
    """One rank's load in this process (the child's side)."""
    import torch

    from moe_runtime.eplb import policy
    from moe_runtime.model import source
    from moe_runtime.rank import worker

    torch.set_num_threads(1)
    cfg = source.open_source(path).config
    num_physical = policy.num_physical_for(cfg.num_experts, num_ranks, 0)
    placement = policy.identity(cfg.num_moe_layers, cfg.num_experts, num_physical, num_ranks)
    w = worker.RankWorker(device="cpu", dtype="float32", torch_threads=1)
    base = _status_kb("VmRSS") * 1024
    anon, file = _status_kb("RssAnon") * 1024, _status_kb("RssFile") * 1024
    held = w.load_weights(source=path, rank=rank, num_ranks=num_ranks, placement=placement)
    _, model = w.loaded.require("bench")
    non_expert = sum(t.numel() * t.element_size() for t in model.non_expert_state().values())
    lazy = _status_kb("VmRSS") * 1024 - base
    # Touch every weight, as the first steps do: a tensor read in the dtype it is stored in is
    # backed by the checkpoint file's pages (safetensors maps the file), faulted in on use.
    tensors = [*model.non_expert_state().values()]
    tensors += [t for e in w.slots.experts.values() for t in e.tensors().values()]
    for t in tensors:
        float(t.float().sum()) if t.dtype != torch.float32 else float(t.sum())
    return {
        "lazy": lazy,
        "anon": _status_kb("RssAnon") * 1024 - anon,
        "file": _status_kb("RssFile") * 1024 - file,
        "rank": rank,
        "num_ranks": num_ranks,
        "base": base,
        "peak": _status_kb("VmHWM") * 1024,
        "held": _status_kb("VmRSS") * 1024,
        "shard": held,
        "non_expert": non_expert,
        "experts": held - non_expert,
        "slots": len(w.slots.experts),
    }


def _build(path: pathlib.Path, args: argparse.Namespace) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(path, max_shard_size="100MB")  # sharded, with an index
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--child", nargs=3, metavar=("PATH", "RANK", "DP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, rank, dp = args.child
        print(json.dumps(_rank(path, int(rank), int(dp))))
        return
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        path = pathlib.Path(tmp) / "ckpt"
        on_disk = _build(path, args)
        print(
            f"checkpoint: Mixtral, hidden {args.hidden}, intermediate {args.intermediate}, "
            f"{args.experts} experts x {args.layers} layers, vocab {args.vocab}: "
            f"{on_disk / MB:.1f} MB on disk (float32, sharded)"
        )
        print(
            f"{'DP':>3} {'rank':>4} {'slots':>5} {'non-expert':>10} {'experts':>8} "
            f"{'shard':>8} {'base':>7} {'lazy':>7} {'peak-base':>9} {'held-base':>9} "
            f"{'anon':>7} {'file':>7} {'peak/shard':>10}"
        )
        bases = []
        for dp in (int(s) for s in args.sizes.split(",")):
            for rank in range(dp):
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "bench.memory",
                        "--child",
                        str(path),
                        str(rank),
                        str(dp),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                r = json.loads(out.stdout.strip().splitlines()[-1])
                bases.append(r["base"])
                grown, kept = r["peak"] - r["base"], r["held"] - r["base"]
                print(
                    f"{dp:>3} {rank:>4} {r['slots']:>5} {r['non_expert'] / MB:>8.1f}MB "
                    f"{r['experts'] / MB:>6.1f}MB {r['shard'] / MB:>6.1f}MB "
                    f"{r['base'] / MB:>5.0f}MB {r['lazy'] / MB:>5.1f}MB {grown / MB:>7.1f}MB "
                    f"{kept / MB:>7.1f}MB {r['anon'] / MB:>5.1f}MB {r['file'] / MB:>5.1f}MB "
                    f"{grown / r['shard']:>10.3f}"
                )
        print(
            f"fixed overhead (RSS before the load: Python, torch, the runtime, a worker): "
            f"{min(bases) / MB:.0f}-{max(bases) / MB:.0f} MB per rank process"
        )


if __name__ == "__main__":
    main()
