"""A template change rolled over rank by rank (pure): from (spec, status, the deployment's
RayClusters as observed) to the actions of one reconcile.

A spec of another template revision (``plan.revision``) than the serving RayCluster's is
never written into that RayCluster's templates. Instead:

1. **Starting**: a second RayCluster, named after the new revision, starts at
   ``k = max(minDataParallelSize, min(maxSurgeRanks, dataParallelSize))`` ranks. The worker
   pods of all RayClusters never exceed ``dataParallelSize + surge`` (the new head comes on
   top), ``surge`` being ``maxSurgeRanks``, raised to what ``k`` needs when the serving
   RayCluster cannot give up enough ranks (it never goes below ``minDataParallelSize``): when
   the surge does not cover ``k``, the serving RayCluster first shrinks (the normal resize).
   Requests keep going to the serving RayCluster.
2. When the new runtime serves (``/ready``) at ``k``, the Service's selector moves to its head
   (**Moving**): new requests go there; those in flight on the old head finish there.
3. Capacity moves one rank at a time, each with the runtime's normal resize stages: the new
   RayCluster grows by one while the bound allows it, else an old one shrinks by one (its
   sequences migrate to its survivors, none is aborted); an old one at
   ``minDataParallelSize`` is **Draining**: it gets no new request, its in-flight ones end,
   then it is deleted.
4. **Completed** once the new RayCluster serves ``dataParallelSize`` ranks and no other is
   left; ``status.rayCluster`` names it.

A new RayCluster that does not serve within ``spec.rollout.readyTimeoutSeconds`` is **rolled
back**: it is deleted and the normal resize grows the serving one back to the spec's size
(its templates stay its own); that revision is not tried again until the template changes.
Another template change mid-rollout starts again from where things stand: the RayCluster of
the newest revision becomes the target, every other one is shrunk or drained away.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Final

from moe_operator.api import rollout as rollout_
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import actions, builders, clock, decide
from moe_operator.plan import rollout_steps as parts

Stage = rollout_.RolloutStage
#: Seconds between two reconciles while a rollout runs.
REQUEUE_SECONDS: Final = 1.0


def needed(
    *,
    status: status_.MoEDeploymentStatus,
    revision: str,
    serving_revision: str | None,
) -> bool:
    """Whether this reconcile is a rollout's: one runs, or the serving RayCluster is of
    another revision than the spec (one made by an operator that recorded none is adopted as
    it is), unless that revision was rolled back already, or a resize still runs."""
    r = status.rollout
    if r is not None and r.active:
        return True
    if serving_revision is None or serving_revision == revision:
        return False
    if r is not None and r.stage is Stage.ROLLED_BACK and r.to_revision == revision:
        return False
    return not (status.resize is not None and status.resize.active)


def _rolling_phase(r: rollout_.RolloutStatus, *, ready: bool) -> actions.SetPhase:
    text = f"rollout {r.from_revision}->{r.to_revision}: {r.stage.value} {r.progress}"
    if r.message:
        text += f" ({r.message})"
    return actions.SetPhase(status_.Phase.RESIZING, rollout_.REASON_ROLLING, text, ready=ready)


def _starting(
    p: parts.Plan,
    *,
    spec: spec_.MoEDeploymentSpec,
    serving: parts.Cluster | None,
    target: parts.Cluster | None,
    others: Sequence[parts.Cluster],
    served: bool,
    now: datetime.datetime,
) -> None:
    """The new RayCluster is made and awaited; requests still go to ``serving``."""
    r = p.rollout
    n, k = spec.data_parallel_size, parts.initial_size(spec)
    if not served or serving is None:
        # Nothing serves: no capacity to protect. The new one at full size, the rest go.
        p.steps.append(
            actions.ApplyRayCluster(
                worker_replicas=n, head_size=parts.head(target) or n, cluster=r.to_cluster
            )
        )
        p.steps += [actions.DeleteRayCluster(c.name) for c in others]
        p.steps.append(actions.ApplyService(cluster=r.to_cluster))
        p.serving, p.revision = r.to_cluster, r.to_revision
        p.rollout = r.model_copy(
            update={"stage": Stage.MOVING, "stage_started_at": clock.rfc3339(now)}
        )
        return
    started = clock.parse(r.stage_started_at) or now
    if (now - started).total_seconds() > spec.rollout.ready_timeout_seconds:
        _roll_back(p, spec=spec, serving=serving, target=target, others=others, now=now)
        return
    leftovers = [c for c in others if c.name != serving.name]
    parts.stop_keep_alive(p, leftovers)
    for c in leftovers:  # an abandoned rollout's: drained away first (they count in the bound)
        if parts.drained(p, c, spec=spec, now=now):
            p.steps.append(actions.DeleteRayCluster(c.name))
            p.events.append(
                actions.Event(rollout_.EVENT_OLD_DELETED, f"deleted RayCluster {c.name}")
            )
        return
    room = parts.bound(spec) - k
    if serving.ranks > room or serving.pods > room:
        size = max(room, spec.min_data_parallel_size)
        if not parts.move(p, serving, size, now=now):
            return
    else:
        p.steps.append(parts.settle(serving, serving.ranks))
    if target is None and serving.pods + p.orphans > room:
        p.rollout = p.rollout.model_copy(update={"message": _orphans(p)})
        return
    p.rollout = p.rollout.model_copy(update={"move_cluster": None, "move_to": None})
    p.steps.append(
        actions.ApplyRayCluster(
            worker_replicas=k, head_size=parts.head(target) or k, cluster=r.to_cluster
        )
    )
    if target is not None and target.serves and target.ranks >= k:
        p.steps.append(actions.ApplyService(cluster=r.to_cluster))
        p.serving, p.revision = r.to_cluster, r.to_revision
        p.rollout = p.rollout.model_copy(
            update={
                "stage": Stage.MOVING,
                "stage_started_at": clock.rfc3339(now),
                "ranks_moved": target.ranks,
                "message": None,
            }
        )
        p.events.append(
            actions.Event(
                rollout_.EVENT_SWITCHED,
                f"rollout {r.from_revision}->{r.to_revision}: the Service now sends new requests "
                f"to RayCluster {r.to_cluster} ({target.ranks} ranks); {serving.name} drains",
            )
        )
        return
    p.rollout = p.rollout.model_copy(update={"message": _why_not_serving(target, k)})


def _orphans(p: parts.Plan) -> str:
    return f"waiting for {p.orphans} worker pods of deleted RayClusters to go"


def _why_not_serving(target: parts.Cluster | None, k: int) -> str:
    if target is None:
        return "creating the new RayCluster"
    ray = target.observed.raycluster
    waiting = target.observed.head_waiting
    if waiting:
        return f"the new head does not start: {waiting}"
    if ray is None or not ray.head_ready:
        return "waiting for the new head"
    if target.runtime is None:
        return "waiting for the new runtime to answer"
    why = target.runtime.ready_reason or "not ready"
    return f"the new runtime serves {target.ranks} of {k} ranks ({why})"


def _roll_back(
    p: parts.Plan,
    *,
    spec: spec_.MoEDeploymentSpec,
    serving: parts.Cluster,
    target: parts.Cluster | None,
    others: Sequence[parts.Cluster],
    now: datetime.datetime,
) -> None:
    """The new RayCluster did not serve in time (or was never made: the serving one could
    not give up its ranks): it goes, the serving one stays and the normal path grows it back."""
    r = p.rollout
    if target is not None:
        why = (
            f"the new RayCluster {target.name} did not serve within "
            f"{spec.rollout.ready_timeout_seconds}s: "
            f"{_why_not_serving(target, parts.initial_size(spec))}"
        )
        p.steps.append(actions.DeleteRayCluster(target.name))
    else:
        why = (
            f"the new RayCluster was not started within {spec.rollout.ready_timeout_seconds}s: "
            f"{r.message or 'the serving RayCluster did not give up its ranks'}"
        )
    p.steps += [actions.DeleteRayCluster(c.name) for c in others if c.name != serving.name]
    p.steps.append(actions.ApplyService(cluster=serving.name))
    p.serving, p.revision = serving.name, r.from_revision
    p.rollout = r.model_copy(
        update={
            "stage": Stage.ROLLED_BACK,
            "stage_started_at": clock.rfc3339(now),
            "finished_at": clock.rfc3339(now),
            "message": why,
            "move_cluster": None,
            "move_to": None,
        }
    )
    p.events.append(
        actions.Event(
            rollout_.REASON_ROLLED_BACK,
            f"rollout {r.from_revision}->{r.to_revision} rolled back: {why}; "
            f"{serving.name} grows back to {spec.data_parallel_size}",
        )
    )


def _moving(
    p: parts.Plan,
    *,
    spec: spec_.MoEDeploymentSpec,
    target: parts.Cluster | None,
    others: Sequence[parts.Cluster],
    now: datetime.datetime,
) -> None:
    """The Service selects ``target``: move capacity to it, one rank at a time."""
    r = p.rollout
    n, m = spec.data_parallel_size, spec.min_data_parallel_size
    if target is None or target.runtime is None:
        if target is None:
            p.steps.append(
                actions.ApplyRayCluster(
                    worker_replicas=n, head_size=parts.head(target) or n, cluster=r.to_cluster
                )
            )
        p.steps += [parts.settle(c, c.ranks) for c in others]
        p.rollout = r.model_copy(update={"message": "waiting for the new runtime to answer"})
        return
    p.rollout = r = r.model_copy(update={"ranks_moved": target.ranks})
    parts.stop_keep_alive(p, others)
    if target.draining:  # a rollout reverted to a RayCluster that had been drained
        p.steps.append(actions.PatchSettings({"draining": False}, cluster=target.name))
    # The move under way ends first.
    if r.move_cluster is not None and r.move_to is not None:
        moving = next((c for c in (target, *others) if c.name == r.move_cluster), None)
        if moving is not None:
            p.steps += [parts.settle(c, c.ranks) for c in (target, *others) if c is not moving]
            if not parts.move(p, moving, r.move_to, now=now):
                return
            p.events.append(
                actions.Event(
                    rollout_.EVENT_RANK_MOVED,
                    f"rollout {r.from_revision}->{r.to_revision}: {moving.name} serves "
                    f"{r.move_to} ranks",
                )
            )
        else:
            p.steps += [parts.settle(c, c.ranks) for c in (target, *others)]
        # The next move is decided in the next reconcile, on fresh observations.
        p.rollout = p.rollout.model_copy(
            update={"move_cluster": None, "move_to": None, "message": None}
        )
        return
    if any(c.busy for c in (target, *others)):
        p.steps += [parts.settle(c, c.ranks) for c in (target, *others)]
        p.rollout = r.model_copy(update={"message": "waiting for a running resize to end"})
        return
    pods = sum(c.pods for c in (target, *others)) + p.orphans
    if target.ranks < n:
        if pods + 1 <= parts.bound(spec):
            p.steps += [parts.settle(c, c.ranks) for c in others]
            parts.move(p, target, target.ranks + 1, now=now)
            return
        shrinkable = [c for c in others if c.ranks > m]
        if shrinkable:
            old = max(shrinkable, key=lambda c: c.ranks)
            p.steps += [parts.settle(c, c.ranks) for c in (target, *others) if c is not old]
            parts.move(p, old, old.ranks - 1, now=now)
            return
        if not others:  # only pods on their way out stand in the way
            p.steps.append(parts.settle(target, target.ranks))
            p.rollout = r.model_copy(update={"message": _orphans(p)})
            return
    p.steps.append(parts.settle(target, target.ranks))
    if others:
        old = min(others, key=lambda c: c.ranks)
        p.steps += [parts.settle(c, c.ranks) for c in others if c is not old]
        if r.stage is not Stage.DRAINING:
            p.rollout = r = r.model_copy(
                update={"stage": Stage.DRAINING, "stage_started_at": clock.rfc3339(now)}
            )
        if parts.drained(p, old, spec=spec, now=now):
            p.steps = [
                s
                for s in p.steps
                if not isinstance(s, actions.ApplyRayCluster) or s.cluster != old.name
            ]
            p.steps.append(actions.DeleteRayCluster(old.name))
            p.events.append(
                actions.Event(
                    rollout_.EVENT_OLD_DELETED,
                    f"rollout {r.from_revision}->{r.to_revision}: drained and deleted "
                    f"RayCluster {old.name}",
                )
            )
            p.rollout = p.rollout.model_copy(
                update={"stage": Stage.MOVING, "drain_started_at": None, "message": None}
            )
        return
    done = clock.rfc3339(now)
    p.serving, p.revision = target.name, r.to_revision
    p.rollout = r.model_copy(
        update={
            "stage": Stage.COMPLETED,
            "stage_started_at": done,
            "finished_at": done,
            "message": None,
        }
    )
    p.events.append(
        actions.Event(
            rollout_.EVENT_COMPLETED,
            f"rollout {r.from_revision}->{r.to_revision} completed: RayCluster {target.name} "
            f"serves {target.ranks} ranks",
        )
    )


def plan(
    *,
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    owner_name: str,
    revision: str,
    clusters: Sequence[parts.Cluster],
    now: datetime.datetime,
    orphan_pods: int = 0,
) -> list[actions.Action]:
    """The actions of one reconcile of a rollout towards ``revision``, in order; the last
    ones are a ``SetRollout`` and a ``SetPhase``."""
    serving_name = status.ray_cluster or builders.raycluster_name(owner_name)
    by_name = {c.name: c for c in clusters}
    serving = by_name.get(serving_name)
    target_name = next(
        (c.name for c in clusters if c.revision == revision and c.name == serving_name),
        next(
            (c.name for c in clusters if c.revision == revision),
            builders.raycluster_name(owner_name, revision),
        ),
    )
    target = by_name.get(target_name)
    others = [c for c in clusters if c.name != target_name]
    stamp = clock.rfc3339(now)
    r = status.rollout
    events: list[actions.Event] = []
    if r is None or not r.active or r.to_revision != revision:
        from_revision = (serving.revision if serving else None) or status.revision or "unknown"
        if r is not None and r.active:
            events.append(
                actions.Event(
                    rollout_.EVENT_RESTARTED,
                    f"rollout {r.from_revision}->{r.to_revision} superseded by revision "
                    f"{revision}: starting again from where it stands",
                )
            )
        r = rollout_.RolloutStatus(
            from_revision=from_revision,
            to_revision=revision,
            from_cluster=serving_name,
            to_cluster=target_name,
            stage=Stage.MOVING if target_name == serving_name else Stage.STARTING,
            ranks_total=spec.data_parallel_size,
            started_at=stamp,
            stage_started_at=stamp,
        )
        events.append(
            actions.Event(
                rollout_.EVENT_STARTED,
                f"rollout {from_revision}->{revision}: new RayCluster {target_name} beside "
                f"{serving_name}, capacity moved rank by rank (at most "
                f"{parts.bound(spec)} worker pods, starting at {parts.initial_size(spec)} "
                "ranks)",
            )
        )
    r = r.model_copy(update={"ranks_total": spec.data_parallel_size})
    p = parts.Plan(
        rollout=r,
        serving=serving_name,
        revision=status.revision,
        events=events,
        orphans=orphan_pods,
    )
    if spec.rollout.paused:
        p.steps += [parts.settle(c, c.ranks) for c in clusters]
        p.rollout = r.model_copy(update={"message": "paused (spec.rollout.paused)"})
    elif r.stage is Stage.STARTING:
        _starting(
            p,
            spec=spec,
            serving=serving,
            target=target,
            others=others,
            served=decide.served(status),
            now=now,
        )
    else:
        _moving(p, spec=spec, target=target, others=others, now=now)
    out: list[actions.Action] = list(p.steps)
    out.append(actions.SetRollout(p.rollout, ray_cluster=p.serving, revision=p.revision))
    out.extend(p.events)
    serving_now = by_name.get(p.serving)
    ready = serving_now is not None and serving_now.runtime is not None
    if p.rollout.active:
        out.append(actions.Requeue(REQUEUE_SECONDS))
        out.append(p.phase or _rolling_phase(p.rollout, ready=ready))
    return out
