"""Every family against transformers in one process (no server): greedy tokens and logits of
tiny random checkpoints saved by `save_pretrained`, in every layout they are saved in, and the
checkpoint features that decide what is served (dtype, rotary forms, stop ids, unused tensors).
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import pytest
import safetensors.torch
import torch
import transformers

from moe_runtime.model import decoder, errors, families, generate, names, source
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from tests.support import hf_families

PROMPTS = [[1, 5, 9, 200, 3], [1, 7], [1, *range(40, 58)]]
NEW_TOKENS = 10


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def models() -> dict[str, transformers.PreTrainedModel]:
    return {family: hf_families.build(family) for family in hf_families.FAMILIES}


@pytest.fixture(scope="module")
def saved(
    models: dict[str, transformers.PreTrainedModel], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: hf_families.save(m, root / family) for family, m in models.items()}


@pytest.mark.parametrize("family", hf_families.FAMILIES)
def test_greedy_tokens_and_logits_match_transformers(
    family: str,
    models: dict[str, transformers.PreTrainedModel],
    saved: dict[str, pathlib.Path],
) -> None:
    hf = models[family]
    src = source.open_source(str(saved[family]))
    assert src.config.family == family
    ours = generate.generate_greedy(src, PROMPTS, NEW_TOKENS)
    net = decoder.MoEModel.from_source(src)
    local = experts_mod.LocalExperts.from_source(src)
    for prompt, got in zip(PROMPTS, ours, strict=True):
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert got == out.sequences[0, len(prompt) :].tolist()
        # The last step's logits, recomputed by one prefill of prompt + generated.
        batch = kv_mod.ForwardBatch(["s"], [prompt + got[:-1]], [0])
        logits = net.forward(batch, kv_mod.KVCache(src.config), local)[0]
        torch.testing.assert_close(logits, out.logits[-1][0].float(), atol=1e-4, rtol=0)


def test_moe_layers_are_the_placement_layers(saved: dict[str, pathlib.Path]) -> None:
    """Dense layers (Qwen's mlp_only_layers, DeepSeek's first_k_dense_replace) hold no experts:
    placements and load counts index the MoE layers only."""
    qwen = source.open_source(str(saved["qwen3_moe"])).config
    assert (qwen.num_layers, qwen.moe_layer_ids, qwen.num_moe_layers) == (4, (0, 2, 3), 3)
    deepseek = source.open_source(str(saved["deepseek_v3"])).config
    assert deepseek.moe_layer_ids == (1, 2, 3)
    expert = names.expert_tensor_names(deepseek, 0, 5)  # MoE layer 0 is decoder layer 1
    assert all(n.startswith("model.layers.1.mlp.experts.5.") for n in expert)
    assert "model.layers.0.mlp.gate_proj.weight" in names.non_expert_tensor_names(deepseek)
    load = torch.zeros(deepseek.num_moe_layers, deepseek.num_experts, dtype=torch.int64)
    net = decoder.MoEModel.from_source(source.open_source(str(saved["deepseek_v3"])))
    local = experts_mod.LocalExperts.from_source(source.open_source(str(saved["deepseek_v3"])))
    net.forward(
        kv_mod.ForwardBatch(["a"], [[1, 2, 3]], [0]),
        kv_mod.KVCache(deepseek),
        local,
        expert_load=load,
    )
    assert load.sum(dim=1).tolist() == [3 * deepseek.top_k] * 3


def test_gpt_oss_experts_carry_their_biases(saved: dict[str, pathlib.Path]) -> None:
    src = source.open_source(str(saved["gpt_oss"]))
    weights = experts_mod.load_expert(src, 1, 3)
    assert set(weights.tensors()) == {"gate", "up", "down", "gate_bias", "up_bias", "down_bias"}
    assert weights.activation.kind == "gpt_oss"
    flat = weights.flatten()
    back = experts_mod.ExpertWeights.unflatten(flat, weights)
    assert all(
        torch.equal(a, b)
        for a, b in zip(back.tensors().values(), weights.tensors().values(), strict=True)
    )


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_fused_layout_reads_the_same_experts(
    family: str,
    models: dict[str, transformers.PreTrainedModel],
    saved: dict[str, pathlib.Path],
    tmp_path: pathlib.Path,
) -> None:
    """transformers 5's fused layout (`save_original_format=False`): the same tensors."""
    fused_path = hf_families.save(models[family], tmp_path / "fused", save_original_format=False)
    with safetensors.safe_open(str(fused_path / "model.safetensors"), "pt") as handle:
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in handle.keys())
    fused, per_expert = (source.open_source(str(p)) for p in (fused_path, saved[family]))
    cfg = fused.config
    for m in range(cfg.num_moe_layers):
        for e in (0, cfg.num_experts - 1):
            a, b = (experts_mod.load_expert(s, m, e) for s in (fused, per_expert))
            assert all(
                torch.equal(x, y)
                for x, y in zip(a.tensors().values(), b.tensors().values(), strict=True)
            )
    assert generate.generate_greedy(fused, PROMPTS[:1], 6) == generate.generate_greedy(
        per_expert, PROMPTS[:1], 6
    )


def test_sharded_checkpoint_with_index(
    models: dict[str, transformers.PreTrainedModel], tmp_path: pathlib.Path
) -> None:
    path = hf_families.save(models["deepseek_v3"], tmp_path / "sharded", max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    want = hf_families.greedy(models["deepseek_v3"], PROMPTS[0], 6)
    assert generate.generate_greedy(str(path), PROMPTS[:1], 6) == [want]


def test_dtype_follows_the_checkpoint(
    models: dict[str, transformers.PreTrainedModel], tmp_path: pathlib.Path
) -> None:
    path = hf_families.save(models["qwen3_moe"].to(torch.bfloat16), tmp_path / "bf16")
    models["qwen3_moe"].to(torch.float32)
    cfg = source.open_source(str(path)).config
    assert cfg.dtype == "bfloat16"
    hf = json.loads((path / "config.json").read_text())
    hf["torch_dtype"] = hf.pop("dtype")  # the older key
    assert families.from_hf_config(hf, "c").dtype == "bfloat16"


@pytest.mark.parametrize(("flag", "served"), [(None, "bfloat16"), ("float32", "float32")])
def test_serve_takes_the_checkpoint_dtype_unless_told(
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
    flag: str | None,
    served: str,
) -> None:
    from moe_runtime import cli

    path = hf_families.save(hf_families.build("olmoe").to(torch.bfloat16), tmp_path / "bf16")
    argv = ["serve", "--model", str(path), "--data-parallel-size", "1", "--executor", "local"]
    args = cli.build_parser().parse_args(argv + ([] if flag is None else ["--dtype", flag]))
    with caplog.at_level(logging.INFO):
        runtime = cli.build(args)
    try:
        assert any(f"(olmoe, {served})" in r.message for r in caplog.records)
        state = runtime.executor.collective_rpc("live_state")  # type: ignore[union-attr]
        assert state  # the rank serves
    finally:
        runtime.close()


def _config(path: pathlib.Path) -> dict[str, object]:
    loaded: dict[str, object] = json.loads((path / "config.json").read_text())
    return loaded


def test_old_rope_theta_and_rope_scaling_form(saved: dict[str, pathlib.Path]) -> None:
    """`rope_theta` + `rope_scaling` {"type": "yarn"} (DeepSeek-V2-Lite's config.json) reads
    as the same rotary parameters as transformers 5's `rope_parameters`."""
    hf = _config(saved["deepseek_v2"])
    new = families.from_hf_config(hf, "c")
    params = dict(hf.pop("rope_parameters"))  # type: ignore[call-overload]
    hf["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    hf["rope_scaling"] = params
    old = families.from_hf_config(hf, "c")
    assert new.rope_scaling is not None and new.rope_scaling.kind == "yarn"
    assert (old.rope_theta, old.rope_scaling) == (new.rope_theta, new.rope_scaling)


def test_every_stop_id_of_both_configs(
    saved: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(saved["olmoe"], path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    cfg = source.open_source(str(path)).config
    assert cfg.stop_token_ids == (7, 2) and cfg.eos_token_id == 7
    tok = source.open_source(str(path)).tokenizer()  # the byte-level fallback: no tokenizer.json
    assert tok.stop_token_ids == (7, 2)


def test_unknown_model_type_is_refused_by_name() -> None:
    with pytest.raises(errors.CheckpointError, match="'jamba'.*supported.*deepseek_v3"):
        families.from_hf_config({"model_type": "jamba"}, "/ckpt/config.json")


def test_an_unused_tensor_is_an_error_naming_it(
    saved: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(saved["qwen3_moe"], path)
    file = path / "model.safetensors"
    tensors = safetensors.torch.load_file(str(file))
    tensors["model.layers.0.mlp.experts.0.gate_proj.bias"] = torch.zeros(24)
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(errors.CheckpointError, match=r"experts\.0\.gate_proj\.bias"):
        source.open_source(str(path))


def test_deepseek_v3_mtp_layers_are_skipped_with_a_log_line(
    saved: dict[str, pathlib.Path], tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(saved["deepseek_v3"], path)
    file = path / "model.safetensors"
    tensors = safetensors.torch.load_file(str(file))
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(48, 96)  # layer 4 = the MTP layer
    tensors["model.layers.4.enorm.weight"] = torch.ones(48)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # older saves
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO):
        src = source.open_source(str(path))
    assert any(
        "skipping 2 tensors of multi-token-prediction layer 4" in r.message for r in caplog.records
    )
    assert generate.generate_greedy(src, PROMPTS[:1], 4) == generate.generate_greedy(
        str(saved["deepseek_v3"]), PROMPTS[:1], 4
    )


DEEPSEEK_SYNTHETIC = "synthetic://deepseek-tiny?seed=0"


def test_synthetic_deepseek_shape() -> None:
    """synthetic://deepseek-tiny: MLA (a q low-rank), a dense first layer, shared experts,
    sigmoid routing over groups with correction biases; every tensor from (seed, name)."""
    src = source.open_source(DEEPSEEK_SYNTHETIC)
    cfg = src.config
    assert cfg.family == "deepseek_v3" and cfg.mla is not None and cfg.mla.q_lora_rank
    assert cfg.moe_layer_ids == (1, 2, 3) and cfg.shared_intermediate_size > 0
    assert cfg.router == "sigmoid_group" and cfg.n_group > 1
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert torch.equal(src.tensor(name), source.open_source(DEEPSEEK_SYNTHETIC).tensor(name))
    assert src.chat_template() is not None


def test_synthetic_deepseek_served_on_three_ranks_equals_one_process() -> None:
    """Expert parallelism over 3 in-process ranks (8 experts in 9 slots: one redundant) gives
    the single-process tokens; the chat route answers with the synthetic template."""
    from fastapi import testclient

    from moe_runtime import cli

    prompts = [[256, *range(65, 65 + n)] for n in (3, 9, 17)]
    want = generate.generate_greedy(DEEPSEEK_SYNTHETIC, prompts, 12)
    args = cli.build_parser().parse_args(
        ["serve", "--model", DEEPSEEK_SYNTHETIC, "--data-parallel-size", "3"]
        + ["--executor", "local", "--served-model-name", "ds"]
    )
    runtime = cli.build(args)
    try:
        client = testclient.TestClient(runtime.app)
        for prompt, tokens in zip(prompts, want, strict=True):
            body = {"model": "ds", "prompt": prompt, "max_tokens": 12, "temperature": 0}
            r = client.post("/v1/completions", json={**body, "ignore_eos": True})
            assert r.json()["choices"][0]["token_ids"] == tokens
        chat = {"model": "ds", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
    finally:
        runtime.close()


def test_non_expert_transfer_keeps_float32_roles_exact_in_bfloat16() -> None:
    """DeepSeek keeps its router and correction bias in float32 whatever the serving dtype
    (as transformers does): a new rank receives them bit for bit from a bfloat16 peer."""
    from moe_runtime.eplb import policy
    from moe_runtime.executor import local

    cfg = source.open_source(DEEPSEEK_SYNTHETIC).config
    ex = local.LocalExecutor(1, dtype="bfloat16")
    try:
        placement = policy.identity(cfg.num_moe_layers, cfg.num_experts, cfg.num_experts, 1)
        ex.start(DEEPSEEK_SYNTHETIC, placement=placement)
        (new,) = ex.add_ranks(1)
        ex.collective_rpc(
            "load_weights",
            ranks=[new],
            source=DEEPSEEK_SYNTHETIC,
            rank=1,
            num_ranks=2,
            placement=None,
            placeholder=True,
        )
        ex.build_groups([0, new], epoch=1)
        ex.collective_rpc("transfer_non_expert", 1, ranks=[0, new], src_ranks=[0], dst_ranks=[new])
        sender, receiver = (ex.worker(r).loaded.model.non_expert_state() for r in (0, new))
        router = "model.layers.1.mlp.gate.weight"
        assert (
            sender[router].dtype == torch.float32
            and sender["model.norm.weight"].dtype == torch.bfloat16
        )
        assert set(sender) == set(receiver)
        assert all(
            torch.equal(sender[n], receiver[n]) and sender[n].dtype == receiver[n].dtype
            for n in sender
        )
        assert cfg.router == "sigmoid_group"
    finally:
        ex.shutdown()
