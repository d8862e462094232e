"""The whole local stack: control plane + KubeRay stand-in + operator, and handles on a deployment.

`LocalStack` is what the end-to-end tests and `make demo` run: the real kube-apiserver and
etcd (given, or started here), `LocalKubeRay` turning RayClusters into local Ray nodes and the
head's `moe-runtime serve`, and `moe-operator run` as its own process with the least-privilege
RBAC of `manifests/`. The operator's code path is the one of a real cluster; the only local
setting is `MOE_RUNTIME_URL_FROM_RAYCLUSTER=1`, so it reaches the runtime on the loopback port
the stand-in publishes instead of through the Service's cluster DNS name.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess

from e2e import kube
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

    def deployment(self, name: str) -> kube.Deployment:
        def endpoint() -> str | None:
            assert self.kuberay is not None
            return self.kuberay.endpoint(self.namespace, name)

        return kube.Deployment(
            cluster=self.plane, name=name, namespace=self.namespace, endpoint=endpoint
        )
