"""A load generator for local end-to-end runs: greedy completions from several client threads.

Every answer is checked against single-process generation of the same model (token for
token), so "no lost request" also means "no wrong answer". Used by the e2e tests and the demo.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

PROMPTS = [[(11 * i + 3 * j) % 250 + 1 for j in range(2 + (i * 7) % 19)] for i in range(12)]
LENGTHS = [4, 8, 16, 24]


def reference_tokens(
    model: str, lengths: list[int] | None = None
) -> dict[tuple[int, int], list[int]]:
    """Greedy tokens of every (prompt, length), computed in this process (all experts local)."""
    import torch

    from moe_runtime.model import mixtral

    lengths = lengths or LENGTHS
    torch.set_num_threads(1)
    longest = mixtral.generate_greedy(model, PROMPTS, max(lengths))
    return {(p, n): longest[p][:n] for p in range(len(PROMPTS)) for n in lengths}


def completion_body(model_name: str, prompt: int, max_tokens: int) -> dict[str, Any]:
    """A greedy completion of PROMPTS[prompt] that never stops early (ignore_eos)."""
    return {
        "model": model_name,
        "prompt": PROMPTS[prompt],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


class Load:
    """`clients` threads sending greedy completions to `url()` until stopped.

    url: called before every request, so the load follows an endpoint that is published late
    or moves. Failures (HTTP errors, non-200, wrong tokens) are kept with their reason.
    """

    def __init__(
        self,
        url: Callable[[], str | None],
        *,
        model_name: str,
        reference: dict[tuple[int, int], list[int]] | None = None,
        clients: int = 4,
        timeout_s: float = 300.0,
    ) -> None:
        self._url = url
        self.model_name = model_name
        self.reference = reference
        self.timeout_s = timeout_s
        self.ok = 0
        self.failures: list[str] = []
        self.latencies: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), name=f"load-{i}", daemon=True)
            for i in range(clients)
        ]

    @property
    def failed(self) -> int:
        with self._lock:
            return len(self.failures)

    def _one(self, client: httpx.Client, url: str, p: int, n: int) -> str | None:
        body = completion_body(self.model_name, p, n)
        try:
            r = client.post(f"{url}/v1/completions", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:200]}"
        got = r.json()["choices"][0]["token_ids"]
        if self.reference is not None and got != self.reference[(p, n)]:
            return f"prompt {p}, {n} tokens: answer differs from the reference"
        return None

    def _client(self, index: int) -> None:
        rng = random.Random(index)
        with httpx.Client() as client:
            while not self._stop.is_set():
                url = self._url()
                if url is None:
                    self._stop.wait(0.2)
                    continue
                p, n = rng.randrange(len(PROMPTS)), rng.choice(LENGTHS)
                started = time.monotonic()
                problem = self._one(client, url, p, n)
                with self._lock:
                    if problem is None:
                        self.ok += 1
                        self.latencies.append(time.monotonic() - started)
                    else:
                        self.failures.append(problem)

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s)

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def summary(self) -> str:
        with self._lock:
            return f"requests: ok={self.ok} failed={len(self.failures)}"
