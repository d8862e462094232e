"""RayExecutor on a local Ray instance: generation equals the single-process model, the elastic
primitives grow 2 -> 4 and shrink 4 -> 2 ranks mid-generation with identical tokens (no engine:
a small lockstep loop drives the steps), a killed actor is reported by the health check, a new
rank lost before it joins fails the group build at once, and the compiled graph's per-step
overhead is printed next to plain actor calls."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from moe_contract import loading
from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.executor import base
from moe_runtime.model import generate
from moe_runtime.rank import allocator
from moe_runtime.rank import groups as groups_mod
from tests.support import lockstep

pytestmark = pytest.mark.ray

SOURCE = lockstep.SOURCE
PROMPTS = [*lockstep.PROMPTS, [1, 42, 43, 44, 45], [1, 250, 251]]
MAX_TOKENS = 16
ELASTIC_MAX_TOKENS = 40  # long enough that every sequence outlives both resizes
#: The group timeout of a resize (`ElasticConfig.rpc_timeout`): a join that waited for a lost
#: member would hold its rank's control lane that long.
GROUP_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    torch.set_num_threads(1)
    return generate.generate_greedy(SOURCE, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def ray_executor_mod(ray_session: None) -> Any:
    from moe_runtime.executor import ray_executor

    return ray_executor


@pytest.fixture(scope="module")
def two_ranks(ray_executor_mod: Any) -> Iterator[base.Executor]:
    ex = ray_executor_mod.RayExecutor(2)
    ex.start(SOURCE, placement=lockstep.identity(2))
    yield ex
    ex.shutdown()


#: Steps `while_stepping` runs at most during one background call: whatever the machine's
#: speed, the sequences then outlive both resizes (ELASTIC_MAX_TOKENS).
MOST_STEPS = 4


def while_stepping(
    run: lockstep.Lockstep, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[Any, int]:
    """Run fn in a thread while the lockstep loop keeps stepping (at most MOST_STEPS steps);
    (its result, steps run)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(fn, *args, **kwargs)
        steps = 0
        while not future.done() and steps < MOST_STEPS:
            run.step()
            steps += 1
        return future.result(timeout=120), steps


def _total_load(outs: list[step_mod.StepOutput]) -> torch.Tensor:
    return torch.stack([o.expert_load for o in outs]).sum(0)


def test_two_ranks_generate_like_single_process(
    two_ranks: base.Executor, reference: list[list[int]]
) -> None:
    run = lockstep.Lockstep(two_ranks)
    for i, prompt in enumerate(PROMPTS):
        run.add(f"g{i}", prompt, rank=i % 2, max_tokens=MAX_TOKENS)
    got = run.run()
    assert [got[f"g{i}"] for i in range(len(PROMPTS))] == reference
    infos = two_ranks.rank_infos()
    assert sorted(infos) == [0, 1]
    # every rank process set glibc's malloc for step-sized activations (`rank.allocator`)
    tuned = {name: value for name, (_, value) in allocator.SETTINGS.items()}
    assert [infos[r]["malloc"] for r in (0, 1)] == [tuned, tuned]


def test_every_rank_says_what_its_load_read_on_its_health_lane(
    two_ranks: base.Executor,
) -> None:
    """`RayExecutor.load_progress`: each rank's `RankLoad`, asked on the health lane (what
    `GET /ready` shows while the model loads); here after the load: every rank done."""
    loads = [loading.RankLoad.exact(r) for r in two_ranks.load_progress()]
    assert sorted(r.rank for r in loads) == [0, 1]
    assert all(r.done and 0 < r.bytes_loaded == r.bytes_total for r in loads)


def test_grow_2_to_4_then_shrink_to_2_while_generating(ray_executor_mod: Any) -> None:
    reference = generate.generate_greedy(SOURCE, PROMPTS, ELASTIC_MAX_TOKENS)
    ex = ray_executor_mod.RayExecutor(2)
    try:
        _grow_and_shrink(ex, reference)
    finally:
        ex.shutdown()


def _grow_and_shrink(ex: base.Executor, reference: list[list[int]]) -> None:
    t0 = time.monotonic()

    def mark(stage: str) -> None:
        print(f"[{time.monotonic() - t0:6.2f}s] {stage}")

    cfg = lockstep.config()
    num_physical = cfg.num_experts
    old = lockstep.identity(2)
    ex.start(SOURCE, placement=old)
    run = lockstep.Lockstep(ex)
    for i, prompt in enumerate(PROMPTS):
        run.add(str(i), prompt, rank=i % 2, max_tokens=ELASTIC_MAX_TOKENS)
    load = _total_load(run.step())
    for _ in range(2):
        load += _total_load(run.step())

    mark("Standby")
    # Standby: new actors with placeholder weights
    started = time.monotonic()
    new = ex.add_ranks(2)
    assert new == [2, 3] and ex.pending_ranks == [2, 3] and ex.ranks == [0, 1]
    ex.collective_rpc(
        "load_weights",
        ranks=new,
        per_rank={2: {"rank": 2}, 3: {"rank": 3}},
        source=SOURCE,
        num_ranks=4,
        placement=None,
        placeholder=True,
    )
    print(f"\nstandby: 2 new actors ready with placeholders in {time.monotonic() - started:.2f}s")
    mark("Standby groups")
    # Standby groups over 4 ranks, built in the background: ranks 0-2 enter the rendezvous
    # and wait for rank 3 while the old graph keeps stepping; then rank 3 joins.
    for role in groups_mod.ROLES:
        spec = group_mod.GroupSpec.local(4, epoch=1)
        joining = ex.collective_rpc_async(
            "join_group",
            spec,
            ranks=[0, 1, 2],
            per_rank={r: {"rank": r} for r in range(3)},
            role=role,
        )
        for _ in range(3):
            run.step()
            assert not joining.done()
        ex.collective_rpc("join_group", spec, 3, ranks=[3], role=role, background=True)
        joining.result(timeout=60)
    assert ex.collective_rpc("groups", ranks=[0]) == [
        [(0, "step"), (0, "transfer"), (1, "step"), (1, "transfer")]
    ]

    mark("Transferring")
    # Transferring: non-expert weights peer to peer (rank 0 -> 2, rank 1 -> 3), in the background
    received, steps = while_stepping(
        run,
        ex.collective_rpc,
        "transfer_non_expert",
        1,
        ranks=[0, 1, 2, 3],
        background=True,
        src_ranks=[0, 1],
        dst_ranks=[2, 3],
    )
    assert received[0] == received[1] == 0 and received[2] == received[3] > 0
    print(f"non-expert transfer: {sum(received)} bytes to 2 new ranks ({steps} steps meanwhile)")

    mark("Staging experts")
    # Experts for 4 ranks staged (EPLB from the observed load); live experts keep serving
    grown = moves_mod.rebalance_for_resize(
        load, old, old_num_ranks=2, new_num_ranks=4, num_physical=num_physical
    )
    plan = moves_mod.plan_moves(old, grown, old_num_ranks=2, new_num_ranks=4)
    staged, steps = while_stepping(
        run,
        ex.collective_rpc,
        "stage_experts",
        1,
        plan,
        grown,
        ranks=[0, 1, 2, 3],
        background=True,
        per_rank={r: {"new_rank": r} for r in range(4)},
        new_num_ranks=4,
    )
    assert staged[2] > 0 and staged[3] > 0
    print(f"expert staging: {len(plan)} moves, {sum(staged)} bytes ({steps} steps meanwhile)")

    mark("Switching")
    # Switching: at a step boundary
    ex.switch([0, 1, 2, 3], epoch=1, placement=grown)
    assert ex.ranks == [0, 1, 2, 3] and ex.pending_ranks == []
    print(f"switch 2->4: {ex.switcher.last}")
    run.migrate("4", 2)
    run.migrate("5", 3)
    for _ in range(3):
        outs = run.step()
        assert outs[2].tokens and outs[3].tokens  # the new ranks serve sequences
    # The old epoch's groups stay until the switch is confirmed (it could be undone till then).
    assert ex.collective_rpc("groups", ranks=[0]) == [
        [(0, "step"), (0, "transfer"), (1, "step"), (1, "transfer")]
    ]
    ex.collective_rpc("retire_previous", ranks=[0, 1, 2, 3])
    assert ex.collective_rpc("groups", ranks=[0]) == [[(1, "step"), (1, "transfer")]]

    mark("Shrink")
    # Shrink: experts leave ranks 2 and 3 first (staged), their sequences re-prefill on 0 and 1
    shrunk = moves_mod.rebalance_for_resize(
        load, grown, old_num_ranks=4, new_num_ranks=2, num_physical=num_physical
    )
    plan = moves_mod.plan_moves(grown, shrunk, old_num_ranks=4, new_num_ranks=2)
    while_stepping(
        run,
        ex.collective_rpc,
        "stage_experts",
        1,
        plan,
        shrunk,
        ranks=[0, 1, 2, 3],
        background=True,
        stage=2,
        per_rank={
            0: {"new_rank": 0},
            1: {"new_rank": 1},
            2: {"new_rank": None},
            3: {"new_rank": None},
        },
        new_num_ranks=2,
    )
    for seq_id, seq in run.seqs.items():
        if seq.rank >= 2:
            run.migrate(seq_id, seq.rank - 2)
    while_stepping(run, ex.build_groups, [0, 1], epoch=2)
    run.step()
    ex.switch([0, 1], epoch=2, placement=shrunk)
    print(f"switch 4->2: {ex.switcher.last}")
    assert ex.ranks == [0, 1] and ex.pending_ranks == [2, 3]
    infos = ex.remove_ranks([2, 3])
    assert [i["label"] for i in infos] == [2, 3] and all(i["pod"] for i in infos)
    assert ex.pending_ranks == []

    mark("finishing")
    assert not any(s.done for s in run.seqs.values())  # generation goes on at 2 ranks
    got = run.run()
    mark("done")
    assert [got[str(i)] for i in range(len(PROMPTS))] == reference


@pytest.mark.parametrize("step_mode", ["compiled", "remote"])
def test_killed_actor_is_reported_dead_and_survivors_recover(
    ray_executor_mod: Any, step_mode: str
) -> None:
    import ray

    # groups over TCPStore, as on Kubernetes
    ex = ray_executor_mod.RayExecutor(2, rendezvous="tcp", step_mode=step_mode)
    try:
        ex.start(SOURCE, placement=lockstep.identity(2))
        run = lockstep.Lockstep(ex)
        run.add("a", PROMPTS[0], rank=0, max_tokens=MAX_TOKENS)
        run.add("b", PROMPTS[1], rank=1, max_tokens=MAX_TOKENS)
        run.step()
        assert ex.check_health() == {0: "ok", 1: "ok"}
        ray.kill(ex.roster.member(1).handle.actor)
        deadline = time.monotonic() + 10
        health = ex.check_health(timeout=2.0)
        while health[1] == "ok" and time.monotonic() < deadline:
            health = ex.check_health(timeout=2.0)
        assert health == {0: "ok", 1: "dead"}
        started = time.monotonic()
        with pytest.raises(base.RankDied) as failed:
            run.step()
        assert failed.value.ranks == [1]
        print(f"\nstep on a dead rank failed in {time.monotonic() - started:.2f}s")

        # Recovery with the same primitives: drop the dead rank, rank 0 reads the experts it
        # lacks from the model source, new groups over the survivor, switch, generation goes on
        started = time.monotonic()
        (info,) = ex.remove_ranks([1])
        assert info["label"] == 1 and info["pod"]
        ex.build_groups([0], epoch=1)
        one = lockstep.identity(1)
        ex.collective_rpc(
            "stage_experts", 0, [], one, ranks=[0], new_rank=0, new_num_ranks=1, from_source=True
        )
        ex.switch([0], epoch=1, placement=one)
        print(f"recovered at 1 rank in {time.monotonic() - started:.2f}s")
        run.migrate("b", 0)
        run.to_free.pop(1, None)
        got = run.run()
        assert [got["a"], got["b"]] == generate.generate_greedy(SOURCE, PROMPTS[:2], MAX_TOKENS)
    finally:
        ex.shutdown()


def test_a_new_rank_lost_before_it_joins_fails_the_build_at_once(
    two_ranks: base.Executor, reference: list[list[int]]
) -> None:
    """A grow's new rank dies (its pod was lost) before the standby groups form: the build
    fails naming it (RankDied, not the TimeoutError of the 300 s group timeout), instead of
    holding the serving ranks' control lanes in a rendezvous until then, and those ranks take
    the next calls (a deadline far below the group timeout). How long it takes:
    bench/failures.py."""
    new = two_ranks.add_ranks(1, timeout=120)
    os.kill(int(two_ranks.rank_infos()[new[0]]["pid"]), signal.SIGKILL)
    with pytest.raises(base.RankDied) as info:
        two_ranks.build_groups([0, 1, *new], epoch=7, timeout=GROUP_TIMEOUT)
    assert info.value.ranks == new
    groups = two_ranks.collective_rpc(
        "groups", ranks=[0, 1], background=True, timeout=GROUP_TIMEOUT / 3
    )
    assert all(7 not in {epoch for epoch, _ in g} for g in groups), groups
    two_ranks.remove_ranks(new)
    run = lockstep.Lockstep(two_ranks)
    for i, prompt in enumerate(PROMPTS):
        run.add(f"n{i}", prompt, rank=i % 2, max_tokens=MAX_TOKENS)
    got = run.run()
    assert [got[f"n{i}"] for i in range(len(PROMPTS))] == reference
