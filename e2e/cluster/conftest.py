"""Fixtures of the real-node tier: one node per pytest session (reused when `make cluster-up`
already started one, and then left running), a namespace that enforces Pod Security
`restricted`, and the sample MoEDeployment applied there with kubectl."""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Iterator

import pytest
import yaml

from e2e import kube
from e2e import load as load_mod
from e2e.node import config, install, lifecycle, stack

REPO = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = REPO / "manifests" / "samples" / "moedeployment.yaml"
NAMESPACE = "moe-e2e"
RESTRICTED = {
    f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "audit", "warn")
}

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="session")
def node() -> Iterator[stack.Node]:
    if os.geteuid() != 0:
        pytest.skip("the real-node tier needs root (network namespace, kubelet, containerd)")
    state = REPO / ".cluster"
    already = stack.attach(config.Paths(state=state.resolve()))
    reused = already is not None and stack.healthy(already)
    started = time.monotonic()
    up = lifecycle.up(state)
    if not reused:
        print(f"\n[cluster] node up in {time.monotonic() - started:.0f}s")
    try:
        yield up
    finally:
        if not reused and os.environ.get("MOE_KEEP_CLUSTER") != "1":
            lifecycle.down(state)


@pytest.fixture(scope="module")
def namespace(node: stack.Node) -> Iterator[str]:
    """A fresh namespace enforcing Pod Security `restricted` for each test module."""
    node.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", timeout=180)
    install.ensure_namespace(node, NAMESPACE, labels=RESTRICTED)
    yield NAMESPACE
    node.kubectl(
        "delete", "moed", "--all", "-n", NAMESPACE, "--wait=true", check=False, timeout=180
    )


def sample() -> dict[str, object]:
    obj: dict[str, object] = yaml.safe_load(SAMPLE.read_text())
    return obj


def sample_model() -> str:
    spec = sample()["spec"]
    assert isinstance(spec, dict)
    return str(spec["model"]["source"])


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, int, int | None], list[int]]:
    return load_mod.reference_tokens(sample_model())


@pytest.fixture(scope="module")
def port_forward(node: stack.Node, namespace: str) -> Iterator[kube.PortForward]:
    name = str(sample()["metadata"]["name"])  # type: ignore[index]
    forward = kube.PortForward(node, namespace=namespace, target=f"svc/{name}-api", port=8000)
    yield forward
    forward.stop()
