"""Schema fuzzing of the runtime's HTTP API (schemathesis) against `moe-runtime serve`'s own app.

The app is what `cli.build` makes (LocalExecutor, synthetic tiny model with a 64-token context so
a generation is short), admin token set, a small queue bound. Every operation of the OpenAPI
document is driven with schema-valid and schema-violating input; every default check must hold:
no 5xx, every status and body as documented (errors in the OpenAI shape), invalid input refused,
the admin routes refuse a request without the token.

Not checked: `positive_data_acceptance` (schema-valid is not always acceptable: a prompt longer
than the context, a size outside the live bounds, a model name that is not served all get a
documented 400/404).

Bounded in `make test` (MOE_FUZZ_EXAMPLES, default 25 per operation and mode); `make fuzz` runs
many more. Two values are capped before a request, for this machine's sake only: the live
`max_data_parallel_size` (a scale request could otherwise start thousands of in-process ranks)
and `eplb_window_size` (a window of a million steps is a large buffer); the caps keep valid
values valid and leave invalid ones as they are.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi import checks as openapi_checks

from moe_runtime import cli
from moe_runtime.elastic import settings as live_settings

EXAMPLES = int(os.environ.get("MOE_FUZZ_EXAMPLES", "25"))
TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
    ("POST", "/scale_elastic_ep"),
    ("GET", "/elastic_ep/status"),
    ("POST", "/is_scaling_elastic_ep"),
    ("GET", "/elastic_ep/config"),
    ("PATCH", "/elastic_ep/config"),
]
#: (snake_case name, camelCase name, cap, largest valid value).
CAPS = [
    ("max_data_parallel_size", "maxDataParallelSize", 2, live_settings.MAX_SIZE),
    ("eplb_window_size", "eplbWindowSize", 1000, live_settings.MAX_WINDOW_SIZE),
    # each spare is a worker started in this process: one is enough to exercise it
    ("warm_spare_ranks", "warmSpareRanks", 1, live_settings.MAX_SPARES),
]


@pytest.fixture(scope="module")
def runtime() -> Iterator[cli.Runtime]:
    args = cli.build_parser().parse_args(
        ["serve", "--model", "synthetic://tiny?seed=0&max_position_embeddings=64"]
        + ["--data-parallel-size", "1", "--max-data-parallel-size", "2", "--executor", "local"]
        + ["--admin-token", TOKEN, "--max-queued-requests", "8", "--drain-timeout", "1"]
    )
    rt = cli.build(args)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def api(runtime: cli.Runtime) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", runtime.app)


def _cap(body: Any) -> None:
    """Caps the valid values of CAPS (an int, or a float with no fraction: JSON Schema's and the
    API's integer) and leaves every invalid one as it is."""
    if not isinstance(body, dict):
        return
    for snake, camel, cap, largest in CAPS:
        for key in (snake, camel):
            value = body.get(key)
            integral = type(value) is int or (type(value) is float and value.is_integer())
            if integral and 1 <= value <= largest:
                body[key] = min(int(value), cap)


def _headers(case: Any) -> dict[str, str]:
    """The admin token, unless the case is about a missing or bad header (it must get 401)."""
    components = case.meta.components if case.meta is not None else {}
    for location, info in components.items():
        if str(getattr(location, "value", location)) == "header" and not info.mode.is_positive:
            return {}
    return AUTH


@pytest.mark.parametrize("mode", list(GenerationMode), ids=str)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_the_api_holds_to_its_schema(
    api: Any, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api[path][method]
    takes_input = operation.body or operation.query or operation.headers
    if not mode.is_positive and not takes_input:
        pytest.skip("no input to make invalid")

    @given(operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        _cap(case.body)
        case.call_and_validate(
            headers=_headers(case), excluded_checks=[openapi_checks.positive_data_acceptance]
        )

    run()


def test_fuzzing_left_the_server_serving(runtime: cli.Runtime) -> None:
    """After the fuzz (it may have resized and reconfigured): a plain completion works."""
    from fastapi import testclient

    assert runtime.app is not None
    client = testclient.TestClient(runtime.app)
    body = {"model": "tiny", "prompt": [256, 72, 105], "max_tokens": 4, "temperature": 0}
    client.patch("/elastic_ep/config", json={"max_queued_requests": 0}, headers=AUTH)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 4
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    # The caps held: never more in-process ranks than the capped size and spares allow.
    caps = {snake: cap for snake, _, cap, _ in CAPS}
    ranks = runtime.executor.rank_infos()
    assert len(ranks) <= caps["max_data_parallel_size"] + caps["warm_spare_ranks"], ranks
