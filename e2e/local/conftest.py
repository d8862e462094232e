"""Fixtures of the local end-to-end tier: the session control plane and the KubeRay stand-in."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from e2e.controlplane import cluster
from e2e.local import kuberay

T = TypeVar("T")


def wait_for(
    check: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.2,
) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what`` past the deadline."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)  # poll interval; the deadline above bounds the wait
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")


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
