"""kopf registrations, kept thin: every watch event goes to the operator's loop
(``moe_operator.loop``), which queues the deployments to reconcile.

Only ``@kopf.on.event`` handlers: kopf's create/update/resume handlers would PATCH their
progress and diff base into annotations after every handling (one more write and one more
watch event per change), and timers or daemons would make kopf put a finalizer on every
object, so deleting a deployment would hang whenever the operator is down. An event handler's
error is logged and ignored by kopf, never retried (``process_watching_cause`` runs them with
``ErrorsMode.IGNORED``, kopf/_core/reactor/processing.py), and kopf's ``PermanentError`` /
``TemporaryError`` only steer the retries of change handlers (kopf/_core/actions/
execution.py): so the handlers only queue, and the loop owns retries, backoff and what is not
retried (an invalid spec waits for a spec change). They return at once: kopf handles one
object's events one after the other, and a reconcile waits on the API server and the runtime.

kopf's memo holds one :class:`loop.Operator`: kopf gives every object a shallow copy of the
operator's memo (``copy.copy(memobase)`` in kopf/_core/reactor/inventory.py, ``recall``), so
all of them share it.
"""

from __future__ import annotations

import logging
from typing import Any, Final, cast

import kopf

from moe_operator import loop, metrics
from moe_operator.api import group
from moe_operator.k8s import api as k8s_api

RESOURCE: Final = (group.GROUP, group.VERSION, group.PLURAL)
RAYCLUSTERS: Final = ("ray.io", "v1", "rayclusters")
PODS: Final = ("", "v1", "pods")

logger = logging.getLogger(__name__)

#: The operator's metrics (one registry per process); served on ``METRICS_ADDRESS`` when set
#: (``moe-operator run --metrics HOST:PORT`` sets it before kopf starts).
METRICS: Final = metrics.OperatorMetrics()
METRICS_ADDRESS: tuple[str, int] | None = None


class _NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base, never built: with no change handlers registered (only
    ``@kopf.on.event``) nothing reads it, and kopf would deep-copy every watched body (status
    and managedFields included) to build it, for every event on every watched kind."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()


def post_event(body: dict[str, Any], reason: str, message: str, warning: bool) -> None:
    """A Kubernetes event on the MoEDeployment, through kopf's event queue."""
    post = kopf.warn if warning else kopf.info
    try:
        post(kopf.Body(cast(kopf.RawBody, body)), reason=reason, message=message)
    except LookupError:
        # kopf's event queue lives in context variables of its per-object tasks: a reconcile
        # outside them (none captured yet, see loop.Operator.kopf_context) cannot post. The
        # reconcile must go on (it may have written already); the log keeps the event.
        logger.warning("event %s not posted (outside kopf's tasks): %s", reason, message)


def _operator(memo: Any) -> loop.Operator:
    operator: loop.Operator = memo.operator
    return operator


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    # No change handlers, so kopf stores nothing on the objects; these name where it would.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=group.GROUP)
    settings.persistence.diffbase_storage = _NoDiffBase(
        prefix=group.GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{group.GROUP}/operator"
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    api = k8s_api.Api.from_environment()
    operator = loop.Operator(
        api=api,
        # Every deployment's tokens derive from this key (plan.credentials): no Secret is read
        # outside the operator's own namespace.
        operator_key=await api.operator_key(namespace=k8s_api.operator_namespace()),
        post=post_event,
        metrics=METRICS,
    )
    if METRICS_ADDRESS is not None:
        operator.metrics_server = METRICS.serve(*METRICS_ADDRESS)
        logger.info("metrics on http://%s:%d/metrics", *METRICS_ADDRESS)
    operator.start()
    memo.operator = operator


@kopf.on.cleanup()
async def close(memo: Any, **_: Any) -> None:
    operator: loop.Operator | None = memo.get("operator")
    if operator is not None:
        await operator.close()


@kopf.on.event(*RESOURCE)
async def deployment_changed(
    type: str | None,  # noqa: A002 - kopf's name
    event: kopf.RawEvent,
    memo: Any,
    **_: Any,
) -> None:
    """Any watch event of a MoEDeployment (the loop decides whether it needs a reconcile)."""
    operator = _operator(memo)
    operator.capture_context()
    operator.deployment_event(type, cast(dict[str, Any], event["object"]))


@kopf.on.event(*RAYCLUSTERS, labels={group.LABEL_MANAGED_BY: group.MANAGED_BY})
async def raycluster_changed(
    type: str | None,  # noqa: A002 - kopf's name
    labels: kopf.Labels,
    namespace: str | None,
    memo: Any,
    **_: Any,
) -> None:
    """A managed RayCluster changed (status, deletion, someone's edit): reconcile its owner."""
    owner = labels.get(group.LABEL_DEPLOYMENT)
    # None: the initial listing (the deployments' own listing covers those); ADDED: almost
    # always our own create.
    if type in (None, "ADDED") or owner is None:
        return
    operator = _operator(memo)
    operator.capture_context()
    operator.child_event((namespace or "", owner))


@kopf.on.event(*PODS, labels={group.LABEL_MANAGED_BY: group.MANAGED_BY})
async def pod_changed(
    type: str | None,  # noqa: A002 - kopf's name
    labels: kopf.Labels,
    namespace: str | None,
    memo: Any,
    **_: Any,
) -> None:
    """A Ray pod of a managed RayCluster changed (Ready, terminating, gone): reconcile its
    owner soon (one reconcile per burst of pod events)."""
    owner = labels.get(group.LABEL_DEPLOYMENT)
    if type is None or owner is None:
        return
    operator = _operator(memo)
    operator.capture_context()
    operator.child_event((namespace or "", owner), delay=loop.POD_DEBOUNCE_SECONDS)
