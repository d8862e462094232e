"""The runtime API's OpenAPI document: response bodies and every status a route answers.

Routes declare their statuses with `responses(...)`; `install(app)` then rewrites FastAPI's
document to what the server really does: request validation fails with 400 in the OpenAI error
shape (FastAPI would document 422, which this server never sends), and every route that reads
input lists that 400. A schema fuzzer checks the server against this document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import fastapi
import pydantic
from fastapi.openapi import utils as openapi_utils


def _integral(value: Any) -> Any:
    """30.0 is an integer to JSON Schema (and to a fuzzer): take it as 30."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: An integer field of a request body: an int, or a float with no fraction; never a string or
#: a bool (strict), unlike pydantic's lax int.
JsonInt = Annotated[int, pydantic.BeforeValidator(_integral), pydantic.Strict()]


class ErrorBody(pydantic.BaseModel):
    message: str
    type: str
    param: str | None = pydantic.Field(description="The request field at fault, when one is.")
    code: str | None


class ErrorResponse(pydantic.BaseModel):
    """Every error, OpenAI's shape."""

    error: ErrorBody


class CompletionChoice(pydantic.BaseModel):
    index: int
    text: str
    token_ids: list[int]
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class Usage(pydantic.BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(pydantic.BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(pydantic.BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(pydantic.BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(pydantic.BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(pydantic.BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(pydantic.BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthBody(pydantic.BaseModel):
    status: Literal["ok"]


class ReadyBody(pydantic.BaseModel):
    """``GET /ready`` (``moe_contract.loading.ReadyBody``; ``loading`` while the model loads)."""

    status: Literal["ready", "not_ready", "loading"]
    reason: str
    loading: dict[str, Any] | None = None


STATUS_TEXT = {
    400: "Invalid request: `error.param` names the field, the message the allowed values",
    401: "Missing or wrong admin token (`Authorization: Bearer <token>`)",
    404: "Not found",
    408: "Not done within the time asked for; it goes on",
    409: "Conflicts with the running resize",
    429: "The request queue is full (`--max-queued-requests`); retry after `Retry-After` s",
    500: "Failed on the server side",
    503: "The engine is not serving",
}

COMPLETION_200: dict[str, Any] = {
    "description": "The completion (JSON), or with `stream` server-sent events ending with "
    "`data: [DONE]`",
    "model": Completion,
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


CHAT_COMPLETION_200: dict[str, Any] = {
    "description": "The assistant's message (JSON), or with `stream` server-sent events of "
    "`chat.completion.chunk` deltas (the role first, `finish_reason` last, then `usage` when "
    "`stream_options.include_usage`) ending with `data: [DONE]`",
    "model": ChatCompletion,
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


def error(status: int, description: str | None = None) -> dict[str, Any]:
    """The OpenAPI response of an error status."""
    out: dict[str, Any] = {
        "description": description or STATUS_TEXT.get(status, "Error"),
        "model": ErrorResponse,
    }
    if status == 429:
        out["headers"] = {
            "Retry-After": {
                "description": "Seconds after which a retry is likely to be queued",
                "required": True,
                "schema": {"type": "integer", "minimum": 1},
            }
        }
    if status == 401:
        out["headers"] = {
            "WWW-Authenticate": {"required": True, "schema": {"type": "string"}},
        }
    return out


def responses(
    extra: dict[int, str | dict[str, Any]] | None = None, *statuses: int
) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route: `extra` (a status's description, or its whole response) and
    the error `statuses` with their standard descriptions."""
    out: dict[int | str, dict[str, Any]] = {}
    for status, value in (extra or {}).items():
        out[status] = value if isinstance(value, dict) else error(status, value)
    for status in statuses:
        out.setdefault(status, error(status))
    return out


def install(app: fastapi.FastAPI) -> None:
    """Make `app.openapi()` describe the server as it answers (see the module docstring)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = openapi_utils.get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        components.setdefault("ErrorResponse", ErrorResponse.model_json_schema(ref_template=_REF))
        components.setdefault("ErrorBody", ErrorBody.model_json_schema(ref_template=_REF))
        components["ErrorResponse"].pop("$defs", None)
        for operations in doc.get("paths", {}).values():
            for operation in operations.values():
                answers = operation.setdefault("responses", {})
                answers.pop("422", None)
                reads_input = "requestBody" in operation or operation.get("parameters")
                if reads_input and "400" not in answers:
                    answers["400"] = {
                        "description": STATUS_TEXT[400],
                        "content": {"application/json": {"schema": {"$ref": _REF_ERROR}}},
                    }
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


_REF = "#/components/schemas/{model}"
_REF_ERROR = "#/components/schemas/ErrorResponse"
