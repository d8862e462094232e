"""Errors in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`: `ApiError`,
and request validation failures turned into one (`validation_error`), naming the field."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import encoders, responses


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


#: Fields whose type is a union: pydantic reports one error per member, so say it in words.
_UNION_FIELDS = {
    "prompt": "a string or a list of token ids (integers)",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of text parts ({"type": "text", "text": ...})',
}


#: The first element of a validation error's location says where the field is.
_LOCATIONS = ("body", "query", "header", "path", "cookie")


def validation_error(errors: Sequence[Any]) -> ApiError:
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
    field_words: str | None = field if field in _UNION_FIELDS else None
    if field == "messages" and len(loc) > 2 and loc[2] == "content":
        # A message's content is a union too: name it with its message's index.
        field_words, where = "content", ".".join(loc[:3])
    if kind == "extra_forbidden":
        message = f"unknown field '{'.'.join(loc)}'"
    elif field_words is not None:
        message = f"{where if field == 'messages' else field} must be {_UNION_FIELDS[field_words]}"
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
