"""What every part of a rank is built with (`RankContext`): the loaded model they share, the
device and dtype of its weights, its fault point and its log context."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from moe_runtime.rank import loaded as loaded_mod


@dataclasses.dataclass(frozen=True)
class RankContext:
    """loaded: the rank's weights and KV cache (`loaded.LoadedModel`, filled by
    `load_weights`); device, dtype: where and how its weights live; check(point): its fault
    point (the hooks' `check`, a no-op without hooks); where(): its log context; fail(reason):
    the rank cannot step again (`RankWorker.fail`)."""

    loaded: loaded_mod.LoadedModel
    device: str
    dtype: torch.dtype
    check: Callable[[str], None]
    where: Callable[[], str]
    fail: Callable[[str], None] = lambda reason: None
