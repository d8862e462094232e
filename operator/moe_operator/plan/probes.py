"""The probes of the Ray containers (pure): the head's startup, readiness and liveness on the
runtime's routes, the workers' on their raylet."""

from __future__ import annotations

from typing import Any, Final

from moe_contract import names
from moe_operator.api import spec as spec_

#: Period of the head's startup probe; ``model.loadTimeoutSeconds`` sets how many it may fail.
#: Short: the head is Ready (and the deployment Serving) at the first probe after its load
#: (the kubelet then runs the readiness probe at once); at 10 s a start waited 5 s on average
#: for it. A probe of the loading server is a 503 from memory (docs/MODELS-ON-CLAIMS.md).
STARTUP_PERIOD_SECONDS: Final = 2
#: The raylet's health check, served by Ray's dashboard agent on every node (KubeRay passes
#: ``--dashboard-agent-listen-port=52365``): 200 "success", or 503 when the raylet is down.
RAYLET_HEALTH_PATH: Final = "/api/local_raylet_healthz"
DASHBOARD_AGENT_PORT: Final = 52365
#: A worker's readiness probe: its first check 1 s after start, then every 2 s. KubeRay's own
#: (injected when a container has none) waits 10 s first: every grow without warm spares
#: waited that long for its new pods.
WORKER_READY_DELAY_SECONDS: Final = 1
WORKER_READY_PERIOD_SECONDS: Final = 2


def http_probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": names.RUNTIME_PORT},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def worker_probes() -> dict[str, Any]:
    """Readiness and liveness of a worker: its raylet answers (what KubeRay's injected probes
    check, with a wget in the container; an httpGet needs no process in it). Readiness is
    checked at once and often (see WORKER_READY_DELAY_SECONDS); liveness keeps KubeRay's
    defaults (30 s first, every 5 s, 120 failures)."""
    check = {"path": RAYLET_HEALTH_PATH, "port": DASHBOARD_AGENT_PORT}
    return {
        "readinessProbe": {
            "httpGet": dict(check),
            "initialDelaySeconds": WORKER_READY_DELAY_SECONDS,
            "periodSeconds": WORKER_READY_PERIOD_SECONDS,
            "timeoutSeconds": 2,
            "failureThreshold": 10,
        },
        "livenessProbe": {
            "httpGet": dict(check),
            "initialDelaySeconds": 30,
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 120,
        },
    }


def head_probes(spec: spec_.MoEDeploymentSpec) -> dict[str, Any]:
    """Startup allows ``model.loadTimeoutSeconds`` to load the model (the server answers only
    once it serves); then liveness is the process and its loop, readiness that it serves."""
    startup_failures = -(-spec.model.load_timeout_seconds // STARTUP_PERIOD_SECONDS)
    return {
        "startupProbe": http_probe(
            names.HEALTH_PATH, period=STARTUP_PERIOD_SECONDS, failures=startup_failures
        ),
        "readinessProbe": http_probe(names.READY_PATH, period=5, failures=3),
        "livenessProbe": http_probe(names.HEALTH_PATH, period=10, failures=6),
    }
