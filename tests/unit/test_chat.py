"""POST /v1/chat/completions: templates rendered as transformers renders them, and the route
through the `openai` client (plain and streamed) equal to transformers' `apply_chat_template`
+ `generate` on a checkpoint whose generation_config.json lists two eos ids."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
import transformers
from fastapi import testclient

from moe_runtime import cli
from moe_runtime.model import chat_template, source
from tests.support import hf_families

MODEL = "chat"
MESSAGES = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": "hello there, how are you?"},
]
OTHER = [{"role": "user", "content": "the quick brown fox"}]

# Templates that use what transformers' environment offers: loop controls, raise_exception,
# its tojson (non-ASCII kept, indent), namespace, special tokens, trim/lstrip of blocks.
TEMPLATES = {
    "chatml": hf_families.CHATML,
    "system-first": """{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}{% set rest = messages[1:] %}
{% else %}{% set system = 'You are helpful.' %}{% set rest = messages %}{% endif %}
{{ bos_token }}[SYS]{{ system }}[/SYS]
{% for m in rest %}
    {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
    {% if loop.index0 > 6 %}{% break %}{% endif %}
[{{ m['role'] | upper }}] {{ m['content'] | trim }}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}""",
    "json-namespace": """{% set ns = namespace(count=0) %}
{% for m in messages %}{% set ns.count = ns.count + 1 %}
{{ m | tojson(indent=2) }}
{% endfor %}turns={{ ns.count }}{{ eos_token }}""",
}
CONVERSATIONS = [
    MESSAGES,
    [
        *MESSAGES,
        {"role": "assistant", "content": "  fine, thanks  "},
        {"role": "user", "content": "héllo ☃"},
    ],
    [{"role": "user", "content": "only a user", "name": None}],
]


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_templates_render_as_transformers_renders_them(template: str) -> None:
    hf = hf_families.chat_tokenizer()
    hf.chat_template = TEMPLATES[template]
    hf.bos_token = "<|im_start|>"
    ours = chat_template.ChatTemplate(
        TEMPLATES[template], special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    )
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            want = hf.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False
            )
            assert ours.render(messages, add_generation_prompt=generation_prompt) == want


def test_a_template_that_refuses_says_why() -> None:
    ours = chat_template.ChatTemplate(TEMPLATES["system-first"], special_tokens={})
    with pytest.raises(chat_template.TemplateError, match="bad role tool"):
        ours.render([{"role": "tool", "content": "x"}])


@pytest.fixture(scope="module")
def chat_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[pathlib.Path, transformers.PreTrainedModel, transformers.PreTrainedTokenizerFast]:
    torch.set_num_threads(2)
    model = hf_families.build("qwen3_moe")
    path, tok, _ = hf_families.make_chat_checkpoint(
        model, tmp_path_factory.mktemp("chat") / "ckpt", MESSAGES
    )
    return path, model, tok


def _runtime(path: pathlib.Path) -> cli.Runtime:
    args = cli.build_parser().parse_args(
        ["serve", "--model", str(path), "--data-parallel-size", "1", "--executor", "local"]
        + ["--served-model-name", MODEL]
    )
    return cli.build(args)


@pytest.fixture(scope="module")
def http(chat_model: tuple[pathlib.Path, Any, Any]) -> Iterator[testclient.TestClient]:
    runtime = _runtime(chat_model[0])
    try:
        yield testclient.TestClient(runtime.app)
    finally:
        runtime.close()


@pytest.fixture(scope="module")
def client(http: testclient.TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


def test_the_checkpoint_lists_two_eos_ids(chat_model: tuple[pathlib.Path, Any, Any]) -> None:
    generation = json.loads((chat_model[0] / "generation_config.json").read_text())
    assert len(generation["eos_token_id"]) == 2
    assert source.open_source(str(chat_model[0])).config.stop_token_ids == tuple(
        generation["eos_token_id"]
    )


@pytest.mark.parametrize(
    ("messages", "max_tokens"),
    [
        pytest.param(MESSAGES, 16, id="stops-on-the-second-eos-id"),
        pytest.param(MESSAGES, 2, id="length"),
        pytest.param(OTHER, 16, id="other-chat"),
    ],
)
def test_chat_equals_transformers_plain_and_streamed(
    client: openai.OpenAI,
    chat_model: tuple[pathlib.Path, transformers.PreTrainedModel, Any],
    messages: list[dict[str, str]],
    max_tokens: int,
) -> None:
    _, model, tok = chat_model
    ids, text, finish, prompt_len = hf_families.chat_answer(model, tok, messages, max_tokens)
    plain = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = plain.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant",
        text,
        finish,
    )
    assert plain.usage is not None
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (prompt_len, len(ids))
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == prompt_len


def test_a_stop_string_ends_the_answer_with_stop(
    client: openai.OpenAI, chat_model: tuple[pathlib.Path, transformers.PreTrainedModel, Any]
) -> None:
    _, model, tok = chat_model
    _, text, _, _ = hf_families.chat_answer(model, tok, MESSAGES, 16)
    cut = next(i for i, ch in enumerate(text) if ch.isascii())
    answer = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stop=[text[cut]],  # type: ignore[arg-type]
    )
    assert answer.choices[0].message.content == text[:cut]
    assert answer.choices[0].finish_reason == "stop"


def test_seeded_chat_is_reproducible(client: openai.OpenAI) -> None:
    answers = [
        client.chat.completions.create(
            model=MODEL,
            messages=OTHER,
            max_tokens=8,
            temperature=1.0,
            top_p=0.9,
            seed=5,  # type: ignore[arg-type]
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert answers[0] == answers[1]


def test_a_model_without_a_chat_template_answers_400(
    chat_model: tuple[pathlib.Path, Any, Any], tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(chat_model[0], path)
    (path / "chat_template.jinja").unlink()
    runtime = _runtime(path)
    try:
        http = testclient.TestClient(runtime.app)
        resp = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": OTHER, "max_tokens": 4}
        )
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["code"] == "no_chat_template" and "no chat template" in error["message"]
        assert (
            http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2}
            ).status_code
            == 200
        )
    finally:
        runtime.close()


def test_bad_messages_get_openai_errors(http: testclient.TestClient) -> None:
    for body, param in (
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages"),
        ({"messages": OTHER, "n": 2}, "n"),
        ({"messages": OTHER, "max_completion_tokens": 10_000}, "max_completion_tokens"),
    ):
        resp = http.post("/v1/chat/completions", json={"model": MODEL, **body})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param, resp.text
