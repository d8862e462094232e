"""Driving one reconcile without a cluster: an in-memory API (``FakeApi``), MoEDeployment
bodies, Ray pods as KubeRay and the kubelet report them, and fake runtimes whose status is
built from the contract's model (``moe_contract.status``), so it cannot drift from what the
runtime sends."""

from __future__ import annotations

import asyncio
import base64
import copy
import itertools
import json
import logging
from typing import Any

import httpx

from moe_contract import status as runtime_status
from moe_operator import reconcile, runtime_client
from moe_operator.k8s import api as k8s_api

LOG = logging.getLogger("test")
NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:01:00Z"


class FakeApi:
    """The six calls of ``k8s_api.Api`` over a dict; counts writes."""

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

    async def delete(self, *, api_version: str, kind: str, namespace: str, name: str) -> bool:
        self.writes.append(f"delete {kind}/{name}")
        return self.objects.pop(self._key(kind, namespace, name), None) is not None

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


def runtime_answering(
    payload: runtime_status.ElasticStatus | None, seen: list[httpx.Request]
) -> Any:
    """A runtime answering every GET with ``payload`` (``None``: refusing connections)."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if payload is None:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=payload.to_json())

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


def scripted_runtime(
    status: runtime_status.ElasticStatus, answer: tuple[int, dict[str, Any]], posts: list[Any]
) -> Any:
    """A runtime whose status is ``status`` and that answers every POST with ``answer``."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            posts.append(json.loads(request.content))
            return httpx.Response(answer[0], json=answer[1])
        return httpx.Response(200, json=status.to_json())

    def factory(url: str, token: str | None) -> runtime_client.RuntimeClient:
        return runtime_client.RuntimeClient(
            url, token=token, transport=httpx.MockTransport(handler)
        )

    return factory
