"""The observe step of a reconcile: the children as stored, the Ray pods, and the runtime's own
view (``GET /elastic_ep/status`` and its live settings, ``GET /elastic_ep/config``). Reads
only; what was read becomes ``plan.observe.Observed`` for the planner.

Glue between the API client / runtime client and the pure parsers (``plan.observe``); no kopf.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from collections.abc import Callable
from typing import Any, Union

import httpx

from moe_contract import loading
from moe_operator import runtime_client
from moe_operator.api import spec as spec_
from moe_operator.k8s import api as k8s_api
from moe_operator.plan import access, availability, builders, observe, storage

Logger = Union[logging.Logger, "logging.LoggerAdapter[Any]"]
#: ``factory(base_url, admin_token)``: a client of one runtime (tests pass a fake transport).
RuntimeFactory = Callable[[str, Union[str, None]], runtime_client.RuntimeClient]


@dataclasses.dataclass(frozen=True)
class Children:
    """The children as stored (``None``: missing), and the observation planned on. The
    Secret is never read back (``plan.credentials``)."""

    raycluster: dict[str, Any] | None
    service: dict[str, Any] | None
    network_policy: dict[str, Any] | None
    observed: observe.Observed

    @classmethod
    def missing(cls) -> Children:
        """A deployment never reconciled: its children are taken as missing (not read)."""
        return cls(raycluster=None, service=None, network_policy=None, observed=observe.Observed())


@dataclasses.dataclass(frozen=True)
class Observation:
    """Everything one reconcile read before it plans."""

    children: Children
    #: The children's observation with the generation, the moment and the runtime's view.
    observed: observe.Observed
    #: Where the runtime is reached, and whether it was asked (Ray reports its head ready).
    url: str
    runtime_asked: bool
    #: ``GET /elastic_ep/config`` (``None``: not asked, away, or an older runtime).
    runtime_config: dict[str, Any] | None = None
    #: Why the spec's model cannot be served (``plan.availability``), read only while no
    #: RayCluster exists; ``None``: it can, or it was not checked.
    model_problem: str | None = None


async def ray_pods(
    *, api: k8s_api.Api, owner: builders.Owner, cluster: str, logger: Logger
) -> observe.PodsObservation | None:
    """The RayCluster's head and worker pods, terminating ones included (``None`` when they
    cannot be listed)."""
    selector = f"{observe.CLUSTER_LABEL}={cluster}"
    try:
        pods = await api.list(
            api_version="v1", kind="Pod", namespace=owner.namespace, label_selector=selector
        )
    except k8s_api.ApiError as error:
        logger.warning("%s/%s: Ray pods not listed: %s", owner.namespace, owner.name, error)
        return None
    return observe.pods(pods)


async def observe_children(
    *,
    api: k8s_api.Api,
    owner: builders.Owner,
    logger: Logger | None = None,
    cluster: str | None = None,
) -> Children:
    """The RayCluster (``cluster``, default the deployment's first), Service, NetworkPolicy
    and Ray pods, read at once."""
    log = logger or logging.getLogger(__name__)
    cluster = cluster or builders.raycluster_name(owner.name)
    ray, service, policy, pods = await asyncio.gather(
        api.get(
            api_version="ray.io/v1",
            kind="RayCluster",
            namespace=owner.namespace,
            name=cluster,
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
        ray_pods(api=api, owner=owner, cluster=cluster, logger=log),
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
        head_loading_ip=pods.head_loading_ip if pods is not None else None,
        head_failure=pods.head_failure if pods is not None else None,
        head_waiting=pods.head_waiting if pods is not None else None,
    )
    return Children(raycluster=ray, service=service, network_policy=policy, observed=observed)


async def observe_runtime(
    *, url: str, token: str | None, factory: RuntimeFactory, logger: Logger
) -> tuple[observe.RuntimeObservation | None, dict[str, Any] | None]:
    """The runtime's own view and its live settings; ``(None, None)`` when it does not answer
    (yet), a ``None`` config when only that is unavailable (an older runtime)."""
    async with factory(url, token) as client:
        try:
            payload = await client.status_json()
        except (httpx.HTTPError, runtime_client.RuntimeApiError, ValueError) as error:
            logger.debug("runtime at %s not observed: %s", url, error)
            return None, None
        try:
            runtime = observe.runtime(payload)
        except (KeyError, TypeError, ValueError) as error:
            logger.warning("runtime at %s sent a status this operator cannot read: %s", url, error)
            return None, None
        try:
            config: dict[str, Any] | None = await client.config()
        except (httpx.HTTPError, runtime_client.RuntimeApiError, ValueError):
            config = None  # an older runtime, or away: no live settings to compare
    return runtime, config


async def observe_loading(
    *, url: str, factory: RuntimeFactory, logger: Logger
) -> loading.LoadProgress | None:
    """What a head that is not ready yet is loading (``GET /ready`` with status ``loading``);
    ``None`` when it is not loading or does not answer (yet)."""
    async with factory(url, None) as client:  # /ready needs no token: none is sent
        try:
            body = await client.ready()
        except (httpx.HTTPError, runtime_client.RuntimeApiError, ValueError) as error:
            logger.debug("loading head at %s not observed: %s", url, error)
            return None
    return body.loading if body.status == loading.LOADING else None


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


async def observe_all(
    *,
    api: k8s_api.Api,
    owner: builders.Owner,
    spec: spec_.MoEDeploymentSpec,
    annotations: dict[str, str] | None,
    has_status: bool,
    generation: int,
    now: datetime.datetime,
    admin_token: str,
    factory: RuntimeFactory,
    logger: Logger,
    cluster: str | None = None,
) -> Observation:
    """The observe step. The runtime is asked for its view only once Ray reports the head
    ready; its URL comes from :func:`runtime_client.runtime_url` (annotation,
    ``$MOE_RUNTIME_URL_TEMPLATE``, or the Service)."""
    if has_status:
        children = await observe_children(api=api, owner=owner, logger=logger, cluster=cluster)
    else:
        # Never reconciled (no operator wrote a status yet): its children do not exist, or
        # are ours from a reconcile that stopped before its status write, which applying
        # them again puts right. Reading them would cost four requests per new deployment
        # before its RayCluster is even asked for, when many are applied at once.
        children = Children.missing()
    observed = dataclasses.replace(children.observed, generation=generation, now=now)
    url = runtime_client.runtime_url(
        name=owner.name,
        namespace=owner.namespace,
        annotations=annotations,
        raycluster_annotations=((children.raycluster or {}).get("metadata") or {}).get(
            "annotations"
        ),
        cluster=cluster,
    )
    asked = observed.raycluster is not None and observed.raycluster.head_ready
    config: dict[str, Any] | None = None
    if asked:
        runtime, config = await observe_runtime(
            url=url, token=admin_token, factory=factory, logger=logger
        )
        observed = dataclasses.replace(observed, runtime=runtime)
    elif observed.raycluster is not None and observed.head_loading_ip is not None:
        loading_at = runtime_client.loading_url(
            name=owner.name,
            namespace=owner.namespace,
            head_ip=observed.head_loading_ip,
            annotations=annotations,
            raycluster_annotations=((children.raycluster or {}).get("metadata") or {}).get(
                "annotations"
            ),
            cluster=cluster,
        )
        progress = await observe_loading(url=loading_at, factory=factory, logger=logger)
        observed = dataclasses.replace(observed, loading=progress)
    problem = None
    if observed.raycluster is None:  # nothing created yet: is the model there to serve?
        problem = await model_problem(api=api, owner=owner, spec=spec, logger=logger)
    return Observation(
        children=children,
        observed=observed,
        url=url,
        runtime_asked=asked,
        runtime_config=config,
        model_problem=problem,
    )
