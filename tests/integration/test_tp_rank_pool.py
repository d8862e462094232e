"""Issue 22, the rank pool at tensor-parallel size T > 1 and at pipeline-parallel size P > 1:
`moe-runtime serve --data-parallel-size 2 --tensor-parallel-size 2 --rank-pool 1` (or
`--pipeline-parallel-size 2`) keeps its pooled process as a whole DP rank (a leader and its
TP follower, or a leader and its pipeline stage actor; no weights, both below the serving
ranks' CPU priority); a grow to 3 takes it whole (no process started: the new DP rank is
those two processes; its follower's shard, or its stage actor's tensors, come from the
serving ranks' same process, its stage's experts by the stages' moves), every answer under load equals transformers', and the pool refills whole; a
pooled rank whose other process is SIGKILLed is removed whole and replaced.

One server per mesh (tiny random Mixtral shape, `tests.support.tp_serving`), joining the
tests' Ray instance (3 DP ranks and the pooled one, 2 actors each).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from moe_runtime.executor import niceness
from tests.support import hf_families, mesh_serving, runtime_proc, tp_serving
from tests.support.tp_serving import Served, assert_whole, serving, status

pytestmark = pytest.mark.ray

MESHES = {"tp2": tp_serving.TP2, "pp2": tp_serving.PP2}


@pytest.fixture(scope="module", params=list(MESHES))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, ray_session: None
) -> Iterator[Served]:
    root = tmp_path_factory.mktemp(f"pool_{request.param}")
    yield from tp_serving.serve(root, "--rank-pool", "1", mesh=MESHES[request.param])


def _pooled(s: Served, timeout: float = 180.0) -> list[dict[str, Any]]:
    """The pool's rank once it is up and healthy: the inactive rank, holding no expert (a
    pooled rank just lost shows unhealthy until it is replaced)."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(s)
        idle = [r for r in st["ranks"] if r["rank"] is not None and not r["active"]]
        if idle and not st["is_scaling"] and all(r["healthy"] for r in idle):
            assert all(r["num_experts"] == 0 for r in idle), idle
            return idle
        assert time.monotonic() < deadline, (st["ranks"], s.server.tail())
        time.sleep(0.2)


def _expert_load(s: Served, rank: int) -> float:
    """`moe_rank_expert_load` of DP rank `rank`: the tokens its MoE layers (every pipeline
    stage's) routed over the last steps."""
    return mesh_serving.metric(s.server.url, "moe_rank_expert_load", rank=str(rank))


def _expert_bytes() -> int:
    """Bytes of one routed expert of the served checkpoint (gate, up, down; float32)."""
    cfg = hf_families.build(tp_serving.FAMILY).config
    return 3 * cfg.hidden_size * cfg.intermediate_size * 4


def test_a_grow_takes_the_pooled_rank_whole_and_the_pool_refills(served: Served) -> None:
    mesh = served.mesh
    pooled = _pooled(served)
    assert len(pooled) == 1
    assert_whole(pooled, nice=niceness.SPARE_NICENESS, mesh=mesh)
    traffic = tp_serving.load(served)
    with traffic:
        tp_serving.wait_traffic(traffic, 4)
        done = runtime_proc.scale(served.server.url, 3, headers=tp_serving.AUTH)
        assert done["stage"] == "Completed", done
        tp_serving.wait_traffic(traffic, traffic.ok + 4)
    assert not traffic.failures, traffic.failures[:3]
    st = status(served)
    ranks = serving(st)
    assert len(ranks) == 3
    assert_whole(ranks, nice=0, mesh=mesh)
    # the new DP rank is the pooled leader and its other process (no process started)
    took = (pooled[0]["pid"], pooled[0][mesh.pids])
    assert took in [(r["pid"], r[mesh.pids]) for r in ranks], (pooled, ranks)
    grow = next(h for h in st["history"] if h["resize_id"] == done["resize_id"])
    assert grow["warm_spares"] == 0, grow
    # every process of the new DP rank (its TP follower's shard, its stage's tensors) got its
    # non-expert tensors from the serving ranks' same process, none from the source
    assert grow["bytes_moved"]["non_expert"] == served.rank_non_expert_bytes(), grow
    # each expert move carries one expert, except at P > 1 the moves of a later pipeline
    # stage's layers: the leaders hold one zero expert there and move nothing for them
    carried = grow["expert_moves"] * _expert_bytes()
    if "--pipeline-parallel-size" in mesh.flags:
        assert 0 < grow["bytes_moved"]["expert"] < carried, grow
    else:
        assert grow["bytes_moved"]["expert"] == carried, grow
    # it serves (every stage of it routed tokens to its experts), every answer equal
    traffic = tp_serving.load(served)
    with traffic:
        tp_serving.wait_traffic(traffic, 12)
    assert not traffic.failures, traffic.failures[:3]
    new = next(r for r in serving(status(served)) if r["pid"] == pooled[0]["pid"])
    assert _expert_load(served, new["rank"]) > 0, new
    # the pool refills with a whole rank (new processes)
    refilled = _pooled(served)
    assert refilled[0]["pid"] != pooled[0]["pid"]
    assert_whole(refilled, nice=niceness.SPARE_NICENESS, mesh=mesh)
    # a pooled rank whose other process dies is lost whole (its leader's pings fail) and
    # replaced
    os.kill(refilled[0][mesh.pids][0], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while (again := _pooled(served))[0]["pid"] == refilled[0]["pid"]:
        assert time.monotonic() < deadline, (again, served.server.tail())
        time.sleep(0.2)
    assert_whole(again, nice=niceness.SPARE_NICENESS, mesh=mesh)
    assert len(serving(status(served))) == 3
