"""Fixtures of the operator integration tests: the operator as a real process running with the
least-privilege RBAC of ``manifests/``, a fresh namespace per test, and polling helpers."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from e2e.controlplane import cluster

REPO = pathlib.Path(__file__).resolve().parents[3]
SAMPLE = REPO / "manifests" / "samples" / "moedeployment.yaml"
OPERATOR_NAMESPACE = "elastic-moe-system"
OPERATOR_SA = "moe-operator"

T = TypeVar("T")

pytestmark = pytest.mark.controlplane


def wait_for(
    probe: Callable[[], T | None],
    *,
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str = "condition",
) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


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


@dataclasses.dataclass
class OperatorProcess:
    """``moe-operator run`` as a child process; restartable."""

    plane: cluster.ControlPlane
    kubeconfig: pathlib.Path
    log_path: pathlib.Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "MOE_RESYNC_SECONDS": "3600",
            "PYTHONUNBUFFERED": "1",
        }
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start {self.starts} =====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moe_operator.cli", "run", "--verbose"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        wait_for(self._watching, timeout=60, what="the operator to start watching")

    def _watching(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.log_tail()}")
        text = self.log_text()
        # kopf logs this once its watch streams are up.
        return "Starting the watch-stream for moedeployments" in text.rsplit("===== start", 1)[-1]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def current_log(self) -> str:
        """The log of the current run only."""
        return self.log_text().rsplit("===== start", 1)[-1]

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def operator_kubeconfig(plane: cluster.ControlPlane, directory: pathlib.Path) -> pathlib.Path:
    """Install the manifests' namespace + RBAC and return a kubeconfig for the operator's own
    service account, so the tests prove the ClusterRole is sufficient."""
    plane.kubectl(
        "apply",
        "--server-side",
        "-f",
        str(REPO / "manifests" / "namespace.yaml"),
        "-f",
        str(REPO / "manifests" / "rbac.yaml"),
    )
    token = plane.kubectl(
        "create", "token", OPERATOR_SA, "-n", OPERATOR_NAMESPACE, "--duration=2h"
    ).stdout.strip()
    return plane.write_kubeconfig(
        directory / "operator.kubeconfig", token=token, user=f"{OPERATOR_NAMESPACE}:{OPERATOR_SA}"
    )


@pytest.fixture(scope="session")
def operator(
    control_plane: cluster.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator, running as its service account, for the whole session."""
    directory = pathlib.Path(tmp_path_factory.mktemp("operator"))
    process = OperatorProcess(
        plane=control_plane,
        kubeconfig=operator_kubeconfig(control_plane, directory),
        log_path=directory / "operator.log",
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
