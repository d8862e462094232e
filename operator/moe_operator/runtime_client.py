"""Asynchronous httpx client of the runtime's admin API (docs/RUNTIME.md).

Used by the operator to observe a deployment (``GET /elastic_ep/status``, ``GET /health``) and,
from the resize driver, to ask for a live resize (``POST /scale_elastic_ep``). Tests pass an
``httpx.MockTransport``.

Where the runtime is reached, first match wins: with ``MOE_ALLOW_RUNTIME_URL_OVERRIDE=1``
(``moe-operator run --allow-runtime-url-override``; local development only), the
``elasticmoe.io/runtime-url`` annotation of the MoEDeployment; with
``MOE_RUNTIME_URL_FROM_RAYCLUSTER=1`` (the local KubeRay stand-in), the
``elasticmoe.io/local-endpoint`` annotation it puts on the RayCluster;
``$MOE_RUNTIME_URL_TEMPLATE`` (``{name}``, ``{namespace}`` and ``{service}`` filled in); else
the in-cluster Service. Annotations are off by default because the operator sends its admin
token and scale calls there: whoever may annotate a MoEDeployment could otherwise send them
anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Final

import httpx
import pydantic

from moe_contract import loading, names
from moe_contract import status as runtime_status
from moe_operator.api import group
from moe_operator.plan import builders

URL_TEMPLATE_ENV: Final = "MOE_RUNTIME_URL_TEMPLATE"
FROM_RAYCLUSTER_ENV: Final = "MOE_RUNTIME_URL_FROM_RAYCLUSTER"
ALLOW_OVERRIDE_ENV: Final = "MOE_ALLOW_RUNTIME_URL_OVERRIDE"


def ignored_override(
    annotations: Mapping[str, str] | None, *, environ: Mapping[str, str] | None = None
) -> str | None:
    """The ``elasticmoe.io/runtime-url`` annotation when it is set but not allowed (the
    operator warns about it once)."""
    env = os.environ if environ is None else environ
    override = (annotations or {}).get(group.ANNOTATION_RUNTIME_URL)
    return override if override and env.get(ALLOW_OVERRIDE_ENV) != "1" else None


def _chosen_url(
    *,
    name: str,
    namespace: str,
    annotations: Mapping[str, str] | None,
    raycluster_annotations: Mapping[str, str] | None,
    environ: Mapping[str, str] | None,
    cluster: str | None = None,
) -> str | None:
    """The runtime URL an annotation or ``$MOE_RUNTIME_URL_TEMPLATE`` chooses, if any
    (``cluster``: the RayCluster that serves, for a template that names ``{cluster}``)."""
    env = os.environ if environ is None else environ
    override = (annotations or {}).get(group.ANNOTATION_RUNTIME_URL)
    if override and env.get(ALLOW_OVERRIDE_ENV) == "1":
        return override.rstrip("/")
    local = (raycluster_annotations or {}).get(group.ANNOTATION_LOCAL_ENDPOINT)
    if local and env.get(FROM_RAYCLUSTER_ENV) == "1":
        return local.rstrip("/")
    template = env.get(URL_TEMPLATE_ENV)
    if template:
        return template.format(
            name=name,
            namespace=namespace,
            service=builders.service_name(name),
            cluster=cluster or builders.raycluster_name(name),
        ).rstrip("/")
    return None


def runtime_url(
    *,
    name: str,
    namespace: str,
    annotations: Mapping[str, str] | None = None,
    raycluster_annotations: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    cluster: str | None = None,
) -> str:
    """The base URL of a deployment's runtime API (``cluster``: the RayCluster that serves,
    for a template that names ``{cluster}``)."""
    chosen = _chosen_url(
        name=name,
        namespace=namespace,
        annotations=annotations,
        raycluster_annotations=raycluster_annotations,
        environ=environ,
        cluster=cluster,
    )
    return chosen or builders.endpoint(owner_name=name, namespace=namespace)


def loading_url(
    *,
    name: str,
    namespace: str,
    head_ip: str,
    annotations: Mapping[str, str] | None = None,
    raycluster_annotations: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    cluster: str | None = None,
) -> str:
    """Where a head that is not ready yet (loading its model) answers ``GET /ready``: the
    URL an annotation or the template chooses, else the head pod itself (the Service routes
    only to a ready head). Only ``/ready`` is asked there, with no token."""
    chosen = _chosen_url(
        name=name,
        namespace=namespace,
        annotations=annotations,
        raycluster_annotations=raycluster_annotations,
        environ=environ,
        cluster=cluster,
    )
    host = f"[{head_ip}]" if ":" in head_ip else head_ip
    return chosen or f"http://{host}:{names.RUNTIME_PORT}"


def cluster_url(
    *,
    name: str,
    namespace: str,
    cluster: str,
    raycluster_annotations: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The base URL of the runtime of one RayCluster of a deployment, whichever the Service
    selects (a rollout talks to both): the local stand-in's annotation, a
    ``$MOE_RUNTIME_URL_TEMPLATE`` that names ``{cluster}``, else KubeRay's head Service of
    that RayCluster (``CLUSTER-head-svc``: it exposes every port of the head container)."""
    env = os.environ if environ is None else environ
    local = (raycluster_annotations or {}).get(group.ANNOTATION_LOCAL_ENDPOINT)
    if local and env.get(FROM_RAYCLUSTER_ENV) == "1":
        return local.rstrip("/")
    template = env.get(URL_TEMPLATE_ENV)
    if template and "{cluster}" in template:
        return template.format(
            name=name, namespace=namespace, service=builders.service_name(name), cluster=cluster
        ).rstrip("/")
    return f"http://{cluster}-head-svc.{namespace}.svc:{names.RUNTIME_PORT}"


class _Response(pydantic.BaseModel):
    # Answers of our own runtime: tolerate fields added by newer runtimes.
    model_config = pydantic.ConfigDict(extra="ignore", populate_by_name=True)


class ScaleAccepted(_Response):
    """Answer of ``POST /scale_elastic_ep``."""

    resize_id: str | None = None
    from_size: int | None = pydantic.Field(default=None, alias="from")
    to_size: int | None = pydantic.Field(default=None, alias="to")
    stage: str | None = None
    message: str | None = None


class RuntimeApiError(Exception):
    """The runtime answered with an error."""

    def __init__(self, *, method: str, path: str, status: int, detail: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {detail[:500]}")
        self.status = status
        self.detail = detail

    @property
    def message(self) -> str:
        """The runtime's own words: ``error.message`` (OpenAI shape) or FastAPI's ``detail``,
        else the body as sent."""
        try:
            body = json.loads(self.detail)
        except ValueError:
            return self.detail
        if isinstance(body, dict):
            error = body.get("error")
            if isinstance(error, dict) and error.get("message"):
                return str(error["message"])
            if body.get("detail"):
                return str(body["detail"])
        return self.detail


class ResizeConflict(RuntimeApiError):
    """409: a resize to another size is running."""


class Unauthorized(RuntimeApiError):
    """401: the admin token is missing or wrong."""


class RuntimeClient:
    """Client of one runtime's admin API."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=timeout, transport=transport
        )

    async def __aenter__(self) -> RuntimeClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(
        self, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None
    ) -> Any:
        response = await self._client.request(method, path, json=json, params=params)
        if response.status_code >= 400:
            kind = {409: ResizeConflict, 401: Unauthorized}.get(
                response.status_code, RuntimeApiError
            )
            raise kind(method=method, path=path, status=response.status_code, detail=response.text)
        return response.json()

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200; False on any error or transport failure."""
        try:
            response = await self._client.get(names.HEALTH_PATH)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def ready(self) -> loading.ReadyBody:
        """``GET /ready`` (200 ready, 503 not ready or loading: both carry the body) read into
        the contract's model; ``RuntimeApiError`` for any other answer."""
        response = await self._client.get(names.READY_PATH)
        if response.status_code not in (200, 503):
            raise RuntimeApiError(
                method="GET",
                path=names.READY_PATH,
                status=response.status_code,
                detail=response.text,
            )
        return loading.ReadyBody.model_validate(response.json())

    async def status(self) -> runtime_status.ElasticStatus:
        """``GET /elastic_ep/status`` read into the contract's model."""
        return runtime_status.ElasticStatus.model_validate(await self.status_json())

    async def status_json(self) -> dict[str, Any]:
        """``GET /elastic_ep/status`` as the runtime sent it (records included)."""
        payload = await self._call("GET", names.STATUS_PATH)
        if not isinstance(payload, dict):
            raise RuntimeApiError(
                method="GET", path=names.STATUS_PATH, status=200, detail="not a JSON object"
            )
        return payload

    async def config(self) -> dict[str, Any]:
        """``GET /elastic_ep/config``: the settings a running runtime applies now."""
        payload = await self._call("GET", names.CONFIG_PATH)
        if not isinstance(payload, dict):
            raise RuntimeApiError(
                method="GET", path=names.CONFIG_PATH, status=200, detail="not a JSON object"
            )
        return payload

    async def patch_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        """``PATCH /elastic_ep/config``: change settings live (400 names a refused field and
        changes nothing)."""
        payload = await self._call("PATCH", names.CONFIG_PATH, json=changes)
        return payload if isinstance(payload, dict) else {}

    async def is_scaling(self) -> bool:
        payload = await self._call("POST", names.IS_SCALING_PATH)
        return bool(payload["is_scaling_elastic_ep"])

    async def scale(
        self, new_size: int, *, drain_timeout: int | None = None, wait: bool = False
    ) -> ScaleAccepted:
        """Ask for a live resize to ``new_size`` DP ranks (202 at once, or 200 when done)."""
        if new_size < 1:
            raise ValueError(f"new_size must be >= 1, got {new_size}")
        body: dict[str, int] = {"new_data_parallel_size": new_size}
        if drain_timeout is not None:
            body["drain_timeout"] = drain_timeout
        params = {"wait": "true"} if wait else None
        return ScaleAccepted.model_validate(
            await self._call("POST", names.SCALE_PATH, json=body, params=params)
        )
