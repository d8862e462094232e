"""A model without a tokenizer serves token ids: a Hugging Face checkpoint with no
`tokenizer.json` and fewer than the byte fallback's 258 ids, served by `moe-runtime serve`'s
own wiring (LocalExecutor); text prompts get a 400 that says why."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch
from fastapi import testclient

from moe_runtime import cli
from moe_runtime.model import checkpoint as checkpoint_mod
from moe_runtime.model import generate, source, tokenizer
from tests.support import checkpoints

VOCAB = 200
PROMPT = [1, 5, 9, 100, 3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("no-tokenizer") / "model"
    checkpoints.mixtral(vocab_size=VOCAB, max_position_embeddings=64).save_pretrained(path)
    assert not (path / checkpoint_mod.TOKENIZER_FILE).exists()
    return path


@pytest.fixture(scope="module")
def client(checkpoint: pathlib.Path) -> Iterator[testclient.TestClient]:
    torch.set_num_threads(2)
    args = cli.build_parser().parse_args(
        ["serve", "--model", str(checkpoint), "--data-parallel-size", "1", "--executor", "local"]
    )
    runtime = cli.build(args)
    assert runtime.app is not None
    try:
        with testclient.TestClient(runtime.app) as c:
            yield c
    finally:
        runtime.close()


def test_the_source_offers_no_tokenizer(checkpoint: pathlib.Path) -> None:
    tok = source.open_source(str(checkpoint)).tokenizer()
    assert isinstance(tok, tokenizer.NoTokenizer) and tok.vocab_size == VOCAB
    with pytest.raises(tokenizer.TokenizerUnavailable, match="list of token ids"):
        tok.encode("hello")


def test_token_id_prompts_are_served(
    client: testclient.TestClient, checkpoint: pathlib.Path
) -> None:
    body = {"model": "model", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    (want,) = generate.generate_greedy(str(checkpoint), [PROMPT], 6)
    assert (choice["token_ids"], choice["text"]) == (want, "")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"prompt": "hello"}, "prompt", id="text-prompt"),
        pytest.param({"prompt": ["hello"]}, "prompt", id="text-prompt-list"),
        pytest.param({"prompt": PROMPT, "stop": "x"}, "stop", id="stop-string"),
    ],
)
def test_text_gets_400_saying_there_is_no_tokenizer(
    client: testclient.TestClient, body: dict[str, object], param: str
) -> None:
    r = client.post("/v1/completions", json={"model": "model", "max_tokens": 2, **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "no_tokenizer")
    assert "no tokenizer" in error["message"]


def test_skip_tokenizer_init_serves_ids_only() -> None:
    args = cli.build_parser().parse_args(
        ["serve", "--model", "synthetic://tiny?seed=0", "--data-parallel-size", "1"]
        + ["--executor", "local", "--skip-tokenizer-init"]
    )
    runtime = cli.build(args)
    assert runtime.app is not None
    try:
        c = testclient.TestClient(runtime.app)
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
        assert c.post("/v1/completions", json={**body, "prompt": "hi"}).status_code == 400
        ok = c.post("/v1/completions", json={**body, "prompt": [256, 104, 105]})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
    finally:
        runtime.close()
