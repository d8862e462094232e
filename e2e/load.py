"""A checked load generator for end-to-end runs: several client threads sending a mix of greedy
and seeded completions, streamed and not, with long generations.

Every answer is checked token for token against generation of the same model in this process
(all experts local, the runtime's own sampling rule), so "no lost request" also means "no
wrong, repeated or missing token". Used by the e2e tiers, the demo and benches.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

PROMPTS = [[(11 * i + 3 * j) % 250 + 1 for j in range(2 + (i * 7) % 19)] for i in range(12)]
#: Generation lengths; the longest ones span a whole resize.
LENGTHS = (8, 24, 64, 96)
#: Sampling of the seeded requests (the runtime samples by (seed, tokens generated) only).
TEMPERATURE = 1.0
TOP_P = 0.9


@dataclasses.dataclass(frozen=True)
class Case:
    """One kind of request: ``seed`` None is greedy; ``stream`` reads the SSE deltas."""

    prompt: int
    max_tokens: int
    seed: int | None = None
    stream: bool = False

    @property
    def key(self) -> tuple[int, int, int | None]:
        return (self.prompt, self.max_tokens, self.seed)

    def body(self, model_name: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model_name,
            "prompt": PROMPTS[self.prompt],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,  # every answer has exactly max_tokens tokens
            "stream": self.stream,
        }
        if self.seed is None:
            body["temperature"] = 0
        else:
            body.update(temperature=TEMPERATURE, top_p=TOP_P, seed=self.seed)
        return body


def cases(
    *,
    lengths: Sequence[int] = LENGTHS,
    seeds: Sequence[int] = (1, 2),
    prompts: Sequence[int] | None = None,
) -> list[Case]:
    """Every prompt (of `prompts`, default all) × length, greedy and seeded (the stream flag
    is drawn per request)."""
    chosen = range(len(PROMPTS)) if prompts is None else prompts
    return [Case(p, n, seed) for p in chosen for n in lengths for seed in (None, *seeds)]


def reference_tokens(
    model: str, todo: Sequence[Case] | None = None
) -> dict[tuple[int, int, int | None], list[int]]:
    """The tokens of every case, generated in this process with all experts local."""
    import torch

    from moe_runtime import step
    from moe_runtime.model import decoder, source
    from moe_runtime.model import experts as experts_mod
    from moe_runtime.model import kv as kv_mod
    from moe_runtime.rank import sampling

    todo = list(todo or cases())
    torch.set_num_threads(1)
    src = source.open_source(model)
    net = decoder.MoEModel.from_source(src)
    experts = experts_mod.LocalExperts.from_source(src)
    # One sequence per (prompt, seed), generated as long as the longest length asked.
    longest: dict[tuple[int, int | None], int] = {}
    for c in todo:
        longest[(c.prompt, c.seed)] = max(longest.get((c.prompt, c.seed), 0), c.max_tokens)
    seqs = sorted(longest, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    out: dict[tuple[int, int | None], list[int]] = {k: [] for k in seqs}
    kv = kv_mod.KVCache(net.config, dtype=net.dtype, device=net.device)
    active = list(seqs)
    batch = kv_mod.ForwardBatch(
        seq_ids=[str(k) for k in active],
        token_ids=[list(PROMPTS[k[0]]) for k in active],
        start_pos=[0] * len(active),
    )
    with torch.no_grad():
        while active:
            logits = net.forward(batch, kv, experts)
            still = []
            for row, k in enumerate(active):
                prompt, seed = k
                params = (
                    step.SamplingParams(temperature=0.0)
                    if seed is None
                    else step.SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=seed)
                )
                token = sampling.sample_token(logits[row].float(), params, len(out[k]))
                out[k].append(token)
                if len(out[k]) < longest[k]:
                    still.append(k)
                else:
                    kv.free(str(k))
            active = still
            batch = kv_mod.ForwardBatch(
                seq_ids=[str(k) for k in active],
                token_ids=[[out[k][-1]] for k in active],
                start_pos=[len(PROMPTS[k[0]]) + len(out[k]) - 1 for k in active],
            )
    return {c.key: out[(c.prompt, c.seed)][: c.max_tokens] for c in todo}


class Load:
    """``clients`` threads sending checked completions to ``url()`` until stopped.

    ``url`` is called before every request, so the load follows an endpoint that is published
    late or moves. Failures (HTTP errors, non-200, wrong tokens) are kept with their reason;
    ``ok`` counts answers that matched the reference.
    """

    def __init__(
        self,
        url: Callable[[], str | None],
        *,
        model_name: str,
        reference: dict[tuple[int, int, int | None], list[int]] | None = None,
        clients: int = 4,
        timeout_s: float = 300.0,
        lengths: Sequence[int] = LENGTHS,
        seeds: Sequence[int] = (1, 2),
        headers: dict[str, str] | None = None,
        prompts: Sequence[int] | None = None,
    ) -> None:
        self._url = url
        self.model_name = model_name
        self.reference = reference
        self.timeout_s = timeout_s
        self.headers = headers or {}
        self.cases = cases(lengths=lengths, seeds=seeds, prompts=prompts)
        self.ok = 0
        self.by_kind: dict[str, int] = {}
        self.failures: list[str] = []
        self.latencies: list[float] = []
        #: (monotonic time, tokens) of every streamed delta: the serving timeline.
        self.token_times: list[tuple[float, int]] = []
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

    def _check(self, case: Case, got: list[int]) -> str | None:
        if self.reference is None:
            return None if len(got) == case.max_tokens else f"{case}: {len(got)} tokens"
        want = self.reference[case.key]
        if got != want:
            first = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None
            )
            return (
                f"{case}: answer differs from the reference (got {len(got)} tokens, "
                f"first difference at {first})"
            )
        return None

    def _one(self, client: httpx.Client, url: str, case: Case) -> str | None:
        body = case.body(self.model_name)
        try:
            if not case.stream:
                r = client.post(f"{url}/v1/completions", json=body, timeout=self.timeout_s)
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {r.text[:200]}"
                return self._check(case, r.json()["choices"][0]["token_ids"])
            got: list[int] = []
            with client.stream(
                "POST", f"{url}/v1/completions", json=body, timeout=self.timeout_s
            ) as r:
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {r.read()[:200]!r}"
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        return f"{case}: stream error {chunk['error']}"
                    for choice in chunk.get("choices") or []:
                        new = choice.get("token_ids") or []
                        got.extend(new)
                        if new:
                            with self._lock:
                                self.token_times.append((time.monotonic(), len(new)))
            return self._check(case, got)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return f"{case}: {type(exc).__name__}: {exc}"

    def _client(self, index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(headers=self.headers) as client:
            while not self._stop.is_set():
                url = self._url()
                if url is None:
                    self._stop.wait(0.2)
                    continue
                case = dataclasses.replace(rng.choice(self.cases), stream=rng.random() < 0.5)
                started = time.monotonic()
                problem = self._one(client, url, case)
                kind = ("seeded" if case.seed is not None else "greedy") + (
                    "-stream" if case.stream else ""
                )
                with self._lock:
                    if problem is None:
                        self.ok += 1
                        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
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

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time without a streamed token between ``start`` and ``end``."""
        with self._lock:
            times = sorted(t for t, _ in self.token_times if start <= t <= end)
        edges = [start, *times, end]
        return max((b - a for a, b in zip(edges, edges[1:], strict=False)), default=end - start)

    def summary(self) -> str:
        with self._lock:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.by_kind.items()))
            return f"requests: ok={self.ok} failed={len(self.failures)} ({kinds})"
