"""Hugging Face Mixtral checkpoints: our model against transformers, and broken checkpoints."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import safetensors.torch
import tokenizers
import torch
import transformers

from moe_runtime.model import (
    checkpoint,
    decoder,
    errors,
    families,
    generate,
    names,
    source,
    tokenizer,
)
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from tests.support import checkpoints as hf_checkpoints

PROMPTS = [[1, 5, 9, 200, 3], [1, 7], [1, *range(40, 58)]]
NEW_TOKENS = 8


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[pathlib.Path, transformers.MixtralForCausalLM]]:
    """Three layouts: one file; an index + shards; fused experts (tied, sliding window)."""
    root = tmp_path_factory.mktemp("hf")
    classic = hf_checkpoints.mixtral()
    classic.save_pretrained(root / "single")
    classic.save_pretrained(root / "sharded", max_shard_size="100KB")
    fused = hf_checkpoints.mixtral(tie_word_embeddings=True, sliding_window=6, num_hidden_layers=2)
    fused.save_pretrained(root / "fused", save_original_format=False)
    return {
        "single-file": (root / "single", classic),
        "sharded-index": (root / "sharded", classic),
        "fused-tied-window": (root / "fused", fused),
    }


def test_layouts_are_what_we_think(
    checkpoints: dict[str, tuple[pathlib.Path, transformers.MixtralForCausalLM]],
) -> None:
    assert len(list(checkpoints["sharded-index"][0].glob("*.safetensors"))) > 2
    assert (checkpoints["sharded-index"][0] / checkpoint.INDEX_FILE).is_file()
    with safetensors.safe_open(
        str(checkpoints["fused-tied-window"][0] / "model.safetensors"), "pt"
    ) as handle:
        assert "model.layers.0.mlp.experts.gate_up_proj" in handle.keys()


@pytest.mark.parametrize("layout", ["single-file", "sharded-index", "fused-tied-window"])
def test_greedy_tokens_and_logits_match_transformers(
    checkpoints: dict[str, tuple[pathlib.Path, transformers.MixtralForCausalLM]], layout: str
) -> None:
    path, hf = checkpoints[layout]
    src = source.open_source(str(path))
    ours = generate.generate_greedy(src, PROMPTS, NEW_TOKENS)
    model = decoder.MoEModel.from_source(src)
    experts = experts_mod.LocalExperts.from_source(src)
    for prompt, got in zip(PROMPTS, ours, strict=True):
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert got == out.sequences[0, len(prompt) :].tolist()
        # Logits of the last step, recomputed by a single prefill of prompt + generated.
        batch = kv_mod.ForwardBatch(["s"], [prompt + got[:-1]], [0])
        logits = model.forward(batch, kv_mod.KVCache(src.config), experts)[0]
        torch.testing.assert_close(logits, out.logits[-1][0].float(), atol=1e-4, rtol=0)


def test_expert_tensors_under_classic_names_in_every_layout(
    checkpoints: dict[str, tuple[pathlib.Path, transformers.MixtralForCausalLM]],
) -> None:
    single = source.open_source(str(checkpoints["single-file"][0]))
    sharded = source.open_source(str(checkpoints["sharded-index"][0]))
    fused_path, fused_hf = checkpoints["fused-tied-window"]
    fused = source.open_source(str(fused_path))
    for name in names.expert_tensor_names(single.config, 1, 4):
        assert torch.equal(single.tensor(name), sharded.tensor(name))
    inter = fused.config.intermediate_size
    gate_up = fused_hf.model.layers[1].mlp.experts.gate_up_proj.detach()
    down = fused_hf.model.layers[1].mlp.experts.down_proj.detach()
    weights = experts_mod.load_expert(fused, 1, 4)
    assert torch.equal(weights["gate"], gate_up[4, :inter])
    assert torch.equal(weights["up"], gate_up[4, inter:])
    assert torch.equal(weights["down"], down[4])
    assert fused.config.tie_word_embeddings and fused.config.sliding_window == 6
    assert "lm_head.weight" not in names.non_expert_tensor_names(fused.config)


def test_sliding_window_matters(
    checkpoints: dict[str, tuple[pathlib.Path, transformers.MixtralForCausalLM]],
) -> None:
    """The fused checkpoint's match with transformers depends on honouring its window."""
    src = source.open_source(str(checkpoints["fused-tied-window"][0]))
    batch = kv_mod.ForwardBatch(["s"], [PROMPTS[2]], [0])
    experts = experts_mod.LocalExperts.from_source(src)
    windowed = decoder.MoEModel.from_source(src)
    full = decoder.MoEModel(dataclasses.replace(src.config, sliding_window=None))
    full.load_non_expert(windowed.non_expert_state())
    a = windowed.forward(batch, kv_mod.KVCache(src.config), experts)
    b = full.forward(batch, kv_mod.KVCache(src.config), experts)
    assert (a - b).abs().max() > 1e-3


def test_tokenizer_json_is_used_and_byte_fallback_otherwise(
    checkpoints: dict[str, tuple[pathlib.Path, transformers.MixtralForCausalLM]],
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["single-file"][0], path)
    assert isinstance(source.open_source(str(path)).tokenizer(), tokenizer.ByteTokenizer)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    loaded = source.open_source(str(path)).tokenizer()
    assert isinstance(loaded, tokenizer.HFTokenizer)
    assert loaded.encode("hello world") == [3, 4]
    assert loaded.decode([1, 3, 4, 2]) == "hello world"
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)


# --- broken checkpoints ---------------------------------------------------------------------


def _rewrite(file: pathlib.Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = safetensors.torch.load_file(str(file))
    change(tensors)
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(path: pathlib.Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


Q0 = "model.layers.0.self_attn.q_proj.weight"


def _drop_q0(t: dict[str, torch.Tensor]) -> None:
    del t[Q0]


def _shrink_q0(t: dict[str, torch.Tensor]) -> None:
    t[Q0] = t[Q0][:-1]


def _first_shard(path: pathlib.Path) -> str:
    index = json.loads((path / checkpoint.INDEX_FILE).read_text())
    return str(index["weight_map"][Q0])


BROKEN: dict[str, tuple[str, Callable[[pathlib.Path], object], str, list[str]]] = {
    # id: (layout to start from, how to break it, file named in the error, words in the error)
    "no-config": (
        "single-file",
        lambda p: (p / "config.json").unlink(),
        "config.json",
        ["missing", "config.json"],
    ),
    "config-not-json": (
        "single-file",
        lambda p: (p / "config.json").write_text("{model_type: mixtral"),
        "config.json",
        ["unreadable JSON"],
    ),
    "wrong-model-type": (
        "single-file",
        lambda p: _edit_config(p, model_type="llama"),
        "config.json",
        ["model_type", "'llama'", "mixtral"],
    ),
    "config-field-missing": (
        "single-file",
        lambda p: _edit_config(p, num_local_experts=None),
        "config.json",
        ["num_local_experts"],
    ),
    "no-weights": (
        "single-file",
        lambda p: (p / "model.safetensors").unlink(),
        "",
        ["no *.safetensors"],
    ),
    "corrupt-weights": (
        "single-file",
        lambda p: (p / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad"),
        "model.safetensors",
        ["not a readable safetensors file"],
    ),
    "missing-tensor": (
        "single-file",
        lambda p: _rewrite(p / "model.safetensors", _drop_q0),
        "model.safetensors",
        ["missing tensor", Q0],
    ),
    "index-not-json": (
        "sharded-index",
        lambda p: (p / checkpoint.INDEX_FILE).write_text("not json"),
        checkpoint.INDEX_FILE,
        ["unreadable JSON"],
    ),
    "index-without-weight-map": (
        "sharded-index",
        lambda p: (p / checkpoint.INDEX_FILE).write_text('{"metadata": {}}'),
        checkpoint.INDEX_FILE,
        ["weight_map"],
    ),
    "index-points-to-missing-shard": (
        "sharded-index",
        lambda p: (p / _first_shard(p)).unlink(),
        checkpoint.INDEX_FILE,
        ["does not exist", "model-0"],
    ),
    "index-lacks-tensor": (
        "sharded-index",
        lambda p: (p / checkpoint.INDEX_FILE).write_text(
            json.dumps(
                {
                    "weight_map": {
                        k: v
                        for k, v in json.loads((p / checkpoint.INDEX_FILE).read_text())[
                            "weight_map"
                        ].items()
                        if k != Q0
                    }
                }
            )
        ),
        checkpoint.INDEX_FILE,
        ["missing tensor", Q0],
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_fails_at_open(
    checkpoints: dict[str, tuple[pathlib.Path, transformers.MixtralForCausalLM]],
    tmp_path: pathlib.Path,
    case: str,
) -> None:
    layout, breaker, file_name, words = BROKEN[case]
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints[layout][0], path)
    breaker(path)
    with pytest.raises(errors.CheckpointError) as info:
        source.open_source(str(path))
    message = str(info.value)
    assert str(path / file_name).rstrip("/") in message
    for word in words:
        assert word in message, message


def test_misshapen_tensor_fails_when_loaded(
    checkpoints: dict[str, tuple[pathlib.Path, transformers.MixtralForCausalLM]],
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["single-file"][0], path)
    _rewrite(path / "model.safetensors", _shrink_q0)
    src = source.open_source(str(path))
    with pytest.raises(errors.CheckpointError) as info:
        decoder.MoEModel.from_source(src)
    message = str(info.value)
    assert str(path / "model.safetensors") in message
    assert Q0 in message and "[63, 64]" in message and "[64, 64]" in message


def test_misshapen_fused_expert_fails_when_loaded(
    checkpoints: dict[str, tuple[pathlib.Path, transformers.MixtralForCausalLM]],
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["fused-tied-window"][0], path)
    name = "model.layers.1.mlp.experts.down_proj"

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:, :, :-2].contiguous()

    _rewrite(path / "model.safetensors", shrink)
    with pytest.raises(errors.CheckpointError, match="down_proj.*shape") as info:
        experts_mod.load_expert(source.open_source(str(path)), 1, 0)
    assert str(path / "model.safetensors") in str(info.value)


def test_shard_listed_but_tensor_absent_fails_when_loaded(
    checkpoints: dict[str, tuple[pathlib.Path, transformers.MixtralForCausalLM]],
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["sharded-index"][0], path)
    shard = path / _first_shard(path)
    _rewrite(shard, _drop_q0)
    src = source.open_source(str(path))
    with pytest.raises(errors.CheckpointError) as info:
        src.tensor(Q0)
    assert str(shard) in str(info.value) and Q0 in str(info.value)


def test_not_a_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.CheckpointError, match="no such checkpoint directory"):
        source.open_source(str(tmp_path / "nowhere"))


_GOOD_HF = dict(
    model_type="mixtral",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        pytest.param({"hidden_size": None}, ["'hidden_size'", "integer"], id="null-field"),
        pytest.param({"vocab_size": "320"}, ["'vocab_size'", "integer"], id="string-field"),
        pytest.param({"num_hidden_layers": 2.5}, ["'num_hidden_layers'"], id="fraction"),
        pytest.param({"hidden_act": "gelu"}, ["hidden_act", "silu"], id="activation"),
        pytest.param(
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
            ["'dynamic'", "yarn"],
            id="rope",
        ),
        pytest.param({"num_key_value_heads": 3}, ["num_kv_heads"], id="gqa-groups"),
        pytest.param({"num_experts_per_tok": 9}, ["top_k"], id="top-k"),
        pytest.param({"eos_token_id": "</s>"}, ["'eos_token_id'"], id="eos"),
    ],
)
def test_config_field_errors_name_the_field(changes: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(errors.CheckpointError) as info:
        families.from_hf_config({**_GOOD_HF, **changes}, "/ckpt/config.json")
    message = str(info.value)
    assert message.startswith("/ckpt/config.json: ")
    assert message.count("/ckpt/config.json") == 1
    for word in words:
        assert word in message, message


def test_config_defaults_and_rope_theta() -> None:
    cfg = families.from_hf_config(
        {**_GOOD_HF, "rope_theta": 5e5, "eos_token_id": [2, 7], "sliding_window": None}, "c"
    )
    assert (cfg.head_dim, cfg.rope_theta, cfg.eos_token_id, cfg.sliding_window) == (
        16,
        5e5,
        2,
        None,
    )
