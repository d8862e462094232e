"""One reconcile end to end against an in-memory API and a fake runtime (no cluster)."""

from __future__ import annotations

import asyncio
import base64
import copy
import itertools
import json
import logging
from typing import Any

import httpx
import pytest

from moe_operator import reconcile, runtime_client
from moe_operator.k8s import api as k8s_api
from moe_operator.plan import availability

LOG = logging.getLogger("test")
NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:01:00Z"


class FakeApi:
    """The five calls of ``k8s_api.Api`` over a dict; counts writes."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.writes: list[str] = []
        self._rv = itertools.count(1)

    def _key(self, kind: str, namespace: str, name: str) -> tuple[str, str, str]:
        return (kind, namespace, name)

    async def get(
        self, *, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        # The operator's RBAC has no get on Secrets outside its own namespace.
        assert kind != "Secret", "the operator must not read a deployment's Secret"
        obj = self.objects.get(self._key(kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def _store(self, obj: dict[str, Any]) -> k8s_api.ApplyResult:
        meta = obj["metadata"]
        key = self._key(obj["kind"], meta["namespace"], meta["name"])
        created = key not in self.objects
        stored = copy.deepcopy(obj)
        if "stringData" in stored:  # as the API server does
            stored["data"] = {
                k: base64.b64encode(v.encode()).decode()
                for k, v in stored.pop("stringData").items()
            }
        stored["metadata"]["resourceVersion"] = str(next(self._rv))
        self.objects[key] = stored
        self.writes.append(f"{obj['kind']}/{meta['name']}")
        return k8s_api.ApplyResult(obj=copy.deepcopy(stored), created=created)

    async def list(
        self, *, api_version: str, kind: str, namespace: str, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        terms = label_selector.split(",") if label_selector else []
        wanted = dict(term.split("=", 1) for term in terms)
        return [
            copy.deepcopy(obj)
            for (k, ns, _), obj in self.objects.items()
            if k == kind
            and ns == namespace
            and all(obj["metadata"].get("labels", {}).get(a) == b for a, b in wanted.items())
        ]

    async def apply(
        self, obj: dict[str, Any], *, priority: int = k8s_api.PRIORITY_DEFAULT
    ) -> k8s_api.ApplyResult:
        return self._store(obj)

    async def create(self, obj: dict[str, Any], *, read_back: bool = True) -> k8s_api.ApplyResult:
        meta = obj["metadata"]
        existing = self.objects.get(self._key(obj["kind"], meta["namespace"], meta["name"]))
        if existing is not None:
            return k8s_api.ApplyResult(
                obj=copy.deepcopy(existing if read_back else obj), created=False
            )
        return self._store(obj)

    async def patch_status(
        self, *, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        self.writes.append(f"status/{name}")
        self.status = {k: v for k, v in patch.items() if v is not None}
        return {"status": self.status}


def body(*, status: dict[str, Any] | None = None, dp: int = 2) -> dict[str, Any]:
    return {
        "metadata": {"name": "tiny", "namespace": "ml", "uid": "u1", "generation": 1},
        "spec": {
            "model": {"source": "synthetic://tiny?seed=0"},
            "dataParallelSize": dp,
            "maxDataParallelSize": 4,
        },
        "status": status or {},
    }


def runtime_answering(payload: dict[str, Any] | None, seen: list[httpx.Request]) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if payload is None:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=payload)

    def factory(url: str, token: str | None) -> runtime_client.RuntimeClient:
        return runtime_client.RuntimeClient(
            url, token=token, transport=httpx.MockTransport(handler)
        )

    return factory


def run(
    api: FakeApi,
    obj: dict[str, Any],
    *,
    events: list[tuple[str, str]],
    now: str = NOW,
    factory: Any = None,
) -> reconcile.Outcome:
    kwargs = {"runtime_factory": factory} if factory else {}
    return asyncio.run(
        reconcile.reconcile(
            api=api,  # type: ignore[arg-type]
            body=obj,
            events=lambda reason, message: events.append((reason, message)),
            logger=LOG,
            now=now,
            **kwargs,
        )
    )


def test_first_reconcile_creates_children_and_writes_status() -> None:
    api, events = FakeApi(), []
    outcome = run(api, body(), events=events)
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
    api, events = FakeApi(), []
    reads: list[str] = []
    get, listing = api.get, api.list

    async def counted_get(**kw: Any) -> dict[str, Any] | None:
        reads.append(f"get {kw['kind']}")
        return await get(**kw)

    async def counted_list(**kw: Any) -> list[dict[str, Any]]:
        reads.append(f"list {kw['kind']}")
        return await listing(**kw)

    api.get, api.list = counted_get, counted_list  # type: ignore[method-assign]
    run(api, body(), events=events)
    assert reads == []
    assert api.writes[0] == "RayCluster/tiny"
    assert api.writes[-1] == "status/tiny"
    # once it has a status, the children are read (and found as they should be)
    api.writes.clear()
    run(api, body(status=api.status), events=events, now=LATER)
    assert "get RayCluster" in reads and api.writes == []


def test_children_of_a_deployment_with_no_status_are_applied_again() -> None:
    """A reconcile that stopped before its status write left children behind: the next one
    (still no status) applies them again and creates nothing twice."""
    api, events = FakeApi(), []
    run(api, body(), events=events)
    events.clear()
    outcome = run(api, body(), events=events, now=LATER)
    assert outcome.created == () and events == []
    assert api.objects[("RayCluster", "ml", "tiny")]["spec"]["workerGroupSpecs"][0]["replicas"] == 2


def test_second_reconcile_writes_nothing() -> None:
    api, events = FakeApi(), []
    run(api, body(), events=events)
    api.writes.clear()
    outcome = run(api, body(status=api.status), events=events, now=LATER)
    assert api.writes == []
    assert outcome.created == () and not outcome.status_written


def test_the_token_is_never_rotated() -> None:
    api, events = FakeApi(), []
    run(api, body(), events=events)
    token = api.objects[("Secret", "ml", "tiny-admin")]["data"]["token"]
    run(api, body(status=api.status, dp=3), events=events)
    assert api.objects[("Secret", "ml", "tiny-admin")]["data"]["token"] == token
    assert api.objects[("RayCluster", "ml", "tiny")]["spec"]["workerGroupSpecs"][0]["replicas"] == 3


def add_pod(
    api: FakeApi, name: str, *, node_type: str, ready: bool = True, terminating: bool = False
) -> None:
    """A pod as KubeRay makes it (its labels) and the kubelet reports it."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ml",
        "labels": {"ray.io/cluster": "tiny", "ray.io/node-type": node_type},
    }
    if terminating:
        meta["deletionTimestamp"] = NOW
    api.objects[("Pod", "ml", name)] = {
        "kind": "Pod",
        "metadata": meta,
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def make_ready(api: FakeApi, ready_workers: int, *, kuberay_says: int | None = None) -> None:
    """A Ready head pod and ``ready_workers`` Ready worker pods; KubeRay's own status counts
    ``kuberay_says`` (it counts terminating pods too)."""
    api.objects[("RayCluster", "ml", "tiny")]["status"] = {
        "readyWorkerReplicas": ready_workers if kuberay_says is None else kuberay_says,
        "state": "ready",
        "conditions": [{"type": "HeadPodReady", "status": "True"}],
    }
    add_pod(api, "tiny-head-x", node_type="head")
    for i in range(ready_workers):
        add_pod(api, f"tiny-ranks-worker-{i}", node_type="worker")


def test_ready_raycluster_and_runtime_make_it_serving() -> None:
    api, events, seen = FakeApi(), [], []
    run(api, body(), events=events)
    make_ready(api, 2)
    factory = runtime_answering(
        {"data_parallel_size": 2, "target_data_parallel_size": 2, "eplb": {"balancedness": 0.9}},
        seen,
    )
    run(api, body(status=api.status), events=events, factory=factory, now=LATER)
    assert api.status["phase"] == "Serving"
    assert api.status["dataParallelSize"] == 2
    assert api.status["experts"] == {"balancedness": 0.9}
    ready = {c["type"]: c for c in api.status["conditions"]}["Ready"]
    assert (ready["status"], ready["lastTransitionTime"]) == ("True", LATER)
    (request,) = [r for r in seen if r.url.path == "/elastic_ep/status"]
    assert str(request.url) == "http://tiny-api.ml.svc:8000/elastic_ep/status"
    token = base64.b64decode(api.objects[("Secret", "ml", "tiny-admin")]["data"]["token"])
    assert request.headers["Authorization"] == f"Bearer {token.decode()}"


def test_runtime_url_annotation_is_ignored_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_ALLOW_RUNTIME_URL_OVERRIDE", raising=False)
    api, events, seen = FakeApi(), [], []
    run(api, body(), events=events)
    make_ready(api, 2)
    obj = body(status=api.status)
    obj["metadata"]["annotations"] = {"elasticmoe.io/runtime-url": "http://attacker.example:80"}
    run(api, obj, events=events, factory=runtime_answering({"data_parallel_size": 2}, seen))
    run(api, obj, events=events, factory=runtime_answering({"data_parallel_size": 2}, seen))
    assert {r.url.host for r in seen} == {"tiny-api.ml.svc"}
    warnings = [m for reason, m in events if reason == "RuntimeUrlIgnored"]
    assert len(warnings) == 1 and "attacker.example" in warnings[0]  # warned once


def test_runtime_url_annotation_is_used_when_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_ALLOW_RUNTIME_URL_OVERRIDE", "1")
    api, events, seen = FakeApi(), [], []
    run(api, body(), events=events)
    make_ready(api, 2)
    obj = body(status=api.status)
    obj["metadata"]["annotations"] = {"elasticmoe.io/runtime-url": "http://127.0.0.1:18000"}
    run(api, obj, events=events, factory=runtime_answering({"data_parallel_size": 2}, seen))
    assert str(seen[0].url) == "http://127.0.0.1:18000/elastic_ep/status"


@pytest.mark.parametrize("ready_workers", [2, 1], ids=["all-ranks", "one-missing"])
def test_unreachable_runtime_falls_back_to_ray(ready_workers: int) -> None:
    api, events, seen = FakeApi(), [], []
    run(api, body(), events=events)
    make_ready(api, ready_workers)
    run(api, body(status=api.status), events=events, factory=runtime_answering(None, seen))
    assert seen  # it was asked
    assert api.status["dataParallelSize"] == ready_workers
    expected = "Serving" if ready_workers == 2 else "Provisioning"
    assert api.status["phase"] == expected


def test_ranks_are_counted_from_the_pods_not_from_kuberay_status() -> None:
    # KubeRay v1.5 counts a terminating pod as ready and keeps `state: ready` for good.
    api, events, seen = FakeApi(), [], []
    run(api, body(), events=events)
    make_ready(api, 1, kuberay_says=2)
    add_pod(api, "tiny-ranks-worker-gone", node_type="worker", terminating=True)
    run(api, body(status=api.status), events=events, factory=runtime_answering(None, seen))
    assert api.status["phase"] == "Provisioning"
    assert api.status["dataParallelSize"] == 1


def test_a_head_pod_that_is_not_ready_is_not_asked() -> None:
    api, events, seen = FakeApi(), [], []
    run(api, body(), events=events)
    make_ready(api, 2)
    add_pod(api, "tiny-head-x", node_type="head", ready=False)  # HeadPodReady is stale
    run(api, body(status=api.status), events=events, factory=runtime_answering(None, seen))
    assert seen == []
    assert api.status["phase"] == "Provisioning"


def test_invalid_spec_is_reported() -> None:
    obj = body()
    obj["spec"]["dataParallelSize"] = 9
    with pytest.raises(reconcile.InvalidSpec, match="dataParallelSize"):
        run(FakeApi(), obj, events=[])


def scripted_runtime(
    status: dict[str, Any], answer: tuple[int, dict[str, Any]], posts: list[Any]
) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            posts.append(json.loads(request.content))
            return httpx.Response(answer[0], json=answer[1])
        return httpx.Response(200, json=status)

    def factory(url: str, token: str | None) -> runtime_client.RuntimeClient:
        return runtime_client.RuntimeClient(
            url, token=token, transport=httpx.MockTransport(handler)
        )

    return factory


def serving_at(api: FakeApi, events: list[tuple[str, str]], dp: int) -> dict[str, Any]:
    run(api, body(dp=dp), events=events)
    make_ready(api, dp)
    factory = runtime_answering({"data_parallel_size": dp}, [])
    run(api, body(status=api.status, dp=dp), events=events, factory=factory)
    assert api.status["phase"] == "Serving"
    return dict(api.status)


def test_a_scale_down_is_asked_once_and_its_id_recorded() -> None:
    api, events, posts = FakeApi(), [], []
    status = serving_at(api, events, 4)
    factory = scripted_runtime(
        {"data_parallel_size": 4, "ranks": []},
        (202, {"resize_id": "abc", "from": 4, "to": 2, "stage": "Reshuffling"}),
        posts,
    )
    outcome = run(api, body(status=status, dp=2), events=events, factory=factory, now=LATER)
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
    api, events, posts = FakeApi(), [], []
    status = serving_at(api, events, 2)
    refusal = {"error": {"message": "new_data_parallel_size 1 is too small to hold every expert"}}
    factory = scripted_runtime({"data_parallel_size": 2, "ranks": []}, (400, refusal), posts)
    run(api, body(status=status, dp=1), events=events, factory=factory, now=LATER)
    assert api.status["resize"]["stage"] == "Failed"
    assert "too small to hold every expert" in api.status["resize"]["message"]
    assert api.status["phase"] == "Degraded"
    conditions = {c["type"]: c for c in api.status["conditions"]}
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == (
        "True",
        "ResizeFailed",
    )
    assert conditions["Ready"]["status"] == "True"
    run(api, body(status=api.status, dp=1), events=events, factory=factory, now=LATER)
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
    obj = body(status=status)
    obj["spec"]["model"] = {"source": "pvc://models/mixtral/tiny"}
    return obj


def test_a_missing_claim_creates_nothing_until_it_exists() -> None:
    api, events = FakeApi(), []
    outcome = run(api, pvc_body(), events=events)
    assert outcome.created == () and api.writes == ["status/tiny"]
    assert api.status["phase"] == "Pending"
    (ready,) = [c for c in api.status["conditions"] if c["type"] == "Ready"]
    assert ready["status"] == "False" and ready["reason"] == "ModelUnavailable"
    assert "'models'" in ready["message"] and "not found" in ready["message"]
    assert [reason for reason, _ in events] == ["ModelUnavailable"]
    assert outcome.requeue_after == availability.RECHECK_SECONDS
    # looked again: still missing, nothing new to say
    events.clear()
    run(api, pvc_body(copy.deepcopy(api.status)), events=events, now=LATER)
    assert events == [] and [w for w in api.writes if not w.startswith("status/")] == []
    # the claim appears: the deployment starts
    api.objects[("PersistentVolumeClaim", "ml", "models")] = claim()
    outcome = run(api, pvc_body(copy.deepcopy(api.status)), events=events, now=LATER)
    assert "RayCluster/tiny" in outcome.created
    assert api.status["phase"] == "Provisioning"
    head = api.objects[("RayCluster", "ml", "tiny")]["spec"]["headGroupSpec"]["template"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in (head["spec"]["volumes"])


def test_an_operator_that_may_not_read_claims_does_not_hold_deployments_back() -> None:
    api, events = FakeApi(), []
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
            logger=LOG,
            now=NOW,
        )
    )
    assert "RayCluster/tiny" in outcome.created
