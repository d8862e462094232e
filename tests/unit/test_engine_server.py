"""The HTTP API in process (httpx ASGI transport) over the engine and the fake executor."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import fastapi
import httpx
import pytest

from moe_runtime import server
from moe_runtime.engine import core, request, seam
from moe_runtime.server import generation
from tests.support import engine_fakes as fakes

MAX_LEN = 64


@pytest.fixture(scope="module")
def app() -> Iterator[fastapi.FastAPI]:
    engine = core.Engine(
        fakes.FakeExecutor(2),
        fakes.Tokenizer(),
        seam.EngineConfig(max_model_len=MAX_LEN, max_num_seqs_per_rank=8, max_tokens_per_step=64),
    )
    admin = fastapi.APIRouter()

    @admin.get("/elastic_ep/status")
    async def status() -> dict[str, Any]:
        return {"data_parallel_size": 2}

    application = server.create_app(engine, served_model_name=fakes.MODEL, admin_router=admin)
    engine.start()
    yield application
    engine.stop()


def test_completion(app: fastapi.FastAPI) -> None:
    resp = fakes.run(
        fakes.post(app, {"model": fakes.MODEL, "prompt": "ab", "max_tokens": 3, "temperature": 0})
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    (choice,) = body["choices"]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (
        "cde",
        [2, 3, 4],
        "length",
    )
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert body["object"] == "text_completion" and body["model"] == fakes.MODEL


def test_null_max_tokens_fills_the_context(app: fastapi.FastAPI) -> None:
    body = {"model": fakes.MODEL, "prompt": "a" * 60, "max_tokens": None, "ignore_eos": True}
    resp = fakes.run(fakes.post(app, body))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == MAX_LEN - 60


def test_token_id_prompt_and_stop(app: fastapi.FastAPI) -> None:
    resp = fakes.run(
        fakes.post(
            app,
            {"model": fakes.MODEL, "prompt": [0], "max_tokens": 10, "temperature": 0, "stop": "e"},
        )
    )
    choice = resp.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("bcd", "stop")


def test_stream_ends_with_done_and_matches(app: fastapi.FastAPI) -> None:
    body = {
        "model": fakes.MODEL,
        "prompt": "a",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = fakes.run(fakes.post(app, body))
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in resp.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert (text, ids) == ("bcdef", [1, 2, 3, 4, 5])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_seeded_sampling_is_reproducible(app: fastapi.FastAPI) -> None:
    body = {"model": fakes.MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 0.7, "seed": 5}
    a, b = fakes.run(fakes.post(app, body)), fakes.run(fakes.post(app, body))
    assert a.json()["choices"][0]["token_ids"] == b.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        pytest.param(b"{not json", 400, None, "invalid_json", id="malformed-json"),
        pytest.param([1, 2], 400, None, "invalid_body", id="not-an-object"),
        pytest.param({"prompt": "a"}, 400, "model", "invalid_value", id="missing-model"),
        pytest.param(
            {"model": fakes.MODEL, "prompt": "a", "max_tokens": "5"},
            400,
            "max_tokens",
            "invalid_value",
            id="max-tokens-string",
        ),
        pytest.param(
            {"model": fakes.MODEL, "prompt": 7}, 400, "prompt", "invalid_value", id="prompt-number"
        ),
        pytest.param(
            {"model": fakes.MODEL, "prompt": "a", "max_tokens": -1},
            400,
            "max_tokens",
            "invalid_value",
            id="negative-max-tokens",
        ),
        pytest.param(
            {"model": fakes.MODEL, "prompt": "a", "max_tokens": 10**12},
            400,
            "max_tokens",
            "context_length_exceeded",
            id="huge-max-tokens",
        ),
        pytest.param(
            {"model": fakes.MODEL, "prompt": "a" * MAX_LEN},
            400,
            "prompt",
            "context_length_exceeded",
            id="prompt-too-long",
        ),
        pytest.param(
            {"model": fakes.MODEL, "prompt": [1, 99]},
            400,
            "prompt",
            "invalid_value",
            id="id-out-of-vocab",
        ),
        pytest.param(
            {"model": fakes.MODEL, "prompt": [1, -1]},
            400,
            "prompt",
            "invalid_value",
            id="negative-id",
        ),
        pytest.param(
            {"model": "other", "prompt": "a"}, 404, "model", "model_not_found", id="unknown-model"
        ),
        pytest.param(
            {"model": fakes.MODEL, "prompt": "a", "n": 2},
            400,
            "n",
            "unsupported_parameter",
            id="n-2",
        ),
        pytest.param(
            {"model": fakes.MODEL, "prompt": ["a", "b"]},
            400,
            "prompt",
            "unsupported_parameter",
            id="two-prompts",
        ),
        pytest.param(
            {"model": fakes.MODEL, "prompt": "a", "temperature": 3},
            400,
            "temperature",
            "invalid_value",
            id="temperature-range",
        ),
        pytest.param(
            {"model": fakes.MODEL, "prompt": "a", "frobnicate": 1},
            400,
            "frobnicate",
            "invalid_value",
            id="unknown-field",
        ),
    ],
)
def test_bad_requests_get_openai_errors(
    app: fastapi.FastAPI, body: Any, status: int, param: str | None, code: str
) -> None:
    resp = fakes.run(fakes.post(app, body))
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"]
    assert fakes.run(fakes.get(app, "/health")).status_code == 200


def test_models_health_metrics_admin(app: fastapi.FastAPI) -> None:
    models = fakes.run(fakes.get(app, "/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [fakes.MODEL]
    assert fakes.run(fakes.get(app, "/health")).json() == {"status": "ok"}
    fakes.run(fakes.post(app, {"model": fakes.MODEL, "prompt": "a", "max_tokens": 2}))
    text = fakes.run(fakes.get(app, "/metrics")).text
    for name in (
        'moe_requests_total{outcome="length"}',
        "moe_prompt_tokens_total",
        "moe_generation_tokens_total",
        "moe_requests_waiting",
        "moe_requests_running",
        "moe_step_seconds_bucket",
        "moe_step_batch_size_bucket",
        "moe_time_to_first_token_seconds_bucket",
        "moe_data_parallel_size 2.0",
    ):
        assert name in text, name
    assert fakes.run(fakes.get(app, "/elastic_ep/status")).json() == {"data_parallel_size": 2}
    missing = fakes.run(fakes.get(app, "/nope"))
    assert missing.status_code == 404 and "error" in missing.json()


def test_health_and_queueing_while_a_boundary_call_holds_the_loop(app: fastapi.FastAPI) -> None:
    engine: core.Engine = app.state.api.engine
    release = threading.Event()
    entered = threading.Event()

    def hold() -> None:  # what a resize switch does: the loop does not step meanwhile
        entered.set()
        assert release.wait(30)

    held = engine.call_at_boundary(hold)
    assert entered.wait(30)

    async def during() -> tuple[int, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            health = (await c.get("/health")).status_code
            body = {"model": fakes.MODEL, "prompt": "a", "max_tokens": 2, "temperature": 0}
            pending = asyncio.ensure_future(c.post("/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while engine.stats().num_waiting < 1:  # queued, not refused
                assert time.monotonic() < deadline, "the request never reached the queue"
                await asyncio.sleep(0.005)
            assert not pending.done()
            release.set()
            return health, await pending

    health, resp = fakes.run(during())
    held.result(30)
    assert health == 200
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "bc"


def test_non_streamed_request_is_aborted_when_the_client_goes(app: fastapi.FastAPI) -> None:
    api: generation.Generation = app.state.api

    class Gone:
        async def is_disconnected(self) -> bool:
            return True

    async def go() -> tuple[object, request.RequestHandle]:
        endless = request.Request(
            request_id="gone", prompt_token_ids=[0], max_tokens=MAX_LEN - 1, ignore_eos=True
        )
        handle = api.engine.add_request(endless)
        outputs = await api.collect_unless_gone(handle, Gone())  # type: ignore[arg-type]
        return outputs, handle

    release = threading.Event()
    held = api.engine.call_at_boundary(lambda: release.wait(30))  # no step can finish it first
    try:
        outputs, handle = fakes.run(go())
    finally:
        release.set()
    held.result(30)
    assert outputs is None
    assert handle.result(30).finish_reason is request.FinishReason.ABORT
