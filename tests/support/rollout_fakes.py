"""A deployment with several RayClusters, without a cluster: KubeRay and the kubelet played
over ``reconcile_fakes.FakeApi`` (pods made and deleted from each RayCluster's spec), and one
fake runtime per RayCluster, reached through ``$MOE_RUNTIME_URL_TEMPLATE``
(``http://{cluster}.rt``). Statuses are the contract's model (``moe_contract.status``); a
resize completes at once, naming the pods it freed, as the runtime's records do."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import httpx

from moe_contract import names
from moe_contract import status as runtime_status
from moe_operator import runtime_client
from tests.support import reconcile_fakes as fakes

URL_TEMPLATE = "http://{cluster}.rt"
_IDS = itertools.count(1)


@dataclasses.dataclass
class Runtime:
    """The runtime of one RayCluster: the pods its ranks run on, its records."""

    cluster: str
    pods: list[str] = dataclasses.field(default_factory=list)
    in_flight: int = 0
    history: list[runtime_status.Resize] = dataclasses.field(default_factory=list)
    #: The pods it may grow onto (its RayCluster's worker pods), set by :class:`World`.
    available: list[str] = dataclasses.field(default_factory=list)
    scales: list[int] = dataclasses.field(default_factory=list)
    #: ``PATCH /elastic_ep/config`` draining (the only live setting this fake keeps).
    draining: bool = False

    def status(self) -> runtime_status.ElasticStatus:
        return runtime_status.ElasticStatus(
            data_parallel_size=len(self.pods),
            ready=True,
            resize=self.history[-1] if self.history else None,
            history=list(self.history),
            ranks=[
                runtime_status.Rank(rank=i, pod=pod, active=True, healthy=True)
                for i, pod in enumerate(self.pods)
            ],
            load=runtime_status.Load(in_flight=self.in_flight),
        )

    def scale(self, to: int) -> dict[str, Any]:
        self.scales.append(to)
        before = len(self.pods)
        freed: list[str] = []
        if to > before:
            free = [p for p in self.available if p not in self.pods]
            if len(free) < to - before:
                raise ValueError(f"{self.cluster}: {len(free)} free pods, {to - before} wanted")
            self.pods += free[: to - before]
        else:
            freed, self.pods = self.pods[to:], self.pods[:to]
        record = runtime_status.Resize.model_validate(
            {
                "resize_id": f"r{next(_IDS)}",
                "from": before,
                "to": to,
                "stage": "Completed",
                "freed": [{"pod": p} for p in freed],
            }
        )
        self.history.append(record)
        return {"resize_id": record.resize_id, "from": before, "to": to, "stage": "Completed"}


class World:
    """The RayClusters' pods and runtimes. ``broken``: RayClusters whose head never starts
    (an image that does not exist)."""

    def __init__(self, api: fakes.FakeApi) -> None:
        self.api = api
        self.runtimes: dict[str, Runtime] = {}
        self.broken: set[str] = set()
        #: RayClusters whose runtime does not answer (its head pod still Ready)
        self.silent: set[str] = set()
        self.max_pods = 0
        #: kuberay() calls the pods of a deleted RayCluster stay terminating (0: gone at once)
        self.linger = 0
        self._leaving: dict[str, int] = {}
        self._names = itertools.count()

    def rayclusters(self) -> dict[str, dict[str, Any]]:
        return {
            name: obj for (kind, _, name), obj in self.api.objects.items() if kind == "RayCluster"
        }

    def _pods(self, cluster: str, node_type: str) -> list[str]:
        return sorted(
            name
            for (kind, _, name), obj in self.api.objects.items()
            if kind == "Pod"
            and obj["metadata"]["labels"].get("ray.io/cluster") == cluster
            and obj["metadata"]["labels"].get("ray.io/node-type") == node_type
        )

    def _add_pod(self, cluster: str, name: str, node_type: str) -> None:
        fakes.add_pod(self.api, name, node_type=node_type)
        pod = self.api.objects[("Pod", "ml", name)]
        pod["metadata"]["labels"]["ray.io/cluster"] = cluster
        pod["metadata"]["labels"]["elasticmoe.io/deployment"] = "tiny"  # the template's label
        if node_type == "head" and cluster in self.broken:
            pod["status"] = {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "restartCount": 0,
                        "state": {
                            "waiting": {
                                "reason": "ErrImagePull",
                                "message": "image not found",
                            }
                        },
                    }
                ],
            }

    def kuberay(self) -> None:
        """Pods follow each RayCluster's spec (named pods deleted first, then new ones up to
        the replicas); pods of a deleted RayCluster go; a runtime serves on each head."""
        clusters = self.rayclusters()
        for (kind, ns, name), obj in list(self.api.objects.items()):
            if kind == "Pod" and obj["metadata"]["labels"]["ray.io/cluster"] not in clusters:
                left = self._leaving.setdefault(name, self.linger)
                obj["metadata"]["deletionTimestamp"] = fakes.NOW
                if left <= 0:
                    del self.api.objects[(kind, ns, name)]
                self._leaving[name] = left - 1
        for name in list(self.runtimes):
            if name not in clusters:
                del self.runtimes[name]
        for name, obj in clusters.items():
            (group,) = obj["spec"]["workerGroupSpecs"]
            for pod in group.get("scaleStrategy", {}).get("workersToDelete") or []:
                self.api.objects.pop(("Pod", "ml", pod), None)
            workers = self._pods(name, "worker")
            for _ in range(group["replicas"] - len(workers)):
                self._add_pod(name, f"{name}-ranks-worker-{next(self._names)}", "worker")
            if not self._pods(name, "head"):
                self._add_pod(name, f"{name}-head-x", "head")
            obj["status"] = {
                "conditions": [
                    {"type": "HeadPodReady", "status": "False" if name in self.broken else "True"}
                ]
            }
            if name in self.broken:
                continue
            workers = self._pods(name, "worker")
            runtime = self.runtimes.get(name)
            if runtime is None:
                head = obj["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
                size = int(head["elasticmoe.io/initial-data-parallel-size"])
                runtime = self.runtimes[name] = Runtime(cluster=name, pods=workers[:size])
            runtime.available = workers
        self.max_pods = max(self.max_pods, self.worker_pods())

    def worker_pods(self) -> int:
        return sum(1 for (kind, _, _), obj in self.api.objects.items() if kind == "Pod"
                   and obj["metadata"]["labels"].get("ray.io/node-type") == "worker")  # fmt: skip

    def factory(self, url: str, token: str | None) -> runtime_client.RuntimeClient:
        def handler(request: httpx.Request) -> httpx.Response:
            cluster = request.url.host.removesuffix(".rt")
            runtime = self.runtimes.get(cluster)
            if runtime is None or cluster in self.silent:
                raise httpx.ConnectError("refused", request=request)
            if request.method == "POST" and request.url.path == names.SCALE_PATH:
                body = json.loads(request.content)
                return httpx.Response(202, json=runtime.scale(body["new_data_parallel_size"]))
            if request.url.path == names.STATUS_PATH:
                return httpx.Response(200, json=runtime.status().to_json())
            if request.url.path == names.CONFIG_PATH:
                if request.method == "PATCH":
                    runtime.draining = json.loads(request.content)["draining"]
                return httpx.Response(200, json={"draining": runtime.draining})
            return httpx.Response(404, json={"detail": "not here"})

        return runtime_client.RuntimeClient(
            url, token=token, transport=httpx.MockTransport(handler)
        )
