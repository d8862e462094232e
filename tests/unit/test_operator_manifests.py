"""The kustomize manifests, the sample and the Helm chart agree with each other and the CRD."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import prometheus_client
import yaml

from moe_operator import metrics
from moe_operator.api import crd, storage
from moe_operator.api import spec as spec_
from moe_operator.plan import autoscale, builders

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
    gpus = spec.devices_per_rank  # one worker pod per DP rank holds its T x P devices
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
    deployment = by_kind(MANIFESTS / "base" / "deployment.yaml", "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["limits"]["memory"]
    assert pod["serviceAccountName"] == "moe-operator"


def test_rbac_has_no_wildcards_and_deletes_only_rayclusters() -> None:
    role = by_kind(MANIFESTS / "base" / "rbac.yaml", "ClusterRole")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert not {"deletecollection", "update"} & set(rule["verbs"]) or rule["resources"] == [
            "moedeployments/finalizers"
        ]
        # A rollout deletes its old RayCluster (docs/ROLLOUTS.md); nothing else is deleted.
        assert "delete" not in rule["verbs"] or rule["resources"] in (
            ["moedeployments/finalizers"],
            ["rayclusters"],
        )
    # Cluster-wide, Secrets can only be created (each deployment's, never read back) ...
    secrets = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    # ... and the one Secret read is the operator's key, by name, in its own namespace.
    key = by_kind(MANIFESTS / "base" / "rbac.yaml", "Role")
    assert key["metadata"]["namespace"] == "elastic-moe-system"
    reads = [r for r in key["rules"] if "get" in r["verbs"]]
    assert reads == [{"apiGroups": [""], "resources": ["secrets"],
                      "resourceNames": ["elastic-moe-operator-key"], "verbs": ["get"]}]  # fmt: skip


def test_a_watched_namespace_gets_the_namespaced_rules_and_nothing_else() -> None:
    """manifests/namespaced/: the Role in each watched namespace holds exactly the namespaced
    rules of the cluster-wide ClusterRole; the ClusterRole is cut down to reading CRDs; the
    operator is told to watch each namespace that has a Role (rendered and checked against a
    real API server in tests/integration/operator/test_operator_manifests.py)."""
    cluster_rules = by_kind(MANIFESTS / "base" / "rbac.yaml", "ClusterRole")["rules"]
    crds = [r for r in cluster_rules if r["resources"] == ["customresourcedefinitions"]]
    role = by_kind(MANIFESTS / "namespaced" / "watched" / "role.yaml", "Role")
    assert role["rules"] == [r for r in cluster_rules if r not in crds]
    overlay = yaml.safe_load((MANIFESTS / "namespaced" / "kustomization.yaml").read_text())
    patches = {p["target"]["kind"]: yaml.safe_load(p["patch"]) for p in overlay["patches"]}
    assert patches["ClusterRole"] == [{"op": "replace", "path": "/rules", "value": crds}]
    watched = [r for r in overlay["resources"] if not r.startswith("..")]
    namespaces = [
        yaml.safe_load((MANIFESTS / "namespaced" / d / "kustomization.yaml").read_text())[
            "namespace"
        ]
        for d in watched
    ]
    args = [op["value"] for op in patches["Deployment"]]
    assert args == [f"--namespace={n}" for n in namespaces] and namespaces == ["ml"]


def test_chart_ships_the_generated_crd() -> None:
    assert (CHART / "crds" / crd.FILE_NAME).read_text() == crd.render_crd()


def test_autoscaling_sample_is_a_valid_spec() -> None:
    (sample,) = docs(MANIFESTS / "samples" / "moedeployment-autoscaling.yaml")
    spec = spec_.MoEDeploymentSpec.model_validate(sample["spec"])
    auto = spec.autoscaling
    assert auto.enabled and auto.target_in_flight_per_rank == 8
    assert (auto.scale_up_stabilization_seconds, auto.scale_down_stabilization_seconds) == (15, 120)
    assert spec.data_parallel_size == spec.min_data_parallel_size == 1


def test_the_hpa_and_keda_samples_target_the_sample_and_the_operator_stands_down() -> None:
    (hpa,) = docs(MANIFESTS / "samples" / "hpa.yaml")
    (scaled,) = docs(MANIFESTS / "samples" / "keda-scaledobject.yaml")
    name = docs(MANIFESTS / "samples" / "moedeployment.yaml")[0]["metadata"]["name"]
    assert (
        autoscale.external([hpa], name=name) == f"HorizontalPodAutoscaler {hpa['metadata']['name']}"
    )
    # KEDA's HPA for the ScaledObject: its scaleTargetRef, its labels
    made = {
        "metadata": {"name": f"keda-hpa-{scaled['metadata']['name']}",
                     "labels": {autoscale.KEDA_LABEL: scaled["metadata"]["name"]}},
        "spec": {"scaleTargetRef": scaled["spec"]["scaleTargetRef"]},
    }  # fmt: skip
    assert (
        autoscale.external([made], name=name)
        == "KEDA ScaledObject tiny (HorizontalPodAutoscaler keda-hpa-tiny)"
    )
    for obj in (hpa, scaled):
        behavior = (
            obj["spec"].get("behavior")
            or obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        )
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 15
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 120


def test_the_metrics_service_reaches_the_operator() -> None:
    deployment = by_kind(MANIFESTS / "base" / "deployment.yaml", "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    assert f"--metrics=0.0.0.0:{port}" in container["command"]
    service = by_kind(MANIFESTS / "base" / "service.yaml", "Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    monitors = docs(MANIFESTS / "monitoring" / "servicemonitor.yaml")
    operator = [m for m in monitors if m["metadata"]["name"] == "moe-operator"][0]
    assert (
        operator["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert operator["spec"]["endpoints"][0]["honorLabels"] is True


def _exported(registry: prometheus_client.CollectorRegistry) -> set[str]:
    """Every sample name a registry can export (labelled children need not exist yet)."""
    names: set[str] = set()
    for family in registry.collect():
        suffixes = {
            "counter": ["_total", "_created"],
            "histogram": ["_bucket", "_sum", "_count", "_created"],
            "gauge": [""],
        }.get(family.type, [""])
        names |= {family.name + s for s in suffixes}
    return names


def test_the_dashboard_only_uses_metrics_that_exist() -> None:
    from moe_runtime import metrics as runtime_metrics
    from moe_runtime.elastic import service as elastic_service

    runtime = runtime_metrics.RuntimeMetrics()
    elastic_service.ElasticMetrics(runtime.registry)
    exported = _exported(runtime.registry) | _exported(metrics.OperatorMetrics().registry)
    dashboard = json.loads((CHART / "dashboards" / "elastic-moe.json").read_text())
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in re.findall(r"\bmoe_[a-z_]+\b", target["expr"])
    }
    assert used and used <= exported, sorted(used - exported)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for subject in ("tokens/s", "time to first token", "queue depth", "data-parallel size",
                    "resize stage", "balancedness"):  # fmt: skip
        assert subject in titles


def test_the_pvc_sample_serves_a_checkpoint_the_download_job_puts_on_its_claim() -> None:
    claim, moed = docs(MANIFESTS / "samples" / "moedeployment-pvc.yaml")
    assert claim["kind"] == "PersistentVolumeClaim"
    spec = spec_.MoEDeploymentSpec.model_validate(moed["spec"])
    pvc = storage.parse_pvc(spec.model.source)
    assert pvc is not None and pvc.claim == claim["metadata"]["name"]
    # several nodes mount it at once: not a one-node access mode
    assert set(claim["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}
    (job,) = docs(MANIFESTS / "samples" / "model-download-job.yaml")
    pod = job["spec"]["template"]["spec"]
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == pvc.claim
    (container,) = pod["containers"]
    (mount,) = container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    # the Job writes where the deployment reads: <mount>/<repo> is pvc://<claim>/<repo>
    assert f"{mount['mountPath']}/{env['REPO']}" == f"/models/{pvc.path}"
    assert '--local-dir "/models/$REPO"' in container["args"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
