"""Fakes of the engine's world for tests without a model: a letter tokenizer, an executor
whose "model" checks the KV cache the engine implies, and the HTTP API in process.

`FakeExecutor` keeps, per rank, the tokens of each sequence's KV cache; a SeqWork must continue
it exactly (start_pos == tokens held), else the step fails. The next token is a function of
the whole KV content (and of (seed, num_generated) when sampling), so a wrong re-prefill after
a migration, a lost chunk or a stale cache changes the answer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import fastapi
import httpx

from moe_runtime import step as step_types
from moe_runtime.engine import core, request, seam

VOCAB = 26
EOS = 25


class LetterTokenizer:
    """Token i is the letter chr(ord('a') + i); 'z' (25) is EOS."""

    eos_token_id: int | None = EOS
    stop_token_ids = (EOS,)
    vocab_size = VOCAB

    def encode(self, s: str) -> list[int]:
        return [ord(c) - ord("a") for c in s]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + t) for t in token_ids)


def next_token(kv: list[int], sampling: step_types.SamplingParams, num_generated: int) -> int:
    """Greedy: the letter after the last one (y -> a, skipping EOS unless it is the successor
    of 'y'); sampled: shifted by a function of (seed, num_generated) only."""
    token = (kv[-1] + 1) % VOCAB
    if sampling.temperature > 0:
        token = (token + (sampling.seed or 0) * 7 + num_generated * 13 + len(kv)) % (VOCAB - 1)
    return token


class FakeExecutor:
    """Ranks in-process; records every StepInput; optional failure injection."""

    def __init__(self, num_ranks: int) -> None:
        self._num_ranks = num_ranks
        self.kv: dict[int, dict[str, list[int]]] = {r: {} for r in range(num_ranks)}
        self.steps: list[step_types.StepInput] = []
        self.fail_rank: Callable[[int, int], str | None] = lambda step_id, rank: None
        self.raise_at: set[int] = set()
        self.violations: list[str] = []  # KV inconsistencies seen (the engine retries them)
        self.lock = threading.Lock()

    @property
    def num_ranks(self) -> int:
        return self._num_ranks

    def execute_step(self, step: step_types.StepInput) -> list[step_types.StepOutput]:
        with self.lock:
            self.steps.append(step)
        if step.step_id in self.raise_at:
            raise ConnectionError(f"injected failure at step {step.step_id}")
        outputs = []
        for rank, batch in sorted(step.batches.items()):
            error = self.fail_rank(step.step_id, rank)
            if error is not None:
                outputs.append(step_types.StepOutput(rank=rank, step_id=step.step_id, error=error))
                continue
            cache = self.kv.setdefault(rank, {})
            for seq_id in batch.free:
                cache.pop(seq_id, None)
            out = step_types.StepOutput(rank=rank, step_id=step.step_id)
            for work in batch.seqs:
                held = cache.setdefault(work.seq_id, [])
                if min(work.token_ids) < 0:  # an unfilled placeholder of async scheduling
                    message = f"rank {rank}: {work.seq_id} runs token ids {work.token_ids}"
                    self.violations.append(message)
                    raise AssertionError(message)
                if work.start_pos != len(held):
                    message = (
                        f"rank {rank}: {work.seq_id} start_pos {work.start_pos} but KV holds "
                        f"{len(held)} tokens"
                    )
                    self.violations.append(message)
                    raise AssertionError(message)
                held.extend(work.token_ids)
                out.tokens[work.seq_id] = next_token(held, work.sampling, work.num_generated)
            outputs.append(out)
        return outputs

    def seqs_of(self, step: step_types.StepInput, rank: int) -> list[str]:
        batch = step.batches.get(rank)
        return [w.seq_id for w in batch.seqs] if batch else []


def make_engine(
    num_ranks: int = 1, *, max_model_len: int = 512, **config: int
) -> tuple[core.Engine, FakeExecutor]:
    executor = FakeExecutor(num_ranks)
    engine = core.Engine(
        executor,
        LetterTokenizer(),
        seam.EngineConfig(max_model_len=max_model_len, **config),
    )
    return engine, executor


def req(
    rid: str,
    prompt: str = "a",
    *,
    max_tokens: int = 5,
    stop: tuple[str, ...] = (),
    sampling: step_types.SamplingParams | None = None,
    ignore_eos: bool = False,
) -> request.Request:
    return request.Request(
        request_id=rid,
        prompt_token_ids=LetterTokenizer().encode(prompt),
        sampling=sampling or step_types.SamplingParams(),
        max_tokens=max_tokens,
        stop=stop,
        ignore_eos=ignore_eos,
    )


def inject(executor: FakeExecutor, failure: str, step_id: int) -> None:
    """Make step `step_id` fail: "raises" (execute_step raises) or "rank-error" (rank 1
    reports an error)."""
    if failure == "raises":
        executor.raise_at = {step_id}
    else:
        executor.fail_rank = lambda sid, rank: "boom" if (sid, rank) == (step_id, 1) else None


def run_four(engine: core.Engine, *, max_tokens: int) -> dict[str, list[int]]:
    """Requests "a", "ab", "abc", "abc" served to the end: their token ids."""
    with engine:
        hs = [
            engine.add_request(req(f"r{i}", "abc"[: i + 1], max_tokens=max_tokens))
            for i in range(4)
        ]
        return {h.request_id: h.result(10.0).token_ids for h in hs}


def serve_all(
    engine: core.Engine, requests: list[request.Request]
) -> dict[str, request.RequestOutput]:
    """Serve `requests` at once to the end; every stream ends with one finished output, last,
    and streams the answer's tokens in order."""
    with engine:
        handles = [engine.add_request(r) for r in requests]
        results = {h.request_id: h.result(10.0) for h in handles}
        for h in handles:
            outs = list(h.iter_outputs(10.0))
            assert sum(o.finished for o in outs) == 1 and outs[-1].finished
            assert [t for o in outs for t in o.new_token_ids] == results[h.request_id].token_ids
    return results


def run_endless(engine: core.Engine, *, n: int = 3, max_tokens: int = 12) -> list[int]:
    """`n` requests "ab" that ignore EOS, served to `max_tokens`: their answers' lengths."""
    with engine:
        hs = [
            engine.add_request(req(f"r{i}", "ab", max_tokens=max_tokens, ignore_eos=True))
            for i in range(n)
        ]
        return [len(h.result(10.0).token_ids) for h in hs]


def assert_same_answers(
    got: dict[str, request.RequestOutput],
    want: dict[str, request.RequestOutput],
    aborted: list[str],
) -> None:
    """Two runs of the same requests answered alike: equal tokens, texts and finish reasons
    (an aborted request: one answer a prefix of the other, as where an abort lands depends on
    when it was admitted); stops, lengths and aborts all happened."""
    for rid, done in got.items():
        other = want[rid]
        if rid in aborted:
            short, long = sorted((done.token_ids, other.token_ids), key=len)
            assert long[: len(short)] == short, rid
            continue
        assert (done.token_ids, done.text, done.finish_reason) == (
            other.token_ids,
            other.text,
            other.finish_reason,
        ), rid
    reasons = {r.finish_reason for r in got.values()}
    assert {request.FinishReason.STOP, request.FinishReason.LENGTH} <= reasons
    assert request.FinishReason.ABORT in {got[rid].finish_reason for rid in aborted}


#: The served model name of the letters app.
MODEL = "letters"


class Tokenizer(LetterTokenizer):
    """The letters as the HTTP API asks for them (`encode(..., add_special_tokens=)`)."""

    def encode(self, s: str, *, add_special_tokens: bool = True) -> list[int]:
        return super().encode(s)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def post(app: fastapi.FastAPI, body: Any, **kw: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        if isinstance(body, (bytes, str)):
            return await c.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
        return await c.post("/v1/completions", json=body, **kw)


async def get(app: fastapi.FastAPI, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        return await c.get(path)
