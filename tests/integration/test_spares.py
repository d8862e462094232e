"""Warm spare ranks on the Ray executor (real actors, gloo groups, shared-memory moves).

One deployment for the module: DP 2, one warm spare (`ElasticConfig.warm_spare_ranks=1`),
at most 4 ranks. Under long greedy generations checked token for token:
- the spare comes up ready (weights from the active ranks, standby groups), outside "ranks";
- a grow by one takes it: no Standby (Transferring, Switching, Reshuffling), and a
  replacement spare starts on a free rank slot by itself;
- a grow by more than the spares takes the spare and starts the rest (with Standby);
- a shrink frees the departing ranks (the spare stays a spare);
- a failed grow gives the spare back; a spare killed for real is removed and replaced.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from moe_runtime.elastic import settings, stages
from moe_runtime.executor import niceness
from tests.support import deployment

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, int], list[int]]:
    return deployment.reference()


def spares(d: deployment.Deployment) -> list[dict[str, Any]]:
    """The `spares` of /elastic_ep/status."""
    return list(d.elastic.status()["spares"])


def wait_spares_ready(
    d: deployment.Deployment, count: int = 1, timeout: float = 180.0
) -> list[dict[str, Any]]:
    pool = d.elastic.spares
    assert pool is not None
    deadline = time.monotonic() + timeout
    while len(pool.ready()) < count:
        assert time.monotonic() < deadline, spares(d)
        time.sleep(0.05)
    return spares(d)


def prestaged(d: deployment.Deployment) -> bool:
    """Every ready spare holds the experts of every grow it may serve."""
    pool = d.elastic.spares
    assert pool is not None
    ready = pool.ready()
    plan = pool.prestager.current(d.executor.ranks, d.elastic.ops.ctx.serving.placement)
    return bool(ready) and plan is not None and plan.spares == tuple(ready) and plan.complete()


@pytest.fixture(scope="module")
def dep(ray_session: None) -> Iterator[deployment.Deployment]:
    d = deployment.ray_deployment(2, spares=1, max_size=4)
    yield d
    d.close()


def stage_names(record: Any) -> list[str]:
    return [s["stage"] for s in record.to_json()["stages"]]


def assert_spare_apart(d: deployment.Deployment) -> None:
    """The spare is listed under "spares", never under "ranks"."""
    st = d.elastic.status()
    spare_ranks = {s["rank"] for s in st["spares"]}
    assert st["warm_spare_ranks"] == 1
    assert not spare_ranks & {r["rank"] for r in st["ranks"]}, st


def assert_serves(d: deployment.Deployment, reference: dict[tuple[int, int], list[int]]) -> None:
    """A step path, one live state per active worker (older groups retired; standby groups
    of later epochs may be there), and the tokens of single-process generation."""
    assert d.executor.has_step_path() and d.elastic.readiness()[0]
    epoch = d.elastic.ops.ctx.serving.epoch
    for state in d.executor.collective_rpc("live_state", ranks=d.executor.ranks, timeout=60):
        assert not state["staged"] and not state["previous"] and state["epoch"] == epoch, state
        assert min(state["group_epochs"]) == epoch, state
    got = [d.generate(p, 16) for p in range(3)]
    assert [g.token_ids for g in got] == [reference[(p, 16)] for p in range(3)]


def actor(d: deployment.Deployment, label: int) -> Any:
    """The Ray actor of rank `label`."""
    return d.executor.roster.member(label).handle.actor


def assert_steps_at_full_priority(d: deployment.Deployment) -> None:
    """Once the compiled graph carries the steps again, every serving rank's step thread runs
    at niceness 0: a step waits for its slowest rank (a thread that had run background calls
    at BACKGROUND_NICENESS used to keep it when steps moved onto it)."""
    assert d.executor.path.wait_idle(120)
    d.generate(0, 4)
    niceness = {
        label: ray.get(actor(d, label).step_niceness.remote(), timeout=30)
        for label in d.executor.ranks
    }
    assert set(niceness.values()) == {0}, niceness


def test_a_spare_comes_up_ready_beside_the_active_ranks(dep: deployment.Deployment) -> None:
    (spare,) = wait_spares_ready(dep)
    assert spare["ready"] and spare["healthy"] and spare["pid"] and spare["node_id"]
    assert spare["rank"] not in dep.executor.ranks
    assert_spare_apart(dep)
    # It waits below the serving ranks' CPU priority (they step at 0).
    assert os.getpriority(os.PRIO_PROCESS, spare["pid"]) == niceness.SPARE_NICENESS
    dep.generate(0, 4)
    for info in dep.executor.rank_infos().values():
        if info["pid"] != spare["pid"]:
            assert os.getpriority(os.PRIO_PROCESS, info["pid"]) == 0


def test_a_grow_the_spare_covers_skips_standby_and_the_spare_is_replaced(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    dep.ensure(2)
    (spare,) = wait_spares_ready(dep)
    with deployment.LongRequests(dep) as running:
        record = dep.resize(3)
    running.check(reference)
    assert record.succeeded, record.message
    assert stage_names(record) == ["Transferring", "Switching", "Reshuffling"]
    assert record.warm_spares == 1 and record.switch_pause_s is not None
    assert spare["pid"] in [i["pid"] for i in dep.executor.rank_infos().values()]
    assert os.getpriority(os.PRIO_PROCESS, spare["pid"]) == 0  # it serves now
    # ... and so does the thread that runs its steps (every step waits for the slowest rank).
    assert_steps_at_full_priority(dep)
    (replacement,) = wait_spares_ready(dep)
    assert replacement["pid"] != spare["pid"]
    assert_spare_apart(dep)
    assert_serves(dep, reference)


def test_a_grow_on_a_prestaged_spare_moves_only_what_it_lacks(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    dep.ensure(2)
    wait_spares_ready(dep)
    deadline = time.monotonic() + 120
    while not prestaged(dep):
        assert time.monotonic() < deadline, spares(dep)
        time.sleep(0.05)
    (spare,) = spares(dep)
    assert spare["prestaged"]["held"] == spare["prestaged"]["wanted"] > 0, spare
    record = dep.resize(3)
    assert record.succeeded, record.message
    # What the spare held was not moved again, nor what a serving rank retained (truthful:
    # moves + pre-staged + retained >= lower bound).
    assert record.experts_prestaged > 0
    unneeded = record.experts_prestaged + record.experts_retained
    assert record.expert_moves + unneeded >= record.expert_moves_lower_bound
    assert_serves(dep, reference)


def test_a_grow_beyond_the_spares_takes_them_and_starts_the_rest(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    dep.ensure(2)
    (spare,) = wait_spares_ready(dep)
    record = dep.resize(4)
    assert record.succeeded, record.message
    assert stage_names(record)[0] == "Standby" and record.warm_spares == 1
    assert spare["pid"] in [i["pid"] for i in dep.executor.rank_infos().values()]
    assert_serves(dep, reference)


def test_a_shrink_frees_the_departing_ranks_and_keeps_the_spare(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    dep.ensure(3)
    (spare,) = wait_spares_ready(dep)
    with deployment.LongRequests(dep) as running:
        record = dep.resize(2)
    running.check(reference)
    assert record.succeeded and len(record.freed) == 1, record.message
    assert spare["pid"] not in [f["pid"] for f in record.freed]
    assert [s["pid"] for s in wait_spares_ready(dep)] == [spare["pid"]]
    assert_serves(dep, reference)
    assert_steps_at_full_priority(dep)


def test_a_failed_grow_gives_the_spare_back(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    dep.ensure(2)
    (spare,) = wait_spares_ready(dep)
    dep.elastic.coordinator.inject_failure(stages.Stage.SWITCHING)
    with deployment.LongRequests(dep) as running:
        record = dep.resize(3)
    running.check(reference)
    assert record.stage is stages.Stage.FAILED, record.message
    assert "serving at data parallel size 2" in record.message
    assert [s["pid"] for s in wait_spares_ready(dep)] == [spare["pid"]]
    assert_serves(dep, reference)


def test_a_spare_killed_for_real_is_replaced(dep: deployment.Deployment) -> None:
    dep.ensure(2)
    (spare,) = wait_spares_ready(dep)
    os.kill(spare["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 180
    while True:
        now = spares(dep)
        if now and now[0]["pid"] != spare["pid"] and now[0]["ready"]:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.1)
    assert dep.executor.num_ranks == 2 and not dep.elastic.coordinator.recovering
    assert_spare_apart(dep)


def test_the_spare_count_is_a_live_setting(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    """PATCH /elastic_ep/config warm_spare_ranks: 2 starts another spare, 0 stops them all
    (their rank slots are free again), 1 brings one back; serving goes on throughout."""
    dep.ensure(2)
    wait_spares_ready(dep)
    live = dep.elastic.live
    with deployment.LongRequests(dep) as running:
        assert live.patch(settings.ConfigPatch(warm_spare_ranks=2))["warm_spare_ranks"] == 2
        assert len(wait_spares_ready(dep, 2)) == 2
        live.patch(settings.ConfigPatch(warmSpareRanks=0))
        deadline = time.monotonic() + 60
        while spares(dep):
            assert time.monotonic() < deadline, spares(dep)
            time.sleep(0.1)
        assert dep.executor.num_ranks == 2 and len(dep.executor.rank_infos()) == 2
    running.check(reference)
    assert dep.elastic.status()["warm_spare_ranks"] == 0
    with pytest.raises(settings.InvalidConfig, match="must be <= max_data_parallel_size"):
        live.patch(settings.ConfigPatch(warm_spare_ranks=5))  # max_data_parallel_size is 4
    live.patch(settings.ConfigPatch(warm_spare_ranks=1))
    (spare,) = wait_spares_ready(dep)
    assert spare["ready"]
    assert_serves(dep, reference)
