"""Failures inside a step of an in-process deployment (LocalExecutor, 3 ranks), on gloo and with
NCCL's failure semantics emulated over gloo (`tests.support.nccl_emulation`): none hangs the
peers, every request completes with the tokens of single-process generation.

- a rank runs out of device memory just before its forward pass (its peers are about to wait
  for it in the expert collectives): it is a rank failure; the rank leaves its groups, is
  reported lost and the recovery shrinks around it;
- a rank's forward pass raises (every rank stays healthy): the step group is aborted and the
  recovery builds a new epoch's groups over the same ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from moe_runtime.executor import local
from tests.support import deployment, faults, nccl_emulation


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, int], list[int]]:
    return deployment.reference()


@pytest.fixture(scope="module", params=["gloo", "nccl-emulated"])
def dep(request: pytest.FixtureRequest) -> Iterator[deployment.Deployment]:
    previous = nccl_emulation.install() if request.param == "nccl-emulated" else None
    executor = local.LocalExecutor(3, rank_hooks=faults.Faults)
    # A forward that fails on one rank leaves its NCCL peers held until the op timeout (only
    # a lost rank makes them abort at once): short here.
    executor.heartbeat.clock.min_group_timeout = 3.0
    d = deployment.Deployment(executor, max_size=3, eplb_enabled=False, auto_recover=False)
    yield d
    d.close()
    if previous is not None:
        nccl_emulation.restore(previous)


def _recoveries(d: deployment.Deployment) -> list[object]:
    return [r for r in d.elastic.coordinator.history() if r.recovery is not None]


def _wait_recovered(d: deployment.Deployment, before: int, size: int) -> object:
    deadline = time.monotonic() + 120
    while (
        len(_recoveries(d)) <= before
        or d.elastic.coordinator.recovering
        or d.executor.num_ranks != size
    ):
        assert time.monotonic() < deadline, "no recovery"
        time.sleep(0.02)
    return _recoveries(d)[-1]


def test_a_forward_pass_that_fails_on_one_rank_rebuilds_the_groups(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    dep.ensure(3)
    before = len(_recoveries(dep))
    epoch = dep.elastic.ops.ctx.serving.epoch
    with deployment.LongRequests(dep) as running:
        dep.executor.collective_rpc("fail_next", "forward", ranks=[1])
        rec = _wait_recovered(dep, before, 3)
    running.check(reference)
    assert rec.succeeded and rec.recovery.ranks_lost == [], rec.to_json()  # type: ignore[attr-defined]
    assert dep.elastic.ops.ctx.serving.epoch > epoch
    deployment.assert_clean(dep, 3, reference)


def test_a_rank_out_of_memory_is_lost_and_shrunk_around(
    dep: deployment.Deployment, reference: dict[tuple[int, int], list[int]]
) -> None:
    dep.ensure(3)
    before = len(_recoveries(dep))
    with deployment.LongRequests(dep) as running:
        dep.executor.collective_rpc("fail_next", "forward", ranks=[1], error="oom")
        rec = _wait_recovered(dep, before, 2)
    running.check(reference)
    lost = rec.recovery.ranks_lost  # type: ignore[attr-defined]
    assert rec.succeeded and [r["rank"] for r in lost] == [1], lost  # type: ignore[attr-defined]
    assert "OutOfMemoryError" in lost[0]["reason"], lost
    deployment.assert_clean(dep, 2, reference)
