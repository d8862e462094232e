"""Warm spare ranks on the real node: `spec.elastic.warmSpareRanks: 1` under checked load.

The sample at DP=2 with one warm spare: the RayCluster has 3 workers (2 ranks + the spare's
pod), the runtime reports the spare ready, `kubectl get moed -o wide` shows it. A grow 2→3
takes the spare: the operator asks the runtime at once (no Provisioning), the runtime skips
Standby (Transferring → Switching → Reshuffling), and a 4th worker pod comes for the
replacement spare, which the runtime makes ready by itself. A shrink 3→2 deletes exactly the
pod the runtime freed and keeps the spare's. Between them, the pod of a serving rank is
deleted: the runtime shrinks around it and the operator grows back onto the spare at once.
Every answer is checked; none may fail.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from e2e import kube
from e2e import load as load_mod
from e2e.cluster import conftest

pytestmark = pytest.mark.cluster

NAME = "tiny"
READY_TIMEOUT_S = 420.0
RESIZE_TIMEOUT_S = 420.0
SPARES = 1


def _sample() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(conftest.SAMPLE.read_text())
    doc["spec"].setdefault("elastic", {})["warmSpareRanks"] = SPARES
    doc["spec"].pop("autoscaling", None)
    return doc


@pytest.fixture(scope="module")
def endpoint(node: kube.Kubectl, namespace: str) -> Iterator[Callable[[], str | None]]:
    yield from conftest.service_url(node, namespace, NAME)


def _settled(dep: kube.Deployment, size: int) -> dict[str, Any] | None:
    """Serving ``size`` ranks with its spare ready, and exactly ``size`` + spares worker pods
    (none terminating)."""
    status = dep.serving(size)
    if status is None or (status.get("spares") or {}).get("ready") != SPARES:
        return None
    pods = dep.pods()
    if len(pods) != size + SPARES or any(p["metadata"].get("deletionTimestamp") for p in pods):
        return None
    return status


@pytest.fixture(scope="module")
def dep(node: kube.Kubectl, namespace: str, endpoint: Callable[[], str | None]) -> kube.Deployment:
    return conftest.apply(
        node, namespace, _sample(), endpoint=endpoint, ready=lambda d: _settled(d, 2),
        what="Serving at DP=2, spare ready", timeout_s=READY_TIMEOUT_S, tag="spares",
    )  # fmt: skip


@pytest.fixture(scope="module")
def load(
    dep: kube.Deployment, reference: dict[tuple[int, int, int | None], list[int]]
) -> Iterator[load_mod.Load]:
    with kube.checked_load(dep, model_name=NAME, reference=reference, tag="spares") as lg:
        yield lg


def _patch(dep: kube.Deployment, to: int) -> None:
    body = json.dumps({"spec": {"dataParallelSize": to}})
    dep.kubectl("patch", "moed", NAME, "-n", dep.namespace, "--type=merge", "-p", body)


def _record(dep: kube.Deployment, frm: int, to: int) -> dict[str, Any]:
    records = [r for r in dep.runtime_status()["history"] if (r["from"], r["to"]) == (frm, to)]
    assert records, dep.runtime_status()["history"]
    record: dict[str, Any] = records[-1]
    return record


def test_the_spare_is_a_pod_of_its_own_and_shows(dep: kube.Deployment, load: load_mod.Load) -> None:
    status = dep.status()
    spares = status["spares"]
    assert (spares["desired"], spares["ready"]) == (SPARES, SPARES)
    (spare_pod,) = spares["pods"]
    workers = dep.ready_worker_pods()
    assert len(workers) == 3 and spare_pod in workers
    ranks = dep.runtime_status()["ranks"]
    assert spare_pod not in {r.get("pod") for r in ranks}  # a spare serves nothing
    assert dep.raycluster()["spec"]["workerGroupSpecs"][0]["replicas"] == 3
    wide = dep.kubectl("get", "moed", NAME, "-n", dep.namespace, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    at = header.index("SPARES")  # columns are aligned; an empty STAGE leaves a gap
    assert row[at:].split()[0] == str(SPARES), wide
    kube.wait_for(lambda: load.ok >= 8, timeout_s=180, what="8 checked answers")
    assert load.failures == []


def test_a_grow_by_one_takes_the_spare_and_a_new_spare_follows(
    dep: kube.Deployment, load: load_mod.Load
) -> None:
    spare_pod = dep.status()["spares"]["pods"][0]
    asked = time.monotonic()
    _patch(dep, 3)
    kube.wait_for(lambda: dep.serving(3), timeout_s=RESIZE_TIMEOUT_S, what="DP=3")
    serving_at = time.monotonic() - asked
    record = _record(dep, 2, 3)
    stages = [s["stage"] for s in record["stages"]]
    assert record["stage"] == "Completed" and record["warm_spares"] == 1, record
    assert "Standby" not in stages and stages[0] == "Transferring", stages
    assert spare_pod in {r.get("pod") for r in dep.runtime_status()["ranks"]}  # it serves now
    messages = [e["message"] for e in dep.events()]
    assert not [m for m in messages if m.startswith("resize 2->3: Provisioning")], messages
    assert any(m.startswith("resize 2->3: Transferring") for m in messages), messages
    status = kube.wait_for(
        lambda: _settled(dep, 3), timeout_s=READY_TIMEOUT_S, what="DP=3 + a new ready spare"
    )
    assert status["spares"]["pods"][0] != spare_pod
    print(
        f"\n[spares] 2->3 with a warm spare: serving at 3 {serving_at:.1f}s after the patch; "
        f"the runtime's resize {record['duration_s']:.2f}s ("
        + ", ".join(f"{s['stage']} {s['duration_s']:.2f}s" for s in record["stages"])
        + f"); a new spare ready {time.monotonic() - asked:.1f}s after the patch"
    )
    assert load.failures == []


def test_a_lost_rank_is_healed_by_the_spare(dep: kube.Deployment, load: load_mod.Load) -> None:
    """Failure is another resize: the runtime shrinks around the rank of a deleted pod, and
    the operator's grow back (autoRecover) takes the spare at once instead of waiting for
    KubeRay's new pod; that pod becomes the next spare."""
    status = kube.wait_for(lambda: _settled(dep, 3), timeout_s=READY_TIMEOUT_S, what="DP=3")
    spare_pod = status["spares"]["pods"][0]
    ranks = dep.runtime_status()["ranks"]
    pod = next(r["pod"] for r in ranks if r.get("rank") is not None and r.get("pod"))
    before = len(dep.runtime_status()["history"])
    deleted_at = time.monotonic()
    dep.kubectl("delete", "pod", pod, "-n", dep.namespace, "--wait=false")

    def recovered() -> dict[str, Any] | None:
        new = dep.runtime_status()["history"][before:]
        return next((r for r in new if r["kind"] == "recovery" and r["stage"] == "Completed"), None)

    record = kube.wait_for(recovered, timeout_s=RESIZE_TIMEOUT_S, what="the runtime's recovery")
    assert [r["pod"] for r in record["recovery"]["ranks_lost"]] == [pod]
    recovered_at = time.monotonic() - deleted_at

    def healed() -> bool:
        serving = {r.get("pod") for r in dep.runtime_status()["ranks"] if r.get("rank") is not None}
        return bool(dep.serving(3)) and spare_pod in serving

    kube.wait_for(healed, timeout_s=RESIZE_TIMEOUT_S, what="DP=3 again, on the spare")
    healed_at = time.monotonic() - deleted_at
    grow = [r for r in dep.runtime_status()["history"][before:] if r["kind"] == "resize"]
    assert grow and grow[-1]["warm_spares"] == 1 and grow[-1]["stage"] == "Completed", grow
    kube.wait_for(lambda: _settled(dep, 3), timeout_s=READY_TIMEOUT_S, what="a new spare")
    print(
        f"\n[spares] pod of a rank deleted: recovered at DP=2 {recovered_at:.1f}s after the "
        f"delete, back at DP=3 on the spare {healed_at:.1f}s after, a new spare ready "
        f"{time.monotonic() - deleted_at:.1f}s after"
    )
    assert pod not in dep.worker_pods()
    assert load.failures == []


def test_a_shrink_deletes_the_freed_pod_and_keeps_the_spare(
    dep: kube.Deployment, load: load_mod.Load
) -> None:
    before = set(dep.worker_pods())
    spare_pod = dep.status()["spares"]["pods"][0]
    _patch(dep, 2)
    status = kube.wait_for(lambda: _settled(dep, 2), timeout_s=RESIZE_TIMEOUT_S, what="DP=2")
    freed = set(status["resize"]["freedPods"])
    assert len(freed) == 1 and freed < before and spare_pod not in freed
    assert set(dep.worker_pods()) == before - freed
    assert status["spares"]["pods"] == [spare_pod]
    assert load.failures == []


def test_no_request_failed(dep: kube.Deployment, load: load_mod.Load) -> None:
    settled = load.ok + 8
    kube.wait_for(lambda: load.ok >= settled, timeout_s=180, what="answers at the final size")
    load.stop()
    assert load.failures == [] and load.ok >= 20
    assert all(r["stage"] == "Completed" for r in dep.runtime_status()["history"])
    assert not [e for e in dep.events() if e["reason"] == "Failed"]
