"""The whole local stack: control plane + KubeRay stand-in + operator, and handles on a deployment.

`LocalStack` is what the end-to-end tests and `make demo` run: the real kube-apiserver and
etcd (given, or started here), `LocalKubeRay` turning RayClusters into local Ray nodes and the
head's `moe-runtime serve`, and `moe-operator run` as its own process with the least-privilege
RBAC of `manifests/`. The operator's code path is the one of a real cluster; the only local
setting is `MOE_RUNTIME_URL_FROM_RAYCLUSTER=1`, so it reaches the runtime on the loopback port
the stand-in publishes instead of through the Service's cluster DNS name.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import pathlib
import subprocess
import threading
from typing import Any

import httpx

from e2e.controlplane import cluster
from e2e.local import kuberay, operator_proc

REPO = operator_proc.REPO
SAMPLE = REPO / "manifests" / "samples" / "moedeployment.yaml"


@dataclasses.dataclass
class LocalStack:
    """The stand-in and the operator watch only `namespace`: other tests of the same control
    plane leave RayClusters and MoEDeployments behind (there is no garbage collector), which
    must stay paper."""

    plane: cluster.ControlPlane
    workdir: pathlib.Path
    namespace: str
    operator: operator_proc.OperatorProcess | None = None
    kuberay: kuberay.LocalKubeRay | None = None

    def start(self) -> LocalStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.kubectl("get", "namespace", self.namespace, check=False).returncode != 0:
            self.kubectl("create", "namespace", self.namespace)
        self.kuberay = kuberay.LocalKubeRay(
            self.plane.kubeconfig, namespace=self.namespace, workdir=self.workdir / "kuberay"
        )
        self.kuberay.start()
        self.operator = operator_proc.OperatorProcess(
            plane=self.plane,
            kubeconfig=operator_proc.operator_kubeconfig(self.plane, self.workdir),
            log_path=self.workdir / "operator.log",
            env={"MOE_RUNTIME_URL_FROM_RAYCLUSTER": "1"},
            args=["--namespace", self.namespace],
        )
        self.operator.start()
        return self

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        if self.kuberay is not None:
            self.kuberay.stop()

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.plane.kubectl(*args, check=check)

    def deployment(self, name: str) -> Deployment:
        return Deployment(stack=self, name=name, namespace=self.namespace)


@dataclasses.dataclass
class Deployment:
    """A MoEDeployment of the stack, seen through kubectl and the runtime's admin API."""

    stack: LocalStack
    name: str
    namespace: str

    def get(self, kind: str = "moed", name: str | None = None) -> dict[str, Any]:
        done = self.stack.kubectl(
            "get", kind, name or self.name, "-n", self.namespace, "-o", "json"
        )
        obj: dict[str, Any] = json.loads(done.stdout)
        return obj

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.get().get("status") or {}
        return status

    def resize(self) -> dict[str, Any]:
        resize: dict[str, Any] = self.status().get("resize") or {}
        return resize

    def raycluster(self) -> dict[str, Any]:
        return self.get("raycluster")

    def worker_pods(self) -> list[str]:
        done = self.stack.kubectl(
            "get", "pods", "-n", self.namespace, "-l",
            f"ray.io/cluster={self.name},ray.io/node-type=worker", "-o", "json",
        )  # fmt: skip
        items = json.loads(done.stdout)["items"]
        return sorted(
            p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp")
        )

    def endpoint(self) -> str | None:
        assert self.stack.kuberay is not None
        return self.stack.kuberay.endpoint(self.namespace, self.name)

    def admin_token(self) -> str:
        secret = self.get("secret", f"{self.name}-admin")
        return base64.b64decode(secret["data"]["token"]).decode()

    def runtime_status(self) -> dict[str, Any]:
        url = self.endpoint()
        assert url is not None, "the runtime has no endpoint yet"
        r = httpx.get(
            f"{url}/elastic_ep/status",
            headers={"Authorization": f"Bearer {self.admin_token()}"},
            timeout=30,
        )
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def serving(self, size: int) -> dict[str, Any] | None:
        """The status once the deployment serves `size` ranks with nothing in flight."""
        status = self.status()
        resize = status.get("resize") or {}
        if resize.get("stage") == "Failed" and resize.get("toSize") == size:
            raise AssertionError(f"resize to {size} failed: {resize.get('message')}")
        idle = not resize or resize.get("stage") in ("Completed", "Failed")
        ok = status.get("phase") == "Serving" and status.get("dataParallelSize") == size
        return status if ok and idle else None

    def watch(self) -> StageWatch:
        return StageWatch(self.stack.plane, self.name, self.namespace)

    def events(self) -> list[dict[str, Any]]:
        done = self.stack.kubectl(
            "get", "events", "-n", self.namespace, "--field-selector",
            f"involvedObject.name={self.name},involvedObject.kind=MoEDeployment", "-o", "json",
        )  # fmt: skip
        items: list[dict[str, Any]] = json.loads(done.stdout)["items"]
        return sorted(items, key=lambda e: e["metadata"]["creationTimestamp"])


class StageWatch:
    """``kubectl get -w`` of a MoEDeployment's ``status.resize`` (stage/toSize): every write."""

    def __init__(self, plane: cluster.ControlPlane, name: str, namespace: str) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            ["kubectl", "get", "moed", name, "-n", namespace, "-w", "-o",
             'jsonpath={.status.resize.stage}/{.status.resize.toSize}{"\\n"}'],
            env=plane.env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def stages(self, to_size: int) -> list[str]:
        """Distinct consecutive stages seen for resizes to ``to_size``."""
        out: list[str] = []
        for line in list(self.lines):
            stage, _, size = line.partition("/")
            if stage and size == str(to_size) and (not out or out[-1] != stage):
                out.append(stage)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.thread.join(timeout=5)
