"""Start and stop `moe-runtime serve` as a subprocess for tests (own session, loopback only)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx

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
        """SIGTERM the server's process group; SIGKILL what is left after `timeout`."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start(
    args: list[str],
    *,
    log: pathlib.Path,
    env: dict[str, str] | None = None,
    deadline_s: float = 300.0,
) -> RuntimeProcess:
    """`moe-runtime serve ARGS --port P` with its own local Ray; returns once /health is 200."""
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
    server = RuntimeProcess(proc=proc, url=f"http://127.0.0.1:{port}", log=log)
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
