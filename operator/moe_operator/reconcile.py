"""One reconcile of a MoEDeployment: observe -> plan -> apply -> one status write.

Glue between the pure planner (``plan``) and the API client (``k8s``); no kopf here, so the
handlers stay thin and this can be driven by any caller (kopf handlers, a timer, a test).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import secrets
from collections.abc import Callable
from typing import Any, Final, Union

import httpx
import pydantic

from moe_operator import autoscaler, logs, runtime_client
from moe_operator.api import group
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.k8s import api as k8s_api
from moe_operator.plan import (
    access,
    actions,
    availability,
    builders,
    clock,
    credentials,
    decide,
    diff,
    observe,
    resize,
    scale_answer,
    settings,
    storage,
)
from moe_operator.plan import status as plan_status

Logger = Union[logging.Logger, "logging.LoggerAdapter[Any]"]
#: ``events(reason, message)``: posts a Kubernetes event on the MoEDeployment.
EventSink = Callable[[str, str], None]
#: ``factory(base_url, admin_token)``: a client of one runtime (tests pass a fake transport).
RuntimeFactory = Callable[[str, Union[str, None]], runtime_client.RuntimeClient]

RUNTIME_TIMEOUT_SECONDS: Final = 3.0
#: (deployment, url) pairs warned about once per operator process.
_WARNED_OVERRIDES: set[tuple[str, str]] = set()
#: (deployment, generation, refusal) warned about once per operator process.
_WARNED_SETTINGS: set[tuple[str, int, str]] = set()


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
    #: ``handlers`` reads the object again until the watch has delivered it.
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


@dataclasses.dataclass(frozen=True)
class Children:
    """The children as stored (``None``: missing), and the observation planned on. The
    Secret is never read back (``plan.credentials``)."""

    raycluster: dict[str, Any] | None
    service: dict[str, Any] | None
    network_policy: dict[str, Any] | None
    observed: observe.Observed


#: The key of operators run without one (tests, one-off calls): tokens derived from it change
#: with every process. ``handlers`` always passes the cluster's key (``k8s.api.operator_key``).
_PROCESS_KEY: Final = secrets.token_bytes(credentials.KEY_BYTES)


def tokens(key: bytes, owner: builders.Owner) -> tuple[str, str]:
    """The deployment's admin token and Ray token."""
    where = {"namespace": owner.namespace, "name": owner.name, "uid": owner.uid}
    return (
        credentials.derive(key, purpose=credentials.PURPOSE_ADMIN, **where),
        credentials.derive(key, purpose=credentials.PURPOSE_RAY, **where),
    )


async def _ray_pods(
    *, api: k8s_api.Api, owner: builders.Owner, logger: Logger
) -> observe.PodsObservation | None:
    """The RayCluster's head and worker pods, terminating ones included (``None`` when they
    cannot be listed)."""
    selector = f"{observe.CLUSTER_LABEL}={builders.raycluster_name(owner.name)}"
    try:
        pods = await api.list(
            api_version="v1", kind="Pod", namespace=owner.namespace, label_selector=selector
        )
    except k8s_api.ApiError as error:
        logger.warning("%s/%s: Ray pods not listed: %s", owner.namespace, owner.name, error)
        return None
    return observe.pods(pods)


async def observe_children(
    *, api: k8s_api.Api, owner: builders.Owner, logger: Logger | None = None
) -> Children:
    log = logger or logging.getLogger(__name__)
    ray, service, policy, pods = await asyncio.gather(
        api.get(
            api_version="ray.io/v1",
            kind="RayCluster",
            namespace=owner.namespace,
            name=builders.raycluster_name(owner.name),
        ),
        api.get(
            api_version="v1",
            kind="Service",
            namespace=owner.namespace,
            name=builders.service_name(owner.name),
        ),
        api.get(
            api_version="networking.k8s.io/v1",
            kind="NetworkPolicy",
            namespace=owner.namespace,
            name=access.network_policy_name(owner.name),
        ),
        _ray_pods(api=api, owner=owner, logger=log),
    )
    observed = observe.Observed(
        raycluster=observe.raycluster(ray, pods=pods),
        # The Secret is created in the reconcile that creates the RayCluster; it is made sure
        # of again (a create that may answer "exists": the operator cannot read Secrets back)
        # only while a head pod has not started, which a missing Secret would cause.
        secret_exists=ray is not None and (pods is None or not pods.head_pending),
        service_exists=service is not None,
        worker_pods=(pods.workers if pods is not None else None) if ray is not None else (),
        leaving_pods=pods.leaving if pods is not None and ray is not None else (),
        head_restarts=pods.head_restarts if pods is not None else None,
    )
    return Children(raycluster=ray, service=service, network_policy=policy, observed=observed)


async def observe_runtime(
    *,
    url: str,
    token: str | None,
    factory: RuntimeFactory,
    logger: Logger,
) -> observe.RuntimeObservation | None:
    """The runtime's own view, or ``None`` when it does not answer (yet)."""
    async with factory(url, token) as client:
        try:
            payload = await client.status_json()
        except (httpx.HTTPError, runtime_client.RuntimeApiError, ValueError) as error:
            logger.debug("runtime at %s not observed: %s", url, error)
            return None
    try:
        return observe.runtime(payload)
    except (KeyError, TypeError, ValueError) as error:
        logger.warning("runtime at %s sent a status this operator cannot read: %s", url, error)
        return None


async def sync_settings(
    *,
    url: str,
    token: str | None,
    spec: spec_.MoEDeploymentSpec,
    runtime: observe.RuntimeObservation,
    factory: RuntimeFactory,
) -> tuple[dict[str, Any], str | None]:
    """Bring the runtime's live settings to the spec (``plan.settings``): what was changed,
    and the runtime's refusal when it refused (it then changed nothing)."""
    async with factory(url, token) as client:
        try:
            current = await client.config()
        except (httpx.HTTPError, runtime_client.RuntimeApiError, ValueError):
            return {}, None  # an older runtime, or away: nothing to do now
        wanted = settings.changes(spec, current, resizing=runtime.running is not None)
        if not wanted:
            return {}, None
        try:
            await client.patch_config(wanted)
        except runtime_client.RuntimeApiError as error:
            return {}, error.message
        except (httpx.HTTPError, ValueError) as error:
            return {}, f"the runtime did not answer: {error!r}"
    return wanted, None


async def scale_runtime(
    *,
    url: str,
    token: str | None,
    new_size: int,
    factory: RuntimeFactory,
) -> actions.ScaleOutcome:
    """``POST /scale_elastic_ep`` (no wait), its answer as the planner sees it."""
    async with factory(url, token) as client:
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


async def model_problem(
    *, api: k8s_api.Api, owner: builders.Owner, spec: spec_.MoEDeploymentSpec, logger: Logger
) -> str | None:
    """Why the spec's model cannot be served (``plan.availability``: a ``pvc://`` claim that
    is missing); ``None`` when it can, or when the operator may not read claims (its RBAC
    predates ``pvc://``): the pods then wait for the claim themselves."""
    pvc = storage.claim(spec)
    if pvc is None:
        return None
    try:
        claim = await api.get(
            api_version="v1",
            kind="PersistentVolumeClaim",
            namespace=owner.namespace,
            name=pvc.claim,
        )
    except k8s_api.ApiError as error:
        if error.status != 403:
            raise
        logger.warning(
            "%s/%s: claim %s not checked: %s", owner.namespace, owner.name, pvc.claim, error
        )
        return None
    return availability.claim_problem(source=pvc, claim=claim, namespace=owner.namespace)


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


#: The actions that write a child; they do not depend on each other.
CHILD_ACTIONS: Final = (
    actions.ApplyRayCluster,
    actions.EnsureSecret,
    actions.ApplyService,
    actions.ApplyNetworkPolicy,
)


async def _execute(
    action: actions.Action,
    *,
    api: k8s_api.Api,
    owner: builders.Owner,
    spec: spec_.MoEDeploymentSpec,
    children: Children,
    key: bytes,
) -> k8s_api.ApplyResult | None:
    """Run one child action (``ScaleRuntime`` is run by :func:`reconcile` itself)."""
    if isinstance(action, actions.EnsureSecret):
        admin, ray = tokens(key, owner)
        secret = access.build_secret(owner=owner, token=admin, ray_token=ray)
        return await api.create(secret, read_back=False)
    if isinstance(action, actions.ApplyRayCluster):
        desired = builders.build_raycluster(
            owner=owner,
            spec=spec,
            worker_replicas=action.worker_replicas,
            workers_to_delete=action.workers_to_delete,
            head_size=action.head_size,
        )
        # Ahead of every other request waiting for a connection: pods start from it.
        return await _apply_unless_current(
            api, desired, children.raycluster, priority=k8s_api.PRIORITY_FIRST
        )
    if isinstance(action, actions.ApplyNetworkPolicy):
        return await _apply_unless_current(
            api, access.build_network_policy(owner=owner), children.network_policy
        )
    if isinstance(action, actions.ApplyService):
        return await _apply_unless_current(api, access.build_service(owner=owner), children.service)
    return None


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
    status if it changed.

    The runtime is asked for its view only once Ray reports the head ready; its URL comes
    from :func:`runtime_client.runtime_url` (annotation, ``$MOE_RUNTIME_URL_TEMPLATE``, or the
    Service).
    """
    meta = body["metadata"]
    owner = builders.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    where = f"{owner.namespace}/{owner.name}"
    generation = int(meta.get("generation") or 1)
    moment = clock.parse(now) or datetime.datetime.now(datetime.timezone.utc)
    spec = parse_spec(body.get("spec"))
    raw_status = body.get("status") or {}
    current = parse_status(raw_status, logger=logger)
    if raw_status:
        children = await observe_children(api=api, owner=owner, logger=logger)
    else:
        # Never reconciled (no operator wrote a status yet): its children do not exist, or
        # are ours from a reconcile that stopped before its status write, which applying
        # them again puts right. Reading them would cost four requests per new deployment
        # before its RayCluster is even asked for, when many are applied at once.
        children = Children(
            raycluster=None, service=None, network_policy=None, observed=observe.Observed()
        )
    observed = dataclasses.replace(children.observed, generation=generation, now=moment)
    key = operator_key or _PROCESS_KEY
    admin_token, _ = tokens(key, owner)
    ignored = runtime_client.ignored_override(meta.get("annotations"))
    if ignored is not None and (where, ignored) not in _WARNED_OVERRIDES:
        _WARNED_OVERRIDES.add((where, ignored))
        logger.warning("%s: ignoring the runtime-url annotation %r (not allowed)", where, ignored)
        events(
            "RuntimeUrlIgnored",
            f"annotation {group.ANNOTATION_RUNTIME_URL}={ignored} ignored: the operator sends its "
            "admin token only to the deployment's own Service unless it runs with "
            "--allow-runtime-url-override (local development)",
        )
    url = runtime_client.runtime_url(
        name=owner.name,
        namespace=owner.namespace,
        annotations=meta.get("annotations"),
        raycluster_annotations=((children.raycluster or {}).get("metadata") or {}).get(
            "annotations"
        ),
    )
    if observed.raycluster is not None and observed.raycluster.head_ready:
        runtime = await observe_runtime(
            url=url, token=admin_token, factory=runtime_factory, logger=logger
        )
        observed = dataclasses.replace(observed, runtime=runtime)
        if runtime is not None:
            applied, refused = await sync_settings(
                url=url, token=admin_token, spec=spec, runtime=runtime, factory=runtime_factory
            )
            if applied:
                text = ", ".join(f"{k}={v}" for k, v in sorted(applied.items()))
                logger.info("%s: runtime settings changed live: %s", where, text)
                events("SettingsApplied", f"runtime settings changed live: {text}")
            if refused and (where, generation, refused) not in _WARNED_SETTINGS:
                _WARNED_SETTINGS.add((where, generation, refused))
                events("SettingsRefused", f"the runtime refused the spec's settings: {refused}")
    steps = resize.plan_resize(spec, current, observed)
    if observed.raycluster is None:  # nothing created yet: is the model there to serve?
        problem = await model_problem(api=api, owner=owner, spec=spec, logger=logger)
        if problem is not None:
            steps = availability.hold_back(steps, problem=problem, status=current)
    created: list[str] = []
    phase: actions.SetPhase | None = None
    planned: status_.ResizeStatus | None | actions.Keep = actions.KEEP
    outcome: actions.ScaleOutcome | None = None
    requeue: float | None = None
    writes = sorted(
        (a for a in steps if isinstance(a, CHILD_ACTIONS)),
        key=lambda a: CHILD_ACTIONS.index(type(a)),
    )
    # Independent writes, sent at once: the RayCluster (the slowest to come up) first.
    results = await asyncio.gather(
        *(
            _execute(write, api=api, owner=owner, spec=spec, children=children, key=key)
            for write in writes
        ),
        return_exceptions=True,
    )
    made: list[str] = []
    failure: BaseException | None = None
    for write, result in zip(writes, results, strict=True):
        if isinstance(result, BaseException):
            failure = failure or result
            continue
        if isinstance(write, actions.ApplyRayCluster) and result is not None:
            logger.info(
                "%s: applied RayCluster: worker replicas %d, workersToDelete %s",
                where,
                write.worker_replicas,
                list(write.workers_to_delete),
            )
        if result is not None and result.created:
            kind, name = result.obj["kind"], result.obj["metadata"]["name"]
            created.append(f"{kind}/{name}")
            made.append(f"{kind} {name}")
            logger.info("created %s %s/%s", kind, owner.namespace, name)
    if made:
        events("Created", "Created " + ", ".join(made))
    if failure is not None:
        raise failure  # what was created is reported; the retry applies the rest
    for action in steps:
        if isinstance(action, actions.SetPhase):
            phase = action
        elif isinstance(action, actions.SetResize):
            planned = action.resize
        elif isinstance(action, actions.Event):
            events(action.reason, action.message)
        elif isinstance(action, actions.Requeue):
            requeue = action.seconds
        elif isinstance(action, actions.ScaleRuntime):
            outcome = await scale_runtime(
                url=url,
                token=admin_token,
                new_size=action.new_size,
                factory=runtime_factory,
            )
            logger.info("%s: asked the runtime for size %d: %s", where, action.new_size, outcome)
    if phase is None:  # plan_resize always ends with one; keep the status honest regardless
        phase = actions.SetPhase(current.phase or status_.Phase.PENDING, "Unknown", "")
    if outcome is not None and isinstance(planned, status_.ResizeStatus):
        planned, more = scale_answer.after_scale(planned, outcome, now=moment)
        for event in more:
            events(event.reason, event.message)
        phase = scale_answer.phase_after_scale(planned, phase)
        requeue = decide.REQUEUE_SECONDS
    resize_now = current.resize if isinstance(planned, actions.Keep) else planned
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
    if scaler.requeue is not None:
        requeue = scaler.requeue if requeue is None else min(requeue, scaler.requeue)
    new = plan_status.next_status(
        name=owner.name,
        namespace=owner.namespace,
        generation=generation,
        target=spec.data_parallel_size,
        current=current,
        observed=observed,
        phase=phase,
        now=clock.rfc3339(moment),
        resize_status=planned,
        autoscaling=scaler.status,
    )
    written = plan_status.needs_write(raw_status, new)
    resource_version: str | None = None
    if written:
        stored = await api.patch_status(
            namespace=owner.namespace,
            name=owner.name,
            patch=plan_status.merge_patch(raw_status, new),
        )
        resource_version = (stored.get("metadata") or {}).get("resourceVersion")
        logger.info(
            "%s: status: phase=%s dp=%s target=%s stage=%s",
            where,
            phase.phase.value,
            new.data_parallel_size,
            new.target_data_parallel_size,
            new.resize.stage.value if new.resize else None,
        )
    logger.debug(
        "reconciled %s: phase=%s created=%s status %s",
        where,
        phase.phase.value,
        created,
        "written" if written else "unchanged",
    )
    return Outcome(
        phase=phase.phase,
        created=tuple(created),
        status_written=written,
        requeue_after=requeue,
        previous=current,
        status=new,
        runtime_reachable=(
            observed.runtime is not None
            if observed.raycluster is not None and observed.raycluster.head_ready
            else None
        ),
        autoscale_decision=scaler.decision,
        resource_version=resource_version,
    )
