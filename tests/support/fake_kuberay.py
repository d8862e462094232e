"""KubeRay and the kubelet for every RayCluster of a namespace, played from a thread against a
real kube-apiserver (the operator's integration tests): each RayCluster gets a fake runtime
(``fake_cluster.FakeRuntime``) whose URL it carries in the ``elasticmoe.io/local-endpoint``
annotation (an operator run with ``MOE_RUNTIME_URL_FROM_RAYCLUSTER=1`` reaches it there), and
Ready pods for its head and workers; pods named in ``workersToDelete`` are deleted (the list is
never cleared, as KubeRay never does), and a deleted RayCluster's pods and runtime go."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

from e2e.controlplane import cluster
from moe_operator.api import group
from tests.support import fake_cluster
from tests.support import operator_ops as ops


class FakeKubeRay:
    def __init__(self, plane: cluster.ControlPlane, namespace: str) -> None:
        self.plane, self.namespace = plane, namespace
        self.runtimes: dict[str, fake_cluster.FakeRuntime] = {}
        self.max_workers = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeKubeRay:
        # pods need the namespace's default ServiceAccount (no controller makes it here)
        if self.plane.kubectl("get", "sa", "default", "-n", self.namespace,
                              check=False).returncode != 0:  # fmt: skip
            self.plane.kubectl("create", "sa", "default", "-n", self.namespace)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for runtime in self.runtimes.values():
            runtime.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.once()
            except Exception as error:  # noqa: BLE001 - kept for the test to report
                self.errors.append(repr(error))
            self._stop.wait(0.3)

    def _list(self, kind: str) -> list[dict[str, Any]]:
        listing = ops.get_json(self.plane, kind, namespace=self.namespace)
        return list((listing or {}).get("items") or [])

    def _pod(self, cluster_name: str, name: str, node_type: str) -> None:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {
                    "ray.io/cluster": cluster_name,
                    "ray.io/node-type": node_type,
                    # the template's labels (the operator watches pods by them)
                    group.LABEL_DEPLOYMENT: fake_cluster.NAME,
                    group.LABEL_MANAGED_BY: group.MANAGED_BY,
                },
            },
            "spec": {"containers": [{"name": "ray", "image": "none"}]},
        }
        self.plane.kubectl("apply", "-f", "-", input=json.dumps(pod))
        status = {"status": {"phase": "Running",
                             "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
        self.plane.kubectl(
            "patch", "pod", name, "-n", self.namespace, "--subresource=status",
            "--type=merge", "-p", json.dumps(status),
        )  # fmt: skip

    def once(self) -> None:
        clusters = {r["metadata"]["name"]: r for r in self._list("rayclusters")}
        pods = self._list("pods")
        for pod in pods:
            owner = pod["metadata"]["labels"].get("ray.io/cluster")
            if owner not in clusters:
                self.plane.kubectl("delete", "pod", pod["metadata"]["name"], "-n",
                                   self.namespace, "--wait=false")  # fmt: skip
        for name in [n for n in self.runtimes if n not in clusters]:
            self.runtimes.pop(name).stop()
        for name, obj in clusters.items():
            self._sync(name, obj, [p for p in pods if p["metadata"]["labels"].get(
                "ray.io/cluster") == name])  # fmt: skip
        workers = [p for p in self._list("pods")
                   if p["metadata"]["labels"].get("ray.io/node-type") == "worker"]  # fmt: skip
        self.max_workers = max(self.max_workers, len(workers))

    def _sync(self, name: str, obj: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        (workers_group,) = obj["spec"]["workerGroupSpecs"]
        runtime = self.runtimes.get(name)
        if runtime is None:
            head = obj["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
            runtime = fake_cluster.FakeRuntime(
                size=int(head["elasticmoe.io/initial-data-parallel-size"])
            )
            runtime.in_flight = 0
            runtime.start()
            self.runtimes[name] = runtime
            self.plane.kubectl(
                "annotate", "raycluster", name, "-n", self.namespace, "--overwrite",
                f"{group.ANNOTATION_LOCAL_ENDPOINT}={runtime.url}",
            )  # fmt: skip
        existing = {p["metadata"]["name"] for p in pods}
        if f"{name}-head" not in existing:
            self._pod(name, f"{name}-head", "head")
        delete = (workers_group.get("scaleStrategy") or {}).get("workersToDelete") or []
        for pod in delete:
            if pod in existing:
                self.plane.kubectl("delete", "pod", pod, "-n", self.namespace, "--wait=false")
                existing.discard(pod)
        with runtime.lock:
            extra = workers_group["replicas"] - len(runtime.pods) - len(runtime.spare)
            runtime.spare += [f"{name}-w-{uuid.uuid4().hex[:5]}" for _ in range(max(extra, 0))]
            wanted = [p for p in runtime.pods + runtime.spare if p not in delete]
        for pod in wanted[: workers_group["replicas"]]:
            if pod not in existing:
                self._pod(name, pod, "worker")
