"""The admin token: any header bytes get 401 (never 500), tokens from a file, rotation."""

from __future__ import annotations

import asyncio
import os
import pathlib
from typing import Any

import fastapi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_runtime.elastic import admin
from tests.support import fake_ops

TOKEN = "tøken-ü"  # not ASCII: compared as its UTF-8 bytes


def admin_app(token: str | admin.TokenSource) -> fastapi.FastAPI:
    ops, coordinator = fake_ops.make(2)
    router = admin.build_router(
        coordinator, status_fn=lambda: {"data_parallel_size": ops.size}, token=token
    )
    app = fastapi.FastAPI()
    app.include_router(router)
    return app


def call(app: fastapi.FastAPI, authorization: bytes | None) -> tuple[int, dict[str, str]]:
    """GET /elastic_ep/status through raw ASGI: the header goes as these exact bytes."""
    headers = [] if authorization is None else [(b"authorization", authorization)]
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/elastic_ep/status",
        "raw_path": b"/elastic_ep/status",
        "query_string": b"",
        "headers": headers,
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 1234),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], {k.decode(): v.decode("latin-1") for k, v in start["headers"]}


@pytest.fixture(scope="module")
def app() -> fastapi.FastAPI:
    return admin_app(TOKEN)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_an_authorization_header_of_any_bytes_gets_401(app: fastapi.FastAPI, value: bytes) -> None:
    status, headers = call(app, value)
    assert status == 401
    assert headers["www-authenticate"] == "Bearer"


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=60))
def test_bearer_with_any_other_bytes_gets_401(app: fastapi.FastAPI, value: bytes) -> None:
    if value.strip() == TOKEN.encode():
        return
    assert call(app, b"Bearer " + value)[0] == 401


@pytest.mark.parametrize(
    ("header", "status"),
    [
        pytest.param(b"Bearer " + TOKEN.encode(), 200, id="utf8-token"),
        pytest.param(b"bearer " + TOKEN.encode() + b" ", 200, id="scheme-case-and-space"),
        pytest.param(b"Bearer " + TOKEN.encode("latin-1", errors="replace"), 401, id="latin1"),
        pytest.param(b"Bearer \xff\xfe\x00", 401, id="binary"),
        pytest.param(None, 401, id="missing"),
    ],
)
def test_the_token_is_compared_as_bytes(
    app: fastapi.FastAPI, header: bytes | None, status: int
) -> None:
    assert call(app, header)[0] == status


def test_a_token_file_is_read_again_when_it_changes(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    app = admin_app(admin.FileToken(path))
    assert call(app, b"Bearer first")[0] == 200
    # A Secret update: the kubelet swaps the mounted file (a new inode).
    new = tmp_path / "token.new"
    new.write_text("second")
    os.replace(new, path)
    assert call(app, b"Bearer first")[0] == 401
    assert call(app, b"Bearer second")[0] == 200
    # A bad update (empty, then gone) keeps the last good token: the routes never open.
    path.write_text("")
    assert call(app, b"Bearer second")[0] == 200
    assert call(app, b"Bearer ")[0] == 401
    path.unlink()
    assert call(app, b"Bearer second")[0] == 200
    assert call(app, None)[0] == 401


@pytest.mark.parametrize(
    "content", [pytest.param(None, id="missing"), pytest.param(" \n", id="empty")]
)
def test_a_token_file_that_gives_no_token_is_refused_at_start(
    tmp_path: pathlib.Path, content: str | None
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(admin.TokenFileError, match=str(path)):
        admin.FileToken(path)


def test_token_sources(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "token"
    path.write_text("from-file")
    monkeypatch.delenv(admin.TOKEN_ENV, raising=False)
    monkeypatch.delenv(admin.TOKEN_FILE_ENV, raising=False)
    assert admin.token_source().current() is None  # a laptop: open
    assert admin.token_source(token="flag").current() == b"flag"
    assert admin.token_source(token_file=str(path)).current() == b"from-file"
    with pytest.raises(ValueError, match="not both"):
        admin.token_source(token="flag", token_file=str(path))
    monkeypatch.setenv(admin.TOKEN_FILE_ENV, str(path))
    assert admin.token_source().current() == b"from-file"
    assert admin.token_source(token="flag").current() == b"flag"  # a flag wins over the env
    monkeypatch.setenv(admin.TOKEN_ENV, "env")
    with pytest.raises(ValueError, match="not both"):
        admin.token_source()
    monkeypatch.delenv(admin.TOKEN_FILE_ENV)
    assert admin.token_source().current() == b"env"
