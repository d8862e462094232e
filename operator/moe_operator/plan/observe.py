"""What the operator sees of the world, parsed from API objects into small value objects."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RayClusterObservation:
    """The parts of a RayCluster's spec and status the operator decides on."""

    worker_replicas: int
    ready_workers: int
    head_ready: bool
    state: str | None = None


@dataclasses.dataclass(frozen=True)
class RuntimeObservation:
    """The runtime's own view (``GET /elastic_ep/status``); absent until a runtime answers."""

    data_parallel_size: int
    target_data_parallel_size: int
    stage: str | None = None
    balancedness: float | None = None


@dataclasses.dataclass(frozen=True)
class Observed:
    """Everything observed before planning one reconcile."""

    raycluster: RayClusterObservation | None = None
    secret_exists: bool = False
    service_exists: bool = False
    runtime: RuntimeObservation | None = None


def _condition_true(conditions: Any, type_: str) -> bool:
    for cond in conditions or ():
        if isinstance(cond, dict) and cond.get("type") == type_:
            return cond.get("status") == "True"
    return False


def raycluster(obj: dict[str, Any] | None) -> RayClusterObservation | None:
    """Parse a RayCluster object (``None`` when it does not exist)."""
    if obj is None:
        return None
    groups = (obj.get("spec") or {}).get("workerGroupSpecs") or []
    replicas = sum(int(g.get("replicas") or 0) for g in groups if isinstance(g, dict))
    status = obj.get("status") or {}
    head_ready = _condition_true(status.get("conditions"), "HeadPodReady") or (
        status.get("state") == "ready"
    )
    return RayClusterObservation(
        worker_replicas=replicas,
        ready_workers=int(status.get("readyWorkerReplicas") or 0),
        head_ready=head_ready,
        state=status.get("state"),
    )


def runtime(payload: dict[str, Any] | None) -> RuntimeObservation | None:
    """Parse the runtime's ``/elastic_ep/status`` answer."""
    if payload is None:
        return None
    eplb = payload.get("eplb") or {}
    return RuntimeObservation(
        data_parallel_size=int(payload["data_parallel_size"]),
        target_data_parallel_size=int(
            payload.get("target_data_parallel_size", payload["data_parallel_size"])
        ),
        stage=payload.get("stage"),
        balancedness=eplb.get("balancedness"),
    )
