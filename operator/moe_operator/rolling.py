"""One reconcile of a deployment whose template changes (``plan.rollout``): observe every
RayCluster of the deployment and its runtime, plan the rollout's step, execute it. The
commit stays ``moe_operator.reconcile``'s.

Glue between the pure planner and the clients; no kopf.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from typing import Any, Union

from moe_operator import execution, observation, runtime_client
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.k8s import api as k8s_api
from moe_operator.plan import actions, builders, decide, observe, revision, rollout, rollout_steps

Logger = Union[logging.Logger, "logging.LoggerAdapter[Any]"]


@dataclasses.dataclass(frozen=True)
class Seen:
    """The deployment's RayClusters as observed, stored, and where each runtime answers."""

    clusters: tuple[rollout_steps.Cluster, ...]
    stored: dict[str, dict[str, Any]]
    urls: dict[str, str]
    #: Worker pods of the deployment whose RayCluster is gone (still terminating).
    orphan_pods: int = 0


def _ours(obj: dict[str, Any], owner: builders.Owner) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner.uid for ref in refs) or not refs


async def _one(
    obj: dict[str, Any],
    *,
    api: k8s_api.Api,
    owner: builders.Owner,
    admin_token: str,
    factory: observation.RuntimeFactory,
    generation: int,
    now: datetime.datetime,
    logger: Logger,
) -> tuple[rollout_steps.Cluster, str]:
    name = obj["metadata"]["name"]
    pods = await observation.ray_pods(api=api, owner=owner, cluster=name, logger=logger)
    url = runtime_client.cluster_url(
        name=owner.name,
        namespace=owner.namespace,
        cluster=name,
        raycluster_annotations=(obj.get("metadata") or {}).get("annotations"),
    )
    ray = observe.raycluster(obj, pods=pods)
    runtime, config = None, None
    if ray is not None and ray.head_ready:
        runtime, config = await observation.observe_runtime(
            url=url, token=admin_token, factory=factory, logger=logger
        )
    draining = (config or {}).get("draining")
    observed = observe.Observed(
        raycluster=ray,
        secret_exists=True,
        service_exists=True,
        runtime=runtime,
        worker_pods=pods.workers if pods is not None else None,
        leaving_pods=pods.leaving if pods is not None else (),
        head_restarts=pods.head_restarts if pods is not None else None,
        head_waiting=pods.head_waiting if pods is not None else None,
        generation=generation,
        now=now,
    )
    cluster = rollout_steps.Cluster(
        name=name,
        revision=revision.of_raycluster(obj),
        observed=observed,
        draining=draining if isinstance(draining, bool) else None,
    )
    return cluster, url


async def observe_clusters(
    *,
    api: k8s_api.Api,
    owner: builders.Owner,
    admin_token: str,
    factory: observation.RuntimeFactory,
    generation: int,
    now: datetime.datetime,
    logger: Logger,
) -> Seen:
    """Every RayCluster labelled with the deployment (and owned by it), with its pods and
    its runtime's view."""
    listed = await api.list(
        api_version="ray.io/v1",
        kind="RayCluster",
        namespace=owner.namespace,
        label_selector=builders.selector(owner.name),
    )
    mine = [
        obj
        for obj in listed
        if _ours(obj, owner) and not (obj.get("metadata") or {}).get("deletionTimestamp")
    ]
    seen = await asyncio.gather(
        *(
            _one(
                obj,
                api=api,
                owner=owner,
                admin_token=admin_token,
                factory=factory,
                generation=generation,
                now=now,
                logger=logger,
            )
            for obj in mine
        )
    )
    names = {obj["metadata"]["name"] for obj in mine}
    workers = await api.list(
        api_version="v1",
        kind="Pod",
        namespace=owner.namespace,
        label_selector=f"{builders.selector(owner.name)},{observe.NODE_TYPE_LABEL}=worker",
    )
    orphans = sum(
        1
        for pod in workers
        if ((pod.get("metadata") or {}).get("labels") or {}).get(observe.CLUSTER_LABEL) not in names
    )
    return Seen(
        clusters=tuple(c for c, _ in seen),
        stored={obj["metadata"]["name"]: obj for obj in mine},
        urls={c.name: url for c, url in seen},
        orphan_pods=orphans,
    )


@dataclasses.dataclass(frozen=True)
class Result:
    """What one reconcile of a rollout did, for the commit."""

    done: execution.Executed
    #: The serving RayCluster's observation after this step (the status' sizes and phase).
    observed: observe.Observed
    rollout: actions.SetRollout


async def run(
    *,
    api: k8s_api.Api,
    target: execution.Target,
    spec: spec_.MoEDeploymentSpec,
    current: status_.MoEDeploymentStatus,
    now: datetime.datetime,
    events: execution.EventSink,
    logger: Logger,
) -> Result:
    """Observe, plan and execute one step of the rollout towards the spec's revision."""
    owner = target.owner
    seen = await observe_clusters(
        api=api,
        owner=owner,
        admin_token=target.admin_token,
        factory=target.factory,
        generation=target.generation,
        now=now,
        logger=logger,
    )
    children = await observation.observe_children(
        api=api, owner=owner, logger=logger, cluster=target.serving
    )
    steps = rollout.plan(
        spec=spec,
        status=current,
        owner_name=owner.name,
        revision=revision.revision(spec),
        clusters=seen.clusters,
        now=now,
        orphan_pods=seen.orphan_pods,
    )
    planned = next(s for s in steps if isinstance(s, actions.SetRollout))
    serving = planned.ray_cluster or target.serving
    # The policy admits every RayCluster of the deployment (older operators named one).
    steps = [actions.ApplyNetworkPolicy(), *steps]
    urls = dict(seen.urls)
    run_on = dataclasses.replace(
        target,
        children=children,
        clusters=seen.stored,
        urls=urls,
        url=urls.get(target.serving, target.url),
    )
    done = await execution.execute(
        steps, api=api, target=run_on, current=current, now=now, events=events, logger=logger
    )
    by_name = {c.name: c for c in seen.clusters}
    observed = by_name[serving].observed if serving in by_name else observe.Observed(now=now)
    if not planned.rollout or not planned.rollout.active:
        # Completed or rolled back: the normal path takes over at once, on the serving one.
        done.phase = decide.default_phase(spec=spec, status=current, observed=observed)
        done.requeue = rollout.REQUEUE_SECONDS
        if planned.rollout is not None and planned.rollout.stage is rollout.Stage.COMPLETED:
            done.resize = None  # the old runtime's resize records mean nothing to the new one
    return Result(done=done, observed=observed, rollout=planned)
