"""Tensor-parallel ranks for tests: a TP group of threads over an in-process fake collective
(`ThreadGroup`, `run_threads`), and the task spawned rank processes run over a real gloo group
(`TASKS`, for `ep_ranks.RankPool(..., tasks_module=__name__)`).

Every TP rank generates greedily with its shard of the non-expert weights; in the layout
`serve` runs only TP rank 0 (the leader) holds routed experts (`LocalExperts`), the followers'
backend raises if it is ever called (`tensor_group.NoExperts`: they add zeros to the MoE
reduce, docs/TENSOR-PARALLEL.md); `task_dp_tp_generate` also runs the `MESH` layout (experts
over DP x T).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import safetensors
import torch

from moe_runtime.comm import ep, group
from moe_runtime.eplb import policy
from moe_runtime.model import decoder, generate, source, tensor_parallel, tp_shard
from moe_runtime.model import experts as experts_mod
from moe_runtime.rank import tensor_group
from tests.support import ep_ranks, read_counter

T = TypeVar("T")
GROUP_TIMEOUT_S = 60.0


class _Exchange:
    """What the members of one `ThreadGroup` share: a barrier and one slot per rank."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * size


class ThreadGroup:
    """One member of a TP group of threads: `all_reduce` (sum in rank order, so every member
    gets the same bits) and `all_gather_into`, as `comm.group.StatelessGroup` has them."""

    def __init__(self, exchange: _Exchange, rank: int) -> None:
        self._x = exchange
        self.rank = rank
        self.world_size = exchange.size

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._x.slots[self.rank] = tensor.clone()
        self._x.barrier.wait()
        values = [t for t in self._x.slots if t is not None]
        self._x.barrier.wait()  # everyone has read before anyone writes again
        return values

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        assert op == "sum"
        values = self._gather(tensor)
        total = values[0].clone()
        for value in values[1:]:
            total += value
        tensor.copy_(total)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        values = self._gather(tensor)
        output.copy_(torch.stack(values).view(output.shape))


def run_threads(size: int, fn: Callable[[ThreadGroup], T]) -> list[T]:
    """fn(member) on `size` threads, one per TP rank; results in rank order (the first
    failure raised)."""
    exchange = _Exchange(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ThreadGroup(exchange, rank))
        except BaseException as exc:  # reported below, with the other ranks released
            errors.append(exc)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    return results


def tp_model(
    src: source.ModelSource,
    tp_group: tensor_parallel.Collective,
    rank: int,
    size: int,
    *,
    layout: str = tensor_parallel.LEADER,
) -> decoder.MoEModel:
    """TP rank `rank` of `size`'s model: its shard read from `src`; routed experts run as
    `layout` says (`tensor_parallel.LEADER` or `MESH`)."""
    shard = tp_shard.plan(src.config, rank=rank, size=size)
    tp = tensor_parallel.TensorParallel(shard, tp_group, expert_layout=layout)
    return decoder.MoEModel.from_source(src, tp=tp)


def tp_generate(
    src: source.ModelSource,
    tp_group: tensor_parallel.Collective,
    rank: int,
    size: int,
    prompts: list[list[int]],
    new_tokens: int,
) -> list[list[int]]:
    """Greedy tokens of every prompt (one batch) on TP rank `rank` of `size`."""
    model = tp_model(src, tp_group, rank, size)
    return generate.generate_greedy(model, prompts, new_tokens, experts=experts_for(src, rank))


def experts_for(src: source.ModelSource, tp_rank: int) -> Any:
    """The leader's every routed expert; a follower's backend that must never run."""
    if tp_rank == 0:
        return experts_mod.LocalExperts.from_source(src)
    return tensor_group.NoExperts()


# --- spawned rank processes (ep_ranks.RankPool) ------------------------------------------------


def task_free_port() -> int:
    return group.free_port(group.LOOPBACK)


def task_tp_generate(
    *,
    spec: group.GroupSpec,
    rank: int,
    checkpoints: dict[str, str],
    prompts: list[list[int]],
    new_tokens: int,
) -> dict[str, Any]:
    """Per checkpoint: this TP rank's greedy tokens, and the bytes of non-expert weights it
    read and holds, over one gloo group of spec.world_size processes."""
    grp = group.StatelessGroup(spec, rank, timeout=GROUP_TIMEOUT_S)
    out: dict[str, Any] = {}
    try:
        for family, path in checkpoints.items():
            src = source.open_source(path)
            counter = read_counter.ReadCounter()
            real = safetensors.safe_open
            safetensors.safe_open = counter.safe_open  # type: ignore[assignment]
            try:
                model = tp_model(src, grp, rank, spec.world_size)
            finally:
                safetensors.safe_open = real  # type: ignore[assignment]
            held = sum(t.numel() * t.element_size() for t in model.non_expert_state().values())
            local = experts_for(src, rank)
            tokens = generate.generate_greedy(model, prompts, new_tokens, experts=local)
            out[family] = {"tokens": tokens, "read": counter.nbytes, "held": held}
        return out
    finally:
        grp.destroy()


class _Counted:
    """An expert backend that counts the rows sent to it."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.rows = 0

    def __call__(self, layer: int, hidden: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        self.rows += hidden.shape[0]
        return self.backend(layer, hidden, *rest)  # type: ignore[no-any-return]


def task_dp_tp_generate(
    *,
    tp_spec: group.GroupSpec,
    ep_spec: group.GroupSpec,
    dp_rank: int,
    tp_rank: int,
    checkpoints: dict[str, str],
    requests: list[dict[str, Any]],
    layout: str = tensor_parallel.LEADER,
) -> dict[str, dict[str, Any]]:
    """DP x TP in miniature: this process is TP rank `tp_rank` of DP rank `dp_rank`. Its TP
    group holds the TP ranks of its DP rank. `layout` `LEADER` (what `serve` runs): its
    expert-parallel group holds TP rank `tp_rank` of every DP rank and only the leaders' (TP
    rank 0) runs experts. `MESH`: one expert-parallel group of all DP x T processes (this one
    is member dp_rank * T + tp_rank), the experts placed over all of them, every process
    dispatching its 1/T of its DP rank's rows. Requests carry their DP rank (`rank`). Returns
    per checkpoint this process's tokens, the expert slots it held and the rows it sent to
    its experts' backend."""
    size = tp_spec.world_size
    mesh = layout == tensor_parallel.MESH
    tp_grp = group.StatelessGroup(tp_spec, tp_rank, timeout=GROUP_TIMEOUT_S)
    ep_rank = dp_rank * size + tp_rank if mesh else dp_rank
    ep_grp = group.StatelessGroup(ep_spec, ep_rank, timeout=GROUP_TIMEOUT_S)
    out: dict[str, dict[str, Any]] = {}
    try:
        for family, path in checkpoints.items():
            src = source.open_source(path)
            cfg = src.config
            num_ep = ep_spec.world_size
            physical = policy.num_physical_for(cfg.num_experts, num_ep)
            placement = policy.identity(cfg.num_moe_layers, cfg.num_experts, physical, num_ep)
            slots = {
                (layer, slot): experts_mod.load_expert(
                    src, layer, int(placement.phy2log[layer, slot])
                )
                for layer in range(cfg.num_moe_layers)
                for slot in placement.slots_of_rank(ep_rank, num_ep)
            }
            backend: Any = ep.ExpertParallelBackend(ep_grp, placement, slots)
            if tp_rank and not mesh:
                backend, slots = tensor_group.NoExperts(), {}
            counted = _Counted(backend)
            shard = tp_shard.plan(cfg, rank=tp_rank, size=size)
            tp = tensor_parallel.TensorParallel(shard, tp_grp, expert_layout=layout)
            model = decoder.MoEModel.from_source(src, tp=tp)
            tokens = ep_ranks.lockstep_generate(ep_grp, model, counted, requests, rank=dp_rank)
            out[family] = {
                "tokens": tokens,
                "slots": len(slots),
                "rows": counted.rows,
            }
        return out
    finally:
        ep_grp.destroy()
        tp_grp.destroy()


TASKS: dict[str, Callable[..., Any]] = {
    "free_port": task_free_port,
    "tp_generate": task_tp_generate,
    "dp_tp_generate": task_dp_tp_generate,
}
