"""Fixtures of the real-node tier: one node per pytest session (reused when `make cluster-up`
already started one, and then left running), a namespace that enforces Pod Security
`restricted`, and the sample MoEDeployment applied there with kubectl."""

from __future__ import annotations

import fcntl
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


#: Run the tier against another cluster (e.g. kind, see e2e/kind) instead of the local node.
EXTERNAL_KUBECONFIG = os.environ.get("MOE_E2E_KUBECONFIG")


@pytest.fixture(scope="session")
def node() -> Iterator[kube.Kubectl]:
    """The cluster the tier runs on: the local node (started or reused), or the cluster of
    ``$MOE_E2E_KUBECONFIG`` (its KubeRay and our operator installed beforehand).

    One pytest session at a time uses the local node (a lock: two would share its 2 cores and
    its one operator); the next one waits.
    """
    if EXTERNAL_KUBECONFIG:
        yield kube.ExternalCluster(EXTERNAL_KUBECONFIG)
        return
    if os.geteuid() != 0:
        pytest.skip("the real-node tier needs root (network namespace, kubelet, containerd)")
    lock_path = config.cache_dir() / "node.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _local_node()


def _local_node() -> Iterator[stack.Node]:
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
def namespace(node: kube.Kubectl) -> Iterator[str]:
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
def port_forward(node: kube.Kubectl, namespace: str) -> Iterator[kube.PortForward]:
    name = str(sample()["metadata"]["name"])  # type: ignore[index]
    forward = kube.PortForward(node, namespace=namespace, target=f"svc/{name}-api", port=8000)
    yield forward
    forward.stop()


#: The first real-node test also pays for starting the node (importing a 6 GB runtime image
#: into containerd takes minutes on a busy 2-core machine): its limit covers that too.
NODE_START_TIMEOUT_S = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give the first test of this tier the node's start-up on top of its own limit."""
    first = next((item for item in items if "e2e/cluster/" in item.nodeid), None)
    if first is not None and first.get_closest_marker("timeout") is None:
        first.add_marker(pytest.mark.timeout(NODE_START_TIMEOUT_S))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.stash[_FAILED] = report.failed


_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _diagnose_failures(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a failed test of this tier: what the cluster looked like (objects, the last
    lines of the operator's and the head's logs), so a CI failure can be read."""
    yield
    if not request.node.stash.get(_FAILED, False) or "node" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("node")
    ns = request.getfixturevalue("namespace") if "namespace" in request.fixturenames else NAMESPACE
    diagnose(cluster, ns)


def diagnose(cluster: kube.Kubectl, ns: str, *, head_lines: int = 60) -> None:
    """Print the deployment's objects and the last lines of the operator's and head's logs."""
    sections = [
        ("objects", ["get", "moed,raycluster,pods,events", "-n", ns, "-o", "wide"]),
        ("operator log", ["logs", "-n", config.OPERATOR_NAMESPACE, "deploy/moe-operator",
                          "--tail=40"]),
        ("head log", ["logs", "-n", ns, "-l", "ray.io/node-type=head", f"--tail={head_lines}"]),
    ]  # fmt: skip
    for title, args in sections:
        done = cluster.kubectl(*args, check=False)
        print(f"\n----- {title} -----\n{done.stdout}{done.stderr}")
