"""The CRD generator and the pydantic models it is generated from."""

from __future__ import annotations

import pathlib
from typing import Any

import pydantic
import pytest
import yaml

from moe_operator import cli
from moe_operator.api import crd, storage
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


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"dataParallelSize": 9}, "dataParallelSize must be within"),
        ({"minDataParallelSize": 5, "maxDataParallelSize": 4}, "minDataParallelSize"),
        ({"replicas": 2}, "Extra inputs are not permitted"),
        ({"tensorParallelSize": 0}, "greater than or equal to 1"),
        ({"model": {"source": "pvc://Models/x"}}, "CLAIM a PersistentVolumeClaim name"),
        ({"model": {"source": "pvc:///abs"}}, "CLAIM a PersistentVolumeClaim name"),
        ({"model": {"source": "pvc://models/a/../etc"}}, r"must not contain '\.' or '\.\.'"),
    ],
    ids=[
        "dp-above-max",
        "min-above-max",
        "unknown-field",
        "tp-zero",
        "pvc-claim-upper-case",
        "pvc-no-claim",
        "pvc-dot-dot",
    ],
)
def test_models_refuse_what_the_crd_refuses(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        spec_.MoEDeploymentSpec.model_validate({**VALID, **patch})


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
