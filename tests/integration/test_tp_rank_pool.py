"""Issue 22, the rank pool at tensor-parallel size T > 1: `moe-runtime serve --data-parallel-size
2 --tensor-parallel-size 2 --rank-pool 1` keeps its pooled process as a whole DP rank (a
leader and its TP follower, no weights, both below the serving ranks' CPU priority); a grow to
3 takes it whole (no process started: the new DP rank is those two processes, its follower
loads its shard), every answer under load equals transformers', and the pool refills whole;
a pooled rank whose follower is SIGKILLed is removed whole and replaced.

One server (tiny random Mixtral shape, `tests.support.tp_serving`), joining the tests' Ray
instance (3 DP ranks and the pooled one, 2 actors each).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from moe_runtime.executor import niceness
from tests.support import runtime_proc, tp_serving
from tests.support.tp_serving import Served, assert_whole, serving, status

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, ray_session: None) -> Iterator[Served]:
    yield from tp_serving.serve(tmp_path_factory.mktemp("tp_pool"), "--rank-pool", "1")


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


def test_a_grow_takes_the_pooled_rank_whole_and_the_pool_refills(served: Served) -> None:
    pooled = _pooled(served)
    assert len(pooled) == 1
    assert_whole(pooled, nice=niceness.SPARE_NICENESS)
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
    assert_whole(ranks, nice=0)
    # the new DP rank is the pooled leader and its follower (no process started)
    assert (pooled[0]["pid"], pooled[0]["tp_pids"]) in [(r["pid"], r["tp_pids"]) for r in ranks]
    grow = next(h for h in st["history"] if h["resize_id"] == done["resize_id"])
    assert grow["warm_spares"] == 0, grow
    # the pool refills with a whole rank (new processes)
    refilled = _pooled(served)
    assert refilled[0]["pid"] != pooled[0]["pid"]
    assert_whole(refilled, nice=niceness.SPARE_NICENESS)
    # a pooled rank whose follower dies is lost whole (its leader's pings fail) and replaced
    os.kill(refilled[0]["tp_pids"][0], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while (again := _pooled(served))[0]["pid"] == refilled[0]["pid"]:
        assert time.monotonic() < deadline, (again, served.server.tail())
        time.sleep(0.2)
    assert_whole(again, nice=niceness.SPARE_NICENESS)
    assert len(serving(status(served))) == 3
