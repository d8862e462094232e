"""Fixtures shared by every test tier (tests/ and e2e/): one local control plane (etcd +
kube-apiserver) per pytest session, started only when a test asks for it."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

# Helpers of the tests (fakes, deployments, oracles) assert too: their failures get pytest's
# detailed messages.
pytest.register_assert_rewrite("tests.support")

from e2e.controlplane import cluster  # noqa: E402


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ControlPlane]:
    """A running control plane with the RayCluster and MoEDeployment CRDs installed.

    Yields a :class:`e2e.controlplane.cluster.ControlPlane`: ``.kubeconfig`` (path),
    ``.admin_token``, ``.server``, ``.env()`` and ``.kubectl(*args, input=..., check=...)``.
    Stopped (and its etcd data removed) at the end of the session.
    """
    state_dir = pathlib.Path(tmp_path_factory.mktemp("controlplane"))
    plane = cluster.start(state_dir=state_dir)
    try:
        yield plane
    finally:
        plane.stop()
