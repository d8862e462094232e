"""The operator's autoscaler in a reconcile: list the namespace's HorizontalPodAutoscalers (one
that targets the deployment owns its size), decide (:func:`moe_operator.plan.autoscale.decide`,
pure), and write the size through the scale subresource, as an HPA would.

Glue between the planner and the API client, like :mod:`moe_operator.reconcile`; no kopf here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final, Union

from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.k8s import api as k8s_api
from moe_operator.plan import autoscale, observe

Logger = Union[logging.Logger, "logging.LoggerAdapter[Any]"]
EventSink = Callable[[str, str], None]

HPA_API_VERSION: Final = "autoscaling/v2"
HPA_KIND: Final = "HorizontalPodAutoscaler"


async def external(api: k8s_api.Api, *, namespace: str, name: str, logger: Logger) -> str | None:
    """The HPA (or KEDA ScaledObject) that scales this deployment, if any. When they cannot be
    listed (RBAC of an older install), none is assumed, with a warning: the operator's
    autoscaler then works as if alone."""
    try:
        hpas = await api.list(api_version=HPA_API_VERSION, kind=HPA_KIND, namespace=namespace)
    except k8s_api.ApiError as error:
        logger.warning(
            "%s/%s: HorizontalPodAutoscalers not listed (%s); assuming none targets it",
            namespace,
            name,
            error,
        )
        return None
    return autoscale.external(hpas, name=name)


async def run(
    *,
    api: k8s_api.Api,
    body: dict[str, Any],
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    observed: observe.Observed,
    resize: status_.ResizeStatus | None,
    events: EventSink,
    logger: Logger,
) -> autoscale.Decision:
    """One look of the autoscaler; posts its events and returns what it decided."""
    if not spec.autoscaling.enabled:
        return autoscale.Decision(status=None)
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    found = await external(api, namespace=namespace, name=name, logger=logger)
    decision = autoscale.decide(
        spec=spec, status=status, observed=observed, resize=resize, external_autoscaler=found
    )
    if decision.scale_to is not None:
        try:
            await api.patch_scale(
                namespace=namespace,
                name=name,
                replicas=decision.scale_to,
                resource_version=meta.get("resourceVersion"),
            )
        except k8s_api.ApiError as error:
            why = (
                "the deployment changed since it was read (HTTP 409); deciding again at the "
                "next sample"
                if error.status == 409
                else str(error)
            )
            logger.warning("%s/%s: autoscaler: %s", namespace, name, why)
            decision = autoscale.scale_failed(decision, why, before=status.autoscaling)
        else:
            logger.info(
                "%s/%s: autoscaler: %s",
                namespace,
                name,
                decision.status.message if decision.status else decision.scale_to,
            )
    for event in decision.events:
        events(event.reason, event.message)
    return decision
