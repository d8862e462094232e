"""Helpers of the operator's integration tests (real kube-apiserver, the operator as a real
process): where the sample lives, ``kubectl get -o json``, polling with a deadline, the
operator process and its metrics address. The fixtures are in tests/integration/operator."""

from __future__ import annotations

import json
import pathlib
import socket
from typing import Any

from e2e import operator_proc
from e2e.controlplane import cluster

REPO = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = REPO / "manifests" / "samples" / "moedeployment.yaml"
OPERATOR_NAMESPACE = operator_proc.OPERATOR_NAMESPACE
OPERATOR_SA = operator_proc.OPERATOR_SA

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def metrics_url(process: OperatorProcess) -> str:
    """Where the operator process serves ``/metrics`` (its ``--metrics`` address)."""
    return f"http://{process.args[process.args.index('--metrics') + 1]}/metrics"
