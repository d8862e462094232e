"""Issue acceptance: every supported family, served by `moe-runtime serve --model DIR
--data-parallel-size 2 --dtype float32` (Ray ranks, expert parallelism), answers token for
token as transformers does: greedy (transformers' `generate`) and seeded (transformers' logits
sampled by the runtime's seeded rule), one by one and concurrently, streamed or not; at DP=2,
during and after a live `POST /scale_elastic_ep?wait=true` to 3 ranks under load, and after a
shrink to 1. On the Qwen3-MoE checkpoint (a ChatML tokenizer, two eos ids) the chat route
through the `openai` client equals transformers' `apply_chat_template` + `generate`.

One server per family (a module-scoped fixture per family), all joining the tests' Ray
instance (`ray_session`: no Ray start per server); the checkpoints are tiny random ones saved
by `save_pretrained` (`tests/support/hf_families.py`), with expert counts that the rank
counts do not divide and dense layers between MoE layers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers

from e2e import load as load_mod
from moe_runtime import step
from tests.support import hf_families, runtime_proc

pytestmark = pytest.mark.ray

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = tuple(range(6))
LENGTHS = (6, 12)
SEED = 1
CHAT = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": "hello there, how are you?"},
]
Reference = dict[tuple[int, int, int | None], list[int]]


@dataclasses.dataclass
class Served:
    family: str
    server: runtime_proc.RuntimeProcess
    model: transformers.PreTrainedModel
    reference: Reference
    tokenizer: transformers.PreTrainedTokenizerFast | None


def _reference(model: transformers.PreTrainedModel) -> Reference:
    """transformers' answer to every (prompt, length, seed) case the tests send."""
    params = step.SamplingParams(temperature=load_mod.TEMPERATURE, top_p=load_mod.TOP_P, seed=SEED)
    longest = max(LENGTHS)
    out: Reference = {}
    for p in PROMPTS:
        prompt = load_mod.PROMPTS[p]
        greedy = hf_families.greedy(model, prompt, longest)
        seeded = hf_families.sampled(model, prompt, longest, params)
        for n in LENGTHS:
            out[(p, n, None)] = greedy[:n]
            out[(p, n, SEED)] = seeded[:n]
    return out


@pytest.fixture(scope="module", params=hf_families.FAMILIES)
def served(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    ray_address: str,
) -> Iterator[Served]:
    family: str = request.param
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(family)
    model = hf_families.build(family)
    tokenizer = None
    if family == "qwen3_moe":
        path, tokenizer, _ = hf_families.make_chat_checkpoint(model, root / "ckpt", CHAT)
    else:
        path = hf_families.save(model, root / "ckpt")
    args = ["--model", str(path), "--data-parallel-size", "2", "--dtype", "float32"]
    args += ["--max-data-parallel-size", "3", "--served-model-name", family]
    # The server starts (Ray, ranks, weights) while transformers computes the reference.
    server, reference = runtime_proc.start_while(
        args,
        lambda: _reference(model),
        log=root / "serve.log",
        env={"MOE_ADMIN_TOKEN": TOKEN, "RAY_ADDRESS": ray_address},
    )
    try:
        yield Served(family, server, model, reference, tokenizer)
    finally:
        server.stop()


def _cases() -> list[load_mod.Case]:
    return [
        load_mod.Case(p, n, seed, stream=(p + n) % 2 == 0)
        for p in PROMPTS
        for n in LENGTHS
        for seed in (None, SEED)
    ]


def _answer(client: httpx.Client, family: str, case: load_mod.Case) -> list[int]:
    body = dict(case.body(family), stream=False)
    r = client.post("/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["choices"][0]["token_ids"]
    return tokens


def _check_answers(s: Served, *, concurrently: bool) -> None:
    cases = _cases()
    with httpx.Client(base_url=s.server.url) as client:
        if concurrently:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda c: _answer(client, s.family, c), cases))
        else:
            got = [_answer(client, s.family, c) for c in cases]
    wrong = [
        (c.key, g, s.reference[c.key])
        for c, g in zip(cases, got, strict=True)
        if g != s.reference[c.key]
    ]
    assert not wrong, f"{s.family}: {len(wrong)} answers differ from transformers: {wrong[:3]}"


def _size(s: Served) -> int:
    return int(runtime_proc.status(s.server.url, headers=AUTH)["data_parallel_size"])


def test_answers_equal_transformers_one_by_one(served: Served) -> None:
    assert _size(served) == 2
    _check_answers(served, concurrently=False)


def test_answers_equal_transformers_concurrently(served: Served) -> None:
    _check_answers(served, concurrently=True)


def test_live_resize_to_three_under_load(served: Served) -> None:
    traffic = load_mod.Load(
        lambda: served.server.url,
        model_name=served.family,
        reference=served.reference,
        clients=4,
        lengths=LENGTHS,
        seeds=(SEED,),
        prompts=PROMPTS,
    )
    with traffic:
        done = runtime_proc.scale(served.server.url, 3, headers=AUTH)
    assert done["stage"] == "Completed", done
    assert not traffic.failures, traffic.failures[:3]
    assert traffic.ok > 0, traffic.summary()
    assert _size(served) == 3
    _check_answers(served, concurrently=True)


def test_answers_equal_transformers_on_one_rank(served: Served) -> None:
    assert runtime_proc.scale(served.server.url, 1, headers=AUTH)["stage"] == "Completed"
    assert _size(served) == 1
    _check_answers(served, concurrently=False)


def _chat(served: Served) -> tuple[openai.OpenAI, transformers.PreTrainedTokenizerFast]:
    if served.tokenizer is None:
        pytest.skip("the chat checkpoint is the Qwen3-MoE one")
    client = openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="unused")
    return client, served.tokenizer


@pytest.mark.parametrize("max_tokens", [16, 2], ids=["stop", "length"])
def test_chat_through_the_openai_client(served: Served, max_tokens: int) -> None:
    client, tok = _chat(served)
    ids, text, finish, prompt_len = hf_families.chat_answer(served.model, tok, CHAT, max_tokens)
    assert finish == ("stop" if max_tokens == 16 else "length")
    plain = client.chat.completions.create(
        model=served.family,
        messages=CHAT,
        max_tokens=max_tokens,
        temperature=0,  # type: ignore[arg-type]
    )
    assert plain.choices[0].message.content == text
    assert plain.choices[0].finish_reason == finish
    assert plain.usage is not None and plain.usage.prompt_tokens == prompt_len
    assert plain.usage.completion_tokens == len(ids)
    chunks: list[Any] = list(
        client.chat.completions.create(
            model=served.family,
            messages=CHAT,  # type: ignore[arg-type]
            max_completion_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == text
    assert with_choices[-1].choices[0].finish_reason == finish
    assert chunks[-1].usage.prompt_tokens == prompt_len


def test_logs_name_the_family(served: Served) -> None:
    log: pathlib.Path = served.server.log
    assert f"({served.family}, float32)" in log.read_text(errors="replace")
