"""Tensor parallelism on the real node: a MoEDeployment with `tensorParallelSize: 2` serves, is
resized 2→1→3 under checked load, and answers what one process at T = 1 answers.

Each data-parallel rank is one worker pod offering two rank slots (`moe_rank: 2`): the rank's
leader actor and its tensor-parallel follower, placed together by one placement group. Every
completion (greedy, seeded, streamed) is checked token for token against single-process
generation of the same model at T = 1; a shrink frees whole pods (leader and follower), a
grow's new pod brings both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e import kube
from e2e import load as load_mod
from e2e.cluster import conftest

pytestmark = pytest.mark.cluster

NAME = "tp"
MODEL = "synthetic://tiny?seed=0"
READY_TIMEOUT_S = 420.0
RESIZE_TIMEOUT_S = 420.0
LENGTHS = (8, 24, 48)


def _manifest() -> dict[str, Any]:
    return conftest.manifest(NAME, {"source": MODEL, "servedModelName": NAME}, tensorParallelSize=2)


@pytest.fixture(scope="module")
def endpoint(node: kube.Kubectl, namespace: str) -> Iterator[Callable[[], str | None]]:
    yield from conftest.service_url(node, namespace, NAME)


@pytest.fixture(scope="module")
def dep(node: kube.Kubectl, namespace: str, endpoint: Callable[[], str | None]) -> kube.Deployment:
    return conftest.apply(
        node, namespace, _manifest(), endpoint=endpoint, ready=lambda d: d.serving(2),
        what="Serving at DP=2 TP=2", timeout_s=READY_TIMEOUT_S, tag="tp",
    )  # fmt: skip


@pytest.fixture(scope="module")
def load(dep: kube.Deployment) -> Iterator[load_mod.Load]:
    with conftest.model_load(dep, model=MODEL, lengths=LENGTHS, tag="tp") as lg:
        yield lg


def _settled(dep: kube.Deployment, size: int) -> dict[str, Any] | None:
    """Serving ``size`` ranks, each a leader with one follower, on ``size`` worker pods."""
    if dep.serving(size) is None:
        return None
    ranks = [r for r in dep.runtime_status()["ranks"] if r["rank"] is not None and r["active"]]
    if len(ranks) != size or len(dep.pods()) != size:
        return None
    assert all(len(r["tp_pids"]) == 1 for r in ranks), ranks
    return {"ranks": ranks}


def _resize(dep: kube.Deployment, load: load_mod.Load, to: int) -> None:
    before = load.ok
    dep.kubectl("scale", "moed", NAME, "-n", dep.namespace, f"--replicas={to}")
    kube.wait_for(lambda: _settled(dep, to), timeout_s=RESIZE_TIMEOUT_S, what=f"DP={to} TP=2")
    kube.wait_for(lambda: load.ok >= before + 6 or load.failed, timeout_s=180, what="answers")
    assert not load.failures, load.failures[:3]


def test_serves_at_two_ranks_of_two_devices(dep: kube.Deployment, load: load_mod.Load) -> None:
    kube.wait_for(lambda: _settled(dep, 2), timeout_s=120, what="two worker pods, TP=2 each")
    wide = dep.kubectl("get", "moed", NAME, "-n", dep.namespace, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    assert row.split()[header.split().index("TP")] == "2", wide
    assert not load.failures, load.failures[:3]


def test_shrink_to_one_then_grow_to_three_under_load(
    dep: kube.Deployment, load: load_mod.Load
) -> None:
    _resize(dep, load, 1)
    _resize(dep, load, 3)
    history = dep.runtime_status()["history"]
    done = [(r["from"], r["to"]) for r in history if r["stage"] == "Completed"]
    assert (2, 1) in done and (1, 3) in done, history


def test_no_request_failed(load: load_mod.Load) -> None:
    assert load.ok > 0 and not load.failures, load.summary()
