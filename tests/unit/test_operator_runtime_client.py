"""The runtime admin client against an ``httpx.MockTransport``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from moe_contract import status as runtime_status
from moe_operator import runtime_client

Handler = Callable[[httpx.Request], httpx.Response]


def client(handler: Handler, *, token: str | None = "tok") -> runtime_client.RuntimeClient:
    return runtime_client.RuntimeClient(
        "http://runtime:8000", token=token, transport=httpx.MockTransport(handler)
    )


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_scale_sends_the_body_and_the_token() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            202, json={"resize_id": "r1", "from": 2, "to": 4, "stage": "Provisioning"}
        )

    async def main() -> runtime_client.ScaleAccepted:
        async with client(handler) as c:
            return await c.scale(4, drain_timeout=30)

    accepted = run(main())
    assert accepted == runtime_client.ScaleAccepted(
        resize_id="r1", from_size=2, to_size=4, stage="Provisioning"
    )
    (request,) = seen
    assert (request.method, request.url.path) == ("POST", "/scale_elastic_ep")
    assert request.headers["Authorization"] == "Bearer tok"
    assert json.loads(request.content) == {"new_data_parallel_size": 4, "drain_timeout": 30}


def test_scale_wait_passes_the_query() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.params["wait"] == "true"
        return httpx.Response(200, json={"message": "Scaled to 3 data parallel engines"})

    async def main() -> runtime_client.ScaleAccepted:
        async with client(handler) as c:
            return await c.scale(3, wait=True)

    result = run(main())
    assert isinstance(result, runtime_client.ScaleAccepted)
    assert result.message == "Scaled to 3 data parallel engines"


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (409, runtime_client.ResizeConflict),
        (401, runtime_client.Unauthorized),
        (400, runtime_client.RuntimeApiError),
    ],
    ids=["conflict", "unauthorized", "bad-request"],
)
def test_scale_errors(status: int, error: type[Exception]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"detail": "no"})

    async def main() -> None:
        async with client(handler) as c:
            await c.scale(2)

    with pytest.raises(error):
        run(main())


def test_scale_refuses_a_size_below_one() -> None:
    async def main() -> None:
        async with client(lambda r: httpx.Response(500)) as c:
            await c.scale(0)

    with pytest.raises(ValueError, match="new_size"):
        run(main())


def test_status_is_parsed() -> None:
    sent = runtime_status.ElasticStatus(
        data_parallel_size=2,
        target_data_parallel_size=2,
        ranks=[runtime_status.Rank(rank=0, node_id="n0", pod="p0", healthy=True, num_experts=8)],
        eplb=runtime_status.Eplb(balancedness=0.9),
    )
    payload = {**sent.to_json(), "future_field": 1}  # a newer runtime's

    async def main() -> runtime_status.ElasticStatus:
        async with client(lambda r: httpx.Response(200, json=payload)) as c:
            return await c.status()

    status = run(main())
    assert isinstance(status, runtime_status.ElasticStatus)
    assert status.data_parallel_size == 2
    assert status.ranks[0].num_experts == 8


def test_health_and_is_scaling() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={})
        return httpx.Response(200, json={"is_scaling_elastic_ep": True})

    async def main() -> tuple[bool, bool]:
        async with client(handler) as c:
            return await c.health(), await c.is_scaling()

    assert run(main()) == (True, True)


def test_health_is_false_when_unreachable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async def main() -> bool:
        async with client(handler, token=None) as c:
            return await c.health()

    assert run(main()) is False


@pytest.mark.parametrize(
    ("annotations", "environ", "url"),
    [
        ({}, {}, "http://tiny-api.ml.svc:8000"),
        ({}, {"MOE_RUNTIME_URL_TEMPLATE": "http://127.0.0.1:9000/{namespace}/{name}"},
         "http://127.0.0.1:9000/ml/tiny"),
        ({"elasticmoe.io/runtime-url": "http://127.0.0.1:8123/"},
         {"MOE_RUNTIME_URL_TEMPLATE": "http://x", "MOE_ALLOW_RUNTIME_URL_OVERRIDE": "1"},
         "http://127.0.0.1:8123"),
        # without the operator's opt-in an annotation cannot redirect the admin token
        ({"elasticmoe.io/runtime-url": "http://attacker.example:80/"}, {},
         "http://tiny-api.ml.svc:8000"),
    ],
    ids=["service", "env-template", "annotation-wins-when-allowed", "annotation-ignored"],
)  # fmt: skip
def test_runtime_url(annotations: dict[str, str], environ: dict[str, str], url: str) -> None:
    local = {"elasticmoe.io/local-endpoint": "http://127.0.0.1:7777"}
    assert (
        runtime_client.runtime_url(
            name="tiny",
            namespace="ml",
            annotations=annotations,
            raycluster_annotations=local,
            environ=environ,
        )
        == url
    )


def test_an_ignored_override_is_reported() -> None:
    bad = {"elasticmoe.io/runtime-url": "http://attacker.example"}
    assert runtime_client.ignored_override(bad, environ={}) == "http://attacker.example"
    allowed = {"MOE_ALLOW_RUNTIME_URL_OVERRIDE": "1"}
    assert runtime_client.ignored_override(bad, environ=allowed) is None
    assert runtime_client.ignored_override({}, environ={}) is None


@pytest.mark.parametrize(
    ("environ", "url"),
    [({}, "http://tiny-api.ml.svc:8000"),
     ({"MOE_RUNTIME_URL_FROM_RAYCLUSTER": "1"}, "http://127.0.0.1:7777")],
    ids=["ignored-by-default", "trusted-when-enabled"],
)  # fmt: skip
def test_runtime_url_from_the_local_stand_in(environ: dict[str, str], url: str) -> None:
    local = {"elasticmoe.io/local-endpoint": "http://127.0.0.1:7777/"}
    got = runtime_client.runtime_url(
        name="tiny", namespace="ml", raycluster_annotations=local, environ=environ
    )
    assert got == url
