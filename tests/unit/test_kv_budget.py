"""The KV budget a resize leaves each rank: from the expert slots each rank will hold, one
device's heads at tensor-parallel size T, and migrations over capacity that wait for room
instead of overfilling a survivor."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from moe_runtime import step as step_mod
from moe_runtime.elastic import coordinator, service, serving
from moe_runtime.engine import core, seam
from moe_runtime.engine import request as req_mod
from moe_runtime.engine import scheduler as scheduler_mod
from moe_runtime.engine import text as text_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import local
from moe_runtime.model import config as config_mod
from moe_runtime.model import decoder, generate, kv_budget
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import source as source_mod
from tests.support import engine_fakes as fakes
from tests.support import polling

MIXTRAL = "synthetic://tiny?seed=0"  # 4 query heads over 2 KV heads
DEEPSEEK = "synthetic://deepseek-tiny?seed=0"  # MLA
DEADLINE = 120.0


def _config(model: str) -> config_mod.ModelConfig:
    return source_mod.open_source(model).config


def _gpu_budget(cfg: config_mod.ModelConfig, *, tp_size: int = 1) -> kv_budget.KVBudget:
    """A GPU-like budget (per device) with room for the weights and some thousands of
    positions, measured as `serve` does (the device figure replaced)."""
    measured = kv_budget.KVBudget.measure(
        cfg, torch.float32, budget_bytes=None, fraction=0.5, cuda=False, tp_size=tp_size
    )
    non_expert, experts = kv_budget.weight_bytes(cfg, torch.float32)
    full = kv_mod.bytes_per_token(cfg, torch.float32)
    return dataclasses.replace(
        measured, cuda=True, context=16, available=non_expert + experts + 8000 * full
    )


@pytest.mark.parametrize("model", [MIXTRAL, DEEPSEEK], ids=["gqa", "mla"])
def test_a_cpu_budget_leaves_room_for_the_copies_a_cpu_rank_holds(model: str) -> None:
    """A CPU rank holds its weights twice over: every expert slot and its stacked copy for the
    grouped GEMMs, every non-expert matrix and its transposed copy (`linear`). The host's
    budget leaves room for what a real model and its experts hold after a step, so a KV cache
    sized by it does not push the host past its memory."""
    src = source_mod.open_source(model)
    cfg = src.config
    net = decoder.MoEModel.from_source(src)
    experts = experts_mod.LocalExperts.from_source(src)
    net.forward(kv_mod.ForwardBatch(["a"], [[1, 2, 3]], [0]), kv_mod.KVCache(cfg), experts)

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    held = nbytes(net.non_expert_state().values()) + nbytes(
        t for w in experts.weights.values() for t in w.tensors().values()
    )
    copies = nbytes(t for w in net._layers for r, t in w.items() if r.endswith(".t"))
    copies += nbytes([net._lm_head_t] if net._lm_head_t is not None else [])
    copies += nbytes(t for _, _, stack in experts._stacked._cache.values() for t in stack.values())
    non_expert, slots = kv_budget.weight_bytes(cfg, torch.float32)
    assert held == non_expert + slots and copies > 0
    assert held + copies <= kv_budget.HOST_WEIGHT_COPIES * (non_expert + slots)
    per_token = kv_mod.bytes_per_token(cfg, torch.float32)
    budget = dataclasses.replace(
        kv_budget.KVBudget.measure(cfg, torch.float32, budget_bytes=None, fraction=0.5, cuda=False),
        available=held + copies + 8000 * per_token,
    )
    assert budget.tokens(1) <= 4000  # what is left after both copies, x fraction


def test_a_rank_holding_more_expert_slots_gets_fewer_positions_on_a_gpu() -> None:
    """`set_active` with the slots each rank holds in the placement it will serve: on a GPU a
    rank's KV room is its device less its weights, so the rank with more slots gets fewer
    positions (by exactly those slots' bytes x fraction); on a CPU the host's room is shared
    evenly, less every slot."""
    cfg = _config(MIXTRAL)
    gpu = _gpu_budget(cfg)
    sched = scheduler_mod.Scheduler(
        ranks=[0, 1], max_num_seqs_per_rank=8, max_tokens_per_step=64, kv_budget=gpu.per_rank
    )
    assert sched.kv_budgets == {0: gpu.tokens(2), 1: gpu.tokens(2)}  # 4 slots each
    sched.set_active([0, 1], slots={0: 6, 1: 2})
    budgets = sched.kv_budgets
    assert budgets is not None and budgets[0] < budgets[1]
    extra = 4 * gpu.slot_bytes * gpu.fraction / gpu.per_token  # 4 slots more on rank 0
    assert budgets[1] - budgets[0] == pytest.approx(extra, abs=2 * kv_mod.BLOCK_SIZE)
    # A sequence that only rank 1's room holds goes there, whatever the load.
    assert sched.least_loaded(kv=budgets[1]) == 1
    # A shrink to one rank holding every slot: less room than either.
    sched.set_active([0], slots={0: 8})
    assert sched.kv_budgets == {0: gpu.tokens(1, 8)} and gpu.tokens(1, 8) < budgets[0]

    cpu = dataclasses.replace(gpu, cuda=False)
    even = cpu.per_rank([0, 1], {0: 6, 1: 2})
    assert even[0] == even[1] == cpu.tokens(2)  # the host's room less all 8 slots, shared


def _seq(rid: str, *, rank: int, reserved: int, started: bool) -> scheduler_mod.Seq:
    request = fakes.req(rid, "abc", max_tokens=20)
    seq = scheduler_mod.Seq(
        handle=req_mod.RequestHandle(request),
        tokens=list(request.prompt_token_ids),
        prompt_len=len(request.prompt_token_ids),
        text=text_mod.IncrementalText(fakes.LetterTokenizer()),
        rank=rank,
        kv_reserved=reserved,
    )
    if started:  # its prompt is in its rank's KV cache
        seq.dirty, seq.num_computed = True, len(seq.tokens)
    return seq


def test_a_smaller_budget_keeps_running_reservations_and_re_places_unstarted_ones() -> None:
    """A shrink of a rank's budget (more slots): the sequence that has run keeps its
    reservation; the one not started there yet waits for room, ahead of the queue, and is
    placed once the first ends."""

    def budgets(ranks: Any, slots: Any) -> dict[int, int]:  # 16 positions less a slot
        return {r: 96 - 16 * (2 if slots is None else slots[r]) for r in ranks}

    sched = scheduler_mod.Scheduler(
        ranks=[0], max_num_seqs_per_rank=8, max_tokens_per_step=64, kv_budget=budgets
    )
    assert sched.kv_budgets == {0: 64}
    running = _seq("running", rank=0, reserved=32, started=True)
    fresh = _seq("fresh", rank=0, reserved=32, started=False)
    sched.running = {"running": running, "fresh": fresh}
    sched.set_active([0], slots={0: 3})  # 48 positions now
    assert sched.kv_budgets == {0: 48}
    assert list(sched.running) == ["running"] and list(sched.waiting) == [fresh]
    assert not sched.place_waiting()  # 16 free: it still waits
    sched.remove(running)
    assert sched.place_waiting() and sched.running == {"fresh": fresh}
    assert (fresh.rank, fresh.num_computed, fresh.kv_reserved) == (0, 0, 32)


@pytest.mark.parametrize(
    ("model", "ratio"),
    [pytest.param(MIXTRAL, 2, id="gqa-kv-heads-split"), pytest.param(DEEPSEEK, 1, id="mla")],
)
def test_at_tensor_parallel_size_2_the_budget_counts_one_devices_heads(
    model: str, ratio: int
) -> None:
    """A device of a TP=2 rank caches half the KV heads (GQA: 2 KV heads over 2 devices), so
    for the same bytes a device the rank holds twice the positions; MLA's latent is replicated
    on every TP rank: the same positions."""
    cfg = _config(model)
    per_1 = kv_budget.per_token_bytes(cfg, torch.float32, tp_size=1)
    per_2 = kv_budget.per_token_bytes(cfg, torch.float32, tp_size=2)
    assert per_1 == kv_mod.bytes_per_token(cfg, torch.float32)
    assert per_2 * ratio == per_1

    def fixed(tp_size: int) -> int:  # --kv-cache-bytes: bytes a device
        return kv_budget.KVBudget.measure(
            cfg,
            torch.float32,
            budget_bytes=per_1 * 4096,
            fraction=0.5,
            cuda=False,
            tp_size=tp_size,
        ).tokens(2)

    assert fixed(1) == 4096 and fixed(2) == 4096 * ratio
    # Measured on a GPU: the leader's device also holds only its shard of the non-expert
    # weights, so at least as many positions again.
    gpu_1, gpu_2 = _gpu_budget(cfg, tp_size=1), _gpu_budget(cfg, tp_size=2)
    assert gpu_2.non_expert < gpu_1.non_expert
    assert gpu_2.tokens(2) >= ratio * gpu_1.tokens(2) - kv_mod.BLOCK_SIZE
    # On a CPU the host holds both devices' caches (and the weights both replicate): a rank's
    # position costs T devices' bytes, so TP makes no room there.
    # (the host of 2 ranks: room for their weights as a CPU holds them, and 8,000 positions)
    non_expert, experts = kv_budget.weight_bytes(cfg, torch.float32)
    host = kv_budget.HOST_WEIGHT_COPIES * 2 * (non_expert + experts) + 8000 * per_1
    cpu_1, cpu_2 = (dataclasses.replace(b, cuda=False, available=host) for b in (gpu_1, gpu_2))
    assert cpu_2.tokens(2) * 2 * per_2 <= cpu_1.tokens(2) * per_1
    assert cpu_2.tokens(2) * 2 * per_2 > 0.8 * cpu_1.tokens(2) * per_1


@pytest.mark.parametrize("model", [MIXTRAL, DEEPSEEK], ids=["gqa", "mla"])
def test_with_pipeline_stages_a_position_costs_the_largest_stages_layers(model: str) -> None:
    """At P stages a device caches its stage's layers only: the stage with the most layers
    binds (layers split as `pipeline.plan` does), and a CPU host's room is shared by DP x P
    devices."""
    cfg = _config(model)
    whole = kv_mod.bytes_per_token(cfg, torch.float32)
    for size in range(2, cfg.num_layers + 1):
        most = -(-cfg.num_layers // size)
        per = kv_budget.per_token_bytes(cfg, torch.float32, pp_size=size)
        assert per * cfg.num_layers == whole * most, size
    budget = kv_budget.KVBudget.measure(
        cfg,
        torch.float32,
        budget_bytes=whole * 4096,
        fraction=0.5,
        cuda=False,
        pp_size=cfg.num_layers,
    )
    assert budget.tokens(2) == 4096 * cfg.num_layers  # one layer a device
    assert budget.tp_size == cfg.num_layers  # devices a rank


# --------------------------------------------- a shrink whose migrations exceed the survivor


def _poll(condition: Callable[[], object], what: str, deadline: float = DEADLINE) -> None:
    polling.poll(condition, what, deadline, every=0.005)


def test_a_shrinks_migrations_beyond_the_survivors_budget_wait_and_resume() -> None:
    """DP 2 -> 1 under load, each rank full (three sequences of 4 + 120 positions in a budget
    of 384): the departing rank's three sequences find no room on the survivor, wait ahead of
    the queue with their tokens, and resume (re-prefilled) as the survivor's finish. Every
    request completes with the tokens of one process, each stream without a duplicate or a
    gap, and the survivor's reserved KV never exceeds its budget."""
    torch.set_num_threads(1)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(4)] for i in range(6)]
    max_tokens, budget = 120, 384  # a sequence reserves 128 positions: three a rank
    want = generate.generate_greedy(MIXTRAL, prompts, max_tokens)
    src = source_mod.open_source(MIXTRAL)
    cfg = src.config
    placement = policy.identity(cfg.num_moe_layers, cfg.num_experts, cfg.num_experts, 2)
    ex = local.LocalExecutor(2)
    ex.start(MIXTRAL, placement=placement)
    asked: list[dict[int, int] | None] = []

    def budgets(ranks: Any, slots: Any) -> dict[int, int]:  # the same room at any placement
        asked.append(None if slots is None else dict(slots))
        return dict.fromkeys(ranks, budget)

    engine = core.Engine(
        ex,
        src.tokenizer(),
        seam.EngineConfig(max_model_len=512, kv_budget=budgets, max_num_seqs_per_rank=8),
    )
    elastic = service.ElasticService.attach(
        engine=engine,
        executor=ex,
        model_config=cfg,
        placement=placement,
        config=serving.ElasticConfig(source=MIXTRAL, eplb_enabled=False, auto_recover=False),
        limits=coordinator.Limits(min_size=1, max_size=2, num_experts=cfg.num_experts),
    )
    seen: dict[str, int] = {"max_used": 0, "max_waiting": 0}
    lock = threading.Lock()

    def record(_: object) -> None:  # the engine thread, after every step
        used = max(engine.scheduler.kv_used().values(), default=0)
        with lock:
            seen["max_used"] = max(seen["max_used"], used)
            seen["max_waiting"] = max(seen["max_waiting"], engine.stats().num_waiting)

    engine.on_step(record)
    engine.start()
    try:
        handles = [
            engine.add_request(
                req_mod.Request(
                    request_id=f"r{i}",
                    prompt_token_ids=p,
                    sampling=step_mod.SamplingParams(),
                    max_tokens=max_tokens,
                    ignore_eos=True,
                )
            )
            for i, p in enumerate(prompts)
        ]
        _poll(lambda: engine.stats().seqs_per_rank == {0: 3, 1: 3}, "three running a rank")
        shrink = elastic.coordinator.request(1)
        assert elastic.coordinator.wait(shrink, timeout=DEADLINE) and shrink.succeeded, (
            shrink.message
        )
        streams = [[o for o in h.iter_outputs(timeout=DEADLINE)] for h in handles]
        got = [h.result(DEADLINE) for h in handles]
    finally:
        elastic.close()
        engine.stop()
        ex.shutdown()
    assert [g.error for g in got] == [None] * len(prompts)
    assert [g.token_ids for g in got] == want
    for stream, tokens in zip(streams, want, strict=True):
        assert [t for o in stream for t in o.new_token_ids] == tokens
        counts = [o.num_generated_tokens for o in stream if o.new_token_ids]
        assert counts == sorted(set(counts))  # each token once, in order
    assert seen["max_waiting"] >= 1  # some migrated sequences waited for room
    assert seen["max_used"] <= budget
    assert engine.stats().active_ranks == (0,)
    assert asked[-1] == {0: cfg.num_experts}  # the survivor's budget from all 8 slots it holds


def test_in_the_mesh_layout_a_gpu_leader_holds_its_part_of_the_slots() -> None:
    """At T = 2 with `expert_parts` 2 (`--expert-layout mesh`) the leader's device holds half
    of its rank's slots: a rank of 8 slots has the room of one holding 4 in the leader layout,
    and more than the same rank with every slot on its leader."""
    cfg = _config(MIXTRAL)
    leader = _gpu_budget(cfg, tp_size=2)
    mesh = dataclasses.replace(leader, expert_parts=2)
    assert mesh.tokens(1, 8) == leader.tokens(1, 4) > leader.tokens(1, 8)
    extra = 4 * leader.slot_bytes * leader.fraction / leader.per_token
    assert mesh.tokens(1, 8) - leader.tokens(1, 8) == pytest.approx(
        extra, abs=2 * kv_mod.BLOCK_SIZE
    )
    # the host (CPU) holds every slot of every rank either way
    cpu_leader, cpu_mesh = (dataclasses.replace(b, cuda=False) for b in (leader, mesh))
    assert cpu_mesh.tokens(2, 4, total_slots=8) == cpu_leader.tokens(2, 4, total_slots=8)
