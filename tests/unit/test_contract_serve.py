"""The serve flags of the contract (``moe_contract.serve``): the head's command line that the
operator builds (``plan.builders.serve_command``) for specs the CRD accepts, generated from the
CRD's own bounds, is parsed by the runtime's own parser (``moe_runtime.cli.build_parser``)
into exactly what the operator meant, field by field. A flag renamed on one side only fails
here."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pydantic
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from moe_contract import serve
from moe_operator.api import crd
from moe_operator.api import spec as spec_
from moe_operator.plan import builders
from moe_runtime import cli

#: The spec's schema as the API server enforces it (the generated CRD).
SCHEMA: dict[str, Any] = yaml.safe_load(crd.render_crd())["spec"]["versions"][0]["schema"][
    "openAPIV3Schema"
]["properties"]["spec"]


def node(path: str) -> dict[str, Any]:
    """The schema of ``spec.<path>`` (dotted, camelCase)."""
    out = SCHEMA
    for part in path.split("."):
        out = out["properties"][part]
    return out


def integers(path: str) -> st.SearchStrategy[int]:
    bounds = node(path)
    return st.integers(min_value=bounds.get("minimum", 0), max_value=bounds.get("maximum"))


def text(path: str) -> st.SearchStrategy[str]:
    bounds = node(path)
    return st.text(
        # what a JSON string in the API can hold and an exec argv can carry
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
        min_size=bounds.get("minLength", 0),
        max_size=min(bounds.get("maxLength", 40), 40),
    )


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    """A MoEDeployment spec: every field the head's command line depends on, within the
    CRD's bounds (the size bounds consistent, as its CEL rules ask); the rest left out."""
    top = node("dataParallelSize")["maximum"]
    low, size, high = sorted(draw(st.lists(st.integers(1, top), min_size=3, max_size=3)))
    spec: dict[str, Any] = {
        "model": {"source": draw(text("model.source"))},
        "dataParallelSize": size,
        "minDataParallelSize": low,
        "maxDataParallelSize": high,
        "maxQueuedRequests": draw(integers("maxQueuedRequests")),
        "expertParallel": {
            "numRedundantExperts": draw(integers("expertParallel.numRedundantExperts")),
            "eplb": {
                "enabled": draw(st.booleans()),
                "windowSize": draw(integers("expertParallel.eplb.windowSize")),
                "stepInterval": draw(integers("expertParallel.eplb.stepInterval")),
            },
        },
        "elastic": {
            "drainTimeoutSeconds": draw(integers("elastic.drainTimeoutSeconds")),
            "warmSpareRanks": draw(
                st.integers(0, min(high, node("elastic.warmSpareRanks")["maximum"]))
            ),
        },
        "ray": {"accelerator": draw(st.sampled_from(node("ray.accelerator")["enum"]))},
        "tensorParallelSize": draw(integers("tensorParallelSize")),
        "pipelineParallelSize": draw(integers("pipelineParallelSize")),
    }
    if draw(st.booleans()):
        spec["model"]["servedModelName"] = draw(text("model.servedModelName"))
    if draw(st.booleans()):
        spec["model"]["dtype"] = draw(st.sampled_from(node("model.dtype")["enum"]))
    if draw(st.booleans()):
        spec["model"]["source"] = "synthetic://" + spec["model"]["source"]
    if draw(st.booleans()):
        spec["pipelineMicroBatchTokens"] = draw(integers("pipelineMicroBatchTokens"))
    if draw(st.booleans()):
        spec["pipelineInterleave"] = draw(st.booleans())
    if draw(st.booleans()):
        spec["expertLayout"] = draw(st.sampled_from(node("expertLayout")["enum"]))
    if draw(st.booleans()):
        spec["expertParallel"]["maxExpertsPerRank"] = draw(
            integers("expertParallel.maxExpertsPerRank")
        )
    return spec


def parse(argv: list[str]) -> argparse.Namespace:
    """The runtime's own parser on a command line that starts with ``moe-runtime``."""
    assert argv[:2] == list(serve.COMMAND)
    return cli.build_parser().parse_args(argv[1:])


def assert_parses_as_meant(args: serve.ServeArgs) -> None:
    parsed = parse(args.argv())
    assert parsed.command == "serve"
    for field in dataclasses.fields(serve.ServeArgs):
        assert getattr(parsed, field.name) == getattr(args, field.name), field.name


@settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(raw=specs(), owner=st.from_regex(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", fullmatch=True))
def test_the_operators_command_line_parses_with_the_runtimes_parser(
    raw: dict[str, Any], owner: str
) -> None:
    try:
        spec = spec_.MoEDeploymentSpec.model_validate(raw)
    except pydantic.ValidationError:
        assume(False)  # the CRD refuses it too (the model is the CRD's source)
        raise
    args = builders.serve_args(owner_name=owner, spec=spec)
    assert builders.serve_command(owner_name=owner, spec=spec) == args.argv()
    assert_parses_as_meant(args)
    parsed = parse(args.argv())
    assert (parsed.tensor_parallel_size, parsed.pipeline_parallel_size) == (
        spec.tensor_parallel_size,
        spec.pipeline_parallel_size,
    )
    # and what the head starts at when a resize left another size (head_size)
    assert_parses_as_meant(
        builders.serve_args(owner_name=owner, spec=spec, size=spec.min_data_parallel_size)
    )


SAMPLE = spec_.MoEDeploymentSpec.model_validate(
    {"model": {"source": "synthetic://tiny?seed=0"}, "dataParallelSize": 2}
)


@pytest.mark.parametrize(
    "flag",
    [f for f in vars(serve).values() if isinstance(f, str) and f.startswith("--")],
)
def test_a_flag_renamed_on_one_side_only_is_caught(flag: str) -> None:
    """The check above is not vacuous: the operator's line with one flag spelt otherwise (as
    if one side renamed it) is refused, or read as something else, by the runtime's parser."""
    args = dataclasses.replace(
        builders.serve_args(owner_name="tiny", spec=SAMPLE),
        max_experts_per_rank=4,
        warm_spare_ranks=1,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        pipeline_micro_batch_tokens=64,
        pipeline_interleave=True,
        expert_layout="mesh",
        shutdown_timeout=5.0,
    )
    renamed = [
        a.replace(flag, flag + "-renamed", 1) if a == flag or a.startswith(flag + "=") else a
        for a in args.argv()
    ]
    renamed = [serve.negated(flag) + "-renamed" if a == serve.negated(flag) else a for a in renamed]
    assert renamed != args.argv(), flag
    with pytest.raises((SystemExit, AssertionError)):
        parsed = parse(renamed)
        for field in dataclasses.fields(serve.ServeArgs):
            assert getattr(parsed, field.name) == getattr(args, field.name), field.name


def test_a_value_that_starts_with_a_dash_stays_a_value() -> None:
    spec = SAMPLE.model_copy(
        update={"model": SAMPLE.model.model_copy(update={"served_model_name": "-x"})}
    )
    args = builders.serve_args(owner_name="tiny", spec=spec)
    assert "--served-model-name=-x" in args.argv()
    assert parse(args.argv()).served_model_name == "-x"
