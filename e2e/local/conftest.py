"""Fixtures of the local end-to-end tier: the session control plane and the KubeRay stand-in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.controlplane import cluster
from e2e.local import kuberay


@pytest.fixture(scope="module")
def kuberay_namespace(control_plane: cluster.ControlPlane) -> str:
    """A namespace of its own for each module that runs the stand-in."""
    name = "e2e-kuberay"
    done = control_plane.kubectl("get", "namespace", name, check=False)
    if done.returncode != 0:
        control_plane.kubectl("create", "namespace", name)
    return name


@pytest.fixture(scope="module")
def local_kuberay(
    control_plane: cluster.ControlPlane,
    kuberay_namespace: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[kuberay.LocalKubeRay]:
    """The KubeRay stand-in watching ``kuberay_namespace``; stopped after the module, and then no
    process it started may be left."""
    workdir = Path(tmp_path_factory.mktemp("local-kuberay"))
    stand_in = kuberay.LocalKubeRay(
        control_plane.kubeconfig, namespace=kuberay_namespace, workdir=workdir
    )
    stand_in.start()
    try:
        yield stand_in
    finally:
        stand_in.stop()
    assert stand_in.leftover_pids() == [], "LocalKubeRay.stop() left processes behind"
