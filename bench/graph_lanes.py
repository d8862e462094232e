"""How long a pipeline lane of the compiled step graph takes to carry a micro-batch's hidden
states from a leader to a stage and the stage's answer back (`executor.ray_mesh`), three ways:

- served: what the runtime does on CPUs (`MOE_STEP_GRAPH_TRANSPORT` auto): the channel
  pickles the lane, a host tensor from a quarter of the channel's buffer
  (`ray_pipeline.LANE_INLINE_SHARE`: 250 kB) goes through Ray's object store and the lane carries its reference (`ray_pipeline.Shipper`), the
  channels' buffers at Ray's default (1 MB);
- shm, pickle: the whole lane in the channel, by Ray's tensor transport through shared
  memory or pickled, in channels whose buffers are made large enough for the largest size
  beforehand (`RAY_CGRAPH_buffer_size_bytes` in the actors' environment). A channel that has
  to grow instead hangs its graph's teardown for good in Ray 2.60 (every switch tears the
  step graph down), which is why the runtime ships large tensors by reference.

Two bare actors, the shape of one lane of `ray_graph._pipeline` (``leader.prepare_step ->
stage.graph_step -> leader.finish_step``, the same `ray_pipeline.StageLane` values, the
nodes marked by `ray_graph.carrier`): the leader sends a [tokens, hidden] float32 tensor, the
stage returns one of the same shape with an expert load, the leader sums it. No model: the
figure is the transport alone (plus a copy and a sum). One row per size: the median of
`--rounds` runs of `--steps` executions each, in milliseconds per execution.

    .venv/bin/python bench/graph_lanes.py    # ~1 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any

import ray
import ray.dag
import torch

from moe_runtime.executor import ray_graph, ray_pipeline

#: (mode, its transport, whether large tensors go by reference, whether the buffers are sized)
MODES = (
    ("served", "pickle", True, False),
    ("shm", "shm", False, True),
    ("pickle", "pickle", False, True),
)


@ray.remote(num_cpus=0)
class Leader:
    def __init__(self, ship: bool) -> None:
        self.shipper = ray_pipeline.Shipper() if ship else None

    def prepare_step(self, shape: tuple[int, int]) -> ray_pipeline.StageLane:
        hidden = torch.ones(shape)
        if self.shipper is not None:
            hidden = self.shipper.ship(hidden)
        return ray_pipeline.StageLane(1, 0, args=(1, [], None, hidden, None))

    def finish_step(self, lane: ray_pipeline.StageLane) -> float:
        answer = ray_pipeline.Shipper.land(lane.answer)
        return float(answer["out"].sum())


@ray.remote(num_cpus=0)
class Stage:
    def __init__(self, ship: bool) -> None:
        self.shipper = ray_pipeline.Shipper() if ship else None

    def graph_step(self, lane: ray_pipeline.StageLane) -> ray_pipeline.StageLane:
        assert lane.args is not None
        load = torch.zeros(2, 8, dtype=torch.int64)
        hidden = ray_pipeline.Shipper.land(lane.args[3])
        answer: dict[str, Any] = {"out": hidden * 2, "loads": [(0, 2, load)], "reads": 0}
        if self.shipper is not None:
            answer = self.shipper.ship(answer)
        return dataclasses.replace(lane, args=None, answer=answer)


def lane_graph(leader: Any, stage: Any, transport: str) -> Any:
    carry = ray_graph.carrier(transport)
    with ray.dag.InputNode() as inp:
        lane = carry(stage.graph_step.bind(carry(leader.prepare_step.bind(inp))))
        dag = leader.finish_step.bind(lane)
    return dag.experimental_compile()


def timed(graph: Any, shape: tuple[int, int], steps: int) -> float:
    """Milliseconds per execution of `steps` executions, one at a time."""
    expected = 2.0 * shape[0] * shape[1]
    started = time.perf_counter()
    for _ in range(steps):
        assert ray.get(graph.execute(shape)) == expected
    return (time.perf_counter() - started) / steps * 1e3


def measure(args: argparse.Namespace, sized: bool, ms: dict[tuple[str, int], list[float]]) -> None:
    """Every mode with (or without) sized buffers, in a Ray session of its own (the actors
    read the buffer size from the environment they start with)."""
    buffer_bytes = max(args.tokens) * args.hidden * 4 + (1 << 20)
    if sized:
        os.environ["RAY_CGRAPH_buffer_size_bytes"] = str(buffer_bytes)
    else:
        os.environ.pop("RAY_CGRAPH_buffer_size_bytes", None)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for _ in range(args.rounds):
            for mode, transport, ship, mode_sized in MODES:
                if mode_sized != sized:
                    continue
                leader, stage = Leader.remote(ship), Stage.remote(ship)
                graph = lane_graph(leader, stage, transport)
                try:
                    for tokens in args.tokens:
                        shape = (tokens, args.hidden)
                        timed(graph, shape, 5)  # warm
                        ms.setdefault((mode, tokens), []).append(timed(graph, shape, args.steps))
                        print(f"  {mode} {tokens}: {ms[(mode, tokens)][-1]:.3f} ms", flush=True)
                finally:
                    graph.teardown()
                    ray.kill(leader)
                    ray.kill(stage)
    finally:
        ray.shutdown()
        os.environ.pop("RAY_CGRAPH_buffer_size_bytes", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ms: dict[tuple[str, int], list[float]] = {}
    measure(args, False, ms)
    measure(args, True, ms)
    names = [mode for mode, *_ in MODES]
    print(f"one lane there and back, hidden {args.hidden} float32; ms per execution, median")
    print(f"{'tokens':>7} {'MB':>6} " + " ".join(f"{n:>8}" for n in names))
    for tokens in args.tokens:
        mb = tokens * args.hidden * 4 / 1e6
        cells = " ".join(f"{statistics.median(ms[(n, tokens)]):8.3f}" for n in names)
        print(f"{tokens:>7} {mb:6.2f} {cells}")


if __name__ == "__main__":
    main()
