"""The benches' in-process engine: `start` serves a model with a `LocalExecutor` of `ranks`
ranks on an identity placement and the engine over it; `consume` runs greedy streams through
it the way the HTTP server consumes them (`async for` over each handle in one event loop).
Shared by bench/engine.py and bench/families.py."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from moe_runtime.engine import core, seam
from moe_runtime.engine import request as req
from moe_runtime.eplb import policy
from moe_runtime.executor import local
from moe_runtime.model import source as source_mod


@dataclasses.dataclass
class LocalEngine:
    engine: core.Engine
    executor: local.LocalExecutor
    runner: Any  # what the engine steps through: the executor, or the wrapper given
    source: source_mod.ModelSource

    def stop(self) -> None:
        self.engine.stop()
        self.executor.shutdown()


def start(
    model: str,
    *,
    ranks: int,
    streams: int,
    dtype: str = "float32",
    wrap: Callable[[local.LocalExecutor], Any] | None = None,
    engine_cls: type[core.Engine] = core.Engine,
) -> LocalEngine:
    """`model` served by an engine of `engine_cls` over a started `LocalExecutor`, stepped
    through `wrap(executor)` when given; room for `streams` sequences per rank."""
    src = source_mod.open_source(model)
    cfg = src.config
    physical = policy.num_physical_for(cfg.num_experts, ranks)
    executor = local.LocalExecutor(ranks, dtype=dtype)
    executor.start(
        model, placement=policy.identity(cfg.num_moe_layers, cfg.num_experts, physical, ranks)
    )
    runner = wrap(executor) if wrap is not None else executor
    engine = engine_cls(
        runner,
        src.tokenizer(),
        seam.EngineConfig(max_model_len=cfg.max_position_embeddings, max_num_seqs_per_rank=streams),
    )
    engine.start()
    return LocalEngine(engine=engine, executor=executor, runner=runner, source=src)


async def consume(
    engine: core.Engine, *, streams: int, prompt_len: int, max_tokens: int, vocab: int
) -> int:
    """`streams` greedy requests of `prompt_len`-token prompts (ids below `vocab`, the
    model's) and exactly `max_tokens` new tokens each, all at once; the tokens generated."""

    async def one(i: int) -> int:
        prompt = [(7 * i + 13 * k) % (vocab - 2) + 1 for k in range(prompt_len)]
        handle = engine.add_request(
            req.Request(
                request_id=f"bench-{i}",
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                ignore_eos=True,
            )
        )
        n = 0
        async for out in handle:
            if out.error:
                raise RuntimeError(out.error)
            n += len(out.new_token_ids)
        return n

    return sum(await asyncio.gather(*(one(i) for i in range(streams))))
