"""Sliding window of expert load: the input of the EPLB policy.

Glossary: a *logical expert* is one of the model's E experts of a layer; its *load* is the number
of (token, top-k choice) pairs the router sent to it. Physical slots and replicas (see
``moe_runtime.eplb.policy``) do not appear here: load is counted per logical expert.

Shapes: ``record(load)`` takes [L, E]; ``total()`` returns [L, E] int64, the sum over the last
``window_size`` recorded steps. The buffer is [window_size, L, E] int64.
"""

from __future__ import annotations

import torch


class LoadWindow:
    """Ring buffer of the last ``window_size`` per-step loads, each [L, E] int64."""

    def __init__(self, num_layers: int, num_experts: int, window_size: int) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(
                f"num_layers and num_experts must be >= 1, got {num_layers}, {num_experts}"
            )
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window_size = window_size
        self._buf = torch.zeros(window_size, num_layers, num_experts, dtype=torch.int64)
        self._next = 0
        self._count = 0

    def record(self, load: torch.Tensor) -> None:
        """Adds one step's load [L, E] (tokens per logical expert), dropping the oldest step."""
        if tuple(load.shape) != (self.num_layers, self.num_experts):
            raise ValueError(
                f"load must be [L, E] = [{self.num_layers}, {self.num_experts}], "
                f"got {tuple(load.shape)}"
            )
        self._buf[self._next] = load.to(torch.int64).cpu()
        self._next = (self._next + 1) % self.window_size
        self._count = min(self._count + 1, self.window_size)

    def total(self) -> torch.Tensor:
        """[L, E] int64: load summed over the recorded steps still in the window."""
        return self._buf.sum(dim=0)

    @property
    def num_recorded(self) -> int:
        """Steps currently in the window (at most window_size)."""
        return self._count

    def resized(self, window_size: int) -> LoadWindow:
        """A window of `window_size` steps holding the most recent of this one's steps."""
        out = LoadWindow(self.num_layers, self.num_experts, window_size)
        keep = min(self._count, window_size)
        for back in range(keep, 0, -1):  # oldest kept first
            out.record(self._buf[(self._next - back) % self.window_size])
        return out

    def reset(self) -> None:
        self._buf.zero_()
        self._next = 0
        self._count = 0
