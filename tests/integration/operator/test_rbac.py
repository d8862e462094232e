"""The operator's RBAC (manifests/base/rbac.yaml) as the real API server evaluates it
(`kubectl auth can-i --as` its ServiceAccount): what it needs, and no read of other Secrets."""

from __future__ import annotations

import pytest

from e2e import operator_proc
from e2e.controlplane import cluster
from tests.support import operator_ops as ops

pytestmark = pytest.mark.controlplane

SA = f"system:serviceaccount:{ops.OPERATOR_NAMESPACE}:{ops.OPERATOR_SA}"


@pytest.fixture(scope="module")
def rbac(control_plane: cluster.ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> None:
    operator_proc.operator_kubeconfig(control_plane, tmp_path_factory.mktemp("rbac"))


def can(plane: cluster.ControlPlane, *args: str) -> bool:
    done = plane.kubectl("auth", "can-i", *args, f"--as={SA}", check=False)
    answer = done.stdout.strip()
    assert answer in ("yes", "no"), done.stderr
    return answer == "yes"


@pytest.mark.parametrize(
    ("args", "allowed"),
    [
        # a deployment's Secret is created, never read back, anywhere
        (("create", "secrets", "-n", "ml"), True),
        (("get", "secrets", "-n", "ml"), False),
        (("list", "secrets", "-n", "ml"), False),
        (("watch", "secrets", "--all-namespaces"), False),
        (("update", "secrets", "-n", "ml"), False),
        # its own namespace: only its key, by name
        (("get", "secrets/elastic-moe-operator-key", "-n", ops.OPERATOR_NAMESPACE), True),
        (("get", "secrets/someone-elses", "-n", ops.OPERATOR_NAMESPACE), False),
        (("list", "secrets", "-n", ops.OPERATOR_NAMESPACE), False),
        # what it does need
        (("patch", "rayclusters.ray.io", "-n", "ml"), True),
        (("list", "rayclusters.ray.io", "-n", "ml"), True),
        (("watch", "pods", "--all-namespaces"), True),
        (("create", "networkpolicies.networking.k8s.io", "-n", "ml"), True),
        (("patch", "moedeployments.elasticmoe.io/scale", "-n", "ml"), True),
        # the claim of a pvc:// model is checked before anything is created: read, by name
        (("get", "persistentvolumeclaims", "-n", "ml"), True),
        (("list", "persistentvolumeclaims", "-n", "ml"), False),
        (("create", "persistentvolumeclaims", "-n", "ml"), False),
        # and what it never does
        (("delete", "pods", "-n", "ml"), False),
        (("delete", "rayclusters.ray.io", "-n", "ml"), True),  # a rollout's old one
        (("create", "pods", "-n", "ml"), False),
        (("patch", "moedeployments.elasticmoe.io", "-n", "ml", "--subresource=status"), True),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, tuple) else str(value),
)
def test_the_operator_can_do_what_it_needs_and_no_more(
    control_plane: cluster.ControlPlane, rbac: None, args: tuple[str, ...], allowed: bool
) -> None:
    assert can(control_plane, *args) is allowed
