"""Start and stop `moe-runtime serve` as a subprocess for tests (own session, loopback only),
and the small clients tests use on it: a /health prober, scale and status calls."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

BIN = pathlib.Path(sys.executable).parent / "moe-runtime"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class RuntimeProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: pathlib.Path

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the server (it stops its ranks and the Ray instance it started); SIGKILL
        its process group if it is not gone after `timeout`, and whatever it left behind.

        Not SIGTERM to the whole group at once: Ray's own processes would die under the
        server's shutdown, which then waits a minute on a GCS that is gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing left in the group
        if self.proc.poll() is None:
            self.proc.wait(10)


def spawn(
    args: list[str], *, log: pathlib.Path, env: dict[str, str] | None = None
) -> RuntimeProcess:
    """`moe-runtime serve ARGS --port P`, started (not waited for: it may still be loading)."""
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env.update(env or {})
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN), "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    return RuntimeProcess(proc=proc, url=f"http://127.0.0.1:{port}", log=log)


def start(
    args: list[str],
    *,
    log: pathlib.Path,
    env: dict[str, str] | None = None,
    deadline_s: float = 300.0,
) -> RuntimeProcess:
    """`moe-runtime serve ARGS --port P` with its own local Ray; returns once /health is 200."""
    server = spawn(args, log=log, env=env)
    proc = server.proc
    deadline = time.monotonic() + deadline_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise TimeoutError(f"server not healthy in {deadline_s}s:\n{server.tail()}")
        time.sleep(0.2)


class HealthProbe:
    """GET `path` (default /health) every 50 ms until stopped; every status code is kept
    (-1 for a connection error)."""

    def __init__(self, url: str, path: str = "/health") -> None:
        self.url = url
        self.path = path
        self.codes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url) as client:
            while not self._stop.wait(0.05):
                try:
                    self.codes.append(client.get(self.path, timeout=10).status_code)
                except httpx.HTTPError:
                    self.codes.append(-1)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def start_while(
    args: list[str],
    meanwhile: Callable[[], T],
    *,
    log: pathlib.Path,
    env: dict[str, str] | None = None,
) -> tuple[RuntimeProcess, T]:
    """`start(args)` on another thread while `meanwhile()` runs here (transformers' reference
    answers while the server starts its ranks); the server once it serves, and that result.
    The server is waited for even when `meanwhile` raises (and then stopped)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start, args, log=log, env=env)
        try:
            result = meanwhile()
        except BaseException:
            starting.result().stop()
            raise
        return starting.result(), result


def scale(url: str, to: int, *, headers: dict[str, str]) -> dict[str, Any]:
    """POST /scale_elastic_ep?wait=true; asserts 200 and returns the body."""
    r = httpx.post(
        f"{url}/scale_elastic_ep?wait=true",
        json={"new_data_parallel_size": to},
        headers=headers,
        timeout=600,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def status(url: str, *, headers: dict[str, str]) -> dict[str, Any]:
    """GET /elastic_ep/status; asserts 200."""
    r = httpx.get(f"{url}/elastic_ep/status", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())
