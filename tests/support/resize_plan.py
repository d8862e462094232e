"""The resize planner's inputs, built small (pure; no cluster, no runtime): specs, the
RayCluster, the runtime's records and view as the operator observes them, and a ``Plan``
that reads one reconcile's actions."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import actions, observe, resize

Stage = status_.Stage
Phase = status_.Phase
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
T0_TEXT = "2026-01-01T00:00:00Z"
LATER = T0 + datetime.timedelta(seconds=30)
PODS = ("tiny-ranks-worker-a", "tiny-ranks-worker-b", "tiny-ranks-worker-c", "tiny-ranks-worker-d")


def spec(dp: int, *, timeout: int = 600, tp: int = 1) -> spec_.MoEDeploymentSpec:
    return spec_.MoEDeploymentSpec.model_validate(
        {
            "model": {"source": "synthetic://tiny"},
            "dataParallelSize": dp,
            "maxDataParallelSize": 4,
            "tensorParallelSize": tp,
            "elastic": {"resizeTimeoutSeconds": timeout},
        }
    )


def ray(
    replicas: int, ready: int | None = None, *, delete: tuple[str, ...] = ()
) -> observe.RayClusterObservation:
    return observe.RayClusterObservation(
        worker_replicas=replicas,
        ready_workers=replicas if ready is None else ready,
        head_ready=True,
        workers_to_delete=delete,
    )


def record(
    frm: int,
    to: int,
    stage: str,
    *,
    rid: str = "r1",
    stages: tuple[tuple[str, float | None], ...] = (),
    freed: tuple[str, ...] = (),
    message: str = "",
    started: float | None = None,
) -> observe.RuntimeResize:
    return observe.RuntimeResize(
        resize_id=rid,
        from_size=frm,
        to_size=to,
        stage=stage,
        message=message,
        started_at=started if started is not None else T0.timestamp(),
        stage_started_at=T0.timestamp() + 5,
        stages=stages,
        freed_pods=freed,
    )


def runtime(
    dp: int, last: observe.RuntimeResize | None = None, *, pods: tuple[str, ...] | None = None
) -> observe.RuntimeObservation:
    history = (last,) if last is not None and last.done else ()
    return observe.RuntimeObservation(
        data_parallel_size=dp,
        target_data_parallel_size=last.to_size if last is not None and not last.done else dp,
        stage=last.stage if last is not None else "Idle",
        resize=last,
        history=history,
        active_pods=pods if pods is not None else PODS[:dp],
    )


def observed(
    *,
    raycluster: observe.RayClusterObservation | None,
    rt: observe.RuntimeObservation | None,
    generation: int = 1,
    now: datetime.datetime = LATER,
    pods: tuple[str, ...] | None = None,
) -> observe.Observed:
    return observe.Observed(
        raycluster=raycluster,
        secret_exists=True,
        service_exists=True,
        runtime=rt,
        worker_pods=pods
        if pods is not None
        else PODS[: raycluster.worker_replicas if raycluster else 0],
        generation=generation,
        now=now,
    )


def serving(dp: int, r: status_.ResizeStatus | None = None) -> status_.MoEDeploymentStatus:
    phase = Phase.RESIZING if r is not None and r.active else Phase.SERVING
    return status_.MoEDeploymentStatus(phase=phase, data_parallel_size=dp, resize=r)


def active(
    frm: int,
    to: int,
    stage: Stage,
    *,
    rid: str | None = None,
    generation: int = 1,
    started: str = T0_TEXT,
    **extra: Any,
) -> status_.ResizeStatus:
    return status_.ResizeStatus(
        from_size=frm,
        to_size=to,
        stage=stage,
        started_at=started,
        stage_started_at=started,
        resize_id=rid,
        generation=generation,
        **extra,
    )


@dataclasses.dataclass
class Plan:
    actions: list[actions.Action]

    def one(self, kind: type[Any]) -> Any:
        found = [a for a in self.actions if isinstance(a, kind)]
        assert len(found) == 1, (kind, self.actions)
        return found[0]

    @property
    def raycluster(self) -> actions.ApplyRayCluster:
        result: actions.ApplyRayCluster = self.one(actions.ApplyRayCluster)
        return result

    @property
    def resize(self) -> status_.ResizeStatus:
        r = self.one(actions.SetResize).resize
        assert r is not None
        return r  # type: ignore[no-any-return]

    @property
    def scale(self) -> int | None:
        found = [a.new_size for a in self.actions if isinstance(a, actions.ScaleRuntime)]
        assert len(found) <= 1
        return found[0] if found else None

    @property
    def phase(self) -> actions.SetPhase:
        last = self.actions[-1]
        assert isinstance(last, actions.SetPhase)
        return last

    @property
    def events(self) -> list[str]:
        return [a.reason for a in self.actions if isinstance(a, actions.Event)]

    @property
    def requeue(self) -> bool:
        return any(isinstance(a, actions.Requeue) for a in self.actions)


def plan(
    target: int, status: status_.MoEDeploymentStatus, obs: observe.Observed, **kw: Any
) -> Plan:
    return Plan(resize.plan_resize(spec(target, **kw), status, obs))
