"""Fixtures of the real-node tier: one node per pytest session (reused when `make cluster-up`
already started one, and then left running), a namespace that enforces Pod Security
`restricted`, and the sample MoEDeployment applied there with kubectl."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

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


def manifest(name: str, model: dict[str, str], **spec: object) -> dict[str, Any]:
    """The sample MoEDeployment renamed ``name``, serving ``model`` (``spec.model``), without
    autoscaling, with ``spec`` set on top (camelCase keys)."""
    doc: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["model"] = model
    doc["spec"].pop("autoscaling", None)
    doc["spec"].update(spec)
    return doc


def service_url(
    node: kube.Kubectl, namespace: str, name: str
) -> Iterator[Callable[[], str | None]]:
    """The body of a module's ``endpoint`` fixture: the URL of deployment ``name``'s runtime
    from here, its ClusterIP (the node routes the Service range here), or a port-forward on
    another cluster (``$MOE_E2E_KUBECONFIG``)."""
    if EXTERNAL_KUBECONFIG:
        forward = kube.PortForward(node, namespace=namespace, target=f"svc/{name}-api", port=8000)
        yield forward.url
        forward.stop()
        return
    yield kube.ServiceUrl(node, namespace=namespace, name=f"{name}-api", port=8000).url


def apply(
    node: kube.Kubectl,
    namespace: str,
    doc: dict[str, Any],
    *,
    endpoint: Callable[[], str | None],
    ready: Callable[[kube.Deployment], object],
    what: str,
    timeout_s: float,
    tag: str,
) -> kube.Deployment:
    """``kubectl apply`` of ``doc`` and the deployment once ``ready`` (polled) is truthy."""
    started = time.monotonic()
    node.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    name = str(doc["metadata"]["name"])
    d = kube.Deployment(cluster=node, name=name, namespace=namespace, endpoint=endpoint)
    kube.wait_for(lambda: ready(d), timeout_s=timeout_s, what=what)
    print(f"\n[{tag}] kubectl apply -> {what}: {time.monotonic() - started:.1f}s")
    return d


@contextlib.contextmanager
def model_load(
    dep: kube.Deployment, *, model: str, lengths: tuple[int, ...], tag: str
) -> Iterator[load_mod.Load]:
    """Four checked clients (greedy, seeded, streamed) on ``dep``, every answer compared with
    single-process generation of ``model``; running once the first answers came back."""
    reference = load_mod.reference_tokens(model, load_mod.cases(lengths=lengths, seeds=(1,)))
    with load_mod.Load(
        dep.endpoint, model_name=dep.name, reference=reference, clients=4, lengths=lengths,
        seeds=(1,),
    ) as lg:  # fmt: skip
        try:
            kube.wait_for(lambda: lg.ok >= 4 or lg.failed, timeout_s=180, what="first answers")
            yield lg
        finally:
            print(f"\n[{tag}] {lg.summary()}")
            for failure in lg.failures[:10]:
                print(f"[{tag}] failure: {failure}")
