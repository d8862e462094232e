"""The non-expert linear layers, y = x W^T + b, over a layer's weights by role.

On a CPU the weight matrices a step multiplies by are also held transposed ([in, out],
contiguous) under `role + TRANSPOSED`, and `linear` multiplies by that copy: MKL's SGEMM runs
`x @ Wt` faster than `F.linear(x, W)` (the checkpoint's [out, in] seen through a transpose) at
the shapes of decode steps. Measured here on one thread: [64, 256] x [256, 256] 50 -> 42 us,
[16, 256] x [256, 1024] 72 -> 45 us, the lm_head of `bench/engine_vs_hf.py`'s Mixtral
([64, 256] x [256, 2000]) 414 -> 352 us. The numbers are the same (bit for bit at those
shapes; a one-row product may differ in the last bit, as it may between batch sizes anyway:
tests/unit/test_batch_invariance.py). The routed experts already run over transposed stacks
(`experts.Stacked`).

The copies double the host memory of those matrices (the non-expert weights, small beside
the experts of a MoE model). Elsewhere (a GPU: cuBLAS takes either layout at the same speed)
nothing is copied and `linear` is `F.linear`. The copies are made whenever the weights are
set (`MoEModel.load_non_expert`), so a transfer that replaces them replaces the copies too.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import torch
import torch.nn.functional as F

#: Suffix of a role's transposed copy.
TRANSPOSED = ".t"
#: The matrices of a decoder layer that `linear` multiplies by (those a family has).
ROLES = (
    "q",
    "k",
    "v",
    "o",
    "q_a",
    "q_b",
    "kv_a",
    "mlp_gate",
    "mlp_up",
    "mlp_down",
    "shared_gate",
    "shared_up",
    "shared_down",
)
#: Devices where the transposed copies are made.
DEVICES = frozenset({"cpu"})


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] as a contiguous [in, out] copy."""
    return weight.t().contiguous()


def add_transposed(
    weights: MutableMapping[str, torch.Tensor], roles: tuple[str, ...] = ROLES
) -> None:
    """Add the transposed copy of each 2-D weight of `roles` held in `weights` (on a device
    of `DEVICES`; nothing elsewhere)."""
    for role in roles:
        weight = weights.get(role)
        if weight is not None and weight.dim() == 2 and weight.device.type in DEVICES:
            weights[role + TRANSPOSED] = transposed(weight)


def linear(x: torch.Tensor, w: Mapping[str, torch.Tensor], role: str) -> torch.Tensor:
    """x [T, in] times the weight of `role` (plus its `role_bias`, if held) -> [T, out]."""
    return multiply(x, w[role], w.get(role + TRANSPOSED), w.get(role + "_bias"))


def multiply(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_t: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, in] times weight [out, in] (by its transposed copy `weight_t` when given), plus
    bias -> [T, out]."""
    if weight_t is None or x.dim() != 2:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight_t)
    return torch.addmm(bias, x, weight_t)
