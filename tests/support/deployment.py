"""Serving processes for the runtime's integration tests: the model, prompts and greedy
reference they check answers against, `Deployment` (engine + executor + elastic service in
this process; `ray_deployment`: on Ray ranks with the fault hooks of `faults`), with
`LongRequests` running while something fails and `assert_clean` (serving, one live state per
worker, correct tokens)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from moe_runtime import step as step_mod
from moe_runtime.elastic import coordinator, service, serving
from moe_runtime.engine import core, seam
from moe_runtime.engine import request as req_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import base as executor_base
from moe_runtime.model import generate
from moe_runtime.model import source as source_mod
from tests.support import faults

SOURCE = "synthetic://tiny?seed=0"
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(3 + (i * 5) % 17)] for i in range(12)]
LENGTHS = [4, 9, 16, 24]
LONG = 40  # long enough to outlive a resize


def reference(lengths: list[int] | None = None) -> dict[tuple[int, int], list[int]]:
    """Greedy tokens of every (prompt, length), single process, all experts local (lengths:
    LENGTHS and LONG by default)."""
    torch.set_num_threads(1)
    lengths = [*LENGTHS, LONG] if lengths is None else lengths
    longest = generate.generate_greedy(SOURCE, PROMPTS, max(lengths))
    return {(p, n): longest[p][:n] for p in range(len(PROMPTS)) for n in lengths}


class Deployment:
    """Engine + executor + elastic service in this process (what `moe-runtime serve` wires),
    serving SOURCE on the executor's ranks; config: `ElasticConfig` fields besides the source."""

    def __init__(
        self,
        executor: executor_base.Executor,
        *,
        max_size: int,
        max_experts_per_rank: int | None = None,
        **config: Any,
    ) -> None:
        src = source_mod.open_source(SOURCE)
        self.cfg = src.config
        size = executor.num_ranks
        physical = policy.num_physical_for(self.cfg.num_experts, size)
        placement = policy.identity(self.cfg.num_moe_layers, self.cfg.num_experts, physical, size)
        self.executor = executor
        self.executor.start(SOURCE, placement=placement)
        self.engine = core.Engine(
            self.executor,
            src.tokenizer(),
            seam.EngineConfig(max_model_len=self.cfg.max_position_embeddings),
        )
        self.elastic = service.ElasticService.attach(
            engine=self.engine,
            executor=self.executor,
            model_config=self.cfg,
            placement=placement,
            config=serving.ElasticConfig(source=SOURCE, **config),
            limits=coordinator.Limits(
                min_size=1,
                max_size=max_size,
                num_experts=self.cfg.num_experts,
                max_experts_per_rank=max_experts_per_rank,
            ),
        )
        self.engine.start()
        self._ids = 0

    def close(self) -> None:
        self.elastic.close()
        self.engine.stop()
        self.executor.shutdown()

    def generate(self, prompt: int, n: int, *, rid: str | None = None) -> req_mod.CompletedRequest:
        self._ids += 1
        handle = self.engine.add_request(
            req_mod.Request(
                request_id=rid or f"q{self._ids}",
                prompt_token_ids=PROMPTS[prompt],
                sampling=step_mod.SamplingParams(temperature=0.0),
                max_tokens=n,
                ignore_eos=True,
            )
        )
        return handle.result(timeout=300)

    def resize(self, to: int) -> Any:
        record = self.elastic.coordinator.request(to)
        assert self.elastic.coordinator.wait(record, timeout=300), f"resize to {to} hangs"
        return record

    def ensure(self, size: int) -> None:
        if self.executor.num_ranks != size:
            record = self.resize(size)
            assert record.succeeded, record.message

    def states(self) -> list[dict[str, Any]]:
        labels = sorted(self.executor.rank_infos())
        return list(self.executor.collective_rpc("live_state", ranks=labels, timeout=60))


class LongRequests:
    """Long greedy generations running while something fails; `check()` compares them."""

    def __init__(self, d: Deployment, count: int = 4) -> None:
        self.results: dict[int, req_mod.CompletedRequest] = {}
        self._threads = [
            threading.Thread(target=self._run, args=(d, p), daemon=True) for p in range(count)
        ]
        self._d = d

    def _run(self, d: Deployment, p: int) -> None:
        self.results[p] = d.generate(p, LONG)

    def __enter__(self) -> LongRequests:
        for t in self._threads:
            t.start()
        deadline = time.monotonic() + 60
        while self._d.engine.stats().num_running < len(self._threads):
            assert time.monotonic() < deadline, "the long requests did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self._threads:
            t.join(timeout=300)

    def check(self, reference: dict[tuple[int, int], list[int]]) -> None:
        assert {p: (r.error, r.token_ids) for p, r in self.results.items()} == {
            p: (None, reference[(p, LONG)]) for p in range(len(self._threads))
        }


def ray_deployment(size: int, *, spares: int = 0, max_size: int = 3) -> Deployment:
    """DP `size` on Ray ranks with the fault hooks, no EPLB and no autoRecover (failures are the
    tests'), `spares` warm spare ranks."""
    from moe_runtime.executor import ray_executor

    return Deployment(
        ray_executor.RayExecutor(size, rank_hooks=faults.Faults),
        max_size=max_size,
        eplb_enabled=False,
        auto_recover=False,
        warm_spare_ranks=spares,
    )


def assert_clean(d: Deployment, size: int, reference: dict[tuple[int, int], list[int]]) -> None:
    """Serving at `size` with correct tokens; every worker holds exactly one live state."""
    assert d.executor.num_ranks == size and d.executor.pending_ranks == []
    assert d.executor.has_step_path() and d.elastic.readiness()[0]
    epoch = d.elastic.ops.ctx.serving.epoch
    for state in d.states():
        assert not state["staged"] and not state["previous"], state
        assert state["group_epochs"] == [epoch] and state["epoch"] == epoch, state
    got = [d.generate(p, 16) for p in range(3)]
    assert [g.token_ids for g in got] == [reference[(p, 16)] for p in range(3)]
