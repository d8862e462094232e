"""The operator turns a MoEDeployment into a RayCluster, a Service and a Secret, reports status
and survives a restart without touching anything."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import yaml

from e2e.controlplane import cluster
from moe_operator.api import spec as spec_
from moe_operator.plan import access, builders
from tests.support import operator_ops as ops

pytestmark = pytest.mark.controlplane


def apply_sample(plane: cluster.ControlPlane, namespace: str, *, name: str = "tiny") -> None:
    doc = yaml.safe_load(ops.SAMPLE.read_text())
    doc["metadata"]["name"] = name
    plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))


def children(plane: cluster.ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    objs = {
        "raycluster": ops.get_json(plane, "raycluster", name, namespace=namespace),
        "service": ops.get_json(plane, "service", f"{name}-api", namespace=namespace),
        "secret": ops.get_json(plane, "secret", f"{name}-admin", namespace=namespace),
    }
    return objs if all(objs.values()) else None


def status_of(plane: cluster.ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    obj = ops.get_json(plane, "moed", name, namespace=namespace)
    assert obj is not None
    status: dict[str, Any] = obj.get("status") or {}
    return status


@pytest.fixture
def deployed(
    control_plane: cluster.ControlPlane, operator: ops.OperatorProcess, namespace: str
) -> tuple[str, dict[str, Any]]:
    apply_sample(control_plane, namespace)
    objs = ops.wait_for(lambda: children(control_plane, namespace, "tiny"), what="children of tiny")
    ops.wait_for(
        lambda: status_of(control_plane, namespace, "tiny").get("observedGeneration") == 1,
        what="status of generation 1",
    )
    return namespace, objs


def test_children_have_owner_references(
    control_plane: cluster.ControlPlane, deployed: tuple[str, dict[str, Any]]
) -> None:
    namespace, objs = deployed
    owner = ops.get_json(control_plane, "moed", "tiny", namespace=namespace)
    assert owner is not None
    for kind, obj in objs.items():
        refs = obj["metadata"]["ownerReferences"]
        assert [(r["kind"], r["name"], r["uid"], r["controller"]) for r in refs] == [
            ("MoEDeployment", "tiny", owner["metadata"]["uid"], True)
        ], kind
        assert obj["metadata"]["labels"]["elasticmoe.io/deployment"] == "tiny", kind


def test_raycluster_matches_the_spec(deployed: tuple[str, dict[str, Any]]) -> None:
    _, objs = deployed
    spec = objs["raycluster"]["spec"]
    (group,) = spec["workerGroupSpecs"]
    assert (group["groupName"], group["replicas"], group["minReplicas"], group["maxReplicas"]) == (
        "ranks",
        2,
        1,
        4,
    )
    assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {"moe_rank": 1}
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert (
        "exec moe-runtime serve --model 'synthetic://tiny?seed=0' --data-parallel-size 2"
        in (head["args"][0])
    )
    volumes = {v["name"]: v for v in spec["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert volumes["admin-token"]["secret"]["secretName"] == "tiny-admin"
    assert "--admin-token-file /var/run/elastic-moe/admin/token" in head["args"][0]
    assert head["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert head["startupProbe"]["httpGet"]["path"] == "/health"


def test_raycluster_passes_kuberay_strict_validation(
    control_plane: cluster.ControlPlane, namespace: str
) -> None:
    """Every field we set exists in KubeRay's schema (strict validation refuses unknown ones)."""
    spec = spec_.MoEDeploymentSpec.model_validate(
        {
            "model": {"source": "synthetic://tiny?seed=0"},
            "dataParallelSize": 2,
            "tensorParallelSize": 2,
            "ray": {
                "accelerator": "nvidia.com/gpu",
                "workerResources": {"requests": {"cpu": "2", "memory": "8Gi"}},
                "nodeSelector": {"pool": "gpu"},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
        }
    )
    owner = builders.Owner(name="strict", namespace=namespace, uid="0000")
    manifests = [
        builders.build_raycluster(owner=owner, spec=spec),
        access.build_service(owner=owner),
        access.build_secret(owner=owner, token="t", ray_token="r"),
        access.build_network_policy(owner=owner),
    ]
    for manifest in manifests:
        manifest["metadata"].pop("ownerReferences")  # the uid would not resolve
        control_plane.kubectl(
            "create", "--dry-run=server", "--validate=strict", "-f", "-",
            input=json.dumps(manifest),
        )  # fmt: skip


def test_kubectl_get_shows_the_columns(
    control_plane: cluster.ControlPlane, deployed: tuple[str, dict[str, Any]]
) -> None:
    namespace, _ = deployed
    out = control_plane.kubectl("get", "moed", "-n", namespace).stdout.splitlines()
    assert out[0].split() == [
        "NAME", "DP", "TARGET", "PHASE", "STAGE", "READY", "AGE", "MESSAGE",
    ]  # fmt: skip
    row = out[1].split()
    assert row[:5] == ["tiny", "0", "2", "Provisioning", "False"]  # STAGE is empty


def test_kubectl_get_wide_shows_the_mesh(
    control_plane: cluster.ControlPlane, operator: ops.OperatorProcess, namespace: str
) -> None:
    """A deployment at tensorParallelSize 2: one worker pod per rank offering two rank slots,
    and TP / PP in `kubectl get moed -o wide`."""
    doc = yaml.safe_load(ops.SAMPLE.read_text())
    doc["metadata"]["name"] = "tp2"
    doc["spec"]["tensorParallelSize"] = 2
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    objs = ops.wait_for(lambda: children(control_plane, namespace, "tp2"), what="children")
    (group,) = objs["raycluster"]["spec"]["workerGroupSpecs"]
    assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {"moe_rank": 2}
    (head,) = objs["raycluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert "--tensor-parallel-size 2" in head["args"][0]
    ops.wait_for(
        lambda: status_of(control_plane, namespace, "tp2").get("tensorParallelSize") == 2,
        what="status.tensorParallelSize 2",
    )
    out = control_plane.kubectl("get", "moed", "tp2", "-n", namespace, "-o", "wide").stdout
    header, row = out.splitlines()[:2]
    assert header.split()[:9] == [
        "NAME", "DP", "TARGET", "PHASE", "STAGE", "READY", "AGE", "MESSAGE", "TP",
    ]  # fmt: skip
    start = header.index(" TP ") + 1
    # kubectl aligns the columns: the TP and PP values start under their headers
    assert row[start:].split()[:2] == ["2", "1"], out


def test_status_follows_conventions(
    control_plane: cluster.ControlPlane, deployed: tuple[str, dict[str, Any]]
) -> None:
    namespace, _ = deployed
    status = status_of(control_plane, namespace, "tiny")
    assert status["selector"] == "elasticmoe.io/deployment=tiny"
    assert status["endpoint"] == f"http://tiny-api.{namespace}.svc:8000"
    assert status["targetDataParallelSize"] == 2
    conditions = {c["type"]: c for c in status["conditions"]}
    assert set(conditions) == {"Ready", "Resizing", "Degraded"}
    for cond in conditions.values():
        assert cond["observedGeneration"] == 1
        assert cond["lastTransitionTime"].endswith("Z")
        assert cond["reason"]


def test_describe_shows_events(
    control_plane: cluster.ControlPlane, deployed: tuple[str, dict[str, Any]]
) -> None:
    namespace, _ = deployed

    def described() -> str | None:
        out = control_plane.kubectl("describe", "moed", "tiny", "-n", namespace).stdout
        created = [line for line in out.splitlines() if "Created" in line]
        wanted = ("RayCluster tiny", "Service tiny-api", "Secret tiny-admin")
        return out if any(all(w in line for w in wanted) for line in created) else None

    ops.wait_for(described, what="Created events in kubectl describe")


def test_scale_changes_the_spec_and_the_raycluster(
    control_plane: cluster.ControlPlane, deployed: tuple[str, dict[str, Any]]
) -> None:
    namespace, _ = deployed
    control_plane.kubectl("scale", "moed", "tiny", "-n", namespace, "--replicas=3")
    obj = ops.get_json(control_plane, "moed", "tiny", namespace=namespace)
    assert obj is not None and obj["spec"]["dataParallelSize"] == 3

    def replicas() -> int | None:
        ray = ops.get_json(control_plane, "raycluster", "tiny", namespace=namespace)
        n = ray["spec"]["workerGroupSpecs"][0]["replicas"] if ray else None
        return n if n == 3 else None

    ops.wait_for(replicas, what="RayCluster replicas 3")
    ops.wait_for(
        lambda: status_of(control_plane, namespace, "tiny").get("targetDataParallelSize") == 3,
        what="status.targetDataParallelSize 3",
    )


def test_scale_beyond_max_is_refused(
    control_plane: cluster.ControlPlane, deployed: tuple[str, dict[str, Any]]
) -> None:
    namespace, _ = deployed
    done = control_plane.kubectl(
        "scale", "moed", "tiny", "-n", namespace, "--replicas=5", check=False
    )
    assert done.returncode != 0
    assert "dataParallelSize must be at most maxDataParallelSize" in done.stderr


def resource_versions(plane: cluster.ControlPlane, namespace: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for kind in ("moed", "raycluster", "service", "secret"):
        listing = ops.get_json(
            plane, kind, "-l", "elasticmoe.io/deployment=tiny", namespace=namespace
        )
        if kind == "moed":
            listing = ops.get_json(plane, "moed", namespace=namespace)
        assert listing is not None
        for item in listing["items"]:
            out[f"{kind}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    return out


def test_restart_changes_nothing(
    control_plane: cluster.ControlPlane,
    operator: ops.OperatorProcess,
    deployed: tuple[str, dict[str, Any]],
) -> None:
    namespace, objs = deployed
    ops.wait_for(
        lambda: (
            "Created RayCluster tiny,"
            in control_plane.kubectl("describe", "moed", "tiny", "-n", namespace).stdout
        ),
        what="events posted",
    )
    before = resource_versions(control_plane, namespace)
    token = objs["secret"]["data"]["token"]
    operator.restart()
    ops.wait_for(
        lambda: f"reconciled {namespace}/tiny:" in operator.current_log(),
        what="the resumed reconcile of tiny",
    )
    after = resource_versions(control_plane, namespace)
    assert after == before
    assert sorted(after) == [
        "moed/tiny",
        "raycluster/tiny",
        "secret/tiny-admin",
        "service/tiny-api",
    ]
    secret = ops.get_json(control_plane, "secret", "tiny-admin", namespace=namespace)
    assert secret is not None and secret["data"]["token"] == token


def test_deleted_child_is_recreated(
    control_plane: cluster.ControlPlane, deployed: tuple[str, dict[str, Any]]
) -> None:
    namespace, objs = deployed
    old_uid = objs["raycluster"]["metadata"]["uid"]
    control_plane.kubectl("delete", "raycluster", "tiny", "-n", namespace)

    def recreated() -> bool:
        ray = ops.get_json(control_plane, "raycluster", "tiny", namespace=namespace)
        return ray is not None and ray["metadata"]["uid"] != old_uid

    ops.wait_for(recreated, what="the RayCluster to be re-created")


def test_kubectl_is_real(control_plane: cluster.ControlPlane) -> None:
    version = subprocess.run(
        ["kubectl", "version", "--client", "-o", "json"], capture_output=True, text=True
    )
    assert json.loads(version.stdout)["clientVersion"]["major"] == "1"
