"""The API server refuses bad MoEDeployments (OpenAPI schema + CEL), naming the field.

No operator needed: validation lives in the CRD.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

import pytest
import yaml

from e2e.controlplane import cluster

pytestmark = pytest.mark.controlplane

VALID: dict[str, Any] = {
    "apiVersion": "elasticmoe.io/v1alpha1",
    "kind": "MoEDeployment",
    "metadata": {"name": "bad"},
    "spec": {
        "model": {"source": "synthetic://tiny?seed=0"},
        "dataParallelSize": 2,
        "minDataParallelSize": 1,
        "maxDataParallelSize": 4,
    },
}


def variant(path: str, value: Any) -> dict[str, Any]:
    """VALID with ``path`` (dotted) set to ``value``; ``...`` deletes it."""
    doc = copy.deepcopy(VALID)
    *parents, leaf = path.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    if value is ...:
        del node[leaf]
    else:
        node[leaf] = value
    return doc


CASES = [
    pytest.param(variant("spec.dataParallelSize", "two"), "spec.dataParallelSize", id="dp-not-int"),
    pytest.param(variant("spec.dataParallelSize", 0), "spec.dataParallelSize", id="dp-zero"),
    pytest.param(
        variant("spec.dataParallelSize", 5),
        "dataParallelSize must be at most maxDataParallelSize",
        id="dp-above-max",
    ),
    pytest.param(
        variant("spec.minDataParallelSize", 3),
        "dataParallelSize must be at least minDataParallelSize",
        id="dp-below-min",
    ),
    pytest.param(
        variant("spec.minDataParallelSize", 3)
        | {"spec": {**VALID["spec"], "maxDataParallelSize": 2, "minDataParallelSize": 3}},
        "minDataParallelSize must be less than or equal to maxDataParallelSize",
        id="min-above-max",
    ),
    pytest.param(variant("spec.minDataParallelSize", 0), "spec.minDataParallelSize", id="min-zero"),
    pytest.param(variant("spec.tensorParallelSize", 0), "spec.tensorParallelSize", id="tp-zero"),
    pytest.param(
        variant("spec.elastic.warmSpareRanks", 5),
        "elastic.warmSpareRanks must be at most maxDataParallelSize",
        id="spares-above-max",
    ),
    pytest.param(variant("spec.tensorParallelSize", 9), "spec.tensorParallelSize", id="tp-above-8"),
    pytest.param(
        variant("spec.expertLayout", "mesh"),
        "expertLayout mesh needs tensorParallelSize > 1",
        id="mesh-at-tp1",
    ),
    pytest.param(variant("spec.expertLayout", "rows"), "spec.expertLayout", id="layout-unknown"),
    pytest.param(
        {
            **VALID,
            "spec": {
                **VALID["spec"],
                "pipelineParallelSize": 2,
                "expertParallel": {"eplb": {"enabled": False}},
                "ray": {"workerResources": {"requests": {"cpu": "1500m"}}},
            },
        },
        "cpu must be at least tensorParallelSize x pipelineParallelSize",
        id="cpu-request-below-pp",
    ),  # fmt: skip
    pytest.param(
        variant("spec.pipelineParallelSize", 9), "spec.pipelineParallelSize", id="pp-above-8"
    ),
    pytest.param(
        variant("spec.tensorParallelSize", 2)
        | {
            "spec": {
                **VALID["spec"],
                "tensorParallelSize": 2,
                "ray": {
                    "accelerator": "nvidia.com/gpu",
                    "workerResources": {"limits": {"nvidia.com/gpu": 1}},
                },
            }
        },
        "nvidia.com/gpu must equal tensorParallelSize x pipelineParallelSize",
        id="gpu-limit-below-tp",
    ),
    pytest.param(
        {
            **VALID,
            "spec": {
                **VALID["spec"],
                "tensorParallelSize": 2,
                "ray": {
                    "accelerator": "nvidia.com/gpu",
                    "workerResources": {"requests": {"nvidia.com/gpu": "3"}},
                },
            },
        },
        "nvidia.com/gpu must equal tensorParallelSize x pipelineParallelSize",
        id="gpu-request-above-tp",
    ),
    pytest.param(
        {
            **VALID,
            "spec": {
                **VALID["spec"],
                "tensorParallelSize": 4,
                "ray": {"workerResources": {"requests": {"cpu": "3500m"}}},
            },
        },
        "cpu must be at least tensorParallelSize x pipelineParallelSize",
        id="cpu-request-below-tp",
    ),
    pytest.param(
        variant("spec.maxQueuedRequests", -1), "spec.maxQueuedRequests", id="negative-queue"
    ),
    pytest.param(
        variant("spec.dataParallelSize", 4096), "spec.dataParallelSize", id="dp-above-limit"
    ),
    pytest.param(variant("spec.model.source", ...), "spec.model.source", id="missing-source"),
    pytest.param(variant("spec.model.source", ""), "spec.model.source", id="empty-source"),
    pytest.param(variant("spec.dataParallelSize", ...), "spec.dataParallelSize", id="missing-dp"),
    pytest.param(variant("spec", ...), "spec", id="missing-spec"),
    pytest.param(variant("spec.replicas", 2), 'unknown field "spec.replicas"', id="unknown-field"),
    pytest.param(
        variant("spec.model.revision", "main"),
        'unknown field "spec.model.revision"',
        id="unknown-nested-field",
    ),
    pytest.param(
        variant("spec.ray", {"imagePullPolicy": "Sometimes"}),
        "spec.ray.imagePullPolicy",
        id="bad-enum-pull-policy",
    ),
    pytest.param(
        variant("spec.ray", {"accelerator": "tpu"}),
        "spec.ray.accelerator",
        id="bad-enum-accelerator",
    ),
    pytest.param(
        variant("spec.expertParallel", {"numRedundantExperts": -1}),
        "spec.expertParallel.numRedundantExperts",
        id="negative-redundant-experts",
    ),
    pytest.param(
        variant("spec.expertParallel", {"eplb": {"windowSize": 0}}),
        "spec.expertParallel.eplb.windowSize",
        id="eplb-window-zero",
    ),
    pytest.param(
        variant("spec.elastic", {"drainTimeoutSeconds": -1}),
        "spec.elastic.drainTimeoutSeconds",
        id="drain-timeout-negative",
    ),
    pytest.param(
        variant("spec.ray", {"nodeSelector": {"pool": 1}}),
        "spec.ray.nodeSelector.pool",
        id="node-selector-not-string",
    ),
    pytest.param(
        variant("spec.ray", {"tolerations": [{"operator": "Maybe"}]}),
        "spec.ray.tolerations[0].operator",
        id="bad-enum-toleration",
    ),
    pytest.param(
        variant("spec.model.source", "pvc://Models/mixtral"),
        "CLAIM must be a PersistentVolumeClaim name",
        id="pvc-claim-not-a-name",
    ),
    pytest.param(
        variant("spec.model.source", "pvc://models/a/../../etc"),
        "PATH must not contain '.' or '..' segments",
        id="pvc-path-escapes",
    ),
    pytest.param(
        variant("metadata.name", "a" * 41),
        "metadata.name must be at most 40 characters",
        id="name-too-long",
    ),
]


@pytest.mark.parametrize(("doc", "message"), CASES)
def test_invalid_spec_is_refused(
    control_plane: cluster.ControlPlane, doc: dict[str, Any], message: str
) -> None:
    namespace = "default"
    doc = copy.deepcopy(doc)
    if doc["metadata"]["name"] == "bad":
        doc["metadata"]["name"] = f"bad-{uuid.uuid4().hex[:8]}"
    done = control_plane.kubectl(
        "apply", "--validate=strict", "-n", namespace, "-f", "-",
        input=yaml.safe_dump(doc), check=False,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout
    assert message in done.stderr
    gone = control_plane.kubectl(
        "get", "moed", doc["metadata"]["name"], "-n", namespace, check=False
    )
    assert gone.returncode != 0  # nothing was stored


@pytest.mark.parametrize(
    "spec",
    [
        {"tensorParallelSize": 2},
        {"tensorParallelSize": 8, "ray": {"accelerator": "nvidia.com/gpu"}},
        {"tensorParallelSize": 2, "ray": {"accelerator": "nvidia.com/gpu", "workerResources": {
            "requests": {"nvidia.com/gpu": 2, "cpu": "1"}, "limits": {"nvidia.com/gpu": "2"}}}},
        {"tensorParallelSize": 2, "ray": {"workerResources": {
            "requests": {"cpu": "2000m"}, "limits": {"cpu": 3, "memory": "1Gi"}}}},
        {"tensorParallelSize": 2, "ray": {"workerResources": {"limits": {"memory": "1Gi"}}}},
        {"tensorParallelSize": 1, "ray": {"workerResources": {"requests": {"cpu": "500m"}}}},
        {"pipelineParallelSize": 2},  # EPLB on (the default)
        {"pipelineParallelSize": 4, "expertParallel": {"eplb": {"enabled": False}},
         "ray": {"accelerator": "nvidia.com/gpu", "workerResources": {
            "limits": {"nvidia.com/gpu": 4}}}},
        {"tensorParallelSize": 2, "pipelineParallelSize": 2,
         "expertParallel": {"eplb": {"enabled": False}},
         "ray": {"accelerator": "nvidia.com/gpu", "workerResources": {
            "limits": {"nvidia.com/gpu": 4}}}},
        {"pipelineParallelSize": 2, "expertParallel": {"eplb": {"enabled": False}},
         "elastic": {"warmSpareRanks": 1}},
        {"tensorParallelSize": 2, "pipelineParallelSize": 2, "expertLayout": "mesh"},
    ],
    ids=["tp2-cpu", "tp8-gpu", "gpu-count-given", "cpu-cores-enough", "no-cpu-given",
         "tp1-half-a-core", "pp2-eplb-on", "pp4-gpu-count-given", "tp2-pp2-gpu-count-given",
         "pp2-warm-spare", "tp2-pp2-mesh-layout"],
)  # fmt: skip
def test_a_mesh_the_worker_pod_holds_is_accepted(
    control_plane: cluster.ControlPlane, spec: dict[str, Any]
) -> None:
    doc = copy.deepcopy(VALID)
    doc["spec"].update(spec)
    doc["metadata"]["name"] = f"tp-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("apply", "--validate=strict", "-f", "-", input=yaml.safe_dump(doc))
    stored = yaml.safe_load(
        control_plane.kubectl("get", "moed", doc["metadata"]["name"], "-o", "yaml").stdout
    )
    mesh = (spec.get("tensorParallelSize", 1), spec.get("pipelineParallelSize", 1))
    assert (stored["spec"]["tensorParallelSize"], stored["spec"]["pipelineParallelSize"]) == mesh


def test_a_pvc_source_is_accepted(control_plane: cluster.ControlPlane) -> None:
    doc = variant("spec.model.source", "pvc://models/org.model/v1.0")
    doc["metadata"]["name"] = f"pvc-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("apply", "--validate=strict", "-f", "-", input=yaml.safe_dump(doc))


def test_valid_spec_gets_defaults(control_plane: cluster.ControlPlane) -> None:
    doc = variant("metadata.name", f"ok-{uuid.uuid4().hex[:8]}")
    control_plane.kubectl("apply", "--validate=strict", "-f", "-", input=yaml.safe_dump(doc))
    stored = yaml.safe_load(
        control_plane.kubectl("get", "moed", doc["metadata"]["name"], "-o", "yaml").stdout
    )
    spec = stored["spec"]
    assert (spec["tensorParallelSize"], spec["pipelineParallelSize"]) == (1, 1)
    assert spec["expertParallel"] == {
        "numRedundantExperts": 0,
        "eplb": {"enabled": True, "windowSize": 1000, "stepInterval": 3000},
    }
    assert spec["elastic"] == {
        "drainTimeoutSeconds": 120,
        "resizeTimeoutSeconds": 600,
        "warmSpareRanks": 0,
    }
    assert spec["ray"]["accelerator"] == "cpu"


def test_model_source_may_change(control_plane: cluster.ControlPlane) -> None:
    """A new checkpoint rolls the deployment over (docs/ROLLOUTS.md): the API server takes
    the change; a malformed pvc:// source is still refused."""
    doc = variant("metadata.name", f"src-{uuid.uuid4().hex[:8]}")
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    doc["spec"]["model"]["source"] = "synthetic://tiny?seed=1"
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    doc["spec"]["model"]["source"] = "pvc://Bad_Claim/x"
    done = control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert done.returncode != 0 and "spec.model.source" in done.stderr


def test_status_of_unknown_shape_is_refused(control_plane: cluster.ControlPlane) -> None:
    doc = variant("metadata.name", f"st-{uuid.uuid4().hex[:8]}")
    name = doc["metadata"]["name"]
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    done = control_plane.kubectl(
        "patch", "moed", name, "--subresource=status", "--type=merge",
        "-p", '{"status": {"phase": "Dancing"}}', check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "status.phase" in done.stderr
