"""The pieces of a rollout's step (pure; ``plan.rollout`` decides which to take): a RayCluster
as the planner sees it, the plan being built, the worker-pod bound, and the moves (one
RayCluster to a size with the runtime's normal resize, a drain)."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence

from moe_operator.api import rollout as rollout_
from moe_operator.api import spec as spec_
from moe_operator.plan import actions, clock, decide, observe


@dataclasses.dataclass(frozen=True)
class Cluster:
    """One RayCluster of the deployment as observed (``observed.raycluster`` is set)."""

    name: str
    revision: str | None
    observed: observe.Observed
    #: Whether its runtime closes connections (``None``: unknown, or an older runtime).
    draining: bool | None = None

    @property
    def runtime(self) -> observe.RuntimeObservation | None:
        return self.observed.runtime

    @property
    def ranks(self) -> int:
        """Ranks serving (the runtime's word; else its worker replicas)."""
        if self.runtime is not None:
            return self.runtime.data_parallel_size
        ray = self.observed.raycluster
        return ray.worker_replicas if ray is not None else 0

    @property
    def pods(self) -> int:
        """Worker pods that hold (or may hold) an accelerator: listed ones, leaving ones
        included, and at least the replicas asked for."""
        ray = self.observed.raycluster
        replicas = ray.worker_replicas if ray is not None else 0
        pods = self.observed.worker_pods
        if pods is None:
            return replicas
        return max(len(pods), replicas) + len(self.observed.leaving_pods)

    @property
    def busy(self) -> bool:
        return self.runtime is not None and self.runtime.running is not None

    @property
    def serves(self) -> bool:
        rt = self.runtime
        return rt is not None and rt.ready is not False and rt.running is None


@dataclasses.dataclass
class Plan:
    """What one reconcile of a rollout decided, assembled into actions by :func:`plan`."""

    rollout: rollout_.RolloutStatus
    serving: str
    revision: str | None
    steps: list[actions.Action] = dataclasses.field(default_factory=list)
    events: list[actions.Event] = dataclasses.field(default_factory=list)
    phase: actions.SetPhase | None = None
    #: Worker pods of deleted RayClusters still terminating: they hold their accelerators
    #: until they are gone, so they count in the bound.
    orphans: int = 0


def initial_size(spec: spec_.MoEDeploymentSpec) -> int:
    """The ranks the new RayCluster starts at."""
    n = spec.data_parallel_size
    return max(spec.min_data_parallel_size, min(spec.rollout.max_surge_ranks, n))


def bound(spec: spec_.MoEDeploymentSpec) -> int:
    """Worker pods all RayClusters may hold at once (the new head not counted)."""
    n, m = spec.data_parallel_size, spec.min_data_parallel_size
    k = initial_size(spec)
    # The serving RayCluster gives up at most n - m ranks before the new one starts.
    return n + max(spec.rollout.max_surge_ranks, k - (n - m), 0)


def stop_keep_alive(p: Plan, others: Sequence[Cluster]) -> None:
    """Runtimes the Service no longer selects close their connections after each answer, so
    kept-alive clients reconnect to the serving one (their in-flight requests finish)."""
    for c in others:
        if c.draining is False:
            p.steps.append(actions.PatchSettings({"draining": True}, cluster=c.name))


def head(c: Cluster | None) -> int | None:
    """The size ``c``'s head started at (kept: a resize never rewrites the head)."""
    ray = c.observed.raycluster if c is not None else None
    return ray.head_size if ray is not None else None


def settle(c: Cluster, size: int) -> actions.ApplyRayCluster:
    """Hold ``c`` at ``size`` ranks: excess pods named (once its runtime says which serve),
    none added; while its runtime resizes, its pods as they are."""
    if c.busy or c.runtime is None:
        held = max(decide.hold(c.observed, size), size)
        return actions.ApplyRayCluster(
            worker_replicas=held,
            workers_to_delete=decide.pending(c.observed),
            cluster=c.name,
            head_size=head(c),
        )
    replicas, delete = decide.settle(c.observed, size=size)
    return actions.ApplyRayCluster(
        worker_replicas=replicas, workers_to_delete=delete, cluster=c.name, head_size=head(c)
    )


def move(p: Plan, c: Cluster, to: int, *, now: datetime.datetime) -> bool:
    """Drive ``c`` towards ``to`` ranks with the runtime's normal resize; True once it serves
    ``to`` ranks and holds no pod beyond them."""
    r = p.rollout
    if r.move_cluster != c.name or r.move_to != to:
        p.rollout = r = r.model_copy(update={"move_cluster": c.name, "move_to": to})
    rt, ray = c.runtime, c.observed.raycluster
    if rt is None or ray is None:
        p.steps.append(settle(c, c.ranks))
        p.rollout = r.model_copy(update={"message": f"{c.name}: waiting for its runtime"})
        return False
    if rt.running is not None:
        held = max(decide.hold(c.observed, to), to)
        p.steps.append(
            actions.ApplyRayCluster(
                worker_replicas=held,
                workers_to_delete=decide.pending(c.observed),
                cluster=c.name,
                head_size=head(c),
            )
        )
        running = rt.running
        p.rollout = r.model_copy(
            update={
                "message": f"{c.name}: resize {running.from_size}->{running.to_size} "
                f"{running.stage}"
            }
        )
        return False
    if rt.data_parallel_size == to:
        apply = settle(c, to)
        p.steps.append(apply)
        gone = c.pods - len(rt.spare_pods) <= to and not decide.pending(c.observed)
        if not gone:
            p.rollout = r.model_copy(update={"message": f"{c.name}: waiting for freed pods"})
        return gone
    if to > rt.data_parallel_size:  # grow: the pods first, then the runtime
        p.steps.append(
            actions.ApplyRayCluster(
                worker_replicas=to,
                workers_to_delete=decide.pending(c.observed),
                cluster=c.name,
                head_size=head(c),
            )
        )
        if ray.ready_workers >= to and not decide.pending(c.observed):
            p.steps.append(actions.ScaleRuntime(new_size=to, cluster=c.name))
            message = f"{c.name}: growing {rt.data_parallel_size}->{to}"
        else:
            message = f"{c.name}: {min(ray.ready_workers, to)} of {to} workers ready"
    else:  # shrink: the runtime first (its sequences migrate), then the pods it freed
        p.steps.append(settle(c, rt.data_parallel_size))
        p.steps.append(actions.ScaleRuntime(new_size=to, cluster=c.name))
        message = f"{c.name}: shrinking {rt.data_parallel_size}->{to}"
    last = rt.resize
    if last is not None and last.stage == decide.Stage.FAILED.value and last.to_size == to:
        message += f" (the last try failed: {last.message or 'no message'})"
    p.rollout = r.model_copy(update={"message": message})
    return False


def drained(p: Plan, c: Cluster, *, spec: spec_.MoEDeploymentSpec, now: datetime.datetime) -> bool:
    """An old RayCluster that gets no new request: True once its in-flight requests ended,
    or its head is gone; a head that runs but does not say (its runtime does not answer, or
    too old to report its load) is given ``elastic.drainTimeoutSeconds``."""
    r = p.rollout
    if r.drain_started_at is None:
        p.rollout = r = r.model_copy(update={"drain_started_at": clock.rfc3339(now)})
    p.steps.append(settle(c, c.ranks))
    rt = c.runtime
    ray = c.observed.raycluster
    if rt is None and (ray is None or not ray.head_ready):
        return True
    if rt is not None and rt.in_flight is not None:
        if rt.in_flight == 0 and not c.busy:
            return True
        p.rollout = r.model_copy(
            update={"message": f"draining {c.name}: {rt.in_flight} requests in flight"}
        )
        return False
    started = clock.parse(r.drain_started_at) or now
    waited = (now - started).total_seconds()
    # no seconds in the message: the status is written only when more than time changed
    limit = spec.elastic.drain_timeout_seconds
    p.rollout = r.model_copy(
        update={"message": f"draining {c.name}: in-flight requests unknown, {limit}s at most"}
    )
    return waited >= spec.elastic.drain_timeout_seconds
