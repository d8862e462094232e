"""The kustomize manifests are accepted by a real API server."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from e2e.controlplane import cluster
from tests.integration.operator import conftest as ops

pytestmark = pytest.mark.controlplane


def test_kustomize_dry_run(control_plane: cluster.ControlPlane) -> None:
    # A dry run creates nothing, so namespaced objects need their namespace to exist.
    control_plane.kubectl(
        "apply", "--server-side", "-f", str(ops.REPO / "manifests/base/namespace.yaml")
    )
    done = control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-k", str(ops.REPO / "manifests")
    )
    out = done.stdout
    for name in (
        "customresourcedefinition.apiextensions.k8s.io/moedeployments.elasticmoe.io",
        "serviceaccount/moe-operator",
        "clusterrole.rbac.authorization.k8s.io/elastic-moe-operator",
        "clusterrolebinding.rbac.authorization.k8s.io/elastic-moe-operator",
        "deployment.apps/moe-operator",
        "service/moe-operator-metrics",
    ):
        assert name in out


def test_operator_service_account_cannot_delete(control_plane: cluster.ControlPlane) -> None:
    """Least privilege: the operator's identity may create children but never delete them."""
    control_plane.kubectl(
        "apply", "--server-side",
        "-f", str(ops.REPO / "manifests/base/namespace.yaml"),
        "-f", str(ops.REPO / "manifests/base/rbac.yaml"),
    )  # fmt: skip
    sa = f"system:serviceaccount:{ops.OPERATOR_NAMESPACE}:{ops.OPERATOR_SA}"

    def can(*args: str) -> str:
        done = control_plane.kubectl("auth", "can-i", *args, f"--as={sa}", check=False)
        return done.stdout.strip()

    assert can("patch", "rayclusters.ray.io") == "yes"
    assert can("patch", "moedeployments.elasticmoe.io", "--subresource=status") == "yes"
    assert can("create", "secrets") == "yes"
    assert can("delete", "rayclusters.ray.io") == "no"
    assert can("update", "secrets") == "no"
    assert can("list", "secrets") == "no"
    assert can("create", "pods") == "no"
    # the autoscaler: the size through the scale subresource only; HPAs listed, never changed
    assert can("patch", "moedeployments.elasticmoe.io", "--subresource=scale") == "yes"
    assert can("update", "moedeployments.elasticmoe.io") == "no"
    assert can("list", "horizontalpodautoscalers.autoscaling") == "yes"
    assert can("patch", "horizontalpodautoscalers.autoscaling") == "no"


def test_the_hpa_sample_is_accepted(control_plane: cluster.ControlPlane) -> None:
    control_plane.kubectl("create", "namespace", "hpa-sample", check=False)
    control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-n", "hpa-sample",
        "-f", str(ops.REPO / "manifests/samples/hpa.yaml"),
        "-f", str(ops.REPO / "manifests/samples/moedeployment-autoscaling.yaml"),
    )  # fmt: skip


HELM = shutil.which("helm") or shutil.which("helm", path=str(cluster.cache_dir() / "bin"))


@pytest.mark.skipif(
    HELM is None, reason="helm is not installed (e2e/controlplane/build.sh builds it)"
)
def test_helm_chart_dry_run(control_plane: cluster.ControlPlane) -> None:
    assert HELM is not None
    rendered = subprocess.run(
        [HELM, "template", "moe", str(ops.REPO / "charts" / "elastic-moe"),
         "--namespace", ops.OPERATOR_NAMESPACE, "--include-crds"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    control_plane.kubectl(
        "apply", "--server-side", "-f", str(ops.REPO / "manifests/base/namespace.yaml")
    )
    control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", input=rendered
    )


@pytest.mark.skipif(
    HELM is None, reason="helm is not installed (e2e/controlplane/build.sh builds it)"
)
def test_helm_chart_renders_the_monitoring_objects() -> None:
    assert HELM is not None
    rendered = subprocess.run(
        [HELM, "template", "moe", str(ops.REPO / "charts" / "elastic-moe"),
         "--namespace", ops.OPERATOR_NAMESPACE, "--set", "metrics.serviceMonitor.enabled=true",
         "--set", "dashboards.enabled=true", "--set", "logFormat=json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("ServiceMonitor") == 2 and "ConfigMap" in kinds
    (dashboards,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert json.loads(dashboards["data"]["elastic-moe.json"])["uid"] == "elastic-moe"
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--metrics=0.0.0.0:8081" in command and "--log-format=json" in command
