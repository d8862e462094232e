"""Failure injection on the Ray executor (real actors, compiled step graph, gloo groups):
every failure path ends in a serving engine with the tokens of single-process generation.

- a failure after the work of every resize stage (up 2->3 and down 3->2): the deployment
  serves at its last good size, and no staged set, previous state or stray group is left;
- failures inside Switching (activate on a new or an old rank, a hung activate past the switch
  deadline): the switch goes back to the old graph; a step graph that fails to compile after a
  switch (in the background) leaves the new size serving on plain actor calls until a later
  compile succeeds;
- a step that fails while every rank stays healthy: retried on a graph rebuilt on the same ranks;
- failures inside the EPLB commit (prepare on one rank, the vote on one rank): no rank
  changes its placement; a commit every rank makes moves them all;
- a rank actor killed with SIGKILL (its pid from rank_infos) while requests run: the runtime
  shrinks around it, no request fails, and with autoRecover off it stays smaller until asked;
  the same with NCCL's failure semantics in the ranks (emulated over gloo): the survivor,
  which would wait for its dead peer until the op timeout, is released by the peer-loss abort;
  killed during a resize's Standby: the resize fails, the runtime recovers, nothing is left;
  a grow's new rank killed before it joins the standby groups: the grow fails in seconds.

One deployment for the module (DP 2, at most 3 ranks); each test first brings it to the size
it starts from, so the tests do not depend on their order.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moe_runtime.elastic import rebalance, stages
from moe_runtime.engine import seam
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.executor import base as executor_base
from tests.support import deployment, nccl_emulation

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, int], list[int]]:
    return deployment.reference()


@pytest.fixture(scope="module")
def dep(ray_session: None) -> Iterator[deployment.Deployment]:
    d = deployment.ray_deployment(2)
    yield d
    d.close()


# --------------------------------------------------------- a failure after every stage


@pytest.mark.parametrize(
    ("start", "to", "stage", "end"),
    [
        pytest.param(2, 3, stages.Stage.STANDBY, 2, id="up-Standby"),
        pytest.param(2, 3, stages.Stage.TRANSFERRING, 2, id="up-Transferring"),
        pytest.param(2, 3, stages.Stage.SWITCHING, 2, id="up-Switching"),
        pytest.param(2, 3, stages.Stage.RESHUFFLING, 3, id="up-Reshuffling"),
        pytest.param(3, 2, stages.Stage.RESHUFFLING, 3, id="down-Reshuffling"),
        pytest.param(3, 2, stages.Stage.MIGRATING, 3, id="down-Migrating"),
        pytest.param(3, 2, stages.Stage.SWITCHING, 3, id="down-Switching"),
        pytest.param(3, 2, stages.Stage.RELEASING, 2, id="down-Releasing"),
    ],
)
def test_a_failure_after_any_stage_leaves_the_last_good_size_serving(
    dep: deployment.Deployment,
    reference: dict[tuple[int, int], list[int]],
    start: int,
    to: int,
    stage: stages.Stage,
    end: int,
) -> None:
    """Up to Switching (included: it is undone until the next stage confirms it) the old size
    serves again; after it, the new size is the last good one."""
    dep.ensure(start)
    dep.elastic.coordinator.inject_failure(stage)
    with deployment.LongRequests(dep) as running:
        record = dep.resize(to)
    running.check(reference)
    assert record.stage is stages.Stage.FAILED
    assert f"{stage.value} failed: injected failure" in record.message, record.message
    assert "cleanup problems" not in record.message, record.message
    assert f"serving at data parallel size {end}" in record.message
    deployment.assert_clean(dep, end, reference)


# --------------------------------------------------------------- inside Switching


@pytest.mark.parametrize(
    ("where", "rank"),
    [
        pytest.param("activate", 2, id="activate-on-the-new-rank"),
        pytest.param("activate", 0, id="activate-on-an-old-rank"),
        pytest.param("hang", 1, id="activate-hangs-past-the-deadline"),
    ],
)
def test_a_failure_inside_switching_goes_back_to_the_old_graph(
    dep: deployment.Deployment,
    reference: dict[tuple[int, int], list[int]],
    where: str,
    rank: int | None,
) -> None:
    dep.ensure(2)
    ops = dep.elastic.ops.ctx
    config = ops.config
    armed = threading.Event()

    def arm(record: Any) -> None:
        # At the start of Switching: the new rank (label 2) exists from Standby on.
        if record.stage is not stages.Stage.SWITCHING or armed.is_set():
            return
        armed.set()
        if where == "hang":
            ops.config = dataclasses.replace(config, switch_timeout=2.0)
            dep.executor.collective_rpc("stall_next", "activate", 4.0, ranks=[rank])
        else:
            dep.executor.collective_rpc("fail_next", "activate", ranks=[rank])

    dep.elastic.coordinator.on_change(arm)
    try:
        with deployment.LongRequests(dep) as running:
            started = time.monotonic()
            record = dep.resize(3)
            took = time.monotonic() - started
    finally:
        dep.elastic.coordinator._listeners.remove(arm)
        ops.config = config
    running.check(reference)
    assert armed.is_set()
    assert record.stage is stages.Stage.FAILED and "Switching failed" in record.message
    assert "serving at data parallel size 2" in record.message
    print(f"\n{where}: failed resize took {took:.2f}s: {record.message}")
    deployment.assert_clean(dep, 2, reference)


def test_a_step_graph_that_fails_to_compile_after_a_switch_leaves_plain_calls_serving(
    dep: deployment.Deployment,
    reference: dict[tuple[int, int], list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The graph over the new ranks is compiled after the switch, in the background: its
    failure fails no request and no resize; plain actor calls step meanwhile, and the compile
    is tried again (`ray_step.RETRY_SECONDS` later) until the graph carries the steps."""
    from moe_runtime.executor import ray_graph, ray_step

    dep.ensure(2)
    ex: Any = dep.executor
    armed = threading.Event()
    compile_graph = ray_graph.compile_graph

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        # The background compile runs in this process: its first call after the arming fails.
        if armed.is_set() and not failed.is_set():
            failed.set()
            raise RuntimeError("injected failure compiling the step graph")
        return compile_graph(*args, **kwargs)

    failed = threading.Event()
    monkeypatch.setattr(ray_graph, "compile_graph", fail_once)

    def arm(record: Any) -> None:
        if record.stage is stages.Stage.SWITCHING and not armed.is_set():
            armed.set()

    dep.elastic.coordinator.on_change(arm)
    try:
        with deployment.LongRequests(dep) as running:
            record = dep.resize(3)
            assert record.succeeded, record.message
            assert ex.path.wait_idle(timeout=60)
            assert "injected failure" in ex.path.last_compile.get("error", "")
            assert not ex.path.graph_live()  # plain calls serve
    finally:
        dep.elastic.coordinator._listeners.remove(arm)
    running.check(reference)
    deadline = time.monotonic() + ray_step.RETRY_SECONDS + 60
    while not ex.path.graph_live():  # the next steps start the retry once it is due
        assert time.monotonic() < deadline, ex.path.last_compile
        dep.generate(0, 2)
    assert "error" not in ex.path.last_compile
    deployment.assert_clean(dep, 3, reference)


# ------------------------------------------------------- a failed step, ranks healthy


def test_a_step_that_fails_with_healthy_ranks_is_retried_on_a_rebuilt_graph(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    """A step past the executor's hard limit on a rank that still answers its heartbeat: the
    graph is rebuilt on the same ranks and the step retried; no request fails."""
    dep.ensure(2)
    failures: list[seam.StepFailure] = []
    dep.engine.on_step_failure(failures.append)
    ex: Any = dep.executor
    limit = ex.step_timeout
    ex.step_timeout = 1.0
    try:
        with deployment.LongRequests(dep) as running:
            dep.executor.collective_rpc("stall_next", "execute_step", 2.5, ranks=[1])
    finally:
        ex.step_timeout = limit
    running.check(reference)
    assert failures, "no step failed"
    assert all(type(f.exception) is executor_base.ExecutorError for f in failures), failures
    assert "step path rebuilt on ranks [0, 1]" in str(failures[0].exception)
    assert dep.executor.lost_ranks() == {} and dep.executor.num_ranks == 2
    deployment.assert_clean(dep, 2, reference)


# ---------------------------------------------------------------- the EPLB commit


def skew_load(d: deployment.Deployment) -> None:
    """Record a load (hot experts) under which a rebalance moves experts: so large that the
    tokens of the test itself do not change the plan."""
    ops = d.elastic.ops.ctx
    placement = ops.serving.placement
    layers, experts = placement.num_layers, placement.num_logical
    for shift in range(experts):
        load = torch.ones(layers, experts, dtype=torch.int64)
        load[:, [shift, (shift + 1) % experts]] = 10**6
        ops.load.window.record(load)
        target = moves_mod.rebalance_for_resize(
            ops.load.total(),
            placement,
            old_num_ranks=ops.serving.num_ranks,
            new_num_ranks=ops.serving.num_ranks,
            num_physical=placement.num_physical,
        )
        if not target.equals(placement):
            return
    pytest.fail("no recorded load makes a rebalance move experts")


@pytest.mark.parametrize(
    ("operation", "refused"),
    [
        pytest.param("stage_experts", RuntimeError, id="prepare-fails-on-one-rank"),
        pytest.param("commit_staged", rebalance.CommitRefused, id="vote-fails-on-one-rank"),
        pytest.param(None, None, id="every-rank-commits"),
    ],
)
def test_the_eplb_commit_is_all_or_nothing(
    dep: deployment.Deployment,
    reference: dict[tuple[int, int], list[int]],
    operation: str | None,
    refused: type[Exception] | None,
) -> None:
    dep.ensure(2)
    skew_load(dep)
    before = [s["phy2log"] for s in dep.states()]
    old = dep.elastic.ops.ctx.serving.placement
    if operation is not None:
        dep.executor.collective_rpc("fail_next", operation, ranks=[1])
    try:
        with deployment.LongRequests(dep) as running:
            if refused is None:
                result = dep.elastic.rebalancer.rebalance_now()
            else:
                with pytest.raises(refused):
                    dep.elastic.rebalancer.rebalance_now()
    finally:
        dep.executor.collective_rpc("disarm", ranks=[0, 1])
    running.check(reference)
    after = [s["phy2log"] for s in dep.states()]
    if refused is None:
        assert result["applied"], result
        assert after[0] == after[1] != before[0]
        assert dep.elastic.ops.ctx.serving.placement.phy2log.tolist() == after[0]
    else:
        assert after == before and dep.elastic.ops.ctx.serving.placement is old
    deployment.assert_clean(dep, 2, reference)


# ---------------------------------------------------------- a rank actor killed for real


def test_a_killed_rank_is_shrunk_around_and_stays_smaller_without_auto_recover(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    dep.ensure(3)
    pid = dep.executor.rank_infos()[1]["pid"]
    with deployment.LongRequests(dep, count=6) as running:
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        deadline = killed + 60
        while dep.executor.num_ranks != 2 or dep.elastic.coordinator.recovering:
            assert time.monotonic() < deadline, "no recovery"
            time.sleep(0.01)
        recovered = time.monotonic()
    running.check(reference)
    (rec,) = [r for r in dep.elastic.coordinator.history() if r.recovery is not None][-1:]
    assert rec.succeeded and [r["pid"] for r in rec.recovery.ranks_lost] == [pid]
    assert rec.recovery.experts_from_source + rec.recovery.experts_from_replicas > 0
    print(f"\nSIGKILL -> serving on 2 ranks after {recovered - killed:.2f}s: {rec.to_json()}")
    status = dep.elastic.status()
    assert [r["lost_rank"] for r in status["ranks"] if r["rank"] is None] == [1]
    assert status["auto_recover"] == {"enabled": False, "target": None}
    # the grow-back loop polls every 0.5 s: with autoRecover off it must not act, for 4 rounds
    quiet_until = time.monotonic() + 2.0
    while time.monotonic() < quiet_until:
        assert dep.executor.num_ranks == 2 and not dep.elastic.coordinator.is_scaling
        time.sleep(0.05)
    deployment.assert_clean(dep, 2, reference)
    dep.ensure(3)  # someone asks for the old size: the normal grow path
    assert [r for r in dep.elastic.status()["ranks"] if r["rank"] is None] == []
    deployment.assert_clean(dep, 3, reference)


def test_a_new_rank_lost_before_it_joins_fails_the_grow_at_once(
    dep: deployment.Deployment,
    reference: dict[tuple[int, int], list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The grow's new rank dies between its start and the standby groups (its pod was lost):
    the grow fails naming it as lost, not at the resize's rpc timeout (a join that waited for
    it would fail with "did not join within"), and the old size serves on, clean; the next
    grow works. (How long the failed Standby took: bench/failures.py.)"""
    dep.ensure(2)
    real = dep.executor.build_groups
    killed: list[int] = []

    def build_groups(ranks: Any, **kwargs: Any) -> None:
        new = [r for r in ranks if r in dep.executor.pending_ranks]
        if new and not killed:
            killed.append(int(dep.executor.rank_infos()[new[-1]]["pid"]))
            os.kill(killed[0], signal.SIGKILL)
        real(ranks, **kwargs)

    monkeypatch.setattr(dep.executor, "build_groups", build_groups)
    with deployment.LongRequests(dep) as running:
        record = dep.resize(3)
    monkeypatch.undo()
    running.check(reference)
    assert killed, "the grow built no group over a new rank"
    assert record.stage is stages.Stage.FAILED, record.message
    assert "Standby failed" in record.message and "rank 2" in record.message, record.message
    assert "did not join" not in record.message, record.message
    assert "serving at data parallel size 2" in record.message, record.message
    deployment.assert_clean(dep, 2, reference)
    dep.ensure(3)
    got = [dep.generate(p, 16) for p in range(3)]
    assert [g.token_ids for g in got] == [reference[(p, 16)] for p in range(3)]


def test_a_rank_killed_during_a_resize_fails_the_resize_and_the_runtime_recovers(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    dep.ensure(2)
    pid = dep.executor.rank_infos()[1]["pid"]

    def kill_at_standby(record: Any) -> None:
        if record.kind == "resize" and record.stage is stages.Stage.STANDBY:
            os.kill(pid, signal.SIGKILL)

    dep.elastic.coordinator.on_change(kill_at_standby)
    try:
        with deployment.LongRequests(dep) as running:
            record = dep.resize(3)
    finally:
        dep.elastic.coordinator._listeners.remove(kill_at_standby)
    running.check(reference)
    assert record.stage is stages.Stage.FAILED, record.message
    assert "a rank was lost during the resize and the runtime recovered" in record.message
    (rec,) = [r for r in dep.elastic.coordinator.history() if r.recovery is not None][-1:]
    assert rec.succeeded and [r["pid"] for r in rec.recovery.ranks_lost] == [pid]
    deployment.assert_clean(dep, 1, reference)
    dep.ensure(2)
    deployment.assert_clean(dep, 2, reference)


def test_a_killed_rank_with_nccl_semantics_releases_its_peer_and_is_shrunk_around(
    ray_session: None, reference: dict[tuple[int, int], list[int]]
) -> None:
    """NCCL's failure semantics in the rank actors (`nccl_emulation.NcclFaults`): the survivor
    does not notice its dead peer by itself and would wait in its collective for the op
    timeout (set far past the recovery deadline here); the heartbeat's loss makes it abort its
    live groups (`Executor.abort_peers`), its step fails, and the runtime shrinks around the
    dead rank with every request completed. Own deployment (DP 2)."""
    from moe_runtime.executor import ray_executor

    executor = ray_executor.RayExecutor(2, rank_hooks=nccl_emulation.NcclFaults)
    executor.heartbeat.clock.min_group_timeout = 600.0
    d = deployment.Deployment(executor, max_size=2, eplb_enabled=False, auto_recover=False)
    try:
        pid = executor.rank_infos()[1]["pid"]
        with deployment.LongRequests(d) as running:
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            deadline = killed + 60
            while executor.num_ranks != 1 or d.elastic.coordinator.recovering:
                assert time.monotonic() < deadline, "no recovery"
                time.sleep(0.01)
            recovered = time.monotonic()
        running.check(reference)
        (rec,) = [r for r in d.elastic.coordinator.history() if r.recovery is not None][-1:]
        assert rec.succeeded and [r["pid"] for r in rec.recovery.ranks_lost] == [pid]
        print(f"\nNCCL semantics: SIGKILL -> serving on 1 rank after {recovered - killed:.2f}s")
        deployment.assert_clean(d, 1, reference)
    finally:
        d.close()
