"""Every model family at one size, beside Mixtral: decode tokens/s and memory per rank.

Each family's checkpoint is random at the same size (hidden 256, 6 layers, 16 experts of
256, top-2, 8 heads; each family keeps its own structure: Qwen's dense layer, Qwen2-MoE's
gated shared expert, DeepSeek's MLA latent, dense first layer and shared experts, gpt-oss's
sinks, windows and biases), built by transformers and saved by `save_pretrained`, so it is
read as shipped. It is served by the engine over a LocalExecutor of `--ranks` ranks (expert
parallelism in process, as the Ray ranks run it): `--streams` greedy requests of
`--max-tokens` tokens after a `--prompt-len`-token prompt, consumed as the HTTP server does.

Printed per family: output tokens/s (wall, all streams), weights per rank (non-expert tensors
every rank holds + its expert slots, in the serving dtype) and KV-cache bytes per token per
rank (MLA caches its latent, grouped-query attention keys and values). Prints figures,
asserts nothing.

    .venv/bin/python bench/families.py                      # a few minutes on 2 busy cores
    .venv/bin/python bench/families.py --families mixtral deepseek_v3 --ranks 4
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
import asyncio  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench import local_engine  # noqa: E402
from moe_runtime.eplb import policy  # noqa: E402
from moe_runtime.model import kv, names, source  # noqa: E402
from tests.support import hf_families  # noqa: E402  (transformers builds the checkpoints)

#: The one size every family is built at (family-specific fields follow it).
SIZE = dict(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=512,
    vocab_size=4096,
    max_position_embeddings=1024,
    initializer_range=0.05,
)
PER_FAMILY = {
    "mixtral": dict(head_dim=32, num_local_experts=16, intermediate_size=256, sliding_window=None),
    "qwen3_moe": dict(head_dim=32, num_experts=16, moe_intermediate_size=256, mlp_only_layers=[]),
    "qwen2_moe": dict(
        num_experts=16,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        mlp_only_layers=[],
        use_sliding_window=False,
    ),
    "olmoe": dict(num_experts=16, intermediate_size=256, num_key_value_heads=8),
    "deepseek_v2": dict(n_routed_experts=16, moe_intermediate_size=256, num_key_value_heads=8),
    "deepseek_v3": dict(
        n_routed_experts=16, moe_intermediate_size=256, num_key_value_heads=8, n_group=4
    ),
    "gpt_oss": dict(head_dim=32, num_local_experts=16, intermediate_size=256, sliding_window=128),
}


def checkpoint(family: str, root: pathlib.Path) -> pathlib.Path:
    overrides = {**SIZE, "num_experts_per_tok": 2, **PER_FAMILY[family]}
    model = hf_families.build(family, **overrides)
    return hf_families.save(model, root / family)


def memory_per_rank(cfg: source.ModelSource, ranks: int, elem: int) -> tuple[int, int, int]:
    """(non-expert bytes, expert-slot bytes, KV bytes per token) of one rank."""
    config = cfg.config
    non_expert = sum(
        math.prod(names.tensor_shape(config, n)) for n in names.non_expert_tensor_names(config)
    )
    per_expert = sum(math.prod(s) for s in names.expert_parts(config).values())
    slots = policy.num_physical_for(config.num_experts, ranks) // ranks
    parts, heads, dim = kv.cache_shape(config)
    kv_per_token = config.num_layers * parts * heads * dim
    return non_expert * elem, per_expert * slots * config.num_moe_layers * elem, kv_per_token * elem


def run(model: str, args: argparse.Namespace) -> dict[str, float]:
    served = local_engine.start(model, ranks=args.ranks, streams=args.streams, dtype=args.dtype)
    vocab = served.source.config.vocab_size
    try:
        asyncio.run(  # warm-up
            local_engine.consume(
                served.engine, streams=2, prompt_len=args.prompt_len, max_tokens=4, vocab=vocab
            )
        )
        start = time.perf_counter()
        tokens = asyncio.run(
            local_engine.consume(
                served.engine,
                streams=args.streams,
                prompt_len=args.prompt_len,
                max_tokens=args.max_tokens,
                vocab=vocab,
            )
        )
        wall = time.perf_counter() - start
    finally:
        served.stop()
    elem = getattr(torch, args.dtype).itemsize
    non_expert, experts, kv_token = memory_per_rank(served.source, args.ranks, elem)
    return {
        "tokens_per_s": tokens / wall,
        "non_expert_mb": non_expert / 1e6,
        "expert_mb": experts / 1e6,
        "kv_kb_per_token": kv_token / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(PER_FAMILY))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"{args.ranks} ranks (LocalExecutor), {args.streams} streams x {args.max_tokens} tokens "
        f"after {args.prompt_len}-token prompts, {args.dtype}"
    )
    print(
        f"{'family':<14} {'tok/s':>7} {'non-expert MB':>14} {'experts MB':>11} {'KV kB/token':>12}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            path = checkpoint(family, pathlib.Path(tmp))
            f = run(str(path), args)
            print(
                f"{family:<14} {f['tokens_per_s']:7.0f} {f['non_expert_mb']:14.2f} "
                f"{f['expert_mb']:11.2f} {f['kv_kb_per_token']:12.2f}"
            )


if __name__ == "__main__":
    main()
