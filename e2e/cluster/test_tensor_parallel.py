"""A rank of two devices on the real node: a MoEDeployment with `tensorParallelSize: 2`, then
one with `pipelineParallelSize: 2`, serves, is resized 2→1→3 under checked load, and answers
what one process at T = P = 1 answers.

Each data-parallel rank is one worker pod offering two rank slots (`moe_rank: 2`): the rank's
leader actor and its tensor-parallel follower (or its second pipeline stage), placed together
by one placement group. Every completion (greedy, seeded, streamed) is checked token for token
against single-process generation of the same model; a shrink frees whole pods (leader and
follower or stage), a grow's new pod brings both. At P = 2 the DP ranks' pods have their own
IPs, so each pipeline stage's expert group meets in the leaders' TCPStore.

EPLB runs every 40 steps in both and must move experts under the load. At T = 2 the
deployment runs `expertLayout: mesh` (expert parallelism over every device of every rank: the
follower holds a part of its rank's expert slots, the expert groups span the pods' leaders
and followers) and keeps one warm spare rank (`elastic.warmSpareRanks: 1`), a pod of its own
holding a whole DP rank (leader and follower, both processes ready): the shrink keeps its
pod, and the grow 1→3 takes it at once (the resize record counts it) beside a new pod.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e import kube
from e2e import load as load_mod
from e2e.cluster import conftest

pytestmark = pytest.mark.cluster

MODEL = "synthetic://tiny?seed=0"
READY_TIMEOUT_S = 420.0
RESIZE_TIMEOUT_S = 420.0
LENGTHS = (8, 24, 48)


@dataclasses.dataclass(frozen=True)
class Mesh:
    name: str
    column: str  # of `kubectl get moed -o wide`
    pids: str  # the status field listing a rank's other processes
    spec: dict[str, Any]
    spares: int = 0  # elastic.warmSpareRanks


#: EPLB every 40 steps over a window of 40: it rebalances within seconds under the load.
EPLB = {"expertParallel": {"eplb": {"enabled": True, "windowSize": 40, "stepInterval": 40}}}
MESHES = [
    Mesh("tp", "TP", "tp_pids",
         {"tensorParallelSize": 2, "expertLayout": "mesh", "elastic": {"warmSpareRanks": 1},
          **EPLB}, spares=1),
    Mesh("pp", "PP", "pp_pids", {"pipelineParallelSize": 2, **EPLB}),
]  # fmt: skip


@pytest.fixture(scope="module", params=MESHES, ids=[m.name for m in MESHES])
def mesh(request: pytest.FixtureRequest) -> Mesh:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def endpoint(node: kube.Kubectl, namespace: str, mesh: Mesh) -> Iterator[Callable[[], str | None]]:
    yield from conftest.service_url(node, namespace, mesh.name)


@pytest.fixture(scope="module")
def dep(
    node: kube.Kubectl, namespace: str, mesh: Mesh, endpoint: Callable[[], str | None]
) -> Iterator[kube.Deployment]:
    doc = conftest.manifest(mesh.name, {"source": MODEL, "servedModelName": mesh.name}, **mesh.spec)
    yield conftest.apply(
        node, namespace, doc, endpoint=endpoint, ready=lambda d: d.serving(2),
        what=f"Serving at DP=2 {mesh.column}=2", timeout_s=READY_TIMEOUT_S, tag=mesh.name,
    )  # fmt: skip
    # one mesh at a time on the node's 2 cores
    node.kubectl("delete", "moed", mesh.name, "-n", namespace, "--wait=true", timeout=180)


@pytest.fixture(scope="module")
def load(dep: kube.Deployment, mesh: Mesh) -> Iterator[load_mod.Load]:
    with conftest.model_load(dep, model=MODEL, lengths=LENGTHS, tag=mesh.name) as lg:
        yield lg


def _settled(
    dep: kube.Deployment, mesh: Mesh, size: int, *, spares_ready: bool = True
) -> dict[str, Any] | None:
    """Serving ``size`` ranks, each a leader with one follower or stage, on ``size`` pods of
    their own, and the mesh's spares' pods (their ranks ready, each a whole DP rank, when
    ``spares_ready``); no other worker pod."""
    if dep.serving(size) is None:
        return None
    status = dep.runtime_status()
    ranks = [r for r in status["ranks"] if r["rank"] is not None and r["active"]]
    spares = status.get("spares") or []
    serving_pods = {r["pod"] for r in ranks}
    if len(ranks) != size or len(serving_pods) != size:
        return None
    if spares_ready and [s["ready"] for s in spares] != [True] * mesh.spares:
        return None
    if len(dep.pods()) != size + mesh.spares:
        return None
    ready = [s for s in spares if s["ready"]]
    assert all(len(r[mesh.pids]) == 1 for r in ranks + ready), (ranks, spares)
    assert not serving_pods & {s["pod"] for s in spares}, (ranks, spares)  # a spare serves nothing
    return {"ranks": ranks, "spares": spares}


def _resize(
    dep: kube.Deployment, mesh: Mesh, load: load_mod.Load, to: int, *, spares_ready: bool = True
) -> None:
    before = load.ok
    dep.kubectl("scale", "moed", mesh.name, "-n", dep.namespace, f"--replicas={to}")
    kube.wait_for(
        lambda: _settled(dep, mesh, to, spares_ready=spares_ready), timeout_s=RESIZE_TIMEOUT_S,
        what=f"DP={to} {mesh.column}=2",
    )  # fmt: skip
    kube.wait_for(lambda: load.ok >= before + 6 or load.failed, timeout_s=180, what="answers")
    assert not load.failures, load.failures[:3]


def test_serves_at_two_ranks_of_two_devices(
    dep: kube.Deployment, mesh: Mesh, load: load_mod.Load
) -> None:
    kube.wait_for(
        lambda: _settled(dep, mesh, 2), timeout_s=120, what=f"two worker pods, {mesh.column}=2"
    )
    wide = dep.kubectl("get", "moed", mesh.name, "-n", dep.namespace, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    # kubectl pads each column to where its header starts (cells may be empty or hold spaces)
    start = header.index(f" {mesh.column} ") + 1
    assert row[start:].split()[0] == "2", wide
    # what the operator told the runtime (the head's command line)
    head = dep.raycluster()["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    command, layout = head["args"][-1], mesh.spec.get("expertLayout")
    if layout is None:
        assert "--expert-layout" not in command, command
    else:
        assert f"--expert-layout {layout}" in command, command
    assert not load.failures, load.failures[:3]


def test_shrink_to_one_then_grow_to_three_under_load(
    dep: kube.Deployment, mesh: Mesh, load: load_mod.Load
) -> None:
    spare_pods = [s["pod"] for s in dep.runtime_status().get("spares") or []]
    _resize(dep, mesh, load, 1)
    # the shrink keeps the spare's pod
    assert [s["pod"] for s in dep.runtime_status().get("spares") or []] == spare_pods
    # the grow takes the spare (its replacement is not waited for)
    _resize(dep, mesh, load, 3, spares_ready=False)
    status = dep.runtime_status()
    history = status["history"]
    done = {(r["from"], r["to"]): r for r in history if r["stage"] == "Completed"}
    assert (2, 1) in done and (1, 3) in done, history
    assert done[(1, 3)]["warm_spares"] == mesh.spares, done[(1, 3)]
    assert set(spare_pods) <= {r["pod"] for r in status["ranks"] if r["active"]}, status


def test_eplb_moves_experts_under_load(
    dep: kube.Deployment, mesh: Mesh, load: load_mod.Load
) -> None:
    """EPLB rebalances from the live load and moves experts (at P = 2 each stage moves those
    of its layers, peer to peer with the same stage of the other ranks' pods); the load's
    answers stay those of one process."""
    before = load.ok

    def moved() -> dict[str, Any] | None:
        eplb = dep.runtime_status().get("eplb") or {}
        last = eplb.get("last_rebalance") or {}
        return eplb if last.get("applied") and last.get("moves") else None

    eplb = kube.wait_for(moved, timeout_s=180, what="an EPLB rebalance that moves experts")
    kube.wait_for(lambda: load.ok >= before + 6 or load.failed, timeout_s=180, what="answers")
    assert not load.failures, (eplb, load.failures[:3])


def test_no_request_failed(load: load_mod.Load) -> None:
    assert load.ok > 0 and not load.failures, load.summary()
