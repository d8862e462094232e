"""A pool of spawned rank processes and the tasks they run (tests/integration/test_expert_parallel.py).

The pool starts its processes once (importing torch costs seconds per process) and reuses them
for every case; a case names a task of ``TASKS`` and gives each participating rank its keyword
arguments. Ranks talk to each other only through the ``StatelessGroup`` the task builds.
"""

from __future__ import annotations

import importlib
import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from moe_runtime.comm import ep, group, transfer
from moe_runtime.eplb import moves, policy
from moe_runtime.model import decoder, source
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod

MODEL = "synthetic://tiny?seed=0"
GROUP_TIMEOUT_S = 60.0

_cache: dict[str, Any] = {}


def _source() -> Any:
    if "source" not in _cache:
        _cache["source"] = source.open_source(MODEL)
    return _cache["source"]


def _model() -> decoder.MoEModel:
    if "model" not in _cache:
        _cache["model"] = decoder.MoEModel.from_source(_source())
    model: decoder.MoEModel = _cache["model"]
    return model


def _expert(layer: int, logical: int) -> experts_mod.ExpertWeights:
    key = f"expert/{layer}/{logical}"
    if key not in _cache:
        _cache[key] = experts_mod.load_expert(_source(), layer, logical)
    weights: experts_mod.ExpertWeights = _cache[key]
    return weights


def _slots_from_source(
    placement: policy.Placement, rank: int, num_ranks: int
) -> dict[tuple[int, int], experts_mod.ExpertWeights]:
    return {
        (layer, slot): _expert(layer, int(placement.phy2log[layer, slot]))
        for layer in range(placement.num_layers)
        for slot in placement.slots_of_rank(rank, num_ranks)
    }


def lockstep_generate(
    grp: group.StatelessGroup,
    model: decoder.MoEModel,
    experts: experts_mod.ExpertBackend,
    requests: list[dict[str, Any]],
    *,
    rank: int | None = None,
    kv: kv_mod.KVCache | None = None,
    step: Callable[[kv_mod.ForwardBatch], list[int]] | None = None,
) -> dict[str, list[int]]:
    """Greedy generation of this rank's requests, stepping in lockstep with the other ranks.

    Each request: seq_id, prompt, max_new, start_step (arrival), rank. A rank with nothing to do
    in a step runs an empty batch (it still joins every layer's all-to-all). The loop ends when
    no rank has an unfinished request (all-reduce of the count).
    """
    mine = [r for r in requests if r["rank"] == (grp.rank if rank is None else rank)]
    out: dict[str, list[int]] = {r["seq_id"]: [] for r in mine}
    if kv is None:
        kv = kv_mod.KVCache(model.local_config)  # a TP rank's cache holds only its heads
    cache = kv

    def argmax_step(batch: kv_mod.ForwardBatch) -> list[int]:
        return [int(t) for t in torch.argmax(model.forward(batch, cache, experts), -1).tolist()]

    forward = step or argmax_step
    step_no = 0
    while True:
        left = torch.tensor([sum(len(out[r["seq_id"]]) < r["max_new"] for r in mine)])
        grp.all_reduce(left)
        if int(left.item()) == 0:
            return out
        running = [
            r for r in mine if r["start_step"] <= step_no and len(out[r["seq_id"]]) < r["max_new"]
        ]
        batch = kv_mod.ForwardBatch(
            seq_ids=[r["seq_id"] for r in running],
            token_ids=[
                [out[r["seq_id"]][-1]] if out[r["seq_id"]] else list(r["prompt"]) for r in running
            ],
            start_pos=[
                len(r["prompt"]) + len(out[r["seq_id"]]) - 1 if out[r["seq_id"]] else 0
                for r in running
            ],
        )
        for r, token in zip(running, forward(batch), strict=True):
            out[r["seq_id"]].append(int(token))
        step_no += 1


def task_generate(
    *,
    spec: group.GroupSpec,
    rank: int,
    phy2log: list[list[int]],
    requests: list[dict[str, Any]],
) -> dict[str, Any]:
    """Expert-parallel generation under one placement; returns this rank's tokens."""
    cfg = _model().config
    placement = policy.Placement.from_phy2log(torch.tensor(phy2log), cfg.num_experts)
    grp = group.StatelessGroup(spec, rank, timeout=GROUP_TIMEOUT_S)
    try:
        backend = ep.ExpertParallelBackend(
            grp, placement, _slots_from_source(placement, rank, spec.world_size)
        )
        started = time.monotonic()
        tokens = lockstep_generate(grp, _model(), backend, requests)
        return {"tokens": tokens, "seconds": time.monotonic() - started}
    finally:
        grp.destroy()


def task_grow_and_generate(
    *,
    old_spec: group.GroupSpec | None,
    old_num_ranks: int,
    new_spec: group.GroupSpec,
    rank: int,
    old_phy2log: list[list[int]],
    new_phy2log: list[list[int]],
    requests: list[dict[str, Any]],
) -> dict[str, Any]:
    """Scale-up in miniature: the old group (ranks < old size) and a standby group over all
    ranks coexist; non-expert weights are broadcast to the new rank, experts move to the new
    placement, then the standby group serves. Returns checks and this rank's tokens."""
    cfg = _model().config
    old_size = old_num_ranks
    new_size = new_spec.world_size
    old = policy.Placement.from_phy2log(torch.tensor(old_phy2log), cfg.num_experts)
    new = policy.Placement.from_phy2log(torch.tensor(new_phy2log), cfg.num_experts)
    old_grp = (
        group.StatelessGroup(old_spec, rank, timeout=GROUP_TIMEOUT_S)
        if old_spec is not None
        else None
    )
    new_grp = group.StatelessGroup(new_spec, rank, timeout=GROUP_TIMEOUT_S)
    checks: dict[str, Any] = {}
    try:
        # The old group still works while the standby one exists.
        if old_grp is not None:
            probe = torch.tensor([float(rank + 1)])
            old_grp.all_reduce(probe)
            checks["old_group_sum"] = float(probe.item())
        held = _slots_from_source(old, rank, old_size) if rank < old_size else {}

        # Non-expert weights from rank 0 to everyone (the new rank starts empty).
        state = transfer.broadcast_state(
            new_grp, _model().non_expert_state() if rank == 0 else None, src=0
        )
        reference = _model().non_expert_state()
        checks["state_identical"] = sorted(state) == sorted(reference) and all(
            torch.equal(state[name], reference[name]) for name in reference
        )
        model = decoder.MoEModel(cfg)
        model.load_non_expert(state)

        # Expert moves.
        plan = moves.plan_moves(old, new, old_num_ranks=old_size, new_num_ranks=new_size)
        by_logical: dict[tuple[int, int], experts_mod.ExpertWeights] = {
            (layer, int(old.phy2log[layer, slot])): w for (layer, slot), w in held.items()
        }
        received: dict[tuple[int, int], experts_mod.ExpertWeights] = {}

        def write(move: moves.ExpertMove, weights: experts_mod.ExpertWeights) -> None:
            received[(move.layer, move.logical)] = weights

        stats = transfer.execute_moves(
            new_grp,
            plan,
            read_expert=lambda layer, logical: by_logical[(layer, logical)],
            write_expert=write,
            like=_expert(0, 0),
            max_in_flight=5,
        )
        checks["received"] = stats.received
        checks["sent"] = stats.sent
        checks["moves_total"] = len(plan)
        checks["moved_identical"] = all(
            torch.equal(w[n], _expert(layer, logical)[n])
            for (layer, logical), w in received.items()
            for n in w.tensors()
        )
        available = {**by_logical, **received}
        local = {
            (layer, slot): available[(layer, int(new.phy2log[layer, slot]))]
            for layer in range(new.num_layers)
            for slot in new.slots_of_rank(rank, new_size)
        }
        if old_grp is not None:
            old_grp.destroy()  # switch: the standby group serves from now on
            old_grp = None
        backend = ep.ExpertParallelBackend(new_grp, new, local)
        checks["tokens"] = lockstep_generate(new_grp, model, backend, requests)
        return checks
    finally:
        if old_grp is not None:
            old_grp.destroy()
        new_grp.destroy()


def task_free_port() -> int:
    return group.free_port(group.LOOPBACK)


TASKS: dict[str, Callable[..., Any]] = {
    "generate": task_generate,
    "grow_and_generate": task_grow_and_generate,
    "free_port": task_free_port,
}


def _serve(index: int, inbox: Any, outbox: Any, tasks_module: str = __name__) -> None:
    torch.set_num_threads(1)
    tasks: dict[str, Callable[..., Any]] = importlib.import_module(tasks_module).TASKS
    while True:
        task = inbox.get()
        if task is None:
            return
        seq, name, kwargs = task
        try:
            outbox.put((seq, index, True, tasks[name](**kwargs)))
        except Exception:
            outbox.put((seq, index, False, traceback.format_exc()))


class RankPool:
    """``size`` spawned processes that run TASKS on request (those of this module, or of the
    module named by ``tasks_module``); the test's fixture owns it."""

    def __init__(self, size: int, *, tasks_module: str = __name__) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve, args=(i, self._inboxes[i], self._outbox, tasks_module), daemon=True
            )
            for i in range(size)
        ]
        for proc in self._procs:
            proc.start()
        self._seq = 0

    def run(self, name: str, per_rank: list[dict[str, Any]], *, timeout: float) -> list[Any]:
        """Runs task ``name`` on processes 0..len(per_rank)-1; results in rank order.

        Raises with the remote traceback if a rank fails, TimeoutError past ``timeout``."""
        self._seq += 1
        for i, kwargs in enumerate(per_rank):
            self._inboxes[i].put((self._seq, name, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < len(per_rank):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                seq, index, ok, value = self._outbox.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"rank processes {dead} died") from None
                continue
            if seq != self._seq:
                continue  # a late answer of an earlier, failed case
            if ok:
                results[index] = value
            else:
                failures[index] = value
                # Give the other ranks a moment to fail too (they see a broken peer).
                deadline = min(deadline, time.monotonic() + 5.0)
        if failures:
            text = "\n".join(f"--- rank {i} ---\n{tb}" for i, tb in sorted(failures.items()))
            raise RuntimeError(f"task {name} failed on ranks {sorted(failures)}:\n{text}")
        if len(results) < len(per_rank):
            raise TimeoutError(f"task {name}: only ranks {sorted(results)} answered in {timeout}s")
        return [results[i] for i in range(len(per_rank))]

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
