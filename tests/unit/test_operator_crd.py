"""The CRD generator and the pydantic models it is generated from."""

from __future__ import annotations

import decimal
import pathlib
from typing import Any

import pydantic
import pytest
import yaml

from moe_operator import cli
from moe_operator.api import crd, mesh, storage
from moe_operator.api import spec as spec_

REPO = pathlib.Path(__file__).resolve().parents[2]


def version() -> dict[str, Any]:
    (v,) = crd.build_crd()["spec"]["versions"]
    return dict(v)


def schema() -> dict[str, Any]:
    return dict(version()["schema"]["openAPIV3Schema"])


def walk(node: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(node, dict):
        out.append(node)
        for value in node.values():
            out.extend(walk(value))
    elif isinstance(node, list):
        for value in node:
            out.extend(walk(value))
    return out


def test_checked_in_crd_is_current() -> None:
    assert (REPO / "crds" / crd.FILE_NAME).read_text() == crd.render_crd()


def test_cli_writes_the_crd(tmp_path: pathlib.Path) -> None:
    assert cli.main(["crd", "--out", str(tmp_path)]) == 0
    doc = yaml.safe_load((tmp_path / crd.FILE_NAME).read_text())
    assert doc["metadata"]["name"] == "moedeployments.elasticmoe.io"
    assert (tmp_path / "kustomization.yaml").exists()


def test_names() -> None:
    names = crd.build_crd()["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "MoEDeployment",
        "moedeployments",
        ["moed"],
    )
    assert crd.build_crd()["spec"]["scope"] == "Namespaced"


def test_schema_is_structural() -> None:
    for node in walk(schema()):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node
        assert node.get("additionalProperties") is not False
        assert "x-kubernetes-preserve-unknown-fields" not in node


def test_spec_fields_use_camel_case_and_defaults() -> None:
    spec = schema()["properties"]["spec"]
    assert spec["required"] == ["model", "dataParallelSize"]
    props = spec["properties"]
    assert props["minDataParallelSize"]["default"] == 1
    assert props["dataParallelSize"]["minimum"] == 1
    assert props["expertParallel"]["default"] == {}
    assert (
        props["expertParallel"]["properties"]["eplb"]["properties"]["windowSize"]["default"] == 1000
    )
    assert props["model"]["required"] == ["source"]


def test_cel_rules() -> None:
    spec = schema()["properties"]["spec"]
    rules = {r["rule"] for r in spec["x-kubernetes-validations"]}
    assert "self.minDataParallelSize <= self.maxDataParallelSize" in rules
    assert "self.dataParallelSize <= self.maxDataParallelSize" in rules
    source = spec["properties"]["model"]["properties"]["source"]
    # model.source may change: a change rolls the deployment over (docs/ROLLOUTS.md); only
    # the pvc:// form is checked.
    assert source["x-kubernetes-validations"]
    assert all(
        r["rule"].startswith("!self.startsWith('pvc://') || ")
        for r in source["x-kubernetes-validations"]
    )


def test_quantities_are_int_or_string() -> None:
    requests = schema()["properties"]["spec"]["properties"]["ray"]["properties"]["workerResources"][
        "properties"
    ]["requests"]
    assert requests["additionalProperties"] == {"x-kubernetes-int-or-string": True}


def test_subresources() -> None:
    assert version()["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.dataParallelSize",
            "statusReplicasPath": ".status.dataParallelSize",
            "labelSelectorPath": ".status.selector",
        },
    }


def test_printer_columns() -> None:
    printed = version()["additionalPrinterColumns"]
    columns = {c["name"]: c["jsonPath"] for c in printed if not c.get("priority")}
    assert list(columns) == ["DP", "TARGET", "PHASE", "STAGE", "READY", "AGE", "MESSAGE"]
    # why it is not ready: load progress, a failed start (plan.load_report)
    assert columns["MESSAGE"] == '.status.conditions[?(@.type=="Ready")].message'
    wide = {c["name"]: c["jsonPath"] for c in printed if c.get("priority") == 1}
    assert wide == {
        "TP": ".status.tensorParallelSize",
        "PP": ".status.pipelineParallelSize",
        "SPARES": ".status.spares.ready",
        "DESIRED": ".status.autoscaling.desiredSize",
        "IN-FLIGHT/RANK": ".status.autoscaling.metric",
        "AUTOSCALER": ".status.autoscaling.reason",
        "REVISION": ".status.revision",
        "ROLLOUT": ".status.rollout.stage",
        "MOVED": ".status.rollout.ranksMoved",
    }
    assert columns["STAGE"] == ".status.resize.stage"
    assert columns["READY"] == '.status.conditions[?(@.type=="Ready")].status'


def test_conditions_are_a_list_map() -> None:
    conditions = schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


VALID = {"model": {"source": "synthetic://tiny"}, "dataParallelSize": 2}
NO_EPLB = {"eplb": {"enabled": False}}


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"dataParallelSize": 9}, "dataParallelSize must be within"),
        ({"minDataParallelSize": 5, "maxDataParallelSize": 4}, "minDataParallelSize"),
        ({"replicas": 2}, "Extra inputs are not permitted"),
        ({"tensorParallelSize": 0}, "greater than or equal to 1"),
        ({"tensorParallelSize": 9}, "less than or equal to 8"),
        (
            {
                "pipelineParallelSize": 2,
                "expertParallel": NO_EPLB,
                "ray": {"workerResources": {"requests": {"cpu": "1"}}},
            },
            r"cpu must be at least tensorParallelSize x pipelineParallelSize .*want >= 2",
        ),  # fmt: skip
        ({"pipelineParallelSize": 9}, "less than or equal to 8"),
        (
            {
                "tensorParallelSize": 2,
                "ray": {
                    "accelerator": "nvidia.com/gpu",
                    "workerResources": {"limits": {"nvidia.com/gpu": 1}},
                },
            },
            r"nvidia.com/gpu must equal tensorParallelSize x pipelineParallelSize .*want 2",
        ),
        (
            {
                "tensorParallelSize": 2,
                "ray": {
                    "accelerator": "nvidia.com/gpu",
                    "workerResources": {"requests": {"nvidia.com/gpu": "4"}},
                },
            },
            r"nvidia.com/gpu must equal .*got '4', want 2",
        ),
        (
            {"tensorParallelSize": 4, "ray": {"workerResources": {"requests": {"cpu": "3500m"}}}},
            r"cpu must be at least tensorParallelSize x pipelineParallelSize .*want >= 4",
        ),
        (
            {"tensorParallelSize": 2, "ray": {"workerResources": {"limits": {"cpu": 1}}}},
            "cpu must be at least",
        ),
        ({"model": {"source": "pvc://Models/x"}}, "CLAIM a PersistentVolumeClaim name"),
        ({"model": {"source": "pvc:///abs"}}, "CLAIM a PersistentVolumeClaim name"),
        ({"model": {"source": "pvc://models/a/../etc"}}, r"must not contain '\.' or '\.\.'"),
    ],
    ids=[
        "dp-above-max",
        "min-above-max",
        "unknown-field",
        "tp-zero",
        "tp-above-8",
        "cpu-request-below-pp",
        "pp-above-8",
        "gpu-limit-below-tp",
        "gpu-request-above-tp",
        "cpu-request-below-tp",
        "cpu-limit-below-tp",
        "pvc-claim-upper-case",
        "pvc-no-claim",
        "pvc-dot-dot",
    ],
)
def test_models_refuse_what_the_crd_refuses(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        spec_.MoEDeploymentSpec.model_validate({**VALID, **patch})


@pytest.mark.parametrize(
    "patch",
    [
        {"tensorParallelSize": 2},
        {"tensorParallelSize": 8, "ray": {"accelerator": "nvidia.com/gpu"}},
        {"tensorParallelSize": 2, "ray": {"accelerator": "nvidia.com/gpu",
         "workerResources": {"requests": {"nvidia.com/gpu": "2", "cpu": 1},
                             "limits": {"nvidia.com/gpu": 2}}}},
        {"tensorParallelSize": 2, "ray": {"workerResources": {"requests": {"cpu": "2000m"},
                                                              "limits": {"cpu": "2.5"}}}},
        # the GPU count belongs to GPU workers only; a cpu worker's GPUs are the user's
        {"tensorParallelSize": 2, "ray": {"workerResources": {"limits": {"nvidia.com/gpu": 1}}}},
        # one device per rank reads as before these rules: no stored deployment turns invalid
        {"ray": {"workerResources": {"requests": {"cpu": "500m"}}}},
        {"ray": {"accelerator": "nvidia.com/gpu",
                 "workerResources": {"limits": {"nvidia.com/gpu": 2}}}},
        {"pipelineParallelSize": 2},  # EPLB on (the default)
        {"pipelineParallelSize": 3, "expertParallel": NO_EPLB, "ray": {
            "accelerator": "nvidia.com/gpu", "workerResources": {"limits": {"nvidia.com/gpu": 3}}}},
        {"tensorParallelSize": 2, "pipelineParallelSize": 2, "expertParallel": NO_EPLB,
         "ray": {"workerResources": {"requests": {"cpu": 4}}}},
        {"pipelineParallelSize": 2, "expertParallel": NO_EPLB, "elastic": {"warmSpareRanks": 1}},
    ],
    ids=["tp-2-cpu", "tp-8-gpu", "gpu-count-given-right", "cpu-cores-enough", "cpu-gpu-limit",
         "tp1-half-a-core", "tp1-gpu-count-overwritten", "pp-2-eplb-on", "pp-3-gpu-count-given",
         "tp-2-pp-2-cpu", "pp-2-warm-spare"],
)  # fmt: skip
def test_models_accept_a_mesh_the_worker_pod_holds(patch: dict[str, Any]) -> None:
    parsed = spec_.MoEDeploymentSpec.model_validate({**VALID, **patch})
    assert parsed.devices_per_rank == (parsed.tensor_parallel_size * parsed.pipeline_parallel_size)


def test_the_mesh_rules_are_in_the_crd() -> None:
    """The refusals above are the API server's too (tests/integration/operator/
    test_operator_validation.py applies them): TP and PP are bounded and the pod's fit is
    checked at spec level."""
    props = schema()["properties"]["spec"]["properties"]
    assert (props["tensorParallelSize"]["minimum"], props["tensorParallelSize"]["maximum"]) == (
        1,
        8,
    )
    assert "x-kubernetes-validations" not in props["tensorParallelSize"]
    pp = props["pipelineParallelSize"]
    assert (pp["default"], pp["minimum"], pp["maximum"]) == (1, 1, 8)
    assert "x-kubernetes-validations" not in pp
    messages = [r["message"] for r in schema()["properties"]["spec"]["x-kubernetes-validations"]]
    assert any(m.startswith("ray.workerResources nvidia.com/gpu must equal") for m in messages)
    assert any(m.startswith("ray.workerResources cpu must be at least") for m in messages)


@pytest.mark.parametrize(
    ("text", "value"),
    [("2", 2), (3, 3), ("500m", 0.5), ("1.5", 1.5), ("2k", 2000), ("1Ki", 1024), ("3e2", 300),
     ("1E", 10**18), (".5", 0.5)],
)  # fmt: skip
def test_quantities_parse_as_kubernetes_reads_them(text: Any, value: float) -> None:
    assert mesh.parse_quantity(text) == decimal.Decimal(str(value))


def test_a_malformed_quantity_is_not_one() -> None:
    assert mesh.parse_quantity("two") is None and mesh.parse_quantity("1.2.3") is None


def test_models_fill_defaults() -> None:
    parsed = spec_.MoEDeploymentSpec.model_validate(VALID)
    assert parsed.max_data_parallel_size == 8
    assert parsed.expert_parallel.eplb.step_interval == 3000
    assert parsed.to_wire()["expertParallel"]["eplb"]["windowSize"] == 1000


@pytest.mark.parametrize(
    ("source", "claim", "path"),
    [
        ("pvc://models/mixtral-8x7b", "models", "mixtral-8x7b"),
        ("pvc://models/org/model/", "models", "org/model"),
        ("pvc://my.claim-1", "my.claim-1", ""),
        ("pvc://models/v1..2/.cache-free", "models", "v1..2/.cache-free"),
    ],
    ids=["claim-and-dir", "nested-trailing-slash", "claim-root", "dots-inside-names"],
)
def test_pvc_sources_name_a_claim_and_a_relative_path(source: str, claim: str, path: str) -> None:
    parsed = storage.parse_pvc(source)
    assert parsed == storage.PvcSource(claim=claim, path=path)
    assert (
        spec_.MoEDeploymentSpec.model_validate({**VALID, "model": {"source": source}}).model.source
        == source
    )


@pytest.mark.parametrize(
    "source",
    ["pvc://models/a/../../etc", "pvc://models/./x", "pvc://models//x", "pvc://-bad/x",
     "pvc://" + "a" * 254 + "/x"],
    ids=["dot-dot", "dot", "empty-segment", "claim-starts-with-dash", "claim-too-long"],
)  # fmt: skip
def test_bad_pvc_sources_are_refused_naming_the_source(source: str) -> None:
    with pytest.raises(ValueError, match="model.source"):
        storage.parse_pvc(source)


def test_the_cel_rules_and_python_agree_on_pvc_sources() -> None:
    """The CRD's regular expressions are the ones Python matches (CEL's RE2 and Python's re
    agree on these simple patterns)."""
    rules = [r["rule"] for r in storage.CEL_RULES]
    assert "self.matches('" + storage.PVC_PATTERN.replace("\\", "\\\\") + "')" in rules[0]
    assert "self.matches('" + storage.DOT_SEGMENT_PATTERN.replace("\\", "\\\\") + "')" in rules[1]
    assert storage.parse_pvc("synthetic://tiny") is None
    assert storage.parse_pvc("/models/local") is None
