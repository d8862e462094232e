"""How a generation route answers (`answer`): one JSON body once the request finished, or SSE
events as its tokens come (`stream`), ending with `usage` when asked and `data: [DONE]`. Both
routes share the envelope (`id`, `object`, `created`, `model`, `choices`) and the loop; what
differs is the route's `Shape`: its object names and how a choice is written."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import fastapi
from fastapi import responses

from moe_runtime.engine import request as req
from moe_runtime.server import generation as gen_mod

Choice = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Shape:
    """What one route writes: `object` of its JSON body and `chunk_object` of its events;
    `choice(done)` the choice of the body; `chunks(out)` the choices of the events one output
    makes (one event each; none: no event); `opening` the choices sent before any token."""

    object: str
    chunk_object: str
    choice: Callable[[req.CompletedRequest], Choice]
    chunks: Callable[[req.RequestOutput], Sequence[Choice]]
    opening: tuple[Choice, ...] = ()


async def answer(
    api: gen_mod.Generation,
    engine_request: req.Request,
    request: fastapi.Request,
    *,
    shape: Shape,
    stream: bool,
    include_usage: bool,
) -> responses.Response:
    """Submit `engine_request` and answer as `shape` says: streamed (SSE) or whole (JSON; 499
    when the client went away first)."""
    handle = api.submit(engine_request)
    if stream:
        return responses.StreamingResponse(
            _events(api, handle, shape=shape, include_usage=include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    done = await api.collect_unless_gone(handle, request)
    if done is None:
        return responses.Response(status_code=499)  # nobody reads it: the client is gone
    return responses.JSONResponse(
        {
            "id": engine_request.request_id,
            "object": shape.object,
            "created": int(time.time()),
            "model": api.model,
            "choices": [shape.choice(done)],
            "usage": gen_mod.usage(done.num_prompt_tokens, len(done.token_ids)),
        }
    )


async def _events(
    api: gen_mod.Generation, handle: req.RequestHandle, *, shape: Shape, include_usage: bool
) -> AsyncIterator[str]:
    created = int(time.time())

    def event(choices: list[Choice], **extra: Any) -> str:
        return gen_mod.sse(
            {
                "id": handle.request_id,
                "object": shape.chunk_object,
                "created": created,
                "model": api.model,
                "choices": choices,
                **extra,
            }
        )

    for choice in shape.opening:
        yield event([choice])
    generated = 0
    async for out in api.outputs(handle):
        if out.error is not None:
            yield gen_mod.failed_event(out.error)
            break
        generated += len(out.new_token_ids)
        for choice in shape.chunks(out):
            yield event([choice])
    if include_usage:
        yield event([], usage=gen_mod.usage(len(handle.request.prompt_token_ids), generated))
    yield gen_mod.DONE
