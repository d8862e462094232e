"""The execute step of a reconcile: the planned actions, one after the other in the plan's
order (``plan.resize`` and ``reconcile.plan`` order them: the runtime's settings, the
RayCluster, the Secret, the Service, the NetworkPolicy, the scale request, then the status
parts and the events). Each write is idempotent: a child whose stored object already holds
what is wanted is not written, a Secret that exists is kept.

The first write that fails stops the step: what was created so far is reported (one
``Created`` event), and the retry of the reconcile applies the rest. The actions that only
shape the status write (``SetResize``, ``SetPhase``, ``Requeue``) are gathered into
:class:`Executed` for the commit; a ``ScaleRuntime`` answer is folded into the planned resize
(``plan.scale_answer``).

Glue between the planner and the API / runtime clients; no kopf.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Union

import httpx

from moe_operator import runtime_client
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.k8s import api as k8s_api
from moe_operator.observation import Children, RuntimeFactory
from moe_operator.plan import (
    access,
    actions,
    builders,
    credentials,
    decide,
    diff,
    revision,
    scale_answer,
)

Logger = Union[logging.Logger, "logging.LoggerAdapter[Any]"]
#: ``events(reason, message)``: posts a Kubernetes event on the MoEDeployment.
EventSink = Callable[[str, str], None]

#: The actions that write a child (a ``Created`` event names those a reconcile created).
CHILD_ACTIONS: Final = (
    actions.ApplyRayCluster,
    actions.DeleteRayCluster,
    actions.EnsureSecret,
    actions.ApplyService,
    actions.ApplyNetworkPolicy,
)
#: (deployment, generation, refusal) warned about once per operator process.
_WARNED_SETTINGS: set[tuple[str, int, str]] = set()


def tokens(key: bytes, owner: builders.Owner) -> tuple[str, str]:
    """The deployment's admin token and Ray token."""
    where = {"namespace": owner.namespace, "name": owner.name, "uid": owner.uid}
    return (
        credentials.derive(key, purpose=credentials.PURPOSE_ADMIN, **where),
        credentials.derive(key, purpose=credentials.PURPOSE_RAY, **where),
    )


@dataclasses.dataclass(frozen=True)
class Target:
    """What the actions act on: the deployment, its spec and children as observed, the
    operator's key (tokens) and the runtime (URL, admin token, client factory)."""

    owner: builders.Owner
    spec: spec_.MoEDeploymentSpec
    generation: int
    children: Children
    key: bytes
    url: str
    admin_token: str
    factory: RuntimeFactory
    #: The RayCluster that serves (``status.rayCluster``; ``None``: the deployment's first).
    cluster: str | None = None
    #: During a rollout: the other RayClusters as stored, and each one's runtime URL.
    clusters: Mapping[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    urls: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def serving(self) -> str:
        return self.cluster or builders.raycluster_name(self.owner.name)

    def stored(self, cluster: str) -> dict[str, Any] | None:
        if cluster in self.clusters:
            return self.clusters[cluster]
        return self.children.raycluster if cluster == self.serving else None


@dataclasses.dataclass
class Executed:
    """What the execute step leaves for the commit."""

    created: list[str] = dataclasses.field(default_factory=list)
    phase: actions.SetPhase | None = None
    #: ``status.resize`` after this reconcile (a scale answer folded in), or keep it.
    resize: status_.ResizeStatus | None | actions.Keep = actions.KEEP
    requeue: float | None = None
    #: ``status.rollout`` / ``rayCluster`` / ``revision`` as planned (``None``: kept).
    rollout: actions.SetRollout | None = None


async def _apply_unless_current(
    api: k8s_api.Api,
    desired: dict[str, Any],
    stored: dict[str, Any] | None,
    *,
    priority: int = k8s_api.PRIORITY_DEFAULT,
) -> k8s_api.ApplyResult | None:
    """Server-side apply ``desired``; ``None`` when the stored object already holds it."""
    if stored is not None and diff.contains(stored, desired):
        return None
    return await api.apply(desired, priority=priority)


async def write_child(
    action: actions.Action, *, api: k8s_api.Api, target: Target
) -> k8s_api.ApplyResult | None:
    """Run one child action (``None``: nothing written)."""
    owner, children = target.owner, target.children
    if isinstance(action, actions.EnsureSecret):
        admin, ray = tokens(target.key, owner)
        secret = access.build_secret(owner=owner, token=admin, ray_token=ray)
        return await api.create(secret, read_back=False)
    if isinstance(action, actions.ApplyRayCluster):
        name = action.cluster or target.serving
        stored = target.stored(name)
        desired = builders.build_raycluster(
            owner=owner,
            spec=target.spec,
            worker_replicas=action.worker_replicas,
            workers_to_delete=action.workers_to_delete,
            head_size=action.head_size,
            name=name,
        )
        theirs = revision.of_raycluster(stored)
        if stored is not None and theirs is not None and theirs != revision.of_raycluster(desired):
            # Safe by construction: a RayCluster's templates are only ever written with the
            # spec of its own revision; one of another revision only gets its replicas.
            desired = revision.resized(
                stored,
                metadata=desired["metadata"],
                worker_replicas=action.worker_replicas,
                workers_to_delete=action.workers_to_delete,
            )
        # Ahead of every other request waiting for a connection: pods start from it.
        return await _apply_unless_current(api, desired, stored, priority=k8s_api.PRIORITY_FIRST)
    if isinstance(action, actions.DeleteRayCluster):
        gone = await api.delete(
            api_version="ray.io/v1",
            kind="RayCluster",
            namespace=owner.namespace,
            name=action.cluster,
        )
        return None if not gone else k8s_api.ApplyResult(obj={}, created=False)
    if isinstance(action, actions.ApplyNetworkPolicy):
        return await _apply_unless_current(
            api, access.build_network_policy(owner=owner), children.network_policy
        )
    if isinstance(action, actions.ApplyService):
        service = access.build_service(owner=owner, cluster=action.cluster or target.serving)
        return await _apply_unless_current(api, service, children.service)
    return None


async def patch_settings(
    changes: dict[str, Any], *, target: Target, cluster: str | None = None
) -> tuple[dict[str, Any], str | None]:
    """``PATCH /elastic_ep/config``: what was changed, and the runtime's refusal when it
    refused (it then changed nothing); ``cluster``: that RayCluster's runtime."""
    url = target.urls.get(cluster, target.url) if cluster is not None else target.url
    async with target.factory(url, target.admin_token) as client:
        try:
            await client.patch_config(changes)
        except runtime_client.RuntimeApiError as error:
            return {}, error.message
        except (httpx.HTTPError, ValueError) as error:
            return {}, f"the runtime did not answer: {error!r}"
    return changes, None


async def scale_runtime(
    *, new_size: int, target: Target, cluster: str | None = None
) -> actions.ScaleOutcome:
    """``POST /scale_elastic_ep`` (no wait) to the serving runtime, or to that of
    ``cluster``; its answer as the planner sees it."""
    url = target.urls.get(cluster, target.url) if cluster is not None else target.url
    async with target.factory(url, target.admin_token) as client:
        try:
            accepted = await client.scale(new_size)
        except runtime_client.ResizeConflict as error:
            return actions.ScaleDeferred(f"the runtime is busy (409): {error.message}")
        except runtime_client.RuntimeApiError as error:
            if error.status in (400, 422):
                return actions.ScaleRefused(error.message)
            return actions.ScaleDeferred(f"HTTP {error.status}: {error.message}")
        except (httpx.HTTPError, ValueError) as error:
            return actions.ScaleDeferred(f"the runtime did not answer: {error!r}")
    if not accepted.resize_id:
        return actions.ScaleDeferred("the runtime's answer has no resize_id")
    return actions.ScaleAccepted(resize_id=accepted.resize_id, stage=accepted.stage)


class _Created:
    """The children a reconcile created, announced in one ``Created`` event once the child
    writes end (or one of them failed)."""

    def __init__(self, events: EventSink) -> None:
        self.events = events
        self.made: list[str] = []

    def post(self) -> None:
        if self.made:
            self.events("Created", "Created " + ", ".join(self.made))
        self.made = []


async def execute(
    steps: Sequence[actions.Action],
    *,
    api: k8s_api.Api,
    target: Target,
    current: status_.MoEDeploymentStatus,
    now: datetime.datetime,
    events: EventSink,
    logger: Logger,
) -> Executed:
    """Run ``steps`` in order; raises the first failed write (after its ``Created`` event)."""
    owner = target.owner
    where = f"{owner.namespace}/{owner.name}"
    done = Executed()
    created = _Created(events)
    answer: actions.ScaleOutcome | None = None
    for action in steps:
        if isinstance(action, CHILD_ACTIONS):
            try:
                result = await write_child(action, api=api, target=target)
            except BaseException:
                created.post()  # what was created is reported; the retry applies the rest
                raise
            if isinstance(action, actions.ApplyRayCluster) and result is not None:
                logger.info(
                    "%s: applied RayCluster %s: worker replicas %d, workersToDelete %s",
                    where,
                    action.cluster or target.serving,
                    action.worker_replicas,
                    list(action.workers_to_delete),
                )
            if isinstance(action, actions.DeleteRayCluster):
                if result is not None:
                    logger.info("%s: deleted RayCluster %s", where, action.cluster)
                continue
            if result is not None and result.created:
                kind, name = result.obj["kind"], result.obj["metadata"]["name"]
                done.created.append(f"{kind}/{name}")
                created.made.append(f"{kind} {name}")
                logger.info("created %s %s/%s", kind, owner.namespace, name)
            continue
        created.post()
        if isinstance(action, actions.PatchSettings):
            applied, refused = await patch_settings(
                dict(action.changes), target=target, cluster=action.cluster
            )
            if applied:
                text = ", ".join(f"{k}={v}" for k, v in sorted(applied.items()))
                of = f" of {action.cluster}" if action.cluster else ""
                logger.info("%s: runtime settings%s changed live: %s", where, of, text)
                events("SettingsApplied", f"runtime settings{of} changed live: {text}")
            if refused and (where, target.generation, refused) not in _WARNED_SETTINGS:
                _WARNED_SETTINGS.add((where, target.generation, refused))
                events("SettingsRefused", f"the runtime refused the spec's settings: {refused}")
        elif isinstance(action, actions.ScaleRuntime) and action.cluster is not None:
            # A rollout's resize of one RayCluster: level-triggered, the answer only reported.
            other = await scale_runtime(
                new_size=action.new_size, target=target, cluster=action.cluster
            )
            logger.info(
                "%s: asked the runtime of %s for size %d: %s",
                where,
                action.cluster,
                action.new_size,
                other,
            )
            if isinstance(other, actions.ScaleRefused):
                events(
                    status_.REASON_RESIZE_FAILED,
                    f"the runtime of {action.cluster} refused size {action.new_size}: "
                    f"{other.message}",
                )
        elif isinstance(action, actions.ScaleRuntime):
            answer = await scale_runtime(new_size=action.new_size, target=target)
            logger.info("%s: asked the runtime for size %d: %s", where, action.new_size, answer)
        elif isinstance(action, actions.SetRollout):
            done.rollout = action
        elif isinstance(action, actions.SetResize):
            done.resize = action.resize
        elif isinstance(action, actions.Event):
            events(action.reason, action.message)
        elif isinstance(action, actions.Requeue):
            done.requeue = action.seconds
        elif isinstance(action, actions.SetPhase):
            done.phase = action
    created.post()
    if done.phase is None:  # plan_resize always ends with one; keep the status honest regardless
        done.phase = actions.SetPhase(current.phase or status_.Phase.PENDING, "Unknown", "")
    if answer is not None and isinstance(done.resize, status_.ResizeStatus):
        done.resize, more = scale_answer.after_scale(done.resize, answer, now=now)
        for event in more:
            events(event.reason, event.message)
        done.phase = scale_answer.phase_after_scale(done.resize, done.phase)
        done.requeue = decide.REQUEUE_SECONDS
    return done
