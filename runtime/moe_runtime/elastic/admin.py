"""The admin HTTP routes of a resize (DESIGN §4): scale, status, is-scaling, behind a bearer token.

`build_router(coordinator, status_fn, token)` returns a FastAPI router; the server mounts it.
Errors use the OpenAI error shape like the rest of the API.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from collections.abc import Callable
from typing import Annotated, Any

import fastapi
import pydantic
from fastapi import responses

from moe_runtime.elastic import coordinator as coord
from moe_runtime.elastic import stages

TOKEN_ENV = "MOE_ADMIN_TOKEN"
TEST_HOOKS_ENV = "MOE_ENABLE_TEST_HOOKS"


class ScaleRequest(pydantic.BaseModel):
    """Body of POST /scale_elastic_ep (vLLM-compatible)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    new_data_parallel_size: pydantic.StrictInt = pydantic.Field(gt=0)
    drain_timeout: pydantic.StrictInt | None = pydantic.Field(default=None, gt=0)


class InjectFailureRequest(pydantic.BaseModel):
    """Test hook body: make the next resize fail in `stage` (after its work ran), and/or make
    the next `operation` (a RankWorker method, e.g. "activate", "stage_experts",
    "commit_staged") of rank `rank` fail."""

    model_config = pydantic.ConfigDict(extra="forbid")

    stage: stages.Stage | None = None
    rank: pydantic.NonNegativeInt | None = None
    operation: str | None = None

    @pydantic.model_validator(mode="after")
    def _one_target(self) -> InjectFailureRequest:
        if self.stage is None and self.rank is None:
            raise ValueError("give a stage, or a rank and an operation")
        if (self.rank is None) != (self.operation is None):
            raise ValueError("rank and operation go together")
        return self


def error_response(status: int, message: str, *, type_: str, code: str | None = None) -> Any:
    return responses.JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type_, "param": None, "code": code}},
    )


def _token_dependency(token: str | None) -> Callable[..., None]:
    def check(
        authorization: Annotated[str | None, fastapi.Header()] = None,
    ) -> None:
        if not token:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
            raise fastapi.HTTPException(
                status_code=401,
                detail="missing or wrong admin token (Authorization: Bearer $MOE_ADMIN_TOKEN)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def build_router(
    coordinator: coord.Coordinator,
    *,
    status_fn: Callable[[], dict[str, Any]],
    token: str | None = None,
    test_hooks: bool | None = None,
    fail_rank: Callable[[int, str], None] | None = None,
) -> fastapi.APIRouter:
    """Routes for /scale_elastic_ep, /elastic_ep/status and /is_scaling_elastic_ep.

    token: the admin bearer token (default: $MOE_ADMIN_TOKEN; empty = no auth, for laptops).
    test_hooks: also serve POST /elastic_ep/inject_failure (default: $MOE_ENABLE_TEST_HOOKS=1);
    fail_rank(rank, operation) arms a rank's failure for it.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if test_hooks is None:
        test_hooks = os.environ.get(TEST_HOOKS_ENV) == "1"
    router = fastapi.APIRouter(dependencies=[fastapi.Depends(_token_dependency(token))])

    @router.post("/scale_elastic_ep", status_code=202)
    async def scale_elastic_ep(body: ScaleRequest, wait: bool = False) -> Any:
        try:
            record = coordinator.request(body.new_data_parallel_size)
        except coord.ResizeError as exc:
            kind = "conflict_error" if exc.status_code == 409 else "invalid_request_error"
            return error_response(exc.status_code, str(exc), type_=kind)
        summary = {
            "resize_id": record.resize_id,
            "from": record.from_size,
            "to": record.to_size,
            "stage": record.stage.value,
        }
        if not wait:
            return responses.JSONResponse(status_code=202, content=summary)
        timeout = float(body.drain_timeout) if body.drain_timeout else None
        done = await asyncio.to_thread(coordinator.wait, record, timeout)
        summary["stage"] = record.stage.value
        if not done:
            return error_response(
                408,
                f"resize {record.resize_id} still in stage {record.stage.value} after "
                f"{body.drain_timeout}s; it goes on in the background",
                type_="timeout_error",
            )
        if not record.succeeded:
            return error_response(500, record.message, type_="resize_failed")
        return responses.JSONResponse(
            status_code=200,
            content={"message": f"Scaled to {record.to_size} data parallel engines", **summary},
        )

    @router.get("/elastic_ep/status")
    def elastic_ep_status() -> dict[str, Any]:
        # A plain def: FastAPI runs it in its thread pool, never in the event loop.
        return status_fn()

    @router.post("/is_scaling_elastic_ep")
    async def is_scaling_elastic_ep() -> dict[str, bool]:
        return {"is_scaling_elastic_ep": coordinator.is_scaling}

    if test_hooks:

        @router.post("/elastic_ep/inject_failure")
        def inject_failure(body: InjectFailureRequest) -> dict[str, Any]:
            armed: dict[str, Any] = {}
            if body.stage is not None:
                coordinator.inject_failure(body.stage)
                armed["armed"] = body.stage.value
            if body.rank is not None and body.operation is not None:
                if fail_rank is None:
                    raise fastapi.HTTPException(404, "this server cannot arm rank failures")
                fail_rank(body.rank, body.operation)
                armed.update(rank=body.rank, operation=body.operation)
            return armed

    return router
