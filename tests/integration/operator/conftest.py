"""Fixtures of the operator integration tests: the operator as a real process running with the
least-privilege RBAC of ``manifests/``, a fresh namespace per test (helpers:
tests/support/operator_ops.py)."""

from __future__ import annotations

import pathlib
import uuid
from collections.abc import Iterator

import pytest

from e2e.controlplane import cluster
from tests.support import operator_ops as ops

pytestmark = pytest.mark.controlplane


@pytest.fixture(scope="package")
def operator(
    control_plane: cluster.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ops.OperatorProcess]:
    """The operator, running as its service account, for this package's tests (stopped before
    other tiers start theirs: two cluster-wide operators would both reconcile)."""
    directory = pathlib.Path(tmp_path_factory.mktemp("operator"))
    process = ops.OperatorProcess(
        plane=control_plane,
        kubeconfig=ops.operator_kubeconfig(control_plane, directory),
        log_path=directory / "operator.log",
        # the fake runtime is reached by the runtime-url annotation (local development), or,
        # with several RayClusters (a rollout), by each one's local-endpoint annotation
        env={"MOE_ALLOW_RUNTIME_URL_OVERRIDE": "1", "MOE_RUNTIME_URL_FROM_RAYCLUSTER": "1"},
        args=["--metrics", f"127.0.0.1:{ops.free_port()}"],
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def namespace(control_plane: cluster.ControlPlane) -> str:
    """A fresh namespace per test (never deleted: there is no namespace controller)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    control_plane.kubectl("create", "namespace", name)
    return name
