"""The runtime's HTTP API (DESIGN §4): OpenAI-compatible completions, models, health, metrics.

`create_app(engine, served_model_name=...)` builds the FastAPI app around a started engine; the
resize coordinator plugs its admin routes in with `admin_router`. Every error is answered in
the OpenAI error shape `{"error": {"message", "type", "param", "code"}}` (`param` names the
field at fault), and the OpenAPI document (`/openapi.json`) lists every status a route answers
with its body, so a schema fuzzer (tests/integration/test_fuzz.py) can hold the server to it.

Backpressure: a request that finds the engine's queue at its bound (`--max-queued-requests`)
gets 429 with `Retry-After`; while a resize runs none is refused (`engine.queue`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, Literal, Protocol

import fastapi
import pydantic
from fastapi import encoders, exceptions, responses
from starlette import exceptions as starlette_exceptions

from moe_runtime import api_schema
from moe_runtime import metrics as metrics_mod
from moe_runtime import step as step_types
from moe_runtime.engine import core
from moe_runtime.engine import queue as queue_mod
from moe_runtime.engine import request as req
from moe_runtime.model import tokenizer as tokenizer_mod

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
#: How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.5
OWNER = "elastic-moe"


class Tokenizer(Protocol):
    """What the server needs of the tokenizer (moe_runtime.model.tokenizer.Tokenizer)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...


class ApiError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> responses.JSONResponse:
        return responses.JSONResponse(
            status_code=self.status_code, content=self.body(), headers=self.headers
        )


_Int = api_schema.JsonInt


class StreamOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class CompletionRequest(pydantic.BaseModel):
    """Body of POST /v1/completions (the OpenAI fields; unsupported ones must keep defaults)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[_Int] | list[str] | list[list[_Int]]
    max_tokens: Annotated[_Int, pydantic.Field(ge=1)] | None = 16  # None: the rest of the context
    temperature: Annotated[float, pydantic.Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, pydantic.Field(gt=0.0, le=1.0)] = 1.0
    seed: _Int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[_Int, pydantic.Field(ge=1)] = 1
    best_of: _Int | None = None
    echo: bool = False
    logprobs: _Int | None = None
    suffix: str | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM extension


def create_app(
    engine: core.Engine,
    *,
    served_model_name: str,
    admin_router: fastapi.APIRouter | None = None,
    metrics: metrics_mod.RuntimeMetrics | None = None,
    vocab_size: int | None = None,
    readiness: Callable[[], tuple[bool, str]] | None = None,
) -> fastapi.FastAPI:
    """The HTTP app serving `engine` (already started or started by the caller).

    readiness: what GET /ready answers, (ready, reason); default: the engine loop runs. /health
    stays the liveness of the process and its loop.

    metrics: shared with the engine (it must be the engine's observer); by default one is
    created with its own registry and installed as the engine's observer, which must then
    happen before the engine starts. vocab_size: the model's (token ids in prompts are checked
    against it); defaults to the tokenizer's.
    """
    tokenizer: Tokenizer = engine.tokenizer  # type: ignore[assignment]
    if metrics is None:
        metrics = metrics_mod.RuntimeMetrics(stats=engine.stats)
        engine.set_observer(metrics)
    app = fastapi.FastAPI(title="elastic-moe runtime", version="0.1.0")
    api_schema.install(app)
    api = _Api(
        engine,
        tokenizer=tokenizer,
        served_model_name=served_model_name,
        metrics=metrics,
        vocab_size=vocab_size if vocab_size is not None else tokenizer.vocab_size,
    )
    app.state.api = api
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def on_api_error(request: fastapi.Request, exc: ApiError) -> responses.JSONResponse:
        if request.url.path == "/v1/completions":
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
        return _validation_error(exc.errors()).response()

    @app.exception_handler(starlette_exceptions.HTTPException)
    async def on_http_error(
        request: fastapi.Request, exc: starlette_exceptions.HTTPException
    ) -> responses.JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = ApiError(exc.status_code, str(exc.detail), type_=kind)
        resp = err.response()
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    @app.post(
        "/v1/completions",
        response_model=None,
        responses=api_schema.responses(
            {200: api_schema.COMPLETION_200, 404: "Unknown model"},
            429,
            500,
            503,
        ),
    )
    async def completions(body: CompletionRequest, request: fastapi.Request) -> responses.Response:
        return await api.completions(body, request)

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
        return ApiError(
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
        if ok:
            return responses.JSONResponse({"status": "ready", "reason": reason})
        return responses.JSONResponse(
            status_code=503, content={"status": "not_ready", "reason": reason}
        )

    @app.get("/metrics", response_class=responses.PlainTextResponse)
    async def prometheus() -> responses.Response:
        return responses.Response(
            content=metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    if admin_router is not None:
        app.include_router(admin_router)
    return app


#: Fields whose type is a union: pydantic reports one error per member, so say it in words.
_UNION_FIELDS = {
    "prompt": "a string or a list of token ids (integers)",
    "stop": "a string or a list of strings",
}


#: The first element of a validation error's location says where the field is.
_LOCATIONS = ("body", "query", "header", "path", "cookie")


def _validation_error(errors: Sequence[Any]) -> ApiError:
    """FastAPI's validation errors as one OpenAI error naming the first bad field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in _LOCATIONS:
        loc = loc[1:]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('msg', '')}", code="invalid_json")
    if not loc and kind in ("missing", "model_attributes_type", "dict_type"):
        return ApiError(400, "the request body must be a JSON object", code="invalid_body")
    field = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    if kind == "extra_forbidden":
        message = f"unknown field '{where}'"
    elif field in _UNION_FIELDS:
        message = f"{field} must be {_UNION_FIELDS[field]}"
        if "input" in first:
            shown = json.dumps(encoders.jsonable_encoder(first["input"]))
            message += f" (got {shown[:80]})"
    else:
        # Unions report one error per member; the message of the first is enough to act on.
        message = f"{where}: {first.get('msg', 'invalid value')}"
        if "input" in first and kind != "missing":
            shown = json.dumps(encoders.jsonable_encoder(first["input"]))
            message += f" (got {shown[:80]})"
    return ApiError(400, message, param=field, code="invalid_value")


class _Api:
    def __init__(
        self,
        engine: core.Engine,
        *,
        tokenizer: Tokenizer,
        served_model_name: str,
        metrics: metrics_mod.RuntimeMetrics,
        vocab_size: int,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = served_model_name
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": self.created,
                    "owned_by": OWNER,
                    "max_model_len": self.engine.config.max_model_len,
                }
            ],
        }

    # -- completions -------------------------------------------------------------------------

    def _to_request(self, body: CompletionRequest) -> req.Request:
        if body.model != self.model:
            raise ApiError(
                404,
                f"The model '{body.model}' does not exist; this server serves '{self.model}'.",
                param="model",
                code="model_not_found",
            )
        unsupported = {
            "n": body.n != 1,
            "best_of": body.best_of not in (None, 1),
            "echo": body.echo,
            "logprobs": body.logprobs is not None,
            "suffix": body.suffix is not None,
            "presence_penalty": body.presence_penalty != 0.0,
            "frequency_penalty": body.frequency_penalty != 0.0,
            "logit_bias": bool(body.logit_bias),
        }
        for name, bad in unsupported.items():
            if bad:
                raise ApiError(
                    400,
                    f"'{name}' is not supported by this server (leave it at its default)",
                    param=name,
                    code="unsupported_parameter",
                )
        prompt_ids = self._prompt_ids(body.prompt)
        limit = self.engine.config.max_model_len
        max_tokens = body.max_tokens if body.max_tokens is not None else limit - len(prompt_ids)
        if len(prompt_ids) >= limit or len(prompt_ids) + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens" if len(prompt_ids) < limit else "prompt",
                code="context_length_exceeded",
            )
        stop: list[str] = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings", param="stop")
        if any(stop) and not getattr(self.tokenizer, "has_text", True):
            raise ApiError(
                400,
                "this model has no tokenizer: stop strings cannot be matched (stop on token ids "
                "with max_tokens, or serve a model with tokenizer.json)",
                param="stop",
                code="no_tokenizer",
            )
        seed = body.seed
        if seed is None and body.temperature > 0:
            # A seed fixed here keeps an unseeded request reproducible across a migration.
            seed = secrets.randbits(63)
        return req.Request(
            request_id=f"cmpl-{uuid.uuid4().hex}",
            prompt_token_ids=prompt_ids,
            sampling=step_types.SamplingParams(
                temperature=body.temperature, top_p=body.top_p, seed=seed
            ),
            max_tokens=max_tokens,
            stop=tuple(stop),
            ignore_eos=body.ignore_eos,
        )

    def _prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(
                    400,
                    f"only one prompt per request is supported, got {len(prompt)}",
                    param="prompt",
                    code="unsupported_parameter",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except tokenizer_mod.TokenizerUnavailable as exc:
                raise ApiError(400, str(exc), param="prompt", code="no_tokenizer") from exc
        else:
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ApiError(
                    400,
                    f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}",
                    param="prompt",
                    code="invalid_value",
                )
        if not ids:
            raise ApiError(
                400, "the prompt must not be empty", param="prompt", code="invalid_value"
            )
        return ids

    async def completions(
        self, body: CompletionRequest, request: fastapi.Request
    ) -> responses.Response:
        engine_request = self._to_request(body)
        try:
            handle = self.engine.add_request(engine_request)
        except core.EngineStopped as exc:
            raise ApiError(503, str(exc), type_="server_error", code="engine_stopped") from exc
        except queue_mod.QueueFull as exc:
            raise ApiError(
                429,
                str(exc),
                type_="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(exc.retry_after)},
            ) from exc
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt", code="invalid_value") from exc
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return responses.StreamingResponse(
                self._stream(handle, include_usage=include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            outputs = await self._collect_unless_gone(handle, request)
        finally:
            if not handle.finished:
                log.info("request %s: client went away, aborting", handle.request_id)
                self.engine.abort(handle.request_id)
        if outputs is None:
            return responses.Response(status_code=499)  # nobody reads it: the client is gone
        done = req.collect(engine_request, outputs)
        if done.error is not None:
            raise ApiError(
                500,
                f"generation failed: {done.error}",
                type_="server_error",
                code="generation_failed",
            )
        return responses.JSONResponse(
            {
                "id": engine_request.request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "text": done.text,
                        "token_ids": done.token_ids,
                        "logprobs": None,
                        "finish_reason": _finish_reason(done.finish_reason),
                    }
                ],
                "usage": _usage(done.num_prompt_tokens, len(done.token_ids)),
            }
        )

    async def _collect_unless_gone(
        self, handle: req.RequestHandle, request: fastapi.Request
    ) -> list[req.RequestOutput] | None:
        """The request's outputs, or None when the client disconnects first."""
        collect = asyncio.ensure_future(self._collect(handle))
        watch = asyncio.ensure_future(_wait_disconnected(request))
        try:
            done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if collect in done:
            return collect.result()
        collect.cancel()
        return None

    async def _collect(self, handle: req.RequestHandle) -> list[req.RequestOutput]:
        outputs: list[req.RequestOutput] = []
        arrival = handle.request.arrival_time
        async for out in handle:
            if not outputs and out.new_token_ids:
                self.metrics.ttft.observe(time.monotonic() - arrival)
            outputs.append(out)
        self.metrics.latency.observe(time.monotonic() - arrival)
        return outputs

    async def _stream(
        self, handle: req.RequestHandle, *, include_usage: bool
    ) -> AsyncIterator[str]:
        created = int(time.time())
        arrival = handle.request.arrival_time
        num_prompt = len(handle.request.prompt_token_ids)
        generated = 0
        first = True
        try:
            async for out in handle:
                if out.error is not None:
                    err = ApiError(
                        500,
                        f"generation failed: {out.error}",
                        type_="server_error",
                        code="generation_failed",
                    )
                    yield _sse(err.body())
                    break
                if first and out.new_token_ids:
                    self.metrics.ttft.observe(time.monotonic() - arrival)
                    first = False
                generated += len(out.new_token_ids)
                if not (out.new_token_ids or out.new_text or out.finished):
                    continue
                yield _sse(
                    {
                        "id": handle.request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model,
                        "choices": [
                            {
                                "index": 0,
                                "text": out.new_text,
                                "token_ids": out.new_token_ids,
                                "logprobs": None,
                                "finish_reason": _finish_reason(out.finish_reason)
                                if out.finished
                                else None,
                            }
                        ],
                    }
                )
            self.metrics.latency.observe(time.monotonic() - arrival)
            if include_usage:
                yield _sse(
                    {
                        "id": handle.request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model,
                        "choices": [],
                        "usage": _usage(num_prompt, generated),
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            if not handle.finished:
                log.info("request %s: client went away, aborting", handle.request_id)
                self.engine.abort(handle.request_id)


async def _wait_disconnected(request: fastapi.Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _finish_reason(reason: req.FinishReason | None) -> Literal["stop", "length"] | None:
    if reason is None:
        return None
    return "length" if reason is req.FinishReason.LENGTH else "stop"
