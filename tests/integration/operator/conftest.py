"""Fixtures of the operator integration tests: the operator as a real process running with the
least-privilege RBAC of ``manifests/``, a fresh namespace per test, and polling helpers."""

from __future__ import annotations

import json
import pathlib
import socket
import uuid
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest

from e2e import operator_proc
from e2e.controlplane import cluster

REPO = pathlib.Path(__file__).resolve().parents[3]
SAMPLE = REPO / "manifests" / "samples" / "moedeployment.yaml"
OPERATOR_NAMESPACE = operator_proc.OPERATOR_NAMESPACE
OPERATOR_SA = operator_proc.OPERATOR_SA

T = TypeVar("T")

pytestmark = pytest.mark.controlplane


wait_for = operator_proc.wait_for
OperatorProcess = operator_proc.OperatorProcess
operator_kubeconfig = operator_proc.operator_kubeconfig


def get_json(
    plane: cluster.ControlPlane, *args: str, namespace: str | None = None
) -> dict[str, Any] | None:
    """``kubectl get ... -o json`` or ``None`` when not found."""
    ns = ["-n", namespace] if namespace else []
    done = plane.kubectl("get", *args, *ns, "-o", "json", check=False)
    if done.returncode != 0:
        if "NotFound" in done.stderr or "not found" in done.stderr:
            return None
        raise AssertionError(done.stderr)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.fixture(scope="package")
def operator(
    control_plane: cluster.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator, running as its service account, for this package's tests (stopped before
    other tiers start theirs: two cluster-wide operators would both reconcile)."""
    directory = pathlib.Path(tmp_path_factory.mktemp("operator"))
    process = OperatorProcess(
        plane=control_plane,
        kubeconfig=operator_kubeconfig(control_plane, directory),
        log_path=directory / "operator.log",
        # the fake runtime is reached by the runtime-url annotation (local development)
        env={"MOE_ALLOW_RUNTIME_URL_OVERRIDE": "1"},
        args=["--metrics", f"127.0.0.1:{_free_port()}"],
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def metrics_url(process: OperatorProcess) -> str:
    """Where the operator process serves ``/metrics`` (its ``--metrics`` address)."""
    return f"http://{process.args[process.args.index('--metrics') + 1]}/metrics"


@pytest.fixture
def namespace(control_plane: cluster.ControlPlane) -> str:
    """A fresh namespace per test (never deleted: there is no namespace controller)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    control_plane.kubectl("create", "namespace", name)
    return name
