"""What the operator sees of the world, parsed from API objects into small value objects (the
runtime's ``/elastic_ep/status`` through the contract's model, ``moe_contract.status``)."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Final

from moe_contract import loading, stages
from moe_contract import status as runtime_status
from moe_operator.api import group

#: KubeRay's pod labels.
CLUSTER_LABEL: Final = "ray.io/cluster"
NODE_TYPE_LABEL: Final = "ray.io/node-type"
#: Runtime stages after which a resize record no longer changes.
RUNTIME_DONE: Final = frozenset(s.value for s in stages.TERMINAL)


@dataclasses.dataclass(frozen=True)
class RayClusterObservation:
    """The parts of a RayCluster the operator decides on.

    ``ready_workers`` and ``head_ready`` come from the pods the operator lists itself
    (:func:`pods`): KubeRay v1.5's ``readyWorkerReplicas`` counts terminating pods and its
    ``state`` turns ``ready`` once and never back. Without a pod listing they fall back to
    KubeRay's ``readyWorkerReplicas`` and ``HeadPodReady`` condition.
    """

    worker_replicas: int
    ready_workers: int
    head_ready: bool
    state: str | None = None
    #: ``scaleStrategy.workersToDelete`` as written (KubeRay never clears it: we do).
    workers_to_delete: tuple[str, ...] = ()
    #: The runtime size in the head template (``None``: not ours or not set).
    head_size: int | None = None
    #: Its name, and the template revision its pods are made from (``plan.revision``;
    #: ``None``: made by an operator that did not say).
    name: str | None = None
    revision: str | None = None
    #: The mesh of a DP rank its head serves (its template's annotations; absent: 1).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclasses.dataclass(frozen=True)
class HeadFailure:
    """How the head container last stopped on an error, and what it does now.

    message: its termination message (what ``moe-runtime serve`` wrote to the termination
    log, else the log's last lines: ``FallbackToLogsOnError``), else the kubelet's reason;
    reason: the kubelet's (``Error``, ``OOMKilled``, ...); waiting: why it does not run now
    (``CrashLoopBackOff``), ``None`` when it runs again (a new attempt)."""

    message: str
    reason: str
    exit_code: int | None
    restarts: int
    waiting: str | None = None
    #: It runs again (a new attempt after that stop).
    running: bool = False


@dataclasses.dataclass(frozen=True)
class PodsObservation:
    """The RayCluster's pods, as listed (``ray.io/cluster=NAME``)."""

    #: Worker pods that are neither terminating nor finished, sorted.
    workers: tuple[str, ...] = ()
    #: Of those, the Running ones whose ``Ready`` condition is True.
    ready_workers: tuple[str, ...] = ()
    #: Worker pods that still exist but are on their way out (deleted, or finished).
    leaving: tuple[str, ...] = ()
    #: A head pod is Running, Ready and not terminating (``None``: no head pod listed).
    head_ready: bool | None = None
    #: Restarts of the head pod's containers (a restart takes the runtime and Ray's GCS).
    head_restarts: int | None = None
    #: A head pod exists but has not started yet (Pending: e.g. waiting for its Secret).
    head_pending: bool = False
    #: The head pod's IP while its runtime runs but is not ready (loading the model): the
    #: operator asks it for load progress there (the Service routes only to a ready head).
    head_loading_ip: str | None = None
    #: The head container's last stop on an error while it is not ready (``None``: none).
    head_failure: HeadFailure | None = None
    #: Why the head's container does not run, as the kubelet says (``ErrImagePull``,
    #: ``CrashLoopBackOff``: its waiting reason and message); ``None``: it runs, or no head.
    head_waiting: str | None = None


@dataclasses.dataclass(frozen=True)
class LostRank:
    """A rank the runtime found dead or hung (and fenced)."""

    pod: str | None
    reason: str


@dataclasses.dataclass(frozen=True)
class RuntimeResize:
    """One resize record of the runtime (``resize`` / ``history`` of ``/elastic_ep/status``)."""

    resize_id: str
    from_size: int
    to_size: int
    stage: str
    message: str = ""
    started_at: float | None = None
    stage_started_at: float | None = None
    #: Stages entered, in order, with their duration in seconds (``None``: still running).
    stages: tuple[tuple[str, float | None], ...] = ()
    #: Worker pods the runtime released (a scale-down's ``freed`` entries).
    freed_pods: tuple[str, ...] = ()
    #: ``resize`` (asked for) or ``recovery`` (the runtime shrank around lost ranks by itself).
    kind: str = runtime_status.KIND_RESIZE
    #: Of a recovery: the lost ranks' pods and what happened to them, and its figures.
    lost: tuple[LostRank, ...] = ()
    recovery_s: float | None = None
    requests_rerun: int = 0

    @property
    def done(self) -> bool:
        return self.stage in RUNTIME_DONE

    @property
    def is_recovery(self) -> bool:
        return self.kind == runtime_status.KIND_RECOVERY


@dataclasses.dataclass(frozen=True)
class RuntimeObservation:
    """The runtime's own view (``GET /elastic_ep/status``); absent until a runtime answers."""

    data_parallel_size: int
    target_data_parallel_size: int
    stage: str | None = None
    balancedness: float | None = None
    #: The running resize, else the last one.
    resize: RuntimeResize | None = None
    history: tuple[RuntimeResize, ...] = ()
    #: Pods of the ranks that serve (``None`` when a rank does not say which pod it is on).
    active_pods: tuple[str, ...] | None = None
    #: Ranks lost since the runtime last served at its full size (listed until it is back).
    lost: tuple[LostRank, ...] = ()
    #: Serving ranks whose heartbeat is late (suspected hung, not yet fenced): pod -> state.
    unhealthy: tuple[LostRank, ...] = ()
    #: Whether the runtime has a step path (``GET /ready``), and why not.
    ready: bool | None = None
    ready_reason: str | None = None
    #: Sequences running + queued in the engine (``load.in_flight``; ``None``: an older
    #: runtime that does not say). What the autoscaler decides on.
    in_flight: int | None = None
    #: Warm spare ranks: how many the runtime keeps, the pods they run on (kept by every
    #: shrink), and how many are ready to be taken by a grow.
    warm_spare_ranks: int = 0
    spare_pods: tuple[str, ...] = ()
    spares_ready: int = 0

    @property
    def running(self) -> RuntimeResize | None:
        """The resize the runtime is running now, if any."""
        if self.resize is not None and not self.resize.done:
            return self.resize
        return None

    def find(self, resize_id: str) -> RuntimeResize | None:
        """The record of ``resize_id`` (running or in the history)."""
        if self.resize is not None and self.resize.resize_id == resize_id:
            return self.resize
        return next((r for r in self.history if r.resize_id == resize_id), None)


@dataclasses.dataclass(frozen=True)
class Observed:
    """Everything observed before planning one reconcile."""

    raycluster: RayClusterObservation | None = None
    secret_exists: bool = False
    service_exists: bool = False
    runtime: RuntimeObservation | None = None
    #: Worker pods of the RayCluster that are not being deleted (``None``: not listed).
    worker_pods: tuple[str, ...] | None = None
    #: Worker pods that still exist but are terminating or finished: KubeRay creates no new
    #: worker while one it deleted is still there.
    leaving_pods: tuple[str, ...] = ()
    #: Restarts of the head pod's containers (``None``: no head pod listed).
    head_restarts: int | None = None
    #: See ``PodsObservation``: where to ask a loading head, and how a head that does not
    #: start failed.
    head_loading_ip: str | None = None
    head_failure: HeadFailure | None = None
    #: ``GET /ready`` of a loading head (``None``: not loading, or not asked).
    loading: loading.LoadProgress | None = None
    #: Why the head's container does not run (``PodsObservation.head_waiting``).
    head_waiting: str | None = None
    #: ``metadata.generation`` of the MoEDeployment.
    generation: int = 1
    #: Worker pods kept beside the ranks for warm spares (``spec.elastic.warmSpareRanks``):
    #: the planner counts replicas in ranks; the RayCluster gets that many + these.
    warm_spares: int = 0
    #: The moment of this reconcile (UTC); timeouts are measured against it.
    now: datetime.datetime = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc)
    )


def _condition_true(conditions: Any, type_: str) -> bool:
    for cond in conditions or ():
        if isinstance(cond, dict) and cond.get("type") == type_:
            return cond.get("status") == "True"
    return False


def _head_annotation(spec: dict[str, Any], key: str) -> int | None:
    template = (spec.get("headGroupSpec") or {}).get("template") or {}
    value = ((template.get("metadata") or {}).get("annotations") or {}).get(key)
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _head_size(spec: dict[str, Any]) -> int | None:
    return _head_annotation(spec, group.ANNOTATION_HEAD_SIZE)


def raycluster(
    obj: dict[str, Any] | None, *, pods: PodsObservation | None = None
) -> RayClusterObservation | None:
    """Parse a RayCluster object (``None`` when it does not exist); readiness from ``pods``
    when they were listed."""
    if obj is None:
        return None
    spec = obj.get("spec") or {}
    groups = [g for g in spec.get("workerGroupSpecs") or [] if isinstance(g, dict)]
    replicas = sum(int(g.get("replicas") or 0) for g in groups)
    pending = tuple(
        str(name)
        for g in groups
        for name in ((g.get("scaleStrategy") or {}).get("workersToDelete") or [])
    )
    status = obj.get("status") or {}
    head_ready = _condition_true(status.get("conditions"), "HeadPodReady")
    ready_workers = int(status.get("readyWorkerReplicas") or 0)
    if pods is not None:
        ready_workers = len(pods.ready_workers)
        if pods.head_ready is not None:
            head_ready = pods.head_ready
    return RayClusterObservation(
        worker_replicas=replicas,
        ready_workers=ready_workers,
        head_ready=head_ready,
        state=status.get("state"),
        workers_to_delete=pending,
        head_size=_head_size(spec),
        name=(obj.get("metadata") or {}).get("name"),
        revision=((obj.get("metadata") or {}).get("annotations") or {}).get(group.REVISION),
        tensor_parallel_size=_head_annotation(spec, group.ANNOTATION_TENSOR_PARALLEL_SIZE) or 1,
        pipeline_parallel_size=_head_annotation(spec, group.ANNOTATION_PIPELINE_PARALLEL_SIZE) or 1,
    )


def _leaving(pod: dict[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp")) or (
        (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
    )


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and _condition_true(status.get("conditions"), "Ready")


def head_failure(statuses: list[dict[str, Any]]) -> HeadFailure | None:
    """The head container's last stop on an error (``containerStatuses``: its state when it
    is terminated, else its ``lastState``), ``None`` when it never failed."""
    for status in statuses:
        state = status.get("state") or {}
        stopped = state.get("terminated") or (status.get("lastState") or {}).get("terminated")
        if not stopped or int(stopped.get("exitCode") or 0) == 0:
            continue
        reason = str(stopped.get("reason") or "Error")
        message = " ".join(str(stopped.get("message") or "").split())
        return HeadFailure(
            message=message or f"exit code {stopped.get('exitCode')} ({reason})",
            reason=reason,
            exit_code=stopped.get("exitCode"),
            restarts=int(status.get("restartCount") or 0),
            waiting=(state.get("waiting") or {}).get("reason"),
            running=bool(state.get("running")),
        )
    return None


def _running(statuses: list[dict[str, Any]]) -> bool:
    return bool(statuses) and all((s.get("state") or {}).get("running") for s in statuses)


def pods(listed: list[dict[str, Any]]) -> PodsObservation:
    """The RayCluster's pods (head and workers, by KubeRay's ``ray.io/node-type`` label)."""
    workers, ready, leaving = [], [], []
    head_ready: bool | None = None
    head_restarts: int | None = None
    head_pending = False
    loading_ip: str | None = None
    failure: HeadFailure | None = None
    head_waiting: str | None = None
    for pod in listed:
        meta = pod.get("metadata") or {}
        kind = (meta.get("labels") or {}).get(NODE_TYPE_LABEL)
        if kind == "head":
            now = _ready(pod) and not _leaving(pod)
            head_ready = now or bool(head_ready)
            head_pending = head_pending or (pod.get("status") or {}).get("phase") == "Pending"
            if not _leaving(pod):
                statuses = (pod.get("status") or {}).get("containerStatuses") or []
                head_restarts = sum(int(c.get("restartCount") or 0) for c in statuses)
                if not now:
                    failure = head_failure(statuses)
                    if _running(statuses):
                        loading_ip = (pod.get("status") or {}).get("podIP") or None
                head_waiting = _waiting(statuses) or head_waiting
        elif kind == "worker":
            name = str(meta["name"])
            if _leaving(pod):
                leaving.append(name)
            else:
                workers.append(name)
                if _ready(pod):
                    ready.append(name)
    return PodsObservation(
        workers=tuple(sorted(workers)),
        ready_workers=tuple(sorted(ready)),
        leaving=tuple(sorted(leaving)),
        head_ready=head_ready,
        head_restarts=head_restarts,
        head_pending=head_pending,
        head_loading_ip=loading_ip if not head_ready else None,
        head_failure=failure if not head_ready else None,
        head_waiting=head_waiting,
    )


def _waiting(statuses: list[dict[str, Any]]) -> str | None:
    """The first waiting container's reason and message (``None``: none waits)."""
    for container in statuses:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason and reason != "ContainerCreating":
            message = str(waiting.get("message") or "")[:300]
            return f"{reason}: {message}" if message else str(reason)
    return None


def runtime_resize(record: runtime_status.Resize) -> RuntimeResize:
    """One resize record of the runtime, as the planner reads it."""
    recovery = record.recovery
    return RuntimeResize(
        resize_id=record.resize_id,
        from_size=record.from_size,
        to_size=record.to_size,
        stage=record.stage,
        message=record.message,
        started_at=record.started_at,
        stage_started_at=record.stage_started_at,
        stages=tuple((s.stage, s.duration_s) for s in record.stages),
        # Each pod once: a rank of T x P actors may report its pod per actor.
        freed_pods=tuple(dict.fromkeys(f.pod for f in record.freed if f.pod)),
        kind=record.kind or runtime_status.KIND_RESIZE,
        lost=tuple(
            LostRank(pod=r.pod or None, reason=r.reason or "lost")
            for r in (recovery.ranks_lost if recovery is not None else ())
        ),
        recovery_s=recovery.recovery_s if recovery is not None else None,
        requests_rerun=recovery.requests_rerun if recovery is not None else 0,
    )


def _lost_and_unhealthy(
    ranks: list[runtime_status.Rank],
) -> tuple[tuple[LostRank, ...], tuple[LostRank, ...]]:
    lost: list[LostRank] = []
    unhealthy: list[LostRank] = []
    for rank in ranks:
        if rank.healthy:
            continue
        entry = LostRank(pod=rank.pod or None, reason=rank.state or "unhealthy")
        (unhealthy if rank.active else lost).append(entry)
    return tuple(lost), tuple(unhealthy)


def _active_pods(ranks: list[runtime_status.Rank]) -> tuple[str, ...] | None:
    if not ranks:
        return None
    pods: list[str] = []
    for rank in ranks:
        if not rank.active:
            continue
        if not rank.pod:
            return None
        pods.append(rank.pod)
    return tuple(sorted(pods))


def _in_flight(load: runtime_status.Load | None) -> int | None:
    """``load`` of ``/elastic_ep/status``: ``in_flight``, else ``running`` + ``waiting``."""
    if load is None:
        return None
    total = load.in_flight
    if total is None and load.running is not None:
        total = load.running + (load.waiting or 0)
    return max(total, 0) if total is not None else None


def runtime(payload: dict[str, Any] | None) -> RuntimeObservation | None:
    """Parse the runtime's ``/elastic_ep/status`` answer (``pydantic.ValidationError``, a
    ``ValueError``, when it is malformed)."""
    if payload is None:
        return None
    status = runtime_status.ElasticStatus.model_validate(payload)
    spares = status.spares
    lost, unhealthy = _lost_and_unhealthy(status.ranks)
    return RuntimeObservation(
        data_parallel_size=status.data_parallel_size,
        target_data_parallel_size=status.target_data_parallel_size or status.data_parallel_size,
        stage=status.stage,
        balancedness=status.eplb.balancedness if status.eplb is not None else None,
        resize=runtime_resize(status.resize) if status.resize is not None else None,
        history=tuple(runtime_resize(r) for r in status.history),
        active_pods=_active_pods(status.ranks),
        lost=lost,
        unhealthy=unhealthy,
        ready=status.ready,
        ready_reason=status.ready_reason or None,
        in_flight=_in_flight(status.load),
        warm_spare_ranks=status.warm_spare_ranks,
        spare_pods=tuple(sorted(s.pod for s in spares if s.pod)),
        spares_ready=sum(s.ready for s in spares),
    )
