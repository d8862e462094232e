"""The MoE decoder of every family: non-expert weights in `MoEModel`, routed experts behind an
`experts.ExpertBackend`.

One `forward` runs a batch of sequences of different lengths (prefill of a prompt, one decode
token, or re-prefill of prompt + generated tokens after a migration) against a `KVCache`.
Each decoder layer is: RMSNorm, attention (grouped-query or MLA: `attention`), residual,
RMSNorm, then a dense SwiGLU MLP (a dense layer) or the MoE block (the router: `routing`;
the routed experts through the backend; shared experts, gated or not, here on every rank),
residual. The family's `ModelConfig` says which variant each block is; tensor names come
from `names` by role.

With a `tensor_parallel.TensorParallel` part the model is one TP rank's: it holds its shard
of the weights (`tp_shard`), attends with its heads (`local_config`; its KV cache holds only
those: build it from `local_config`), and reduces the row-parallel outputs and gathers the
logits over its TP group. Without one (T = 1) nothing of that runs.

With a `pipeline.PipelineStage` (`pp=`) the model is one pipeline stage's: it holds and runs
only its decoder layers (and the embedding on the first, the final norm and lm_head on the
last); a stage after the first takes the previous stage's hidden states instead of looking
tokens up, a stage before the last returns its hidden states instead of logits; its KV cache
holds only its layers (`layers`), its experts are called by local MoE layer. Composes with
a TP part (a TP rank of a pipeline stage).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from moe_runtime.model import attention, names, pipeline, routing
from moe_runtime.model import config as config_mod
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import linear as linear_mod
from moe_runtime.model import rope as rope_mod
from moe_runtime.model import source as source_mod
from moe_runtime.model import tensor_parallel as tp_mod

#: Roles kept in float32 whatever the serving dtype, as transformers keeps them
#: (`_keep_in_fp32_modules`): DeepSeek's router and correction bias, gpt-oss's norms.
FLOAT32_ROLES = {
    "deepseek_v2": frozenset({"router"}),
    "deepseek_v3": frozenset({"router", "correction_bias"}),
    "gpt_oss": frozenset({"input_norm", "post_norm", "norm"}),
}


def _swiglu(x: torch.Tensor, w: Mapping[str, torch.Tensor], role: str) -> torch.Tensor:
    gate = linear_mod.linear(x, w, role + "_gate")
    up = linear_mod.linear(x, w, role + "_up")
    return linear_mod.linear(F.silu(gate) * up, w, role + "_down")


class MoEModel:
    """The non-expert part of a MoE model; `forward` calls an ExpertBackend for experts.

    Weights start empty (a rank that will receive them); `load_non_expert` fills them.
    """

    def __init__(
        self,
        config: config_mod.ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tp: tp_mod.TensorParallel | None = None,
        pp: pipeline.PipelineStage | None = None,
    ) -> None:
        if tp is not None and tp.shard.config != config:
            raise ValueError("MoEModel: the tensor parallel shard is of another model config")
        if pp is not None and pp.config != config:
            raise ValueError("MoEModel: the pipeline stage is of another model config")
        self.config = config
        #: what attention and the KV cache run with: this TP rank's heads (T = 1: config)
        self.local_config = config if tp is None else tp.shard.local
        self.tp = tp
        #: this pipeline stage (the whole model at P = 1) and its decoder layers [first, stop)
        self.pp = pp or pipeline.whole(config)
        self.layers = self.pp.layers
        self.dtype = dtype
        self.device = torch.device(device)
        self._state: dict[str, torch.Tensor] = {}
        self._layers: list[dict[str, torch.Tensor]] = []
        self._global: dict[str, torch.Tensor] = {}
        self._lm_head_t: torch.Tensor | None = None
        self._rotary = rope_mod.Rotary(config, device=self.device)
        self._float32 = FLOAT32_ROLES.get(config.family, frozenset())

    @classmethod
    def from_source(
        cls,
        source: source_mod.ModelSource,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tp: tp_mod.TensorParallel | None = None,
        pp: pipeline.PipelineStage | None = None,
        placeholder: bool = False,
    ) -> MoEModel:
        """A model with its non-expert weights read from `source` (a TP rank's: its shard; a
        pipeline stage's: its tensors only); placeholder: zeros instead, nothing read
        (`load_placeholder`)."""
        model = cls(source.config, dtype=dtype, device=device, tp=tp, pp=pp)
        if placeholder:
            model.load_placeholder()
            return model
        shard = None if tp is None else tp.shard
        model.load_non_expert(pipeline.load(source, stage=pp, shard=shard))
        return model

    @property
    def loaded(self) -> bool:
        return bool(self._state)

    @property
    def transfer_dtype(self) -> torch.dtype:
        """A dtype that holds every non-expert tensor exactly (float32 when some role is kept
        in float32): what a flat buffer of the whole state is sent in."""
        return torch.float32 if self._float32 else self.dtype

    def load_non_expert(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Set every non-expert weight (names from `names.non_expert_tensor_names`).

        All are checked (present, right shape) before any is set. Expert tensors and a tied
        `lm_head.weight` are ignored; unknown names are refused. A TP rank's tensors are its
        shard's parts (`tp_shard.Shard.shape`); a pipeline stage's, its own (`pipeline.parts`:
        those of other stages are ignored).
        """
        cfg = self.config
        held = pipeline.parts(cfg, stage=self.pp, shard=None if self.tp is None else self.tp.shard)
        wanted = list(held)
        missing = [n for n in wanted if n not in tensors]
        if missing:
            raise ValueError(f"load_non_expert: missing {len(missing)} tensors: {missing[:5]}")
        for name in tensors:
            if name == names.LM_HEAD or names.is_expert_tensor(cfg, name):
                continue
            try:
                names.tensor_shape(cfg, name)
            except KeyError:
                raise ValueError(
                    f"load_non_expert: {name!r} is not a tensor of this model"
                ) from None
        state: dict[str, torch.Tensor] = {}
        for name in wanted:
            value = tensors[name]
            entry = names.entry(cfg, name)
            shape = pipeline.shape(cfg, name, held[name])
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"load_non_expert: {name!r} has shape {list(value.shape)}, "
                    f"expected {list(shape)}"
                )
            dtype = torch.float32 if entry.role in self._float32 else self.dtype
            state[name] = value.to(device=self.device, dtype=dtype).contiguous()
        self._state = state
        self._global = {
            role: state[name]
            for role, (name, _) in names.global_tensors(cfg).items()
            if name in state
        }
        # every decoder layer's weights by role (empty: another pipeline stage's layer)
        self._layers = [
            {
                role: state[name]
                for role, (name, _) in names.layer_tensors(cfg, layer).items()
                if name in state
            }
            for layer in range(cfg.num_layers)
        ]
        if self.tp is not None:
            self.tp.take(self._layers, self._global)
        for weights in self._layers:
            linear_mod.add_transposed(weights)
        #: lm_head [hidden, vocab] (`linear`: CPU only; a TP rank's logits are its part's)
        self._lm_head_t = (
            linear_mod.transposed(self._lm_head)
            if self.tp is None and self.pp.is_last and self.device.type in linear_mod.DEVICES
            else None
        )

    def load_placeholder(self) -> None:
        """Zeros for every non-expert weight: a rank (or pipeline stage) whose weights will
        come from its peers (`staging.exchange_non_expert`)."""
        held = pipeline.parts(
            self.config, stage=self.pp, shard=None if self.tp is None else self.tp.shard
        )
        shapes = {n: pipeline.shape(self.config, n, part) for n, part in held.items()}
        self.load_non_expert({n: torch.zeros(s, dtype=self.dtype) for n, s in shapes.items()})

    def non_expert_state(self) -> dict[str, torch.Tensor]:
        """The non-expert weights by name (the tensors themselves: do not modify them)."""
        self._require_loaded()
        return dict(self._state)

    def _require_loaded(self) -> None:
        if not self._state:
            raise RuntimeError("MoEModel: non-expert weights are not loaded yet")

    @property
    def _lm_head(self) -> torch.Tensor:
        return self._global["embed" if self.config.tie_word_embeddings else "lm_head"]

    def route(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of hidden [T, H] in MoE layer `layer`: (topk_ids [T, k], topk_weights f32)."""
        decoder_layer = self.config.moe_layer_ids[layer]
        if not self.layers[0] <= decoder_layer < self.layers[1]:
            raise ValueError(f"MoE layer {layer} is not in pipeline stage {self.pp.index}")
        return routing.route(self.config, self._layers[decoder_layer], hidden)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return attention.rms_norm(x, weight, cfg.rms_norm_eps, scale_first=cfg.norm_scale_first)

    def _check(
        self, batch: kv_mod.ForwardBatch, kv: kv_mod.KVCache
    ) -> list[tuple[str, int, int, int]]:
        """(seq_id, batch offset, new tokens, start position) of each sequence, checked."""
        cfg = self.config
        spans: list[tuple[str, int, int, int]] = []
        offset = 0
        for seq_id, tokens, start in zip(
            batch.seq_ids, batch.token_ids, batch.start_pos, strict=True
        ):
            if start + len(tokens) > cfg.max_position_embeddings:
                raise ValueError(
                    f"sequence {seq_id!r}: {start + len(tokens)} tokens exceed "
                    f"max_position_embeddings {cfg.max_position_embeddings}"
                )
            if min(tokens) < 0 or max(tokens) >= cfg.vocab_size:
                raise ValueError(f"sequence {seq_id!r}: token ids must be in [0, {cfg.vocab_size})")
            if start > kv.num_tokens(seq_id):
                raise ValueError(
                    f"sequence {seq_id!r}: start_pos {start} but the KV cache holds only "
                    f"{kv.num_tokens(seq_id)} tokens of it"
                )
            spans.append((seq_id, offset, len(tokens), start))
            offset += len(tokens)
        return spans

    @torch.no_grad()
    def forward(
        self,
        batch: kv_mod.ForwardBatch,
        kv: kv_mod.KVCache,
        experts: experts_mod.ExpertBackend,
        *,
        hidden: torch.Tensor | None = None,
        expert_load: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [num_seqs, vocab] (float32) of the last new token of each sequence.

        Appends the new tokens' attention state to `kv`. An empty batch still calls `experts`
        once per MoE layer with T = 0 and returns a [0, vocab] tensor. `expert_load` (int64
        [num_moe_layers, E]), if given, is incremented by the tokens routed to each expert.

        A pipeline stage after the first takes `hidden` [num_tokens, hidden_size], the
        previous stage's output for the same batch; a stage before the last returns its hidden
        states [num_tokens, hidden_size] (serving dtype) instead of logits. A stage's experts
        and `expert_load` ([stage MoE layers, E]) count its MoE layers from 0.
        """
        self._require_loaded()
        cfg = self.config
        stage = self.pp
        if kv.layers != self.layers:
            raise ValueError(
                f"the KV cache holds decoder layers {list(kv.layers)}; this model runs "
                f"{list(self.layers)} (build it with layers=model.layers)"
            )
        if (kv.parts, kv.heads, kv.dim) != kv_mod.cache_shape(self.local_config):
            raise ValueError(
                f"the KV cache holds {kv.heads} heads of {kv.dim}; this model attends with "
                f"{kv_mod.cache_shape(self.local_config)[1:]} (build it from local_config)"
            )
        spans = self._check(batch, kv)
        for seq_id, _, n, start in spans:
            kv.reserve(seq_id, start, n)
        positions = torch.tensor(
            [p for _, _, n, start in spans for p in range(start, start + n)],
            dtype=torch.int64,
            device=self.device,
        )
        cos, sin = self._rotary.cos_sin(positions, self.dtype)
        ctx = attention.Context(
            batch_kv=kv.batch(spans),
            rotary=self._rotary,
            cos=cos,
            sin=sin,
            split_norm=None if self.tp is None else self.tp.rms_norm,
        )
        attend = attention.mla if cfg.mla is not None else attention.gqa
        hidden = self._input(batch, hidden)
        num_tokens = hidden.shape[0]
        tp = self.tp
        moe0 = stage.moe_layers[0]
        for index in range(*self.layers):
            w = self._layers[index]
            if num_tokens:
                x = self._norm(hidden, w["input_norm"])
                attended = attend(self.local_config, w, x, ctx, index)
                if tp is not None:
                    attended = tp.reduce(attended, index, "o_bias")
                hidden = hidden + attended
            x = self._norm(hidden, w["post_norm"])
            moe = cfg.moe_index(index)
            moe = None if moe is None else moe - moe0
            if moe is None:
                if num_tokens:
                    mlp = _swiglu(x, w, "mlp")
                    if tp is not None:
                        mlp = tp.reduce(mlp, index, "mlp_down_bias")
                    hidden = hidden + mlp
                continue
            if tp is None or tp.runs_experts:
                topk_ids, topk_weights = routing.route(cfg, w, x)
                if expert_load is not None and num_tokens and (tp is None or tp.leads):
                    expert_load[moe] += torch.bincount(
                        topk_ids.reshape(-1), minlength=cfg.num_experts
                    ).to(expert_load.device, expert_load.dtype)
                if tp is not None and tp.expert_layout == tp_mod.MESH:
                    out = tp.routed(experts, moe, x, topk_ids, topk_weights)
                else:
                    out = experts(moe, x, topk_ids, topk_weights).to(hidden.dtype)
            else:
                out = torch.zeros_like(hidden)  # a TP follower holds no routed expert
            if tp is not None:
                if num_tokens:
                    hidden = hidden + self._moe_reduce(tp, w, x, out, index)
                continue
            if cfg.shared_intermediate_size and num_tokens:
                shared = _swiglu(x, w, "shared")
                if cfg.shared_expert_gate:
                    shared = torch.sigmoid(F.linear(x, w["shared_expert_gate"])) * shared
                out = out + shared
            hidden = hidden + out
        if not stage.is_last:
            return hidden
        if not spans:
            return torch.empty((0, cfg.vocab_size), dtype=torch.float32, device=self.device)
        last = torch.tensor([offset + n - 1 for _, offset, n, _ in spans], device=self.device)
        final = self._norm(hidden[last], self._global["norm"])
        if tp is not None:
            return tp.logits(final)
        return linear_mod.multiply(final, self._lm_head, self._lm_head_t).to(torch.float32)

    def _moe_reduce(
        self,
        tp: tp_mod.TensorParallel,
        w: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        routed: torch.Tensor,
        index: int,
    ) -> torch.Tensor:
        """A TP rank's MoE block output: the routed experts' output (the leader's; zeros on a
        follower) plus this rank's partial of the shared experts (gated: the gate is the same
        on every TP rank, so it scales each partial), summed by one all-reduce; then the
        shared down bias once (gated too). In the `MESH` layout `routed` is already whole
        (`TensorParallel.routed`): the shared partials are reduced alone and added to it."""
        cfg = self.config
        whole = tp.expert_layout == tp_mod.MESH
        if not cfg.shared_intermediate_size:
            return routed if whole else tp.reduce(routed, index, "")
        shared = _swiglu(x, w, "shared")
        gate = None
        if cfg.shared_expert_gate:
            gate = torch.sigmoid(F.linear(x, w["shared_expert_gate"]))
            shared = gate * shared
        out = (
            routed + tp.reduce(shared, index, "")
            if whole
            else tp.reduce(routed + shared, index, "")
        )
        bias = tp.bias(index, "shared_down_bias")
        if bias is not None:
            out = out + (bias if gate is None else gate * bias)
        return out

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape of non-expert tensor `name` as this model holds it (a TP rank: its part)."""
        if self.tp is None:
            return tuple(names.tensor_shape(self.config, name))
        return tuple(self.tp.shard.shape(name))

    def _input(self, batch: kv_mod.ForwardBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input: the tokens' embeddings on the first pipeline stage, the
        previous stage's hidden states (checked) on the others."""
        if self.pp.is_first:
            if hidden is not None:
                raise ValueError("the first pipeline stage looks tokens up: pass no hidden")
            ids = torch.tensor(
                [t for tokens in batch.token_ids for t in tokens],
                dtype=torch.int64,
                device=self.device,
            )
            return F.embedding(ids, self._global["embed"])
        want = (batch.num_tokens, self.config.hidden_size)
        if hidden is None or tuple(hidden.shape) != want:
            got = None if hidden is None else list(hidden.shape)
            raise ValueError(
                f"pipeline stage {self.pp.index} takes the hidden states {list(want)} of "
                f"stage {self.pp.index - 1} for this batch, got {got}"
            )
        return hidden.to(device=self.device, dtype=self.dtype)

    __call__ = forward
