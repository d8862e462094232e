"""Routed experts: one expert's weights (`ExpertWeights`, named tensors + how they run), the
fixed-order combine every backend uses, and the in-process backend (`LocalExperts`).

An expert is the unit EPLB places and moves: every tensor of it travels together (biases
included). `ExpertWeights.flatten` / `unflatten` turn one into a flat buffer and back (the
transfer code sends those); `zero_expert(config)` gives the shapes of a model's experts.

Shapes: T tokens, H hidden size, I expert intermediate size, k experts per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from moe_runtime.model import config as config_mod
from moe_runtime.model import names
from moe_runtime.model import source as source_mod


@dataclasses.dataclass(frozen=True)
class Activation:
    """How an expert joins its gate and up projections.

    "silu": silu(gate) * up (SwiGLU). "gpt_oss": gpt-oss's clamped SwiGLU:
    gate' = min(gate, limit), up' = clamp(up, -limit, limit),
    (up' + 1) * gate' * sigmoid(alpha * gate').
    """

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, config: config_mod.ModelConfig) -> Activation:
        if config.expert_activation == "silu":
            return SILU
        return cls(config.expert_activation, config.swiglu_alpha, config.swiglu_limit)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = Activation()


class ExpertWeights:
    """One expert (one physical slot): named tensors, in a fixed order, and its activation.

    Parts: gate [I, H], up [I, H], down [H, I] and, for some families, gate_bias [I],
    up_bias [I], down_bias [H]. Any names may be held (tests use opaque ones); `forward`
    needs gate, up and down.
    """

    __slots__ = ("_tensors", "activation")

    def __init__(self, activation: Activation = SILU, /, **tensors: torch.Tensor) -> None:
        self._tensors = dict(tensors)
        self.activation = activation

    def __getitem__(self, part: str) -> torch.Tensor:
        return self._tensors[part]

    def get(self, part: str) -> torch.Tensor | None:
        return self._tensors.get(part)

    def tensors(self) -> dict[str, torch.Tensor]:
        """{part: tensor}, in order."""
        return dict(self._tensors)

    def to(self, *, dtype: torch.dtype, device: str | torch.device) -> ExpertWeights:
        return ExpertWeights(
            self.activation,
            **{k: t.to(device=device, dtype=dtype) for k, t in self._tensors.items()},
        )

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self._tensors.values())).dtype

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self._tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def flatten(self) -> torch.Tensor:
        """Every tensor, in order, as one 1-D tensor (what a transfer sends)."""
        return torch.cat([t.reshape(-1) for t in self._tensors.values()])

    @staticmethod
    def unflatten(flat: torch.Tensor, like: ExpertWeights) -> ExpertWeights:
        """Views of `flat` shaped as `like`'s tensors (its names, shapes and activation)."""
        if flat.numel() != like.numel:
            raise ValueError(f"expert buffer has {flat.numel()} elements, expected {like.numel}")
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for part, t in like._tensors.items():
            out[part] = flat[offset : offset + t.numel()].view(t.shape)
            offset += t.numel()
        return ExpertWeights(like.activation, **out)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={list(t.shape)}" for k, t in self._tensors.items())
        return f"ExpertWeights({self.activation.kind}: {shapes})"


def expert_forward(weights: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate x + b, up x + b)) + b; x [N, H] -> [N, H]."""
    gate = F.linear(x, weights["gate"], weights.get("gate_bias"))
    up = F.linear(x, weights["up"], weights.get("up_bias"))
    return F.linear(weights.activation(gate, up), weights["down"], weights.get("down_bias"))


class Stacked:
    """The experts of a layer stacked part by part ([E, ...] per part) for grouped GEMMs,
    kept between calls and rebuilt when any expert's tensor is another one or was modified
    in place (a transfer, a staged commit): `parts(key, experts)`.

    The stack is a copy of the weights, matrices transposed (the slots hold their experts as
    separate tensors, which transfers send and replace one by one).
    """

    def __init__(self) -> None:
        self._cache: dict[
            object, tuple[list[torch.Tensor], list[int], dict[str, torch.Tensor]]
        ] = {}

    def parts(self, key: object, experts: Sequence[ExpertWeights]) -> dict[str, torch.Tensor]:
        tensors = [t for w in experts for t in w._tensors.values()]
        versions = [t._version for t in tensors]
        hit = self._cache.get(key)
        if (
            hit is not None
            and len(hit[0]) == len(tensors)
            and all(a is b for a, b in zip(hit[0], tensors, strict=True))
            and hit[1] == versions
        ):
            return hit[2]
        names_ = list(experts[0]._tensors)
        # matrices transposed ([E, in, out], contiguous): what grouped_mm runs fastest on;
        # gate and up side by side ([E, H, 2I]): one GEMM for both
        stacked = {
            n: torch.stack([w[n].t() if w[n].dim() == 2 else w[n] for w in experts])
            for n in names_
            if n not in ("gate", "up", "gate_bias", "up_bias")
        }
        stacked["gate_up"] = torch.stack([torch.cat([w["gate"], w["up"]]).t() for w in experts])
        if "gate_bias" in names_:
            stacked["gate_up_bias"] = torch.stack(
                [torch.cat([w["gate_bias"], w["up_bias"]]) for w in experts]
            )
        self._cache[key] = (tensors, versions, stacked)  # holds the tensors: ids stay unique
        return stacked

    def clear(self) -> None:
        self._cache.clear()


def _grouped_linear(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    index: torch.Tensor | None,
) -> torch.Tensor:
    """rows [N, K] of consecutive groups (ends at `offsets`) times weight [E, K, M] (stacked
    transposed), plus bias [E, M] of each row's group (`index` [N]: given with a bias)."""
    out = F.grouped_mm(rows, weight, offs=offsets)
    return out if bias is None or index is None else out + bias.index_select(0, index)


def grouped_forward(
    experts: Sequence[ExpertWeights],
    rows: torch.Tensor,
    counts: Sequence[int],
    *,
    stacked: Stacked | None = None,
    key: object = None,
) -> torch.Tensor:
    """rows [N, H] grouped by expert (counts[e] rows of experts[e], in order) through their
    experts in two grouped GEMMs (`torch.nn.functional.grouped_mm`: gate and up together,
    then down); returns [N, H].
    stacked/key: where the stacked weights are kept between calls. Falls back to one
    `expert_forward` per expert where grouped_mm is missing or refuses the inputs."""
    out = torch.empty_like(rows)
    if rows.shape[0] == 0:
        return out
    where = (rows.device.type, experts[0].dtype)
    if _GROUPED_MM and where[0] in _STACKED_DEVICES and where not in _NO_GROUPED_MM:
        parts = (stacked or Stacked()).parts(key, experts)
        dev = rows.device
        counts_t = torch.tensor(list(counts), dtype=torch.int64)
        offsets = torch.cumsum(counts_t, 0).to(device=dev, dtype=torch.int32)
        # each row's expert, for the biases' rows (most families have none)
        index = (
            torch.repeat_interleave(
                torch.arange(len(counts), device=dev), counts_t.to(dev), output_size=rows.shape[0]
            )
            if any(name.endswith("bias") for name in parts)
            else None
        )
        x = rows.to(parts["gate_up"].dtype)
        try:
            both = _grouped_linear(x, parts["gate_up"], parts.get("gate_up_bias"), offsets, index)
            half = both.shape[1] // 2
            act = experts[0].activation(both[:, :half], both[:, half:])
            return _grouped_linear(act, parts["down"], parts.get("down_bias"), offsets, index).to(
                out.dtype
            )
        except (RuntimeError, NotImplementedError) as exc:  # no grouped GEMM here
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                raise  # a rank failure (`rank.stepper`), not a missing kernel
            _NO_GROUPED_MM.add(where)  # not tried (nor stacked) again
            if stacked is not None:
                stacked.clear()
    start = 0
    for weights, n in zip(experts, counts, strict=True):
        if n:
            part = rows[start : start + n]
            out[start : start + n] = expert_forward(weights, part).to(out.dtype)
        start += n
    return out


_GROUPED_MM = hasattr(F, "grouped_mm")
#: Where the stacked copy is made. It doubles a rank's expert memory (the slots keep their
#: experts as separate tensors, which transfers send and replace), affordable in host memory
#: but not on an accelerator, where the per-expert loop runs until the slots themselves are
#: held stacked (docs/ENGINE.md).
_STACKED_DEVICES: frozenset[str] = frozenset({"cpu"})
#: (device type, dtype) where grouped_mm refused to run: the per-expert loop runs there.
_NO_GROUPED_MM: set[tuple[str, torch.dtype]] = set()


def apply_experts(
    weights_for: Callable[[int], ExpertWeights],
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    held: Sequence[int] | None = None,
    stacked: Stacked | None = None,
    key: object = None,
) -> torch.Tensor:
    """Run each row of hidden [N, H] through expert expert_ids[N]; returns [N, H].

    Rows are grouped by expert (a stable sort) and run in grouped GEMMs (`grouped_forward`);
    `weights_for(id)` gives the weights of an id (logical or physical, as the caller's ids
    are). held: every id the caller holds, sorted (its stack is kept in `stacked` under `key`
    between calls); None: the ids present, stacked afresh.
    """
    out = torch.empty_like(hidden)
    if hidden.shape[0] == 0:
        return out
    present = torch.unique(expert_ids)
    experts = [weights_for(int(e)) for e in present.tolist()]  # KeyError for one not held
    if held is None:
        ids, stacked, key = present, None, None
    else:
        ids = torch.tensor(list(held), dtype=expert_ids.dtype, device=expert_ids.device)
        experts = [weights_for(e) for e in held]
    position = torch.searchsorted(ids, expert_ids)
    counts = torch.bincount(position, minlength=len(experts))
    order = torch.argsort(position, stable=True)
    out[order] = grouped_forward(
        experts, hidden.index_select(0, order), counts.tolist(), stacked=stacked, key=key
    )
    return out


def combine_expert_outputs(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * expert_out[t, k], summed in float32 in the order k = 0, 1, ...

    expert_out [T, k, H], topk_weights [T, k] -> [T, H] in expert_out's dtype. Every backend
    combines through this function, so results do not depend on the backend.
    """
    weights = topk_weights.to(torch.float32)
    acc = weights[:, 0, None] * expert_out[:, 0].to(torch.float32)
    for j in range(1, expert_out.shape[1]):
        acc = acc + weights[:, j, None] * expert_out[:, j].to(torch.float32)
    return acc.to(expert_out.dtype)


class ExpertBackend(Protocol):
    """Runs the routed experts of one MoE layer and combines them (`combine_expert_outputs`).

    layer: the MoE layer index (as placements count layers); hidden [T, H] (the normalised
    hidden state), topk_ids [T, k] logical expert ids (int64), topk_weights [T, k] (float32)
    -> [T, H]. Called with T = 0 too.
    """

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor: ...


def zero_expert(
    config: config_mod.ModelConfig, *, dtype: torch.dtype, device: str | torch.device
) -> ExpertWeights:
    """Zeros shaped like one expert of `config` (placeholders, receive buffers)."""
    return ExpertWeights(
        Activation.of(config),
        **{
            part: torch.zeros(shape, dtype=dtype, device=device)
            for part, shape in names.expert_parts(config).items()
        },
    )


def load_expert(
    source: source_mod.ModelSource,
    layer: int,
    expert: int,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> ExpertWeights:
    """Read one logical expert of MoE layer `layer` from a source (its tensors only)."""
    parts = names.expert_tensors(source.config, layer, expert)
    return ExpertWeights(
        Activation.of(source.config),
        **{
            part: source.tensor(name).to(device=device, dtype=dtype)
            for part, (name, _) in parts.items()
        },
    )


def load_experts(
    source: source_mod.ModelSource,
    keys: Iterable[tuple[int, int]],
    *,
    first: int = 0,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> dict[tuple[int, int], ExpertWeights]:
    """The experts `keys` ((MoE layer - `first`, logical): a pipeline stage's local MoE
    layers from its first) read from a source, by key."""
    return {
        (layer, logical): load_expert(source, first + layer, logical, dtype=dtype, device=device)
        for layer, logical in sorted(keys)
    }


class LocalExperts:
    """An ExpertBackend over experts held in this process, keyed by (MoE layer, logical id)."""

    def __init__(self, weights: Mapping[tuple[int, int], ExpertWeights]) -> None:
        self.weights = dict(weights)
        self._stacked = Stacked()

    @classmethod
    def from_source(
        cls,
        source: source_mod.ModelSource,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        experts: Sequence[tuple[int, int]] | None = None,
    ) -> LocalExperts:
        """Load `experts` ((MoE layer, logical) pairs; default: every expert of every layer)."""
        cfg = source.config
        wanted: Iterable[tuple[int, int]] = (
            list(experts)
            if experts is not None
            else [(m, e) for m in range(cfg.num_moe_layers) for e in range(cfg.num_experts)]
        )
        return cls(
            {
                (layer, e): load_expert(source, layer, e, dtype=dtype, device=device)
                for layer, e in wanted
            }
        )

    def _weights_for(self, layer: int) -> Callable[[int], ExpertWeights]:
        def lookup(expert: int) -> ExpertWeights:
            try:
                return self.weights[(layer, expert)]
            except KeyError:
                raise KeyError(
                    f"LocalExperts holds no weights for layer {layer}, expert {expert}"
                ) from None

        return lookup

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        tokens, k = topk_ids.shape
        # Row t*k + j of the flattened problem is token t's j-th expert.
        rows = hidden.repeat_interleave(k, dim=0)
        held = sorted(e for (m, e) in self.weights if m == layer)
        out = apply_experts(
            self._weights_for(layer),
            rows,
            topk_ids.reshape(-1),
            held=held,
            stacked=self._stacked,
            key=layer,
        )
        return combine_expert_outputs(out.view(tokens, k, hidden.shape[1]), topk_weights)
