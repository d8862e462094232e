"""What the completion and chat routes share: checking a request against the served model
(`Generation.engine_request`), submitting it to the engine (`submit`: 429 when the queue is
full, 503 when the engine stopped), waiting for its outputs unless the client goes away
(`collect_unless_gone`), streaming them with the latency metrics and the abort of an
abandoned request (`outputs`), and the OpenAI `usage` / `finish_reason` values.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal, Protocol

import fastapi

from moe_runtime import metrics as metrics_mod
from moe_runtime import step as step_types
from moe_runtime.engine import core
from moe_runtime.engine import queue as queue_mod
from moe_runtime.engine import request as req
from moe_runtime.model import chat_template as chat_mod
from moe_runtime.server import errors

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


class Generation:
    """The engine, tokenizer, model name and chat template behind the OpenAI routes."""

    def __init__(
        self,
        engine: core.Engine,
        *,
        tokenizer: Tokenizer,
        served_model_name: str,
        metrics: metrics_mod.RuntimeMetrics,
        vocab_size: int,
        chat_template: chat_mod.ChatTemplate | None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = served_model_name
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.chat_template = chat_template
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

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise errors.ApiError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model}'.",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def refuse_unsupported(unsupported: Mapping[str, bool]) -> None:
        """400 naming the first field set away from its default that this server ignores."""
        for name, bad in unsupported.items():
            if bad:
                raise errors.ApiError(
                    400,
                    f"'{name}' is not supported by this server (leave it at its default)",
                    param=name,
                    code="unsupported_parameter",
                )

    def engine_request(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int | None,
        max_tokens_field: str,
        prompt_field: str,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop: str | list[str] | None,
        ignore_eos: bool,
    ) -> req.Request:
        """The engine request, or 400 when it does not fit the context or the stop strings
        cannot be matched. max_tokens None: the rest of the context."""
        limit = self.engine.config.max_model_len
        max_new = max_tokens if max_tokens is not None else limit - len(prompt_ids)
        if len(prompt_ids) >= limit or len(prompt_ids) + max_new > limit:
            raise errors.ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + max_new} tokens ({len(prompt_ids)} in the prompt, "
                f"{max_new} for the completion). Reduce the {prompt_field} or {max_tokens_field}.",
                param=max_tokens_field if len(prompt_ids) < limit else prompt_field,
                code="context_length_exceeded",
            )
        stops: list[str] = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise errors.ApiError(
                400, f"'stop' takes at most {MAX_STOP_STRINGS} strings", param="stop"
            )
        if any(stops) and not getattr(self.tokenizer, "has_text", True):
            raise errors.ApiError(
                400,
                "this model has no tokenizer: stop strings cannot be matched (stop on token ids "
                "with max_tokens, or serve a model with tokenizer.json)",
                param="stop",
                code="no_tokenizer",
            )
        if seed is None and temperature > 0:
            # A seed fixed here keeps an unseeded request reproducible across a migration.
            seed = secrets.randbits(63)
        return req.Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=step_types.SamplingParams(temperature=temperature, top_p=top_p, seed=seed),
            max_tokens=max_new,
            stop=tuple(stops),
            ignore_eos=ignore_eos,
        )

    def submit(self, engine_request: req.Request) -> req.RequestHandle:
        try:
            return self.engine.add_request(engine_request)
        except core.EngineStopped as exc:
            raise errors.ApiError(
                503, str(exc), type_="server_error", code="engine_stopped"
            ) from exc
        except queue_mod.QueueFull as exc:
            raise errors.ApiError(
                429,
                str(exc),
                type_="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(exc.retry_after)},
            ) from exc
        except ValueError as exc:
            raise errors.ApiError(400, str(exc), param="prompt", code="invalid_value") from exc

    async def collect_unless_gone(
        self, handle: req.RequestHandle, request: fastapi.Request
    ) -> req.CompletedRequest | None:
        """The finished request, or None when the client disconnected first (it is aborted);
        500 when generation failed."""
        collect = asyncio.ensure_future(self._collect(handle))
        watch = asyncio.ensure_future(_wait_disconnected(request))
        try:
            done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not handle.finished:
                log.info("request %s: client went away, aborting", handle.request_id)
                self.engine.abort(handle.request_id)
        if collect not in done:
            collect.cancel()
            return None
        completed = req.collect(handle.request, collect.result())
        if completed.error is not None:
            raise errors.ApiError(
                500,
                f"generation failed: {completed.error}",
                type_="server_error",
                code="generation_failed",
            )
        return completed

    async def _collect(self, handle: req.RequestHandle) -> list[req.RequestOutput]:
        outputs: list[req.RequestOutput] = []
        arrival = handle.request.arrival_time
        async for out in handle:
            if not outputs and out.new_token_ids:
                self.metrics.ttft.observe(time.monotonic() - arrival)
            outputs.append(out)
        self.metrics.latency.observe(time.monotonic() - arrival)
        return outputs

    async def outputs(self, handle: req.RequestHandle) -> AsyncIterator[req.RequestOutput]:
        """The request's outputs as they come, metrics observed; the request is aborted when
        the consumer stops early (the client went away). An output with `error` ends it."""
        arrival = handle.request.arrival_time
        first = True
        try:
            async for out in handle:
                if first and out.new_token_ids:
                    self.metrics.ttft.observe(time.monotonic() - arrival)
                    first = False
                yield out
                if out.error is not None:
                    return
            self.metrics.latency.observe(time.monotonic() - arrival)
        finally:
            if not handle.finished:
                log.info("request %s: client went away, aborting", handle.request_id)
                self.engine.abort(handle.request_id)


async def _wait_disconnected(request: fastapi.Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def failed_event(error: str) -> str:
    """The event that ends a stream whose generation failed."""
    err = errors.ApiError(
        500, f"generation failed: {error}", type_="server_error", code="generation_failed"
    )
    return sse(err.body())


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def finish_reason(reason: req.FinishReason | None) -> Literal["stop", "length"] | None:
    """OpenAI's finish_reason: "stop" exactly when a stop id or a stop string ended it."""
    if reason is None:
        return None
    return "stop" if reason is req.FinishReason.STOP else "length"
