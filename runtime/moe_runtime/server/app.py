"""The FastAPI app of the runtime's HTTP API (docs/RUNTIME.md): the routes, error handlers and
OpenAPI document.

`create_app(engine, served_model_name=...)` builds the app around a started engine; the
resize coordinator plugs its admin routes in with `admin_router`. Every error is answered in
the OpenAI error shape `{"error": {"message", "type", "param", "code"}}` (`param` names the
field at fault), and the OpenAPI document (`/openapi.json`) lists every status a route answers
with its body, so a schema fuzzer (tests/integration/test_fuzz.py) can hold the server to it.
The generation routes live in `completions` and `chat` (what they share: `generation`).

Backpressure: a request that finds the engine's queue at its bound (`--max-queued-requests`)
gets 429 with `Retry-After`; while a resize runs none is refused (`engine.queue`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fastapi
from fastapi import exceptions, responses
from starlette import exceptions as starlette_exceptions

from moe_contract import loading
from moe_runtime import api_schema
from moe_runtime import metrics as metrics_mod
from moe_runtime.engine import core
from moe_runtime.model import chat_template as chat_mod
from moe_runtime.server import chat, completions, errors
from moe_runtime.server import generation as gen_mod

#: Routes whose refusals count as rejected generation requests in the metrics.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class CloseWhenDraining:
    """ASGI middleware: while the engine drains (``Engine.draining``), every answer says
    ``Connection: close`` and the server closes the connection after it; a kept-alive client
    reconnects, through the Service, to the RayCluster that serves now. Pure ASGI (no
    ``BaseHTTPMiddleware``): streams and client disconnects pass through untouched."""

    def __init__(self, app: Any, *, engine: core.Engine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def closing(message: Any) -> None:
            if message["type"] == "http.response.start" and self.engine.draining:
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing)


def create_app(
    engine: core.Engine,
    *,
    served_model_name: str,
    admin_router: fastapi.APIRouter | None = None,
    metrics: metrics_mod.RuntimeMetrics | None = None,
    vocab_size: int | None = None,
    readiness: Callable[[], tuple[bool, str]] | None = None,
    chat_template: chat_mod.ChatTemplate | None = None,
) -> fastapi.FastAPI:
    """The HTTP app serving `engine` (already started or started by the caller).

    readiness: what GET /ready answers, (ready, reason); default: the engine loop runs. /health
    stays the liveness of the process and its loop.

    metrics: shared with the engine (it must be the engine's observer); by default one is
    created with its own registry and installed as the engine's observer, which must then
    happen before the engine starts. vocab_size: the model's (token ids in prompts are checked
    against it); defaults to the tokenizer's. chat_template: the model's (None: the chat route
    answers 400).
    """
    tokenizer: gen_mod.Tokenizer = engine.tokenizer  # type: ignore[assignment]
    if metrics is None:
        metrics = metrics_mod.RuntimeMetrics(stats=engine.stats)
        engine.set_observer(metrics)
    app = fastapi.FastAPI(title="elastic-moe runtime", version="0.1.0")
    app.add_middleware(CloseWhenDraining, engine=engine)
    api_schema.install(app)
    api = gen_mod.Generation(
        engine,
        tokenizer=tokenizer,
        served_model_name=served_model_name,
        metrics=metrics,
        vocab_size=vocab_size if vocab_size is not None else tokenizer.vocab_size,
        chat_template=chat_template,
    )
    app.state.api = api
    app.state.metrics = metrics

    @app.exception_handler(errors.ApiError)
    async def on_api_error(
        request: fastapi.Request, exc: errors.ApiError
    ) -> responses.JSONResponse:
        if request.url.path in GENERATION_PATHS:
            if exc.status_code == 429:
                metrics.observe_queue_full()
            else:
                metrics.observe_rejected()
        return exc.response()

    @app.exception_handler(exceptions.RequestValidationError)
    async def on_invalid(
        request: fastapi.Request, exc: exceptions.RequestValidationError
    ) -> responses.JSONResponse:
        metrics.observe_rejected()
        return errors.validation_error(exc.errors()).response()

    @app.exception_handler(starlette_exceptions.HTTPException)
    async def on_http_error(
        request: fastapi.Request, exc: starlette_exceptions.HTTPException
    ) -> responses.JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = errors.ApiError(exc.status_code, str(exc.detail), type_=kind)
        resp = err.response()
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    @app.post(
        "/v1/completions",
        response_model=None,
        responses=_generation_responses(api_schema.COMPLETION_200),
    )
    async def completions_route(
        body: completions.CompletionRequest, request: fastapi.Request
    ) -> responses.Response:
        return await completions.completions(api, body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=_generation_responses(api_schema.CHAT_COMPLETION_200),
    )
    async def chat_route(
        body: chat.ChatCompletionRequest, request: fastapi.Request
    ) -> responses.Response:
        return await chat.chat_completions(api, body, request)

    @app.get("/v1/models", response_model=api_schema.ModelList)
    async def models() -> dict[str, Any]:
        return api.models()

    @app.get(
        "/health",
        response_model=api_schema.HealthBody,
        responses=api_schema.responses({503: "The engine loop is not running"}),
    )
    async def health() -> responses.JSONResponse:
        if engine.is_alive():
            return responses.JSONResponse({"status": "ok"})
        return errors.ApiError(
            503, "the engine loop is not running", type_="server_error", code="engine_dead"
        ).response()

    @app.get(
        "/ready",
        response_model=api_schema.ReadyBody,
        responses={503: {"description": "Not ready", "model": api_schema.ReadyBody}},
    )
    async def ready() -> responses.JSONResponse:
        ok, reason = (
            readiness() if readiness is not None else (engine.is_alive(), "engine loop state")
        )
        body = loading.ReadyBody.exact(
            {"status": loading.READY if ok else loading.NOT_READY, "reason": reason}
        ).model_dump(mode="json", exclude_none=True)
        return responses.JSONResponse(status_code=200 if ok else 503, content=body)

    @app.get("/metrics", response_class=responses.PlainTextResponse)
    async def prometheus() -> responses.Response:
        return responses.Response(
            content=metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    if admin_router is not None:
        app.include_router(admin_router)
    return app


def _generation_responses(ok: dict[str, Any]) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a generation route: its 200 body, an unknown model, a full queue,
    a failed generation, a stopped engine (and the 400s every route has)."""
    return api_schema.responses({200: ok, 404: "Unknown model"}, 429, 500, 503)
