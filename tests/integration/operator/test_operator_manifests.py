"""The kustomize manifests are accepted by a real API server."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from e2e.controlplane import cluster
from tests.support import operator_ops as ops

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


def test_operator_service_account_deletes_only_rayclusters(
    control_plane: cluster.ControlPlane,
) -> None:
    """Least privilege: the operator's identity may create children; the only thing it may
    delete is a RayCluster (a rollout's old one, docs/ROLLOUTS.md)."""
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
    assert can("delete", "rayclusters.ray.io") == "yes"
    assert can("delete", "pods") == "no" and can("delete", "services") == "no"
    assert (
        can("delete", "secrets") == "no" and can("delete", "moedeployments.elasticmoe.io") == "no"
    )
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


def test_the_pvc_samples_are_accepted(control_plane: cluster.ControlPlane) -> None:
    control_plane.kubectl("create", "namespace", "pvc-sample", check=False)
    control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-n", "pvc-sample",
        "-f", str(ops.REPO / "manifests/samples/moedeployment-pvc.yaml"),
        "-f", str(ops.REPO / "manifests/samples/model-download-job.yaml"),
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


# -- least privilege when the operator watches a list of namespaces ------------------------------

#: The API server's answer to ``kubectl auth can-i VERB RESOURCE -n NS`` for the operator of
#: a namespaced install watching ``ml``: everything it needs there, nothing elsewhere, and
#: nothing on Secrets outside ``ml`` (its key in its own namespace aside).
NAMESPACED_ANSWERS = [
    (("create", "secrets", "-n", "ml"), True),
    (("get", "secrets", "-n", "ml"), False),
    (("create", "secrets", "-n", "other"), False),
    (("create", "secrets", "--all-namespaces"), False),
    (("patch", "rayclusters.ray.io", "-n", "ml"), True),
    (("patch", "rayclusters.ray.io", "-n", "other"), False),
    (("watch", "pods", "-n", "ml"), True),
    (("watch", "pods", "--all-namespaces"), False),
    (("get", "persistentvolumeclaims", "-n", "ml"), True),
    (("get", "persistentvolumeclaims", "-n", "other"), False),
    (("watch", "moedeployments.elasticmoe.io", "-n", "ml"), True),
    (("list", "customresourcedefinitions.apiextensions.k8s.io"), True),
]


def _secret_grants(docs: list[dict[str, Any]]) -> list[str]:
    """ClusterRoles of ``docs`` with any rule on Secrets."""
    return [
        d["metadata"]["name"]
        for d in docs
        if d["kind"] == "ClusterRole"
        and any("secrets" in r.get("resources", []) or "*" in r.get("resources", [])
                for r in d.get("rules", []))
    ]  # fmt: skip


def _install_rbac_as(
    plane: cluster.ControlPlane, docs: list[dict[str, Any]], *, tag: str, namespace: str
) -> str:
    """Apply the RBAC objects of ``docs`` under names of their own (``tag``), bound to a
    ServiceAccount of ``namespace``: the install of other tests is left as it is. The
    ServiceAccount's user name."""
    rbac = [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role",
                                             "RoleBinding")]  # fmt: skip
    for doc in rbac:
        doc["metadata"]["name"] = f"{tag}-{doc['metadata']['name']}"
        if doc["kind"].endswith("Binding"):
            doc["roleRef"]["name"] = f"{tag}-{doc['roleRef']['name']}"
            for subject in doc["subjects"]:
                subject["namespace"] = namespace
        if doc["metadata"].get("namespace") == ops.OPERATOR_NAMESPACE:
            doc["metadata"]["namespace"] = namespace
    for ns in (namespace, "ml", "other"):
        plane.kubectl("create", "namespace", ns, check=False)
    plane.kubectl("create", "serviceaccount", ops.OPERATOR_SA, "-n", namespace, check=False)
    plane.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", "-",
        input="\n---\n".join(yaml.safe_dump(d) for d in rbac),
    )  # fmt: skip
    return f"system:serviceaccount:{namespace}:{ops.OPERATOR_SA}"


def _answers(plane: cluster.ControlPlane, user: str) -> list[tuple[tuple[str, ...], bool]]:
    out = []
    for args, _ in NAMESPACED_ANSWERS:
        done = plane.kubectl("auth", "can-i", *args, f"--as={user}", check=False)
        assert done.stdout.strip() in ("yes", "no"), done.stderr
        out.append((args, done.stdout.strip() == "yes"))
    return out


def test_the_namespaced_kustomize_install_grants_secrets_only_where_it_watches(
    control_plane: cluster.ControlPlane,
) -> None:
    rendered = control_plane.kubectl("kustomize", str(ops.REPO / "manifests" / "namespaced"))
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    assert _secret_grants(docs) == []
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert "--namespace=ml" in deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    user = _install_rbac_as(control_plane, docs, tag="kz", namespace="kz-operator")
    assert _answers(control_plane, user) == NAMESPACED_ANSWERS
    # the cluster-wide install, for contrast: its ClusterRole grants create on Secrets (only)
    wide = control_plane.kubectl("kustomize", str(ops.REPO / "manifests")).stdout
    assert _secret_grants([d for d in yaml.safe_load_all(wide) if d]) == ["elastic-moe-operator"]


@pytest.mark.skipif(
    HELM is None, reason="helm is not installed (e2e/controlplane/build.sh builds it)"
)
def test_the_charts_watch_namespaces_grant_secrets_only_where_it_watches(
    control_plane: cluster.ControlPlane,
) -> None:
    assert HELM is not None

    def render(*args: str) -> list[dict[str, Any]]:
        out = subprocess.run(
            [HELM, "template", "moe", str(ops.REPO / "charts" / "elastic-moe"),
             "--namespace", ops.OPERATOR_NAMESPACE, *args],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return [d for d in yaml.safe_load_all(out) if d]

    namespaced = render("--set", "watchNamespaces={ml}")
    assert _secret_grants(namespaced) == []
    user = _install_rbac_as(control_plane, namespaced, tag="helm", namespace="helm-operator")
    assert _answers(control_plane, user) == NAMESPACED_ANSWERS
    # cluster-wide, the chart grants what manifests/ grants, in one ClusterRole
    (wide,) = [d for d in render() if d["kind"] == "ClusterRole"]
    manifests = [
        d for d in yaml.safe_load_all((ops.REPO / "manifests/base/rbac.yaml").read_text()) if d
    ]
    (ours,) = [d for d in manifests if d["kind"] == "ClusterRole"]
    assert sorted(wide["rules"], key=str) == sorted(ours["rules"], key=str)
    (key,) = [
        d for d in namespaced if d["kind"] == "Role" and d["metadata"]["name"].endswith("-key")
    ]
    (our_key,) = [d for d in manifests if d["kind"] == "Role"]
    assert key["rules"] == our_key["rules"]
