"""`moe-operator run` as a child process (restartable), for the tests, the e2e tier and the demo.

The operator runs as its own service account with the least-privilege RBAC of `manifests/`
(`operator_kubeconfig` installs it and mints a token), so every run proves the ClusterRole is
enough.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from e2e.controlplane import cluster

REPO = pathlib.Path(__file__).resolve().parents[1]
OPERATOR_NAMESPACE = "elastic-moe-system"
OPERATOR_SA = "moe-operator"

T = TypeVar("T")


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


@dataclasses.dataclass
class OperatorProcess:
    """``moe-operator run`` as a child process; restartable. ``env`` adds to the environment,
    ``args`` to the command line (e.g. ``["--namespace", "demo"]``)."""

    plane: cluster.ControlPlane
    kubeconfig: pathlib.Path
    log_path: pathlib.Path
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    args: list[str] = dataclasses.field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "MOE_RESYNC_SECONDS": "3600",
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start {self.starts} =====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moe_operator.cli", "run", "--verbose", *self.args],
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
        # kopf logs this once its watch streams are up.
        return "Starting the watch-stream for moedeployments" in self.current_log()

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

    def kill(self) -> None:
        """SIGKILL: the operator dies without any chance to clean up (a crash, an OOM kill)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def operator_kubeconfig(plane: cluster.ControlPlane, directory: pathlib.Path) -> pathlib.Path:
    """Install the manifests' namespace + RBAC and return a kubeconfig for the operator's own
    service account."""
    plane.kubectl(
        "apply",
        "--server-side",
        "-f",
        str(REPO / "manifests" / "base" / "namespace.yaml"),
        "-f",
        str(REPO / "manifests" / "base" / "rbac.yaml"),
    )
    token = plane.kubectl(
        "create", "token", OPERATOR_SA, "-n", OPERATOR_NAMESPACE, "--duration=2h"
    ).stdout.strip()
    return plane.write_kubeconfig(
        directory / "operator.kubeconfig", token=token, user=f"{OPERATOR_NAMESPACE}:{OPERATOR_SA}"
    )
