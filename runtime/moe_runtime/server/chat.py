"""POST /v1/chat/completions: messages in, rendered with the checkpoint's chat template
(`model.chat_template`, as transformers' `apply_chat_template(add_generation_prompt=True)`),
tokenised without added special tokens; the assistant's answer out (JSON, or SSE with
`stream`: a first delta with the role, content deltas, a last chunk with `finish_reason`,
then `usage` when `stream_options.include_usage`). A model without a chat template answers
400 saying so."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import fastapi
import pydantic
from fastapi import responses

from moe_runtime import api_schema
from moe_runtime.engine import request as req
from moe_runtime.model import chat_template as chat_mod
from moe_runtime.server import answers, completions, errors
from moe_runtime.server import generation as gen_mod

_Int = api_schema.JsonInt


class TextPart(pydantic.BaseModel):
    """One part of a message's content (only text is served)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(pydantic.BaseModel):
    """Body of POST /v1/chat/completions (the OpenAI fields; unsupported ones must keep
    their defaults)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    model: str
    messages: Annotated[list[ChatMessage], pydantic.Field(min_length=1)]
    max_tokens: Annotated[_Int, pydantic.Field(ge=1)] | None = None  # None: the rest
    max_completion_tokens: Annotated[_Int, pydantic.Field(ge=1)] | None = None
    temperature: Annotated[float, pydantic.Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, pydantic.Field(gt=0.0, le=1.0)] = 1.0
    seed: _Int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: completions.StreamOptions | None = None
    n: Annotated[_Int, pydantic.Field(ge=1)] = 1
    logprobs: bool = False
    top_logprobs: _Int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM extension
    add_generation_prompt: bool = True  # vLLM extension


def _messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the template sees them (what the openai client sends, as dicts)."""
    return [m.model_dump(exclude_none=True) for m in body.messages]


def prompt_ids(api: gen_mod.Generation, body: ChatCompletionRequest) -> list[int]:
    """The tokens of the rendered chat; 400 when the model has no template or it refuses."""
    if api.chat_template is None:
        raise errors.ApiError(
            400,
            "this model has no chat template (no chat_template.jinja, and no chat_template in "
            "tokenizer_config.json): use /v1/completions with a prompt",
            param="messages",
            code="no_chat_template",
        )
    if not getattr(api.tokenizer, "has_text", True):
        raise errors.ApiError(
            400,
            "this model has no tokenizer: a chat cannot be tokenised (use /v1/completions "
            "with token ids)",
            param="messages",
            code="no_tokenizer",
        )
    try:
        text = api.chat_template.render(
            _messages(body), add_generation_prompt=body.add_generation_prompt
        )
    except chat_mod.TemplateError as exc:
        raise errors.ApiError(400, str(exc), param="messages", code="invalid_messages") from exc
    ids = api.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise errors.ApiError(
            400, "the rendered chat is empty", param="messages", code="invalid_value"
        )
    return ids


async def chat_completions(
    api: gen_mod.Generation, body: ChatCompletionRequest, request: fastapi.Request
) -> responses.Response:
    api.check_model(body.model)
    api.refuse_unsupported(
        {
            "n": body.n != 1,
            "logprobs": body.logprobs,
            "top_logprobs": body.top_logprobs is not None,
            "presence_penalty": body.presence_penalty != 0.0,
            "frequency_penalty": body.frequency_penalty != 0.0,
            "logit_bias": bool(body.logit_bias),
            "tools": bool(body.tools),
            "response_format": body.response_format not in (None, {"type": "text"}),
        }
    )
    use_completion = body.max_completion_tokens is not None
    engine_request = api.engine_request(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        prompt_ids=prompt_ids(api, body),
        max_tokens=body.max_completion_tokens if use_completion else body.max_tokens,
        max_tokens_field="max_completion_tokens" if use_completion else "max_tokens",
        prompt_field="messages",
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


def _delta(delta: dict[str, str], finish: str | None = None) -> answers.Choice:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _choice(done: req.CompletedRequest) -> answers.Choice:
    return {
        "index": 0,
        "message": {"role": "assistant", "content": done.text},
        "logprobs": None,
        "finish_reason": gen_mod.finish_reason(done.finish_reason),
    }


def _chunks(out: req.RequestOutput) -> list[answers.Choice]:
    chunks = [_delta({"content": out.new_text})] if out.new_text else []
    if out.finished:
        chunks.append(_delta({}, gen_mod.finish_reason(out.finish_reason)))
    return chunks


SHAPE = answers.Shape(
    object="chat.completion",
    chunk_object="chat.completion.chunk",
    choice=_choice,
    chunks=_chunks,
    opening=(_delta({"role": "assistant", "content": ""}),),
)
