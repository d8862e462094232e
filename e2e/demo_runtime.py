"""`make demo-runtime`: serve a synthetic MoE model at DP=2 and talk to it.

Starts `moe-runtime serve --model synthetic://tiny?seed=0 --data-parallel-size 2` (its own
local Ray instance on 127.0.0.1), sends a few completions (one streamed), prints the answers
and the throughput of a concurrent batch, then stops the server with SIGTERM, which also stops
its Ray instance. `make demo` runs the whole story through the operator on the real node (e2e/cluster/demo.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

MODEL = "synthetic://tiny?seed=0"
NAME = "tiny"
DP = 2
START_DEADLINE = 300.0
PROMPTS = [
    "Mixture of experts",
    "Elastic expert parallelism means",
    "A Kubernetes operator",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: pathlib.Path) -> None:
    deadline = time.monotonic() + START_DEADLINE
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not healthy within {START_DEADLINE} s:\n{log.read_text()[-3000:]}")


def show_completions(url: str) -> None:
    for prompt in PROMPTS:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        say(
            f"{prompt!r} -> {choice['text']!r} ({len(choice['token_ids'])} tokens, "
            f"{choice['finish_reason']})"
        )
    body = {
        "model": NAME,
        "prompt": PROMPTS[0],
        "max_tokens": 24,
        "temperature": 0.8,
        "seed": 1,
        "stream": True,
    }
    pieces = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    say(f"streamed (temperature 0.8, seed 1) in {len(pieces)} events: {''.join(pieces)!r}")
    chat = {"model": NAME, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 24}
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).json()
    say(
        f"chat (the model's template, {answer['usage']['prompt_tokens']} prompt tokens): "
        f"{answer['choices'][0]['message']['content']!r}"
    )


async def throughput(url: str, *, n: int = 32, max_tokens: int = 32) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        started = time.monotonic()
        responses = await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json={
                        "model": NAME,
                        "prompt": f"request {i}",
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                for i in range(n)
            )
        )
        wall = time.monotonic() - started
    ok = [r for r in responses if r.status_code == 200]
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in ok)
    say(
        f"{len(ok)}/{n} concurrent completions in {wall:.1f} s: {tokens / wall:.0f} tokens/s "
        f"at DP={DP}"
    )


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = pathlib.Path(tempfile.mkdtemp(prefix="elastic-moe-demo-")) / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [
        str(pathlib.Path(sys.executable).parent / "moe-runtime"),
        "serve",
        "--model",
        MODEL,
        "--data-parallel-size",
        str(DP),
        "--port",
        str(port),
    ]
    say(f"starting: {' '.join(cmd)} (log: {log})")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        started = time.monotonic()
        wait_healthy(url, proc, log)
        say(f"serving {NAME} on {url} at DP={DP} after {time.monotonic() - started:.1f} s")
        say(f"models: {[m['id'] for m in httpx.get(f'{url}/v1/models').json()['data']]}")
        show_completions(url)
        asyncio.run(throughput(url))
    finally:
        if proc.poll() is None:
            say("stopping the server (SIGTERM)")
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                say("server did not stop within 60 s: killing its process group")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    say(f"server stopped (exit status {proc.returncode})")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
