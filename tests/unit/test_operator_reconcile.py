"""One reconcile end to end against an in-memory API and a fake runtime (no cluster)."""

from __future__ import annotations

import asyncio
import base64
import copy
from typing import Any

import pytest

from moe_contract import status as runtime_status
from moe_operator import reconcile
from moe_operator.k8s import api as k8s_api
from moe_operator.plan import availability
from tests.support import reconcile_fakes as fakes


def runtime_serving(dp: int) -> runtime_status.ElasticStatus:
    """The runtime's status, serving ``dp`` ranks (no resize ran)."""
    return runtime_status.ElasticStatus(data_parallel_size=dp)


def test_first_reconcile_creates_children_and_writes_status() -> None:
    api, events = fakes.FakeApi(), []
    outcome = fakes.run(api, fakes.body(), events=events)
    assert sorted(outcome.created) == [
        "NetworkPolicy/tiny-ray",
        "RayCluster/tiny",
        "Secret/tiny-admin",
        "Service/tiny-api",
    ]
    # one event names every child it created
    assert events == [
        (
            "Created",
            "Created RayCluster tiny, Secret tiny-admin, Service tiny-api, NetworkPolicy tiny-ray",
        )
    ]
    assert outcome.status_written and api.status["phase"] == "Provisioning"


def test_a_new_deployment_reads_nothing_before_its_raycluster() -> None:
    """A deployment no operator reconciled yet has no children: its first reconcile sends its
    writes at once, RayCluster first, without reading anything."""
    api, events = fakes.FakeApi(), []
    reads: list[str] = []
    get, listing = api.get, api.list

    async def counted_get(**kw: Any) -> dict[str, Any] | None:
        reads.append(f"get {kw['kind']}")
        return await get(**kw)

    async def counted_list(**kw: Any) -> list[dict[str, Any]]:
        reads.append(f"list {kw['kind']}")
        return await listing(**kw)

    api.get, api.list = counted_get, counted_list  # type: ignore[method-assign]
    fakes.run(api, fakes.body(), events=events)
    assert reads == []
    assert api.writes[0] == "RayCluster/tiny"
    assert api.writes[-1] == "status/tiny"
    # once it has a status, the children are read (and found as they should be)
    api.writes.clear()
    fakes.run(api, fakes.body(status=api.status), events=events, now=fakes.LATER)
    assert "get RayCluster" in reads and api.writes == []


def test_children_of_a_deployment_with_no_status_are_applied_again() -> None:
    """A reconcile that stopped before its status write left children behind: the next one
    (still no status) applies them again and creates nothing twice."""
    api, events = fakes.FakeApi(), []
    fakes.run(api, fakes.body(), events=events)
    events.clear()
    outcome = fakes.run(api, fakes.body(), events=events, now=fakes.LATER)
    assert outcome.created == () and events == []
    assert api.objects[("RayCluster", "ml", "tiny")]["spec"]["workerGroupSpecs"][0]["replicas"] == 2


def test_the_plan_runs_in_order_and_a_failed_write_stops_it() -> None:
    """The child writes go out one after the other, in the plan's order; the first that
    fails ends the reconcile (no later write, no status), with what it created announced; the
    retry applies the rest."""
    api, events = fakes.FakeApi(), []
    apply = api.apply

    async def service_refused(
        obj: dict[str, Any], *, priority: int = k8s_api.PRIORITY_DEFAULT
    ) -> k8s_api.ApplyResult:
        if obj["kind"] == "Service":
            raise k8s_api.ApiError(method="PATCH", url="/services", status=500, body="etcd away")
        return await apply(obj, priority=priority)

    api.apply = service_refused  # type: ignore[method-assign]
    with pytest.raises(k8s_api.ApiError, match="etcd away"):
        fakes.run(api, fakes.body(), events=events)
    assert api.writes == ["RayCluster/tiny", "Secret/tiny-admin"]
    assert events == [("Created", "Created RayCluster tiny, Secret tiny-admin")]
    api.apply = apply  # type: ignore[method-assign]
    api.writes.clear()
    outcome = fakes.run(api, fakes.body(), events=events, now=fakes.LATER)
    assert api.writes == ["RayCluster/tiny", "Service/tiny-api", "NetworkPolicy/tiny-ray",
                          "status/tiny"]  # fmt: skip
    assert sorted(outcome.created) == ["NetworkPolicy/tiny-ray", "Service/tiny-api"]


def test_second_reconcile_writes_nothing() -> None:
    api, events = fakes.FakeApi(), []
    fakes.run(api, fakes.body(), events=events)
    api.writes.clear()
    outcome = fakes.run(api, fakes.body(status=api.status), events=events, now=fakes.LATER)
    assert api.writes == []
    assert outcome.created == () and not outcome.status_written


def test_the_token_is_never_rotated() -> None:
    api, events = fakes.FakeApi(), []
    fakes.run(api, fakes.body(), events=events)
    token = api.objects[("Secret", "ml", "tiny-admin")]["data"]["token"]
    fakes.run(api, fakes.body(status=api.status, dp=3), events=events)
    assert api.objects[("Secret", "ml", "tiny-admin")]["data"]["token"] == token
    assert api.objects[("RayCluster", "ml", "tiny")]["spec"]["workerGroupSpecs"][0]["replicas"] == 3


def test_ready_raycluster_and_runtime_make_it_serving() -> None:
    api, events, seen = fakes.FakeApi(), [], []
    fakes.run(api, fakes.body(), events=events)
    fakes.make_ready(api, 2)
    factory = fakes.runtime_answering(
        runtime_status.ElasticStatus(
            data_parallel_size=2,
            target_data_parallel_size=2,
            eplb=runtime_status.Eplb(balancedness=0.9),
        ),
        seen,
    )
    fakes.run(api, fakes.body(status=api.status), events=events, factory=factory, now=fakes.LATER)
    assert api.status["phase"] == "Serving"
    assert api.status["dataParallelSize"] == 2
    assert api.status["experts"] == {"balancedness": 0.9}
    ready = {c["type"]: c for c in api.status["conditions"]}["Ready"]
    assert (ready["status"], ready["lastTransitionTime"]) == ("True", fakes.LATER)
    (request,) = [r for r in seen if r.url.path == "/elastic_ep/status"]
    assert str(request.url) == "http://tiny-api.ml.svc:8000/elastic_ep/status"
    token = base64.b64decode(api.objects[("Secret", "ml", "tiny-admin")]["data"]["token"])
    assert request.headers["Authorization"] == f"Bearer {token.decode()}"


def test_runtime_url_annotation_is_ignored_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_ALLOW_RUNTIME_URL_OVERRIDE", raising=False)
    api, events, seen = fakes.FakeApi(), [], []
    fakes.run(api, fakes.body(), events=events)
    fakes.make_ready(api, 2)
    obj = fakes.body(status=api.status)
    obj["metadata"]["annotations"] = {"elasticmoe.io/runtime-url": "http://attacker.example:80"}
    fakes.run(api, obj, events=events, factory=fakes.runtime_answering(runtime_serving(2), seen))
    fakes.run(api, obj, events=events, factory=fakes.runtime_answering(runtime_serving(2), seen))
    assert {r.url.host for r in seen} == {"tiny-api.ml.svc"}
    warnings = [m for reason, m in events if reason == "RuntimeUrlIgnored"]
    assert len(warnings) == 1 and "attacker.example" in warnings[0]  # warned once


def test_runtime_url_annotation_is_used_when_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_ALLOW_RUNTIME_URL_OVERRIDE", "1")
    api, events, seen = fakes.FakeApi(), [], []
    fakes.run(api, fakes.body(), events=events)
    fakes.make_ready(api, 2)
    obj = fakes.body(status=api.status)
    obj["metadata"]["annotations"] = {"elasticmoe.io/runtime-url": "http://127.0.0.1:18000"}
    fakes.run(api, obj, events=events, factory=fakes.runtime_answering(runtime_serving(2), seen))
    assert str(seen[0].url) == "http://127.0.0.1:18000/elastic_ep/status"


@pytest.mark.parametrize("ready_workers", [2, 1], ids=["all-ranks", "one-missing"])
def test_unreachable_runtime_falls_back_to_ray(ready_workers: int) -> None:
    api, events, seen = fakes.FakeApi(), [], []
    fakes.run(api, fakes.body(), events=events)
    fakes.make_ready(api, ready_workers)
    fakes.run(
        api,
        fakes.body(status=api.status),
        events=events,
        factory=fakes.runtime_answering(None, seen),
    )
    assert seen  # it was asked
    assert api.status["dataParallelSize"] == ready_workers
    expected = "Serving" if ready_workers == 2 else "Provisioning"
    assert api.status["phase"] == expected


def test_ranks_are_counted_from_the_pods_not_from_kuberay_status() -> None:
    # KubeRay v1.5 counts a terminating pod as ready and keeps `state: ready` for good.
    api, events, seen = fakes.FakeApi(), [], []
    fakes.run(api, fakes.body(), events=events)
    fakes.make_ready(api, 1, kuberay_says=2)
    fakes.add_pod(api, "tiny-ranks-worker-gone", node_type="worker", terminating=True)
    fakes.run(
        api,
        fakes.body(status=api.status),
        events=events,
        factory=fakes.runtime_answering(None, seen),
    )
    assert api.status["phase"] == "Provisioning"
    assert api.status["dataParallelSize"] == 1


def test_a_head_pod_that_is_not_ready_is_not_asked() -> None:
    api, events, seen = fakes.FakeApi(), [], []
    fakes.run(api, fakes.body(), events=events)
    fakes.make_ready(api, 2)
    fakes.add_pod(api, "tiny-head-x", node_type="head", ready=False)  # HeadPodReady is stale
    fakes.run(
        api,
        fakes.body(status=api.status),
        events=events,
        factory=fakes.runtime_answering(None, seen),
    )
    assert seen == []
    assert api.status["phase"] == "Provisioning"


def test_invalid_spec_is_reported() -> None:
    obj = fakes.body()
    obj["spec"]["dataParallelSize"] = 9
    with pytest.raises(reconcile.InvalidSpec, match="dataParallelSize"):
        fakes.run(fakes.FakeApi(), obj, events=[])


def serving_at(api: fakes.FakeApi, events: list[tuple[str, str]], dp: int) -> dict[str, Any]:
    fakes.run(api, fakes.body(dp=dp), events=events)
    fakes.make_ready(api, dp)
    factory = fakes.runtime_answering(runtime_serving(dp), [])
    fakes.run(api, fakes.body(status=api.status, dp=dp), events=events, factory=factory)
    assert api.status["phase"] == "Serving"
    return dict(api.status)


def test_a_scale_down_is_asked_once_and_its_id_recorded() -> None:
    api, events, posts = fakes.FakeApi(), [], []
    status = serving_at(api, events, 4)
    factory = fakes.scripted_runtime(
        runtime_serving(4),
        (202, {"resize_id": "abc", "from": 4, "to": 2, "stage": "Reshuffling"}),
        posts,
    )
    outcome = fakes.run(
        api, fakes.body(status=status, dp=2), events=events, factory=factory, now=fakes.LATER
    )
    assert posts == [{"new_data_parallel_size": 2}]
    resize = api.status["resize"]
    assert (resize["resizeId"], resize["stage"], resize["fromSize"], resize["toSize"]) == (
        "abc",
        "Reshuffling",
        4,
        2,
    )
    assert api.status["phase"] == "Resizing"
    assert outcome.requeue_after == 1.0
    assert ("Reshuffling", "resize 4->2: Reshuffling") in events
    replicas = api.objects[("RayCluster", "ml", "tiny")]["spec"]["workerGroupSpecs"][0]
    assert replicas["replicas"] == 4  # the runtime goes first


def test_a_refused_scale_fails_with_the_runtime_message() -> None:
    api, events, posts = fakes.FakeApi(), [], []
    status = serving_at(api, events, 2)
    refusal = {"error": {"message": "new_data_parallel_size 1 is too small to hold every expert"}}
    factory = fakes.scripted_runtime(runtime_serving(2), (400, refusal), posts)
    fakes.run(api, fakes.body(status=status, dp=1), events=events, factory=factory, now=fakes.LATER)
    assert api.status["resize"]["stage"] == "Failed"
    assert "too small to hold every expert" in api.status["resize"]["message"]
    assert api.status["phase"] == "Degraded"
    conditions = {c["type"]: c for c in api.status["conditions"]}
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == (
        "True",
        "ResizeFailed",
    )
    assert conditions["Ready"]["status"] == "True"
    fakes.run(
        api, fakes.body(status=api.status, dp=1), events=events, factory=factory, now=fakes.LATER
    )
    assert len(posts) == 1  # not retried for the same generation


# -- a pvc:// model whose claim is missing (plan.availability) -------------------------------


def claim(phase: str = "Bound") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "models", "namespace": "ml"},
        "status": {"phase": phase},
    }


def pvc_body(status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = fakes.body(status=status)
    obj["spec"]["model"] = {"source": "pvc://models/mixtral/tiny"}
    return obj


def test_a_missing_claim_creates_nothing_until_it_exists() -> None:
    api, events = fakes.FakeApi(), []
    outcome = fakes.run(api, pvc_body(), events=events)
    assert outcome.created == () and api.writes == ["status/tiny"]
    assert api.status["phase"] == "Pending"
    (ready,) = [c for c in api.status["conditions"] if c["type"] == "Ready"]
    assert ready["status"] == "False" and ready["reason"] == "ModelUnavailable"
    assert "'models'" in ready["message"] and "not found" in ready["message"]
    assert [reason for reason, _ in events] == ["ModelUnavailable"]
    assert outcome.requeue_after == availability.RECHECK_SECONDS
    # looked again: still missing, nothing new to say
    events.clear()
    fakes.run(api, pvc_body(copy.deepcopy(api.status)), events=events, now=fakes.LATER)
    assert events == [] and [w for w in api.writes if not w.startswith("status/")] == []
    # the claim appears: the deployment starts
    api.objects[("PersistentVolumeClaim", "ml", "models")] = claim()
    outcome = fakes.run(api, pvc_body(copy.deepcopy(api.status)), events=events, now=fakes.LATER)
    assert "RayCluster/tiny" in outcome.created
    assert api.status["phase"] == "Provisioning"
    head = api.objects[("RayCluster", "ml", "tiny")]["spec"]["headGroupSpec"]["template"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in (head["spec"]["volumes"])


def test_an_operator_that_may_not_read_claims_does_not_hold_deployments_back() -> None:
    api, events = fakes.FakeApi(), []
    get = api.get

    async def forbidden(**kw: Any) -> dict[str, Any] | None:
        if kw["kind"] == "PersistentVolumeClaim":
            raise k8s_api.ApiError(method="GET", url="/pvc", status=403, body="forbidden")
        return await get(**kw)

    api.get = forbidden  # type: ignore[method-assign]
    outcome = asyncio.run(
        reconcile.reconcile(
            api=api,  # type: ignore[arg-type]
            body=pvc_body(),
            events=lambda reason, message: events.append((reason, message)),
            logger=fakes.LOG,
            now=fakes.NOW,
        )
    )
    assert "RayCluster/tiny" in outcome.created
