"""One reconcile of a MoEDeployment: observe -> plan -> apply -> one status write.

Glue between the pure planner (``plan``) and the API client (``k8s``); no kopf here, so the
handlers stay thin and this can be driven by any caller (kopf handlers, a timer, a test).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import logging
import secrets
from collections.abc import Callable
from typing import Any, Final, Union

import httpx
import pydantic

from moe_operator import runtime_client
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.k8s import api as k8s_api
from moe_operator.plan import builders, diff, observe, resize
from moe_operator.plan import status as plan_status

Logger = Union[logging.Logger, "logging.LoggerAdapter[Any]"]
#: ``events(reason, message)``: posts a Kubernetes event on the MoEDeployment.
EventSink = Callable[[str, str], None]
#: ``factory(base_url, admin_token)``: a client of one runtime (tests pass a fake transport).
RuntimeFactory = Callable[[str, Union[str, None]], runtime_client.RuntimeClient]

RUNTIME_TIMEOUT_SECONDS: Final = 3.0


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
    """The children as stored (``None``: missing), and the observation planned on."""

    raycluster: dict[str, Any] | None
    service: dict[str, Any] | None
    secret: dict[str, Any] | None
    observed: observe.Observed

    def admin_token(self) -> str | None:
        """The runtime's admin token from the Secret (``None`` when missing or unreadable)."""
        encoded = ((self.secret or {}).get("data") or {}).get(builders.SECRET_TOKEN_KEY)
        if not encoded:
            return None
        try:
            return base64.b64decode(encoded).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None


async def observe_children(*, api: k8s_api.Api, owner: builders.Owner) -> Children:
    ray, service, secret = await asyncio.gather(
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
            api_version="v1",
            kind="Secret",
            namespace=owner.namespace,
            name=builders.secret_name(owner.name),
        ),
    )
    observed = observe.Observed(
        raycluster=observe.raycluster(ray),
        secret_exists=secret is not None,
        service_exists=service is not None,
    )
    return Children(raycluster=ray, service=service, secret=secret, observed=observed)


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
            status = await client.status()
        except (httpx.HTTPError, runtime_client.RuntimeApiError, pydantic.ValidationError) as error:
            logger.debug("runtime at %s not observed: %s", url, error)
            return None
    return observe.RuntimeObservation(
        data_parallel_size=status.data_parallel_size,
        target_data_parallel_size=status.target_data_parallel_size or status.data_parallel_size,
        stage=status.stage,
        balancedness=(status.eplb or {}).get("balancedness"),
    )


async def _apply_unless_current(
    api: k8s_api.Api, desired: dict[str, Any], stored: dict[str, Any] | None
) -> k8s_api.ApplyResult:
    if stored is not None and diff.contains(stored, desired):
        return k8s_api.ApplyResult(obj=stored, created=False)
    return await api.apply(desired)


async def _execute(
    action: resize.Action,
    *,
    api: k8s_api.Api,
    owner: builders.Owner,
    spec: spec_.MoEDeploymentSpec,
    children: Children,
) -> k8s_api.ApplyResult | None:
    if isinstance(action, resize.EnsureSecret):
        token = secrets.token_urlsafe(32)
        return await api.create(builders.build_secret(owner=owner, token=token))
    if isinstance(action, resize.ApplyRayCluster):
        desired = builders.build_raycluster(
            owner=owner, spec=spec, worker_replicas=action.worker_replicas
        )
        return await _apply_unless_current(api, desired, children.raycluster)
    if isinstance(action, resize.ApplyService):
        return await _apply_unless_current(
            api, builders.build_service(owner=owner), children.service
        )
    if isinstance(action, resize.ScaleRuntime):
        raise NotImplementedError("live resizes are driven by the resize driver")
    return None


async def reconcile(
    *,
    api: k8s_api.Api,
    body: dict[str, Any],
    events: EventSink,
    logger: Logger,
    now: str | None = None,
    runtime_factory: RuntimeFactory = default_runtime_factory,
) -> Outcome:
    """Bring the children in line with the spec and write the status if it changed.

    The runtime is asked for its view only once Ray reports the head ready; its URL comes
    from :func:`runtime_client.runtime_url` (annotation, ``$MOE_RUNTIME_URL_TEMPLATE``, or the
    Service).
    """
    meta = body["metadata"]
    owner = builders.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    generation = int(meta.get("generation") or 1)
    spec = parse_spec(body.get("spec"))
    raw_status = body.get("status") or {}
    current = parse_status(raw_status, logger=logger)
    children = await observe_children(api=api, owner=owner)
    observed = children.observed
    if observed.raycluster is not None and observed.raycluster.head_ready:
        url = runtime_client.runtime_url(
            name=owner.name,
            namespace=owner.namespace,
            annotations=meta.get("annotations"),
            raycluster_annotations=((children.raycluster or {}).get("metadata") or {}).get(
                "annotations"
            ),
        )
        runtime = await observe_runtime(
            url=url, token=children.admin_token(), factory=runtime_factory, logger=logger
        )
        observed = dataclasses.replace(observed, runtime=runtime)
    actions = resize.plan_resize(spec, current, observed)
    created: list[str] = []
    phase: resize.SetPhase | None = None
    for action in actions:
        if isinstance(action, resize.SetPhase):
            phase = action
            continue
        result = await _execute(action, api=api, owner=owner, spec=spec, children=children)
        if result is not None and result.created:
            kind, name = result.obj["kind"], result.obj["metadata"]["name"]
            created.append(f"{kind}/{name}")
            logger.info("created %s %s/%s", kind, owner.namespace, name)
            events("Created", f"Created {kind} {name}")
    if phase is None:  # plan_resize always ends with one; keep the status honest regardless
        phase = resize.SetPhase(current.phase or status_.Phase.PENDING, "Unknown", "")
    new = plan_status.next_status(
        name=owner.name,
        namespace=owner.namespace,
        generation=generation,
        target=spec.data_parallel_size,
        current=current,
        observed=observed,
        phase=phase,
        now=now or plan_status.now_rfc3339(),
    )
    written = plan_status.needs_write(raw_status, new)
    if written:
        await api.patch_status(
            namespace=owner.namespace,
            name=owner.name,
            patch=plan_status.merge_patch(raw_status, new),
        )
        logger.info(
            "status: phase=%s dp=%s target=%s",
            phase.phase.value,
            new.data_parallel_size,
            new.target_data_parallel_size,
        )
    logger.debug(
        "reconciled %s/%s: phase=%s created=%s status %s",
        owner.namespace,
        owner.name,
        phase.phase.value,
        created,
        "written" if written else "unchanged",
    )
    return Outcome(phase=phase.phase, created=tuple(created), status_written=written)
