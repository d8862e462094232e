"""Quantised checkpoints: block-FP8 (DeepSeek-V3, Qwen3-FP8) and MXFP4 (gpt-oss) are
dequantised at load exactly as transformers' own functions dequantise them, and served equal to
transformers running those dequantised weights; any other quantisation, or quantised tensors
without a quantization_config, are refused at start-up naming it."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import safetensors
import safetensors.torch
import torch
import transformers
from transformers.integrations import finegrained_fp8, mxfp4

from moe_runtime.model import errors, generate, quant, source
from tests.support import hf_families, read_counter, tp_ranks

PROMPTS = [[1, 5, 9, 200, 3], [1, *range(40, 58)]]
BLOCK = (8, 8)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(2)


def _fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `Fp8Quantize` rule: per block, scale = max|w| / FP8_MAX."""
    rows, cols = weight.shape
    bm, bn = block
    tiles = weight.float().reshape(rows // bm, bm, cols // bn, bn)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    inv = amax / FP8_MAX
    q = (tiles / inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), inv.float()


def _is_quantised(name: str, value: torch.Tensor) -> bool:
    """DeepSeek-V3 FP8 quantises the linear layers, not embeddings, norms, router, lm_head."""
    return (
        value.dim() == 2
        and name.endswith("_proj.weight")
        and value.shape[0] % BLOCK[0] == 0
        and value.shape[1] % BLOCK[1] == 0
    )


@pytest.fixture(scope="module")
def fp8(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[pathlib.Path, transformers.PreTrainedModel]:
    """A DeepSeek-V3 checkpoint quantised block-wise to FP8, and transformers' model holding
    its weights as transformers' `Fp8Dequantize` dequantises them."""
    model = hf_families.build("deepseek_v3")
    path = hf_families.save(model, tmp_path_factory.mktemp("fp8") / "ckpt")
    file = path / "model.safetensors"
    tensors = safetensors.torch.load_file(str(file))
    dequant = finegrained_fp8.Fp8Dequantize(hf_quantizer=None)
    reference: dict[str, torch.Tensor] = {}
    for name in [n for n, v in tensors.items() if _is_quantised(n, v)]:
        q, inv = _fp8(tensors[name], BLOCK)
        tensors[name] = q
        tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = inv
        reference[name] = dequant._dequantize_one(q, inv, output_dtype=torch.float32)
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (path / "config.json").write_text(json.dumps(config))
    hf = model
    state = hf.state_dict()
    per_expert: dict[str, torch.Tensor] = {}
    for name, value in reference.items():
        if ".experts." in name:
            per_expert[name] = value
        else:
            state[name].copy_(value)
    # transformers holds experts fused: gate_up_proj [E, 2I, H] = [gate; up], down_proj [E, H, I].
    with torch.no_grad():
        for idx, layer in enumerate(hf.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            for e in range(experts.gate_up_proj.shape[0]):
                p = f"model.layers.{idx}.mlp.experts.{e}."
                gate, up = per_expert[p + "gate_proj.weight"], per_expert[p + "up_proj.weight"]
                experts.gate_up_proj[e].copy_(torch.cat([gate, up]))
                experts.down_proj[e].copy_(per_expert[p + "down_proj.weight"])
    return path, hf


def test_fp8_weights_equal_transformers_dequantisation(
    fp8: tuple[pathlib.Path, transformers.PreTrainedModel],
) -> None:
    path, _ = fp8
    src = source.open_source(str(path))
    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    dequant = finegrained_fp8.Fp8Dequantize(hf_quantizer=None)
    checked = 0
    for name in (
        "model.layers.0.mlp.gate_proj.weight",  # the dense layer
        "model.layers.1.mlp.experts.3.down_proj.weight",
    ):
        scale = tensors[name.removesuffix(".weight") + ".weight_scale_inv"]
        want = dequant._dequantize_one(tensors[name], scale, output_dtype=torch.float32)
        assert torch.equal(src.tensor(name), want)
        checked += 1
    assert checked == 2


def test_fp8_partial_blocks_equal_transformers_backward_dequantisation() -> None:
    """A weight whose shape is not a whole number of blocks (DeepSeek-V3's kv_a_proj is 576
    rows of 128-row blocks): as transformers' `_dequantize_fp8_weight`."""
    weight = (torch.randn(12, 20) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3) + 0.5
    want = finegrained_fp8._dequantize_fp8_weight(weight, scale, [8, 8], torch.float32)
    assert torch.equal(quant.dequantize_fp8(weight, scale, (8, 8)), want)


def test_fp8_checkpoint_is_served_equal_to_its_dequantised_weights(
    fp8: tuple[pathlib.Path, transformers.PreTrainedModel],
) -> None:
    path, hf = fp8
    want = [hf_families.greedy(hf, p, 8) for p in PROMPTS]
    assert generate.generate_greedy(str(path), PROMPTS, 8) == want


MXFP4_SHAPE = dict(hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4)


@pytest.fixture(scope="module")
def mxfp4_ckpt(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[pathlib.Path, transformers.PreTrainedModel]:
    """A gpt-oss checkpoint with MXFP4 experts (`_blocks` + `_scales`, as OpenAI ships it),
    and transformers' model holding `convert_moe_packed_tensors` of them."""
    model = hf_families.build("gpt_oss", **MXFP4_SHAPE)
    path = hf_families.save(model, tmp_path_factory.mktemp("mxfp4") / "ckpt")
    file = path / "model.safetensors"
    tensors = safetensors.torch.load_file(str(file))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for idx, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                e, rows_in, rows_out = getattr(experts, proj).shape  # [E, in, out] (x @ W)
                blocks = torch.randint(0, 256, (e, rows_out, rows_in // 32, 16), generator=gen)
                scales = torch.randint(121, 127, (e, rows_out, rows_in // 32), generator=gen)
                name = f"model.layers.{idx}.mlp.experts.{proj}"
                del tensors[name]
                tensors[name + "_blocks"] = blocks.to(torch.uint8)
                tensors[name + "_scales"] = scales.to(torch.uint8)
                deq = mxfp4.convert_moe_packed_tensors(
                    blocks.to(torch.uint8), scales.to(torch.uint8), dtype=torch.float32
                )
                getattr(experts, proj).copy_(deq)
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    return path, model


def test_mxfp4_experts_equal_transformers_dequantisation(
    mxfp4_ckpt: tuple[pathlib.Path, transformers.PreTrainedModel],
) -> None:
    path, hf = mxfp4_ckpt
    src = source.open_source(str(path))
    fused = hf.model.layers[2].mlp.experts
    expert = 3
    got = {
        part: src.tensor(f"model.layers.2.mlp.experts.{expert}.{part}_proj.weight")
        for part in ("gate", "up", "down")
    }
    assert torch.equal(got["gate"], fused.gate_up_proj[expert][:, 0::2].T)
    assert torch.equal(got["up"], fused.gate_up_proj[expert][:, 1::2].T)
    assert torch.equal(got["down"], fused.down_proj[expert].T)


def test_mxfp4_checkpoint_is_served_equal_to_its_dequantised_weights(
    mxfp4_ckpt: tuple[pathlib.Path, transformers.PreTrainedModel],
) -> None:
    path, hf = mxfp4_ckpt
    want = [hf_families.greedy(hf, p, 8) for p in PROMPTS]
    assert generate.generate_greedy(str(path), PROMPTS, 8) == want


def test_other_quantisations_are_refused_naming_them(
    fp8: tuple[pathlib.Path, transformers.PreTrainedModel], tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(fp8[0], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.CheckpointError, match="quantization 'gptq'.*not supported"):
        source.open_source(str(path))
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.CheckpointError, match="activation_scheme 'static'"):
        source.open_source(str(path))


def test_fp8_tensors_without_a_quantization_config_are_refused(
    fp8: tuple[pathlib.Path, transformers.PreTrainedModel], tmp_path: pathlib.Path
) -> None:
    """Never cast float8 weights and serve them silently wrong."""
    path = tmp_path / "ckpt"
    shutil.copytree(fp8[0], path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        errors.CheckpointError, match="weight_scale_inv.*no fp8 quantization_config"
    ):
        source.open_source(str(path))


@pytest.mark.parametrize(
    ("name", "dim", "start", "stop"),
    [
        ("model.layers.0.mlp.gate_proj.weight", 0, 0, 12),  # a block and a half of rows
        ("model.layers.0.mlp.gate_proj.weight", 0, 12, 24),  # from mid-block
        ("model.layers.0.mlp.down_proj.weight", 1, 4, 20),  # columns, mid-block both ends
        ("model.layers.0.mlp.down_proj.weight", 1, 8, 16),  # one whole block
    ],
)
def test_an_fp8_slice_reads_its_blocks_only_and_equals_the_whole_cut(
    fp8: tuple[pathlib.Path, transformers.PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    dim: int,
    start: int,
    stop: int,
) -> None:
    """A TP rank's slice of a block-FP8 weight (`ModelSource.tensor_slice`) reads the blocks
    it touches and their scales, not the whole tensor, and its values are those of the whole
    tensor dequantised, then cut."""
    path, _ = fp8
    src = source.open_source(str(path))
    whole = src.tensor(name)
    counter = read_counter.ReadCounter()
    monkeypatch.setattr(safetensors, "safe_open", counter.safe_open)
    got = src.tensor_slice(name, dim=dim, start=start, stop=stop)
    assert torch.equal(got, whole.narrow(dim, start, stop - start))
    weight = [r for r in counter.reads if r.stored == name]
    covered = -(-stop // BLOCK[dim]) * BLOCK[dim] - start // BLOCK[dim] * BLOCK[dim]
    assert sum(r.nbytes for r in weight) == covered * whole.shape[1 - dim]  # one byte each
    assert covered < whole.shape[dim]


def test_tp_ranks_of_an_fp8_checkpoint_give_transformers_tokens(
    fp8: tuple[pathlib.Path, transformers.PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """T = 2 over the FP8 DeepSeek-V3 checkpoint: each TP rank reads only its blocks of the
    sliced FP8 weights, and both give transformers' greedy tokens."""
    path, hf = fp8
    want = [hf_families.greedy(hf, p, 8) for p in PROMPTS]
    counter = read_counter.ReadCounter()
    monkeypatch.setattr(safetensors, "safe_open", counter.safe_open)
    src = source.open_source(str(path))
    got = tp_ranks.run_threads(2, lambda g: tp_ranks.tp_generate(src, g, g.rank, 2, PROMPTS, 8))
    assert got == [want, want]
    stored = safetensors.torch.load_file(str(path / "model.safetensors"))
    fp8_read = [r for r in counter.reads if stored[r.stored].dtype == torch.float8_e4m3fn]
    sliced = [r for r in fp8_read if r.nbytes < stored[r.stored].numel()]  # one byte each
    # the dense layer's MLP (split at 28 of 56: mid-block, 8-row blocks) and the shared
    # experts, read in parts
    assert {r.stored for r in sliced} >= {
        f"model.layers.{layer}.mlp.{mlp}{p}_proj.weight"
        for layer, mlp in ((0, ""), (1, "shared_experts."))
        for p in ("gate", "up", "down")
    }
