"""One reconcile of a MoEDeployment: observe -> plan -> execute -> commit.

As KubeRay's reconcilers do: an ordered list of idempotent steps, then one status write,
skipped when nothing but timestamps changed.

- **observe** (``moe_operator.observation``): the children, the Ray pods, the runtime's
  status and live settings. Reads only.
- **plan** (:func:`plan`, pure): the runtime settings to change (``plan.settings``), then the
  resize planner's actions (``plan.resize.plan_resize``).
- **execute** (``moe_operator.execution``): the actions one after the other, in the plan's
  order; then the operator's autoscaler (``moe_operator.autoscaler``: its own observe, decide,
  write), which decides on the resize status the steps left.
- **commit** (:func:`commit`): the next status (``plan.status.next_status``), written once.

Glue between the pure planner (``plan``) and the clients (``k8s``, ``runtime_client``); no
kopf here, so it can be driven by any caller (the operator's loop, a test, a benchmark).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import secrets
from typing import Any, Final, Union

import pydantic

from moe_operator import autoscaler, execution, logs, observation, rolling, runtime_client
from moe_operator.api import group
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.k8s import api as k8s_api
from moe_operator.plan import (
    actions,
    availability,
    builders,
    clock,
    credentials,
    load_report,
    resize,
    revision,
    rollout,
    settings,
)
from moe_operator.plan import status as plan_status

Logger = Union[logging.Logger, "logging.LoggerAdapter[Any]"]
EventSink = execution.EventSink
RuntimeFactory = observation.RuntimeFactory

RUNTIME_TIMEOUT_SECONDS: Final = 3.0
#: (deployment, url) pairs warned about once per operator process.
_WARNED_OVERRIDES: set[tuple[str, str]] = set()
#: The key of operators run without one (tests, one-off calls): tokens derived from it change
#: with every process. The operator's loop always passes the cluster's key
#: (``k8s.api.operator_key``).
_PROCESS_KEY: Final = secrets.token_bytes(credentials.KEY_BYTES)


def default_runtime_factory(url: str, token: str | None) -> runtime_client.RuntimeClient:
    return runtime_client.RuntimeClient(url, token=token, timeout=RUNTIME_TIMEOUT_SECONDS)


class InvalidSpec(ValueError):
    """The spec does not validate (the CRD should have refused it)."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one reconcile did."""

    phase: status_.Phase
    created: tuple[str, ...]
    status_written: bool
    #: Reconcile again after this many seconds (a resize is being driven); ``None``: no need.
    requeue_after: float | None = None
    # For the operator's metrics (moe_operator.metrics): the status before and after, whether
    # the runtime answered (``None``: not asked), what the autoscaler decided.
    previous: status_.MoEDeploymentStatus | None = None
    status: status_.MoEDeploymentStatus | None = None
    runtime_reachable: bool | None = None
    autoscale_decision: str | None = None
    #: The MoEDeployment's resourceVersion after the status write (``None``: none written);
    #: the operator's loop reads the object again until the watch has delivered it.
    resource_version: str | None = None


def parse_spec(raw: Any) -> spec_.MoEDeploymentSpec:
    try:
        return spec_.MoEDeploymentSpec.model_validate(raw)
    except pydantic.ValidationError as error:
        raise InvalidSpec(str(error)) from error


def parse_status(raw: Any, *, logger: Logger) -> status_.MoEDeploymentStatus:
    """The stored status; an unreadable one counts as empty (and gets rewritten)."""
    try:
        return status_.MoEDeploymentStatus.model_validate(raw or {})
    except pydantic.ValidationError as error:
        logger.warning("ignoring unreadable status: %s", error)
        return status_.MoEDeploymentStatus()


def plan(
    *,
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    seen: observation.Observation,
    ignored_override: str | None,
) -> list[actions.Action]:
    """The plan step (pure): the actions of this reconcile, in the order they run."""
    steps: list[actions.Action] = []
    if ignored_override is not None:
        steps.append(
            actions.Event(
                "RuntimeUrlIgnored",
                f"annotation {group.ANNOTATION_RUNTIME_URL}={ignored_override} ignored: the "
                "operator sends its admin token only to the deployment's own Service unless it "
                "runs with --allow-runtime-url-override (local development)",
            )
        )
    runtime = seen.observed.runtime
    if runtime is not None and seen.runtime_config is not None:
        # Before the scale request: a shrink asked in this reconcile drains as the spec says.
        wanted = settings.changes(spec, seen.runtime_config, resizing=runtime.running is not None)
        if wanted:
            steps.append(actions.PatchSettings(wanted))
    steps += resize.plan_resize(spec, status, seen.observed)
    steps = load_report.report(steps, observed=seen.observed, status=status)
    if seen.model_problem is not None:
        steps = availability.hold_back(steps, problem=seen.model_problem, status=status)
    return steps


async def commit(
    *,
    api: k8s_api.Api,
    owner: builders.Owner,
    raw_status: dict[str, Any],
    new: status_.MoEDeploymentStatus,
    logger: Logger,
) -> tuple[bool, str | None]:
    """The commit step: one status write when more than timestamps changed. Whether it
    wrote, and the resourceVersion it wrote."""
    if not plan_status.needs_write(raw_status, new):
        return False, None
    stored = await api.patch_status(
        namespace=owner.namespace,
        name=owner.name,
        patch=plan_status.merge_patch(raw_status, new),
    )
    logger.info(
        "%s/%s: status: phase=%s dp=%s target=%s stage=%s",
        owner.namespace,
        owner.name,
        new.phase.value if new.phase else None,
        new.data_parallel_size,
        new.target_data_parallel_size,
        new.resize.stage.value if new.resize else None,
    )
    version: str | None = (stored.get("metadata") or {}).get("resourceVersion")
    return True, version


async def reconcile(
    *,
    api: k8s_api.Api,
    body: dict[str, Any],
    events: EventSink,
    logger: Logger,
    now: str | None = None,
    runtime_factory: RuntimeFactory = default_runtime_factory,
    operator_key: bytes | None = None,
) -> Outcome:
    """Bring the children in line with the spec, drive a live resize one step, and write the
    status if it changed (:class:`InvalidSpec` when the spec does not validate)."""
    meta = body["metadata"]
    owner = builders.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    where = f"{owner.namespace}/{owner.name}"
    generation = int(meta.get("generation") or 1)
    moment = clock.parse(now) or datetime.datetime.now(datetime.timezone.utc)
    spec = parse_spec(body.get("spec"))
    raw_status = body.get("status") or {}
    current = parse_status(raw_status, logger=logger)
    key = operator_key or _PROCESS_KEY
    admin_token, _ = execution.tokens(key, owner)

    wanted = revision.revision(spec)
    rolling_now = current.rollout is not None and current.rollout.active
    serving_revision: str | None = None
    if not rolling_now:
        # observe
        seen = await observation.observe_all(
            api=api,
            owner=owner,
            spec=spec,
            annotations=meta.get("annotations"),
            has_status=bool(raw_status),
            generation=generation,
            now=moment,
            admin_token=admin_token,
            factory=runtime_factory,
            logger=logger,
            cluster=current.ray_cluster,
        )
        ray = seen.observed.raycluster
        serving_revision = ray.revision if ray is not None else None
        rolling_now = rollout.needed(
            status=current, revision=wanted, serving_revision=serving_revision
        )
    if rolling_now:  # a template change rolls over (moe_operator.rolling)
        return await _roll(
            api=api,
            owner=owner,
            spec=spec,
            generation=generation,
            current=current,
            raw_status=raw_status,
            moment=moment,
            key=key,
            factory=runtime_factory,
            events=events,
            logger=logger,
        )
    observed = seen.observed

    # plan
    ignored = runtime_client.ignored_override(meta.get("annotations"))
    if ignored is not None and (where, ignored) in _WARNED_OVERRIDES:
        ignored = None  # warned once per operator process
    elif ignored is not None:
        _WARNED_OVERRIDES.add((where, ignored))
        logger.warning("%s: ignoring the runtime-url annotation %r (not allowed)", where, ignored)
    steps = plan(spec=spec, status=current, seen=seen, ignored_override=ignored)

    # execute
    target = execution.Target(
        owner=owner,
        spec=spec,
        generation=generation,
        children=seen.children,
        key=key,
        url=seen.url,
        admin_token=admin_token,
        factory=runtime_factory,
        cluster=current.ray_cluster,
    )
    done = await execution.execute(
        steps, api=api, target=target, current=current, now=moment, events=events, logger=logger
    )
    assert done.phase is not None
    resize_now = current.resize if isinstance(done.resize, actions.Keep) else done.resize
    logs.bind(
        stage=resize_now.stage.value if resize_now else None,
        resize_id=resize_now.resize_id if resize_now else None,
    )
    scaler = await autoscaler.run(
        api=api,
        body=body,
        spec=spec,
        status=current,
        observed=observed,
        resize=resize_now,
        events=events,
        logger=logger,
    )
    requeue = done.requeue
    if scaler.requeue is not None:
        requeue = scaler.requeue if requeue is None else min(requeue, scaler.requeue)

    # commit
    new = plan_status.next_status(
        name=owner.name,
        namespace=owner.namespace,
        generation=generation,
        target=spec.data_parallel_size,
        current=current,
        observed=observed,
        phase=done.phase,
        now=clock.rfc3339(moment),
        resize_status=done.resize,
        autoscaling=scaler.status,
        mesh=(spec.tensor_parallel_size, spec.pipeline_parallel_size),
    )
    new = plan_status.with_rollout(
        new,
        rollout=current.rollout,
        ray_cluster=current.ray_cluster,
        revision=serving_revision or wanted,
        generation=generation,
        now=clock.rfc3339(moment),
    )
    written, version = await commit(
        api=api, owner=owner, raw_status=raw_status, new=new, logger=logger
    )
    logger.debug(
        "reconciled %s: phase=%s created=%s status %s",
        where,
        done.phase.phase.value,
        done.created,
        "written" if written else "unchanged",
    )
    return Outcome(
        phase=done.phase.phase,
        created=tuple(done.created),
        status_written=written,
        requeue_after=requeue,
        previous=current,
        status=new,
        runtime_reachable=observed.runtime is not None if seen.runtime_asked else None,
        autoscale_decision=scaler.decision,
        resource_version=version,
    )


async def _roll(
    *,
    api: k8s_api.Api,
    owner: builders.Owner,
    spec: spec_.MoEDeploymentSpec,
    generation: int,
    current: status_.MoEDeploymentStatus,
    raw_status: dict[str, Any],
    moment: datetime.datetime,
    key: bytes,
    factory: RuntimeFactory,
    events: EventSink,
    logger: Logger,
) -> Outcome:
    """A reconcile of a rollout (``moe_operator.rolling``), then the one status write. The
    operator's autoscaler stands aside until it ends."""
    admin_token, _ = execution.tokens(key, owner)
    target = execution.Target(
        owner=owner,
        spec=spec,
        generation=generation,
        children=observation.Children.missing(),
        key=key,
        url="",
        admin_token=admin_token,
        factory=factory,
        cluster=current.ray_cluster,
    )
    result = await rolling.run(
        api=api,
        target=target,
        spec=spec,
        current=current,
        now=moment,
        events=events,
        logger=logger,
    )
    done = result.done
    assert done.phase is not None
    stamp = clock.rfc3339(moment)
    new = plan_status.next_status(
        name=owner.name,
        namespace=owner.namespace,
        generation=generation,
        target=spec.data_parallel_size,
        current=current,
        observed=result.observed,
        phase=done.phase,
        now=stamp,
        resize_status=done.resize,
        mesh=(spec.tensor_parallel_size, spec.pipeline_parallel_size),
    )
    planned = result.rollout
    new = plan_status.with_rollout(
        new,
        rollout=planned.rollout,
        ray_cluster=planned.ray_cluster,
        revision=planned.revision,
        generation=generation,
        now=stamp,
    )
    written, version = await commit(
        api=api, owner=owner, raw_status=raw_status, new=new, logger=logger
    )
    return Outcome(
        phase=done.phase.phase,
        created=tuple(done.created),
        status_written=written,
        requeue_after=done.requeue,
        previous=current,
        status=new,
        runtime_reachable=result.observed.runtime is not None,
        resource_version=version,
    )
