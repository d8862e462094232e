"""Tiny random checkpoints of every supported family, built and saved by transformers, and
transformers' own answers on them (the reference the runtime must equal token for token).

Shapes are off the usual guesses on purpose: an explicit `head_dim` where the family has one,
expert counts that divide neither 2 nor 3 ranks (or not 3), dense layers between MoE layers,
sliding windows shorter than the prompts, random correction and expert biases, YaRN.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import torch
import transformers

from moe_runtime import step
from moe_runtime.rank import sampling

VOCAB = 300
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def _mla(**kw: Any) -> dict[str, Any]:
    return dict(
        _COMMON,
        num_key_value_heads=6,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
        intermediate_size=56,
        moe_intermediate_size=24,
        **kw,
    )


#: family -> (transformers config class, its arguments): the tiny checkpoints' shapes.
CONFIGS: dict[str, tuple[Any, dict[str, Any]]] = {
    "mixtral": (
        transformers.MixtralConfig,
        dict(
            _COMMON,
            num_hidden_layers=3,
            head_dim=12,
            intermediate_size=40,
            num_local_experts=5,
            num_experts_per_tok=2,
            sliding_window=7,
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            _COMMON,
            num_hidden_layers=4,
            head_dim=12,
            intermediate_size=56,
            moe_intermediate_size=24,
            num_experts=7,
            num_experts_per_tok=3,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(
            _COMMON,
            num_hidden_layers=4,
            intermediate_size=56,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            num_experts=5,
            num_experts_per_tok=2,
            mlp_only_layers=[2],
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=3,
        ),
    ),
    "olmoe": (
        transformers.OlmoeConfig,
        dict(
            _COMMON,
            num_key_value_heads=3,
            num_hidden_layers=3,
            intermediate_size=40,
            num_experts=7,
            num_experts_per_tok=2,
            clip_qkv=3.0,
        ),
    ),
    # DeepSeek-V2-Lite's shape: no q low-rank, greedy routing, a dense first layer, YaRN.
    "deepseek_v2": (
        transformers.DeepseekV2Config,
        dict(
            _mla(q_lora_rank=None),
            num_hidden_layers=4,
            n_routed_experts=7,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_shared_experts=2,
            topk_method="greedy",
            routed_scaling_factor=1.0,
            rope_parameters=_YARN,
        ),
    ),
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(
            _mla(q_lora_rank=20),
            num_hidden_layers=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            first_k_dense_replace=1,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=1.0),
        ),
    ),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(
            _COMMON,
            num_hidden_layers=4,
            head_dim=12,
            intermediate_size=40,
            num_local_experts=5,
            num_experts_per_tok=2,
            sliding_window=4,
        ),
    ),
}
FAMILIES = tuple(CONFIGS)


def build(family: str, *, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """The family's tiny model, random (correction and expert biases too), eval mode, fp32."""
    cls, arguments = CONFIGS[family]
    config = cls(**{**arguments, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.3)
            for bias in ("gate_up_proj_bias", "down_proj_bias"):
                if hasattr(module, bias):
                    getattr(module, bias).normal_(0.0, 0.2)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save(model: transformers.PreTrainedModel, path: pathlib.Path, **kw: Any) -> pathlib.Path:
    model.save_pretrained(path, **kw)
    return path


def save_source(family: str, root: pathlib.Path, **overrides: Any) -> Any:
    """The family's tiny model saved under root/family, opened as the runtime opens it."""
    from moe_runtime.model import source

    return source.open_source(str(save(build(family, **overrides), root / family)))


def references(
    root: pathlib.Path, families: Sequence[str], prompts: Sequence[Sequence[int]], n: int
) -> dict[str, dict[str, Any]]:
    """Per family: the saved checkpoint's path, transformers' greedy tokens of every prompt and
    one process's (`generate.generate_greedy`): what a sharded run must equal."""
    from moe_runtime.model import generate

    out: dict[str, dict[str, Any]] = {}
    for family in families:
        model = build(family)
        path = save(model, root / family)
        out[family] = {
            "path": str(path),
            "transformers": [greedy(model, p, n) for p in prompts],
            "one_process": generate.generate_greedy(str(path), [list(p) for p in prompts], n),
        }
    return out


def staggered_requests(prompts: Sequence[Sequence[int]], ranks: int) -> list[dict[str, Any]]:
    """Requests of other lengths arriving at other steps, spread over `ranks` DP ranks."""
    return [
        {
            "seq_id": f"s{i}",
            "prompt": list(p),
            "max_new": 4 + i % 3,
            "start_step": i % 2,
            "rank": i % ranks,
        }
        for i, p in enumerate(prompts)
    ]


def greedy(model: transformers.PreTrainedModel, prompt: Sequence[int], n: int) -> list[int]:
    """transformers' greedy `generate` (no eos stop)."""
    out = model.generate(
        torch.tensor([list(prompt)]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
    )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


@torch.no_grad()
def sampled(
    model: transformers.PreTrainedModel,
    prompt: Sequence[int],
    n: int,
    params: step.SamplingParams,
) -> list[int]:
    """transformers' next-token logits (incremental, with its cache) sampled by the runtime's
    seeded rule (`sampling.sample_token`): what a seeded request must answer."""
    ids = torch.tensor([list(prompt)])
    out: list[int] = []
    cache = None
    while len(out) < n:
        result = model(input_ids=ids, cache=cache, use_cache=True)
        cache = result.cache
        token = sampling.sample_token(result.logits[0, -1].float(), params, len(out))
        out.append(token)
        ids = torch.tensor([[token]])
    return out


@torch.no_grad()
def min_gap(model: transformers.PreTrainedModel, prompt: Sequence[int], n: int) -> float:
    """The smallest top-1 minus top-2 logit over a greedy generation (how far from a tie)."""
    out = model.generate(
        torch.tensor([list(prompt)]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    gaps = [float((lg[0].topk(2).values[0] - lg[0].topk(2).values[1]).item()) for lg in out.logits]
    return min(gaps)


# --- a chat checkpoint ------------------------------------------------------------------------

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello there, how are you today? I am fine, thank you.",
    "system user assistant: answer briefly and well",
] * 20


def chat_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of VOCAB ids at most, with ChatML's special tokens and template."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=list(SPECIAL),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def make_chat_checkpoint(
    model: transformers.PreTrainedModel, path: pathlib.Path, messages: list[dict[str, str]]
) -> tuple[pathlib.Path, transformers.PreTrainedTokenizerFast, list[int]]:
    """Save `model` with a ChatML tokenizer and a generation_config.json listing two eos ids
    (<|im_end|>, <|endoftext|>), after making <|endoftext|> the greedy answer's 4th token
    (its lm_head row scaled from the token transformers picks there), so the answer to
    `messages` ends on the second eos id. Returns (path, tokenizer, the stop ids)."""
    tok = chat_tokenizer()
    stops = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    free = [t for t in greedy(model, prompt, 12) if t not in stops]
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        logits = model(torch.tensor([prompt + free[:3]])).logits[0, -1]
        target = int(logits.argmax())
        scale = 1.1 if float(logits[target]) > 0 else 0.9
        head[stops[1]] = head[target] * scale
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok, stops


def chat_answer(
    model: transformers.PreTrainedModel,
    tok: transformers.PreTrainedTokenizerFast,
    messages: list[dict[str, str]],
    max_new_tokens: int,
) -> tuple[list[int], str, str, int]:
    """transformers' answer: (generated ids, decoded text, finish reason, prompt length)."""
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    stops = model.generation_config.eos_token_id or []
    ended = bool(out) and out[-1] in stops
    text = tok.decode(out, skip_special_tokens=True)
    return out, text, "stop" if ended else "length", len(prompt)
