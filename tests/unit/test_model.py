"""The Mixtral model package: synthetic sources, forward pass, KV cache, experts, tokenizer."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.model import decoder, errors, generate, names, source, tokenizer
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import linear as linear_mod

TINY = "synthetic://tiny?seed=0"


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny() -> source.ModelSource:
    return source.open_source(TINY)


@pytest.fixture(scope="module")
def model(tiny: source.ModelSource) -> decoder.MoEModel:
    return decoder.MoEModel.from_source(tiny)


@pytest.fixture(scope="module")
def experts(tiny: source.ModelSource) -> experts_mod.LocalExperts:
    return experts_mod.LocalExperts.from_source(tiny)


def _prompts(tok: tokenizer.Tokenizer) -> list[list[int]]:
    texts = ["Hello world", "The quick brown fox jumps", "a", "Elastic expert parallelism!"]
    return [tok.encode(t) for t in texts]


def _decode(
    model: decoder.MoEModel,
    experts: experts_mod.ExpertBackend,
    kv: kv_mod.KVCache,
    seq_id: str,
    context: list[int],
    start: int,
    steps: int,
) -> list[int]:
    """Feed context[start:] as one chunk, then decode `steps` tokens one at a time, alone."""
    out: list[int] = []
    batch = kv_mod.ForwardBatch([seq_id], [context[start:]], [start])
    for _ in range(steps):
        token = int(model.forward(batch, kv, experts).argmax(-1)[0])
        out.append(token)
        batch = kv_mod.ForwardBatch([seq_id], [[token]], [len(context) + len(out) - 1])
    return out


# --- synthetic sources ------------------------------------------------------------------------


def test_synthetic_tensors_depend_only_on_seed_and_name() -> None:
    picks = [
        "model.embed_tokens.weight",
        "model.layers.3.block_sparse_moe.experts.5.w2.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ]
    first = source.open_source("synthetic://tiny?seed=7")
    forward_order = {n: first.tensor(n) for n in picks}
    second = source.open_source("synthetic://tiny?seed=7")
    reverse_order = {n: second.tensor(n) for n in reversed(picks)}
    other_seed = source.open_source("synthetic://tiny?seed=8")
    for name in picks:
        assert torch.equal(forward_order[name], reverse_order[name]), name
        assert not torch.equal(forward_order[name], other_seed.tensor(name)), name


def test_synthetic_same_seed_same_tokens_other_seed_other_tokens(tiny: source.ModelSource) -> None:
    prompts = _prompts(tiny.tokenizer())[:2]
    first = generate.generate_greedy(TINY, prompts, 12)
    again = generate.generate_greedy(source.open_source(TINY), prompts, 12)
    other = generate.generate_greedy("synthetic://tiny?seed=1", prompts, 12)
    assert first == again
    assert first != other


def test_synthetic_default_seed_is_zero() -> None:
    name = "model.norm.weight"
    assert torch.equal(
        source.open_source("synthetic://tiny").tensor(name), source.open_source(TINY).tensor(name)
    )


def test_synthetic_presets_shapes() -> None:
    small = source.open_source("synthetic://small?seed=0").config
    assert (small.num_layers, small.num_experts, small.top_k, small.hidden_size) == (8, 32, 4, 512)
    tiny = source.open_source(TINY)
    assert tiny.config.num_kv_heads < tiny.config.num_heads
    for name in names.non_expert_tensor_names(tiny.config):
        assert tuple(tiny.tensor(name).shape) == names.tensor_shape(tiny.config, name)


def test_synthetic_overrides() -> None:
    src = source.open_source("synthetic://tiny?seed=3&num_experts=16&tie_word_embeddings=true")
    assert src.config.num_experts == 16
    assert "lm_head.weight" not in names.non_expert_tensor_names(src.config)
    out = generate.generate_greedy(src, [[256, 72, 105]], 4)
    assert len(out[0]) == 4


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        pytest.param("synthetic://huge", ["unknown synthetic model", "tiny"], id="unknown-name"),
        pytest.param("synthetic://tiny?seed=-1", ["seed"], id="negative-seed"),
        pytest.param("synthetic://tiny?seed=abc", ["seed"], id="text-seed"),
        pytest.param("synthetic://tiny?colour=red", ["unknown option", "colour"], id="bad-key"),
        pytest.param("synthetic://tiny?top_k=99", ["top_k"], id="bad-override"),
        pytest.param("s3://bucket/model", ["unsupported scheme"], id="scheme"),
    ],
)
def test_bad_source_strings(spec: str, words: list[str]) -> None:
    with pytest.raises(errors.SourceError) as info:
        source.open_source(spec)
    for word in words:
        assert word in str(info.value)


def test_unknown_tensor_name(tiny: source.ModelSource) -> None:
    with pytest.raises(KeyError):
        tiny.tensor("model.layers.99.self_attn.q_proj.weight")


# --- greedy decoding robustness -------------------------------------------------------------


def test_logit_margin_and_varied_text(
    tiny: source.ModelSource, model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    prompts = _prompts(tiny.tokenizer())
    kv = kv_mod.KVCache(model.config)
    ids = [str(i) for i in range(len(prompts))]
    batch = kv_mod.ForwardBatch(ids, prompts, [0] * len(prompts))
    gaps: list[float] = []
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(80):
        logits = model.forward(batch, kv, experts)
        top2 = logits.topk(2, dim=-1).values
        gaps.extend((top2[:, 0] - top2[:, 1]).tolist())
        tokens = logits.argmax(-1).tolist()
        for out, token in zip(outputs, tokens, strict=True):
            out.append(token)
        starts = [len(p) + step for p in prompts]
        batch = kv_mod.ForwardBatch(ids, [[t] for t in tokens], starts)
    median_gap = float(torch.tensor(gaps).median())
    assert len(gaps) == 320
    assert median_gap > 0.1, f"median top1-top2 logit gap {median_gap} is too small"
    for out in outputs:
        assert len(set(out[40:])) >= 3, f"degenerate greedy text: {out}"


# --- batch composition independence ----------------------------------------------------------


def test_sequence_alone_equals_sequence_in_batch(tiny: source.ModelSource) -> None:
    prompts = _prompts(tiny.tokenizer())
    batched = generate.generate_greedy(tiny, prompts, 16)
    for i, prompt in enumerate(prompts):
        assert generate.generate_greedy(tiny, [prompt], 16)[0] == batched[i]


def test_token_by_token_prefill_equals_whole_prompt(
    tiny: source.ModelSource, model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    prompt = _prompts(tiny.tokenizer())[1]
    whole = _decode(model, experts, kv_mod.KVCache(model.config), "s", prompt, 0, 10)
    kv = kv_mod.KVCache(model.config)
    for pos in range(len(prompt) - 1):
        model.forward(kv_mod.ForwardBatch(["s"], [[prompt[pos]]], [pos]), kv, experts)
    assert kv.num_tokens("s") == len(prompt) - 1
    stepwise = _decode(model, experts, kv, "s", prompt, len(prompt) - 1, 10)
    assert stepwise == whole


def test_reprefill_after_migration_continues_identically(
    tiny: source.ModelSource, model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    prompt = _prompts(tiny.tokenizer())[3]
    straight = _decode(model, experts, kv_mod.KVCache(model.config), "s", prompt, 0, 20)
    # Another rank, fresh cache: prefill prompt + the 8 tokens generated so far, then continue.
    context = prompt + straight[:8]
    resumed = _decode(model, experts, kv_mod.KVCache(model.config), "s", context, 0, 12)
    assert resumed == straight[8:]


def test_mixed_prefill_and_decode_batch(
    tiny: source.ModelSource, model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    """Continuous batching: B is prefilled in the same step as A's decode tokens."""
    a, b = _prompts(tiny.tokenizer())[:2]
    want_a = _decode(model, experts, kv_mod.KVCache(model.config), "a", a, 0, 10)
    want_b = _decode(model, experts, kv_mod.KVCache(model.config), "b", b, 0, 6)
    kv = kv_mod.KVCache(model.config)
    got_a = _decode(model, experts, kv, "a", a, 0, 4)
    got_b: list[int] = []
    batch = kv_mod.ForwardBatch(["a", "b"], [[got_a[-1]], b], [len(a) + 3, 0])
    while len(got_b) < 6:
        ta, tb = model.forward(batch, kv, experts).argmax(-1).tolist()
        got_a.append(ta)
        got_b.append(tb)
        batch = kv_mod.ForwardBatch(
            ["a", "b"], [[ta], [tb]], [len(a) + len(got_a) - 1, len(b) + len(got_b) - 1]
        )
    assert got_a == want_a
    assert got_b == want_b


# --- empty batch, KV cache, batch validation ------------------------------------------------


class _Recorder:
    def __init__(self, inner: experts_mod.ExpertBackend) -> None:
        self.inner = inner
        self.calls: list[tuple[int, int]] = []

    def __call__(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        self.calls.append((layer, hidden.shape[0]))
        assert topk_ids.dtype == torch.int64
        assert topk_ids.shape == topk_weights.shape == (hidden.shape[0], 2)
        return self.inner(layer, hidden, topk_ids, topk_weights)


def test_empty_batch_runs_every_layer_with_zero_tokens(
    model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    recorder = _Recorder(experts)
    logits = model.forward(kv_mod.ForwardBatch.empty(), kv_mod.KVCache(model.config), recorder)
    assert logits.shape == (0, model.config.vocab_size)
    assert recorder.calls == [(layer, 0) for layer in range(model.config.num_layers)]


def test_kv_cache_counts_frees_and_truncates(
    model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    kv = kv_mod.KVCache(model.config, initial_capacity=2)
    model.forward(kv_mod.ForwardBatch(["x", "y"], [[1, 2, 3], [4, 5]], [0, 0]), kv, experts)
    assert (kv.num_tokens("x"), kv.num_tokens("y"), kv.num_tokens("z")) == (3, 2, 0)
    model.forward(kv_mod.ForwardBatch(["x"], [[9, 9]], [1]), kv, experts)  # drops token 2..
    assert kv.num_tokens("x") == 3
    kv.free("x")
    kv.free("never-there")
    assert kv.seq_ids() == ["y"]
    with pytest.raises(ValueError, match="start_pos 5"):
        model.forward(kv_mod.ForwardBatch(["y"], [[1]], [5]), kv, experts)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(dict(seq_ids=["a"], token_ids=[], start_pos=[0]), "differ", id="lengths"),
        pytest.param(
            dict(seq_ids=["a", "a"], token_ids=[[1], [2]], start_pos=[0, 0]), "dup", id="dup"
        ),
        pytest.param(dict(seq_ids=["a"], token_ids=[[]], start_pos=[0]), "empty", id="no-tokens"),
        pytest.param(dict(seq_ids=["a"], token_ids=[[1]], start_pos=[-1]), "< 0", id="neg-start"),
    ],
)
def test_forward_batch_validation(kwargs: dict[str, list[object]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kv_mod.ForwardBatch(**kwargs)  # type: ignore[arg-type]


def test_out_of_range_token_is_refused(
    model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    with pytest.raises(ValueError, match="token ids"):
        model.forward(
            kv_mod.ForwardBatch(["a"], [[model.config.vocab_size]], [0]),
            kv_mod.KVCache(model.config),
            experts,
        )


# --- experts, router, weights ---------------------------------------------------------------


def test_local_experts_match_per_token_reference(
    model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, model.config.hidden_size, generator=gen)
    ids, weights = model.route(2, hidden)
    assert torch.allclose(weights.sum(-1), torch.ones(9))
    got = experts(2, hidden, ids, weights)
    for t in range(9):
        want = sum(
            weights[t, j]
            * experts_mod.expert_forward(experts.weights[(2, int(ids[t, j]))], hidden[t])
            for j in range(ids.shape[1])
        )
        assert torch.allclose(got[t], torch.as_tensor(want), atol=1e-5)


def test_router_is_softmax_topk_renormalised(model: decoder.MoEModel) -> None:
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    ids, weights = model.route(0, hidden)
    router = model.non_expert_state()["model.layers.0.block_sparse_moe.gate.weight"]
    probs = torch.softmax(hidden @ router.T, dim=-1)
    want_w, want_ids = probs.topk(model.config.top_k, dim=-1)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(weights, want_w / want_w.sum(-1, keepdim=True))


def test_expert_load_counts_routed_tokens(
    model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    cfg = model.config
    load = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64)
    batch = kv_mod.ForwardBatch(["a", "b"], [[1, 2, 3], [4, 5]], [0, 0])
    model.forward(batch, kv_mod.KVCache(cfg), experts, expert_load=load)
    assert load.sum(1).tolist() == [5 * cfg.top_k] * cfg.num_layers


def test_missing_local_expert_is_named(model: decoder.MoEModel) -> None:
    partial = experts_mod.LocalExperts({})
    with pytest.raises(KeyError, match="layer 0, expert"):
        model.forward(kv_mod.ForwardBatch(["a"], [[1]], [0]), kv_mod.KVCache(model.config), partial)


def test_non_expert_state_transfers_to_a_new_rank(
    model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    fresh = decoder.MoEModel(model.config)
    assert not fresh.loaded
    with pytest.raises(RuntimeError, match="not loaded"):
        fresh.forward(kv_mod.ForwardBatch(["a"], [[1]], [0]), kv_mod.KVCache(model.config), experts)
    fresh.load_non_expert(model.non_expert_state())
    batch = kv_mod.ForwardBatch(["a"], [[1, 2, 3]], [0])
    assert torch.equal(
        fresh.forward(batch, kv_mod.KVCache(model.config), experts),
        model.forward(batch, kv_mod.KVCache(model.config), experts),
    )


def test_transposed_weights_follow_every_load(
    tiny: source.ModelSource,
    model: decoder.MoEModel,
    experts: experts_mod.LocalExperts,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU the projections multiply by transposed copies (`linear`): made again by every
    load, so a rank that held placeholders (zeros) and then received its weights computes
    with the weights, and the same numbers as `F.linear` over the checkpoint's layout."""
    batch = kv_mod.ForwardBatch(["a", "b"], [[1, 2, 3], [7, 8]], [0, 0])
    want = model.forward(batch, kv_mod.KVCache(model.config), experts)
    assert "q" + linear_mod.TRANSPOSED in model._layers[0]
    fresh = decoder.MoEModel.from_source(tiny, placeholder=True)
    fresh.load_non_expert(model.non_expert_state())
    assert torch.equal(fresh.forward(batch, kv_mod.KVCache(model.config), experts), want)
    monkeypatch.setattr(linear_mod, "DEVICES", frozenset())
    plain = decoder.MoEModel.from_source(tiny)
    assert "q" + linear_mod.TRANSPOSED not in plain._layers[0]
    got = plain.forward(batch, kv_mod.KVCache(model.config), experts)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_load_non_expert_refuses_missing_and_misshapen(model: decoder.MoEModel) -> None:
    state = model.non_expert_state()
    fresh = decoder.MoEModel(model.config)
    with pytest.raises(ValueError, match="missing"):
        fresh.load_non_expert({k: v for k, v in state.items() if k != "model.norm.weight"})
    bad = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        fresh.load_non_expert(bad)
    assert not fresh.loaded


def test_expert_names(tiny: source.ModelSource) -> None:
    got = names.expert_tensor_names(tiny.config, 2, 5)
    assert got == [
        f"model.layers.2.block_sparse_moe.experts.5.{w}.weight" for w in ("w1", "w3", "w2")
    ]
    assert all(names.is_expert_tensor(tiny.config, n) for n in got)
    assert not names.is_expert_tensor(tiny.config, "model.layers.2.block_sparse_moe.gate.weight")


def test_bfloat16_model_runs(tiny: source.ModelSource) -> None:
    out = generate.generate_greedy(tiny, [[256, 65, 66]], 3, dtype=torch.bfloat16)
    assert len(out[0]) == 3


def test_generate_stops_at_eos(
    tiny: source.ModelSource, model: decoder.MoEModel, experts: experts_mod.LocalExperts
) -> None:
    prompt = _prompts(tiny.tokenizer())[0]
    full = generate.generate_greedy(model, [prompt], 6, experts=experts)[0]
    stopped = generate.generate_greedy(model, [prompt], 6, experts=experts, eos_token_id=full[2])[0]
    assert stopped == full[: full.index(full[2]) + 1]


# --- tokenizer ------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_specials(tiny: source.ModelSource) -> None:
    tok = tiny.tokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_token_id == 256
    assert tok.decode([*ids, tok.eos_token_id or 0, 400]) == "héllo"
    assert tok.vocab_size <= tiny.config.vocab_size
    assert tok.eos_token_id == tiny.config.eos_token_id
