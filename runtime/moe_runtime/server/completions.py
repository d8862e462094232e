"""POST /v1/completions: a prompt (text or token ids) in, the completion out (JSON, or SSE
with `stream`); each choice also carries `token_ids` (the generated ids)."""

from __future__ import annotations

import uuid
from typing import Annotated

import fastapi
import pydantic
from fastapi import responses

from moe_runtime import api_schema
from moe_runtime.engine import request as req
from moe_runtime.model import tokenizer as tokenizer_mod
from moe_runtime.server import answers, errors
from moe_runtime.server import generation as gen_mod

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


def _prompt_ids(
    api: gen_mod.Generation, prompt: str | list[int] | list[str] | list[list[int]]
) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise errors.ApiError(
                400,
                f"only one prompt per request is supported, got {len(prompt)}",
                param="prompt",
                code="unsupported_parameter",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = api.tokenizer.encode(prompt)
        except tokenizer_mod.TokenizerUnavailable as exc:
            raise errors.ApiError(400, str(exc), param="prompt", code="no_tokenizer") from exc
    else:
        ids = [int(t) for t in prompt]  # type: ignore[arg-type]
        bad = [t for t in ids if not 0 <= t < api.vocab_size]
        if bad:
            raise errors.ApiError(
                400,
                f"prompt token ids must be in [0, {api.vocab_size}); got {bad[:5]}",
                param="prompt",
                code="invalid_value",
            )
    if not ids:
        raise errors.ApiError(
            400, "the prompt must not be empty", param="prompt", code="invalid_value"
        )
    return ids


async def completions(
    api: gen_mod.Generation, body: CompletionRequest, request: fastapi.Request
) -> responses.Response:
    api.check_model(body.model)
    api.refuse_unsupported(
        {
            "n": body.n != 1,
            "best_of": body.best_of not in (None, 1),
            "echo": body.echo,
            "logprobs": body.logprobs is not None,
            "suffix": body.suffix is not None,
            "presence_penalty": body.presence_penalty != 0.0,
            "frequency_penalty": body.frequency_penalty != 0.0,
            "logit_bias": bool(body.logit_bias),
        }
    )
    engine_request = api.engine_request(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        prompt_ids=_prompt_ids(api, body.prompt),
        max_tokens=body.max_tokens,
        max_tokens_field="max_tokens",
        prompt_field="prompt",
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop,
        ignore_eos=body.ignore_eos,
    )
    return await answers.answer(
        api,
        engine_request,
        request,
        shape=SHAPE,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )


def _choice(done: req.CompletedRequest) -> answers.Choice:
    return {
        "index": 0,
        "text": done.text,
        "token_ids": done.token_ids,
        "logprobs": None,
        "finish_reason": gen_mod.finish_reason(done.finish_reason),
    }


def _chunks(out: req.RequestOutput) -> list[answers.Choice]:
    if not (out.new_token_ids or out.new_text or out.finished):
        return []
    finish = gen_mod.finish_reason(out.finish_reason) if out.finished else None
    return [
        {
            "index": 0,
            "text": out.new_text,
            "token_ids": out.new_token_ids,
            "logprobs": None,
            "finish_reason": finish,
        }
    ]


SHAPE = answers.Shape(
    object="text_completion", chunk_object="text_completion", choice=_choice, chunks=_chunks
)
