"""The kustomize manifests, the sample and the Helm chart agree with each other and the CRD."""

from __future__ import annotations

import pathlib
from typing import Any

import yaml

from moe_operator.api import crd
from moe_operator.api import spec as spec_
from moe_operator.plan import builders

REPO = pathlib.Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
CHART = REPO / "charts" / "elastic-moe"


def docs(path: pathlib.Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(path: pathlib.Path, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs(path) if d["kind"] == kind]
    return doc


def test_sample_is_a_valid_spec() -> None:
    (sample,) = docs(MANIFESTS / "samples" / "moedeployment.yaml")
    spec = spec_.MoEDeploymentSpec.model_validate(sample["spec"])
    assert spec.model.source == "synthetic://tiny?seed=0"
    assert (
        spec.data_parallel_size,
        spec.min_data_parallel_size,
        spec.max_data_parallel_size,
    ) == (2, 1, 4)


def test_gpu_sample_gives_each_worker_its_gpus() -> None:
    (sample,) = docs(MANIFESTS / "samples" / "moedeployment-gpu.yaml")
    spec = spec_.MoEDeploymentSpec.model_validate(sample["spec"])
    assert spec.wants_gpus
    assert spec.ray.image == f"{spec_.DEFAULT_IMAGE}-gpu"  # the variant images/build.sh builds
    owner = builders.Owner(name=sample["metadata"]["name"], namespace="default", uid="uid")
    cluster = builders.build_raycluster(owner=owner, spec=spec)
    (group,) = cluster["spec"]["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    gpus = spec.tensor_parallel_size
    assert worker["resources"]["limits"][spec_.ACCELERATOR_NVIDIA_GPU] == gpus
    assert group["rayStartParams"]["num-gpus"] == str(gpus)
    assert spec_.ACCELERATOR_NVIDIA_GPU not in head["resources"].get("limits", {})
    assert "--device cuda" in " ".join([*head.get("command", []), *head.get("args", [])])
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert spec.ray.shared_memory_size == "8Gi"


def test_kustomization_lists_every_file() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (MANIFESTS / resource).exists(), resource


def test_operator_runs_locked_down() -> None:
    deployment = by_kind(MANIFESTS / "deployment.yaml", "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["limits"]["memory"]
    assert pod["serviceAccountName"] == "moe-operator"


def test_rbac_has_no_wildcards_and_no_delete() -> None:
    role = by_kind(MANIFESTS / "rbac.yaml", "ClusterRole")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert not {"delete", "deletecollection", "update"} & set(rule["verbs"]) or rule[
            "resources"
        ] == ["moedeployments/finalizers"]
    secrets = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]}]


def test_chart_rbac_matches_the_manifests() -> None:
    role = by_kind(MANIFESTS / "rbac.yaml", "ClusterRole")
    template = (CHART / "templates" / "rbac.yaml").read_text()
    block = template.split("rules:\n", 1)[1].split("---", 1)[0]
    assert yaml.safe_load(block) == role["rules"]


def test_chart_ships_the_generated_crd() -> None:
    assert (CHART / "crds" / crd.FILE_NAME).read_text() == crd.render_crd()
