"""The admin HTTP routes (docs/RUNTIME.md): scale, status, is-scaling, live config, behind a bearer token.

`build_router(coordinator, status_fn, token)` returns a FastAPI router; the server mounts it.
Errors use the OpenAI error shape like the rest of the API, with `param` naming the field.

The token is compared as bytes: a header of any bytes that is not `Bearer <token>` gets 401,
never an error of the comparison. It comes from a flag, $MOE_ADMIN_TOKEN, or a file
(`--admin-token-file`, $MOE_ADMIN_TOKEN_FILE: a mounted Secret, re-read when it changes).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import pathlib
import threading
from collections.abc import Callable
from typing import Annotated, Any, Protocol

import fastapi
import pydantic
from fastapi import responses, security

from moe_contract import names
from moe_runtime import api_schema
from moe_runtime.elastic import coordinator as coord
from moe_runtime.elastic import settings, stages

log = logging.getLogger(__name__)

TOKEN_ENV = "MOE_ADMIN_TOKEN"
TOKEN_FILE_ENV = "MOE_ADMIN_TOKEN_FILE"
TEST_HOOKS_ENV = "MOE_ENABLE_TEST_HOOKS"
UNAUTHORIZED = "missing or wrong admin token (Authorization: Bearer <token>)"


class ScaleRequest(pydantic.BaseModel):
    """Body of POST /scale_elastic_ep (vLLM-compatible)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    new_data_parallel_size: api_schema.JsonInt = pydantic.Field(gt=0)
    drain_timeout: api_schema.JsonInt | None = pydantic.Field(
        default=None,
        ge=0,
        le=settings.MAX_DRAIN_SECONDS,
        description="A shrink: seconds sequences on departing ranks may take to finish there "
        "before the rest migrate (default: the live setting drain_timeout; 0 = at once).",
    )


class ScaleAccepted(pydantic.BaseModel):
    resize_id: str
    from_: int = pydantic.Field(alias="from")
    to: int
    stage: str
    message: str | None = None


class InjectFailureRequest(pydantic.BaseModel):
    """Test hook body: make the next resize fail in `stage` (after its work ran), and/or make
    the next `operation` (a fault point of the rank, `moe_runtime.rank.hooks.POINTS`, e.g.
    "activate", "stage_experts", "commit_staged") of rank `rank` fail: the ranks must carry the
    tests' fault hooks (`MOE_RANK_HOOKS`)."""

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


def error_response(
    status: int,
    message: str,
    *,
    type_: str,
    code: str | None = None,
    param: str | None = None,
) -> Any:
    return responses.JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type_, "param": param, "code": code}},
    )


class TokenSource(Protocol):
    """Where the admin token comes from; `current()` is the token now (None = no auth)."""

    def current(self) -> bytes | None: ...


class StaticToken:
    """A token given once (`--admin-token`, $MOE_ADMIN_TOKEN); empty means no auth."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    def current(self) -> bytes | None:
        return self._token


class FileToken:
    """A token read from a file (`--admin-token-file`, $MOE_ADMIN_TOKEN_FILE): a mounted Secret.

    The file is read at start (`TokenFileError` when it is missing, unreadable or empty: the
    server must not start open by accident) and read again whenever it changes (its inode,
    size or mtime; one `stat` per admin request), so a Secret update, which the kubelet applies
    by swapping the mounted file, rotates the token without a restart. Surrounding whitespace
    (a trailing newline) is dropped. A later read that fails or finds the file empty keeps the
    last good token and logs why: a bad update never opens the routes.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._token = self._read()

    def _read(self) -> bytes:
        try:
            stat = self.path.stat()
            token = self.path.read_bytes().strip()
        except OSError as exc:
            raise TokenFileError(f"admin token file {self.path}: {exc}") from exc
        if not token:
            raise TokenFileError(f"admin token file {self.path} is empty")
        self._seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        return token

    def current(self) -> bytes | None:
        with self._lock:
            try:
                stat = self.path.stat()
                changed = (stat.st_ino, stat.st_size, stat.st_mtime_ns) != self._seen
            except OSError as exc:
                log.warning("admin token file %s: %s; keeping the last token", self.path, exc)
                return self._token
            if changed:
                try:
                    self._token = self._read()
                    log.info("admin token file %s changed: token reloaded", self.path)
                except TokenFileError as exc:
                    log.warning("%s; keeping the last token", exc)
            return self._token


class TokenFileError(ValueError):
    """The admin token file cannot give a token."""


def token_source(*, token: str | None = None, token_file: str | None = None) -> TokenSource:
    """The admin token from a flag value or a file, else $MOE_ADMIN_TOKEN / $MOE_ADMIN_TOKEN_FILE.

    Flags win over the environment; a token and a token file at the same level are refused
    (ValueError) rather than one silently ignored. No token anywhere: the routes are open (a
    laptop); the operator always sets one.
    """
    if token and token_file:
        raise ValueError("give --admin-token or --admin-token-file, not both")
    if token_file:
        return FileToken(token_file)
    if token:
        return StaticToken(token)
    env_token, env_file = os.environ.get(TOKEN_ENV), os.environ.get(TOKEN_FILE_ENV)
    if env_token and env_file:
        raise ValueError(f"set {TOKEN_ENV} or {TOKEN_FILE_ENV}, not both")
    if env_file:
        return FileToken(env_file)
    return StaticToken(env_token)


def authorized(authorization: str | None, token: bytes) -> bool:
    """Whether an Authorization header value is `Bearer <token>`.

    Header values reach the app decoded as latin-1 (ASGI), so any bytes a client sends map
    back to exactly those bytes here and are compared as bytes, in constant time.
    """
    raw = (authorization or "").encode("latin-1", errors="replace")
    scheme, _, given = raw.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)


_BEARER = security.HTTPBearer(auto_error=False, description="The admin token")


def _token_dependency(tokens: TokenSource) -> Callable[..., None]:
    def check(
        request: fastapi.Request,
        _: Annotated[Any, fastapi.Security(_BEARER)] = None,  # documents the scheme only
    ) -> None:
        token = tokens.current()
        if token is None:
            return
        if not authorized(request.headers.get("authorization"), token):
            raise fastapi.HTTPException(
                status_code=401,
                detail=UNAUTHORIZED,
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def build_router(
    coordinator: coord.Coordinator,
    *,
    status_fn: Callable[[], dict[str, Any]],
    token: str | TokenSource | None = None,
    test_hooks: bool | None = None,
    fail_rank: Callable[[int, str], None] | None = None,
    live: settings.LiveSettings | None = None,
) -> fastapi.APIRouter:
    """Routes for /scale_elastic_ep, /elastic_ep/status, /is_scaling_elastic_ep and, with
    `live`, GET/PATCH /elastic_ep/config.

    token: the admin bearer token, or where to read it (default: `token_source()`, i.e.
    $MOE_ADMIN_TOKEN or $MOE_ADMIN_TOKEN_FILE; none = no auth, for laptops).
    test_hooks: also serve POST /elastic_ep/inject_failure (default: $MOE_ENABLE_TEST_HOOKS=1);
    fail_rank(rank, operation) arms a rank's failure for it.
    """
    tokens = token_source() if token is None else token
    if isinstance(tokens, str):
        tokens = StaticToken(tokens)
    if test_hooks is None:
        test_hooks = os.environ.get(TEST_HOOKS_ENV) == "1"
    router = fastapi.APIRouter(
        dependencies=[fastapi.Depends(_token_dependency(tokens))],
        responses=api_schema.responses(None, 401),
    )

    @router.post(
        names.SCALE_PATH,
        status_code=202,
        response_model=ScaleAccepted,
        responses=api_schema.responses(
            {
                200: {"description": "Done (`?wait=true`)", "model": ScaleAccepted},
                500: "The resize failed (`?wait=true`); the message says where it serves now",
            },
            400,
            408,
            409,
        ),
    )
    async def scale_elastic_ep(
        body: ScaleRequest,
        wait: bool = False,
        timeout: Annotated[
            float | None,
            fastapi.Query(gt=0, le=settings.MAX_DRAIN_SECONDS, description="?wait: at most s"),
        ] = None,
    ) -> Any:
        try:
            record = coordinator.request(
                body.new_data_parallel_size,
                drain_timeout=None if body.drain_timeout is None else float(body.drain_timeout),
            )
        except coord.ResizeError as exc:
            kind = "conflict_error" if exc.status_code == 409 else "invalid_request_error"
            return error_response(
                exc.status_code,
                str(exc),
                type_=kind,
                param="new_data_parallel_size" if exc.status_code == 400 else None,
            )
        summary = {
            "resize_id": record.resize_id,
            "from": record.from_size,
            "to": record.to_size,
            "stage": record.stage.value,
        }
        if not wait:
            return responses.JSONResponse(status_code=202, content=summary)
        done = await asyncio.to_thread(coordinator.wait, record, timeout)
        summary["stage"] = record.stage.value
        if not done:
            return error_response(
                408,
                f"resize {record.resize_id} still in stage {record.stage.value} after "
                f"{timeout}s; it goes on in the background",
                type_="timeout_error",
                param="timeout",
            )
        if not record.succeeded:
            return error_response(500, record.message, type_="resize_failed")
        return responses.JSONResponse(
            status_code=200,
            content={"message": f"Scaled to {record.to_size} data parallel engines", **summary},
        )

    @router.get(names.STATUS_PATH)
    def elastic_ep_status() -> dict[str, Any]:
        # A plain def: FastAPI runs it in its thread pool, never in the event loop.
        return status_fn()

    @router.post(names.IS_SCALING_PATH)
    async def is_scaling_elastic_ep() -> dict[str, bool]:
        return {"is_scaling_elastic_ep": coordinator.is_scaling}

    if live is not None:
        _config_routes(router, live)

    if test_hooks:

        @router.post("/elastic_ep/inject_failure")
        def inject_failure(body: InjectFailureRequest) -> Any:
            armed: dict[str, Any] = {}
            if body.stage is not None:
                coordinator.inject_failure(body.stage)
                armed["armed"] = body.stage.value
            if body.rank is not None and body.operation is not None:
                if fail_rank is None:
                    raise fastapi.HTTPException(404, "this server cannot arm rank failures")
                try:
                    fail_rank(body.rank, body.operation)
                except Exception as exc:  # noqa: BLE001 - answered: no hooks, or a bad operation
                    # The ranks carry no fault hooks (`MOE_RANK_HOOKS`), or they refused it.
                    return error_response(
                        400, str(exc), type_="invalid_request_error", param="operation"
                    )
                armed.update(rank=body.rank, operation=body.operation)
            return armed

    return router


def _config_routes(router: fastapi.APIRouter, live: settings.LiveSettings) -> None:
    """GET/PATCH /elastic_ep/config (moe_runtime.elastic.settings)."""

    @router.get(names.CONFIG_PATH, response_model=settings.Config)
    def get_config() -> dict[str, Any]:
        return live.get()

    @router.patch(
        names.CONFIG_PATH,
        response_model=settings.Config,
        responses=api_schema.responses(
            {409: "num_redundant_experts while a resize or recovery runs"}, 400
        ),
    )
    def patch_config(body: settings.ConfigPatch) -> Any:
        try:
            return live.patch(body)
        except settings.InvalidConfig as exc:
            return error_response(
                exc.status_code,
                str(exc),
                type_="conflict_error" if exc.status_code == 409 else "invalid_request_error",
                param=exc.param,
                code="invalid_value",
            )
