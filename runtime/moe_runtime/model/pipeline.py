"""Pipeline parallelism of a model: the decoder layers split into P contiguous pipeline stages
(`plan(config, stage=s, size=P) -> PipelineStage`), what each holds of the weights
(`parts`, `load`) and of the routed experts (`local_experts`). Not a resize stage
(`elastic.stages`): "pipeline stage" everywhere.

- Layers: L decoder layers over P pipeline stages, as even as possible; where P does not
  divide L the extra layers go to the stages before the last (counting back from the
  second-to-last: the last also runs the final norm and lm_head), as vLLM's
  `get_pp_indices` does. P > L is refused, naming `num_layers`.
- Pipeline stage 0 holds the embedding; the last the final norm and lm_head, and with tied
  embeddings the embedding rows lm_head reads (all of them at T = 1; a TP rank's vocabulary
  rows, `tp_shard.Shard.vocab`, at T > 1). A stage holds the non-expert tensors of its layers
  and the routed experts of its MoE layers only.
- MoE layers of a pipeline stage are numbered from 0 in its expert backend, its placement
  and its expert load counts: local MoE layer i is the model's MoE layer
  `moe_layers[0] + i` (`PipelineStage.moe_layers`). A stage's EP group places only its layers.
- Between stages: the hidden states [tokens, hidden] of the batch's new tokens, in the
  serving dtype; positions, rotary tables and the batch's view of the KV cache are
  recomputed from the batch on every stage (every stage runs the same `ForwardBatch`).
- The KV cache of a stage holds only its layers (`kv.KVCache(..., layers=stage.layers)`).

Pure except `load` and `local_experts`, which read from a `source.ModelSource`.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_runtime.model import config as config_mod
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import names, source, tp_shard


@dataclasses.dataclass(frozen=True)
class PipelineStage:
    """Pipeline stage `index` of `size` of `config`.

    layers: its decoder layers [first, stop); moe_layers: the model's MoE layers among them
    [first, stop) (empty where all its layers are dense).
    """

    config: config_mod.ModelConfig
    index: int
    size: int
    layers: tuple[int, int]
    moe_layers: tuple[int, int]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def num_moe_layers(self) -> int:
        """MoE layers of this stage: its placement's and its load counts' layers."""
        return self.moe_layers[1] - self.moe_layers[0]

    @property
    def holds_embedding(self) -> bool:
        """The first stage looks tokens up; the last reads lm_head from it when tied."""
        return self.is_first or (self.is_last and self.config.tie_word_embeddings)

    def holds(self, name: str) -> bool:
        """Whether this stage holds tensor `name` (non-expert or expert); KeyError for a name
        the model does not use."""
        entry = names.entry(self.config, name)
        if entry.layer >= 0:
            return self.layers[0] <= entry.layer < self.layers[1]
        if name == names.EMBED:
            return self.holds_embedding
        return self.is_last  # the final norm, an untied lm_head

    def tensor_names(self) -> list[str]:
        """The non-expert tensors this stage holds, in the model's order."""
        return [n for n in names.non_expert_tensor_names(self.config) if self.holds(n)]

    def experts(self) -> list[tuple[int, int]]:
        """(local MoE layer, logical expert) of every routed expert of this stage."""
        return [(m, e) for m in range(self.num_moe_layers) for e in range(self.config.num_experts)]


def plan(config: config_mod.ModelConfig, *, stage: int, size: int) -> PipelineStage:
    """Pipeline stage `stage` of `size` (module docstring); ValueError for a size the layers
    cannot fill, naming the field."""
    if size < 1 or not 0 <= stage < size:
        raise ValueError(f"pipeline stage {stage} of size {size}: need 0 <= stage < size")
    total = config.num_layers
    if size > total:
        raise ValueError(
            f"pipeline parallel size {size} exceeds num_layers (num_hidden_layers) {total}: "
            f"every pipeline stage needs at least one decoder layer"
        )
    counts = [total // size] * size
    for i in range(2, total % size + 2):
        counts[-i] += 1
    first = sum(counts[:stage])
    stop = first + counts[stage]
    moe = [m for m, layer in enumerate(config.moe_layer_ids) if first <= layer < stop]
    m0 = moe[0] if moe else sum(1 for layer in config.moe_layer_ids if layer < first)
    return PipelineStage(
        config=config,
        index=stage,
        size=size,
        layers=(first, stop),
        moe_layers=(m0, m0 + len(moe)),
    )


def whole(config: config_mod.ModelConfig) -> PipelineStage:
    """The one pipeline stage of P = 1: every layer."""
    return plan(config, stage=0, size=1)


def parts(
    config: config_mod.ModelConfig,
    *,
    stage: PipelineStage | None,
    shard: tp_shard.Shard | None,
) -> dict[str, tp_shard.Slice | None]:
    """Every non-expert tensor a model of this pipeline stage and TP shard holds (in the
    model's order) and the slice of it held (None: whole). A tied embedding on a last stage
    that is not the first is held for lm_head only: a TP rank's vocabulary rows."""
    stage = stage or whole(config)
    out: dict[str, tp_shard.Slice | None] = {}
    for name in stage.tensor_names():
        part = None if shard is None else shard.slice_of(name)
        if name == names.EMBED and not stage.is_first and shard is not None and shard.size > 1:
            part = tp_shard.Slice(0, *shard.vocab)
        out[name] = part
    return out


def shape(config: config_mod.ModelConfig, name: str, part: tp_shard.Slice | None) -> names.Shape:
    """The shape of `part` of tensor `name` (None: the whole tensor's)."""
    dims = list(names.tensor_shape(config, name))
    if part is not None:
        dims[part.dim] = part.length
    return tuple(dims)


def load(
    src: source.ModelSource,
    *,
    stage: PipelineStage | None,
    shard: tp_shard.Shard | None,
) -> dict[str, torch.Tensor]:
    """The non-expert tensors this stage and TP shard hold (`parts`), read from `src`: sliced
    ones through `tensor_slice` (a checkpoint reads only those bytes where it can)."""
    out: dict[str, torch.Tensor] = {}
    for name, part in parts(src.config, stage=stage, shard=shard).items():
        if part is None:
            out[name] = src.tensor(name)
        else:
            out[name] = src.tensor_slice(name, dim=part.dim, start=part.start, stop=part.stop)
    return out


def local_experts(
    src: source.ModelSource,
    stage: PipelineStage,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> experts_mod.LocalExperts:
    """Every routed expert of this stage's MoE layers, read from `src`, keyed by local MoE
    layer (what a stage's `MoEModel` calls its backend with)."""
    first = stage.moe_layers[0]
    return experts_mod.LocalExperts(
        experts_mod.load_experts(src, stage.experts(), first=first, dtype=dtype, device=device)
    )
