"""Issue 22, warm spares at tensor-parallel size T > 1: `moe-runtime serve --data-parallel-size 2
--tensor-parallel-size 2 --warm-spare-ranks 1` keeps its spare as a whole DP rank (a leader and
its TP follower, both loaded, both below the serving ranks' CPU priority), a grow to 3 takes it
whole (no Standby), the pool starts a whole replacement, and a follower SIGKILLed under load
takes its DP rank out and the recovery grows back on the replacement spare: no request fails,
every answer equals transformers' (greedy and seeded, streamed or not).

One server for the module (tiny random Mixtral shape, `tests.support.tp_serving`), joining the
tests' Ray instance (3 DP ranks and one spare, 2 actors each).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from moe_runtime.executor import niceness
from tests.support import runtime_proc, tp_serving
from tests.support.tp_serving import Served, assert_whole, serving, status

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, ray_session: None) -> Iterator[Served]:
    # 8 rank processes on 2 cores: a heartbeat answer can take over 3 s there (a rank fenced
    # with no fault); the follower this test kills fails its rank's step at once anyway
    yield from tp_serving.serve(
        tmp_path_factory.mktemp("tp_spares"),
        "--warm-spare-ranks",
        "1",
        "--rank-hang-timeout",
        "15",
    )


def _wait_spare_ready(s: Served, timeout: float = 180.0) -> dict[str, object]:
    """The status once one spare is ready (loaded, warm, in standby groups)."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(s)
        if [sp for sp in st["spares"] if sp["ready"]]:
            return st
        assert time.monotonic() < deadline, (st["spares"], s.server.tail())
        time.sleep(0.2)


def test_spare_is_whole_taken_by_a_grow_and_replaces_a_lost_rank(served: Served) -> None:
    st = _wait_spare_ready(served)
    assert st["warm_spare_ranks"] == 1
    assert len(serving(st)) == 2
    assert_whole(serving(st))
    # the spare is a whole DP rank (listed under "spares"): its follower started with it and
    # waits below the serving ranks' CPU priority with it
    spare = st["spares"][0]
    assert_whole([spare], nice=niceness.SPARE_NICENESS)
    before = len(st["history"])

    traffic = tp_serving.load(served)
    with traffic:
        tp_serving.wait_traffic(traffic, 4)
        done = runtime_proc.scale(served.server.url, 3, headers=tp_serving.AUTH)
        assert done["stage"] == "Completed", done
        st = status(served)
        grow = next(h for h in st["history"] if h["resize_id"] == done["resize_id"])
        # the grow took the spare: no Standby (no rank started, no rendezvous)
        assert grow["warm_spares"] == 1, grow
        assert "Standby" not in [s["stage"] for s in grow["stages"]], grow
        ranks = serving(st)
        assert len(ranks) == 3
        assert_whole(ranks, nice=0)
        # the spare itself serves now: its leader and its follower
        assert (spare["pid"], spare["tp_pids"]) in [(r["pid"], r["tp_pids"]) for r in ranks]

        # a whole replacement spare comes up on the freed slots
        st = _wait_spare_ready(served)
        replacement = st["spares"][0]
        assert replacement["pid"] != spare["pid"]
        assert_whole([replacement], nice=niceness.SPARE_NICENESS)

        # a follower SIGKILLed under load: its DP rank out, the spare takes its place
        victim = serving(st)[0]
        os.kill(victim["tp_pids"][0], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:
            st = status(served)
            history = st["history"][before:]
            recoveries = [h for h in history if h.get("recovery")]
            pids = {r["pid"] for r in serving(st)}
            if (
                recoveries
                and victim["pid"] not in pids
                and replacement["pid"] in pids
                and st["data_parallel_size"] == 3
                and not st["is_scaling"]
            ):
                break
            assert time.monotonic() < deadline, (st, served.server.tail())
            time.sleep(0.2)
        tp_serving.wait_traffic(traffic, traffic.ok + 4)
    assert not traffic.failures, traffic.failures[:3]
    assert traffic.ok > 0, traffic.summary()
    lost = [lost for h in recoveries for lost in h["recovery"]["ranks_lost"]]
    assert [r["pid"] for r in lost] == [victim["pid"]], recoveries
    # the grow back after the recovery took the (whole) replacement spare
    after = history[history.index(recoveries[0]) + 1 :]
    assert [h["warm_spares"] for h in after] == [1], history
    assert_whole(serving(st), nice=0)
