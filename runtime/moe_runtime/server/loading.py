"""The HTTP server of a `serve` whose model is still loading (`LoadingServer`).

It answers from the moment `moe-runtime serve` starts until the model serves, on the port the
full app then takes: `GET /ready` says what is loading and how far (503,
`moe_contract.loading.ReadyBody` with status ``loading``), `GET /health` answers 503 too
(the head's startup probe keeps bounding the load: `model.loadTimeoutSeconds`), every other
route 503 "the model is loading". It serves from a thread of its own (uvicorn installs no
signal handler off the main thread: the main thread keeps its SIGTERM handling).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import fastapi
import uvicorn
from fastapi import responses

from moe_contract import loading

log = logging.getLogger(__name__)

#: Seconds `LoadingServer.start` waits for the port, and `stop` for the thread.
START_TIMEOUT_S: Final = 10.0
STOP_TIMEOUT_S: Final = 10.0

Progress = Callable[[], loading.LoadProgress]


def progress_from(ranks: Callable[[], list[dict[str, Any]]], *, ranks_total: int) -> Progress:
    """The progress of a load of `ranks_total` ranks from `ranks()`: each rank's
    `RankLoad` as JSON (a rank that has not begun its load says rank -1: left out). No rank
    counted yet: starting; every rank done: building groups; else reading weights."""

    def progress() -> loading.LoadProgress:
        counted = [loading.RankLoad.model_validate(r) for r in ranks()]
        counted = sorted((r for r in counted if r.rank >= 0), key=lambda r: r.rank)
        if not counted:
            activity = loading.ACTIVITY_STARTING
        elif len(counted) >= ranks_total and all(r.done for r in counted):
            activity = loading.ACTIVITY_GROUPS
        else:
            activity = loading.ACTIVITY_WEIGHTS
        return loading.LoadProgress(activity=activity, ranks_total=ranks_total, ranks=counted)

    return progress


def create_app(progress: Progress) -> fastapi.FastAPI:
    """The app of a loading `serve`; `progress()` is asked at every `/ready` and `/health`."""
    app = fastapi.FastAPI(title="moe-runtime (loading)", openapi_url=None, docs_url=None)

    def body() -> dict[str, object]:
        now = progress()
        return loading.ReadyBody.exact(
            {"status": loading.LOADING, "reason": now.message(), "loading": now.to_json()}
        ).to_json()

    @app.get("/ready")
    def ready() -> responses.JSONResponse:
        return responses.JSONResponse(status_code=503, content=body())

    @app.get("/health")
    def health() -> responses.JSONResponse:
        return responses.JSONResponse(status_code=503, content=body())

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    def other(path: str) -> responses.JSONResponse:
        return responses.JSONResponse(
            status_code=503,
            content={
                "error": {
                    "message": f"the model is loading: {progress().message()}",
                    "type": "server_error",
                    "code": "loading",
                }
            },
        )

    return app


class LoadingServer:
    """`create_app(progress)` served on `host:port` from a thread, until `stop`."""

    def __init__(self, progress: Progress, *, host: str, port: int) -> None:
        config = uvicorn.Config(
            create_app(progress), host=host, port=port, log_config=None, access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, name="moe-loading-http", daemon=True
        )
        self._where = f"{host}:{port}"

    def start(self) -> None:
        """Serve; returns once the port listens (or the server gave up: the full app will
        say why it cannot bind when it tries)."""
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                log.warning("serve: the loading server on %s did not start", self._where)
                return
            time.sleep(0.02)

    def __enter__(self) -> LoadingServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving and free the port."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(STOP_TIMEOUT_S)
