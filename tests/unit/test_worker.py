"""RankWorker through the LocalExecutor: generation equals the single-process model at 1 and 2
ranks, seeded sampling is rank-independent, step errors are reported (never raised), and the
elastic primitives (add, groups, transfers, staging, switch, commit) work without Ray."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import base, local
from moe_runtime.model import generate
from moe_runtime.rank import sampling
from tests.support import faults, lockstep


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    torch.set_num_threads(1)
    return generate.generate_greedy(lockstep.SOURCE, lockstep.PROMPTS, 8)


Factory = Callable[[int], local.LocalExecutor]


@pytest.fixture
def executor_factory() -> Iterator[Factory]:
    """LocalExecutors with the fault hooks (`tests.support.faults`), shut down after the test."""
    made: list[local.LocalExecutor] = []

    def make(num_ranks: int) -> local.LocalExecutor:
        made.append(local.LocalExecutor(num_ranks, rank_hooks=faults.Faults))
        return made[-1]

    yield make
    for ex in made:
        ex.shutdown()


@pytest.mark.parametrize("num_ranks", [1, 2], ids=["1-rank", "2-ranks"])
def test_local_generation_equals_single_process(
    num_ranks: int, reference: list[list[int]], executor_factory: Factory
) -> None:
    ex = executor_factory(num_ranks)
    ex.start(lockstep.SOURCE, placement=lockstep.identity(num_ranks))
    run = lockstep.Lockstep(ex)
    for i, prompt in enumerate(lockstep.PROMPTS):
        run.add(str(i), prompt, rank=i % num_ranks, max_tokens=8)
    got = run.run()
    assert [got[str(i)] for i in range(len(lockstep.PROMPTS))] == reference


def test_expert_load_counts_routed_tokens(executor_factory: Factory) -> None:
    cfg = lockstep.config()
    ex = executor_factory(2)
    ex.start(lockstep.SOURCE, placement=lockstep.identity(2))
    run = lockstep.Lockstep(ex)
    run.add("a", lockstep.PROMPTS[0], rank=0, max_tokens=1)
    started = time.monotonic()
    outs = run.step()
    took = time.monotonic() - started
    # each rank's own time on the step, within the executor's call (the bench's `link`)
    assert all(0.0 < o.seconds <= took for o in outs), [o.seconds for o in outs]
    load = outs[0].expert_load
    assert tuple(load.shape) == (cfg.num_moe_layers, cfg.num_experts)
    assert load.sum(dim=1).tolist() == [len(lockstep.PROMPTS[0]) * cfg.top_k] * cfg.num_moe_layers
    assert outs[1].expert_load.sum().item() == 0  # the idle rank routed nothing


def test_seeded_sampling_is_the_same_on_rank_0_and_rank_1(
    executor_factory: Factory,
) -> None:
    sampling = step_mod.SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    tokens = []
    for rank in (0, 1):
        ex = executor_factory(2)
        ex.start(lockstep.SOURCE, placement=lockstep.identity(2))
        run = lockstep.Lockstep(ex)
        run.add("s", lockstep.PROMPTS[2], rank=rank, max_tokens=12, sampling=sampling)
        run.add("other", lockstep.PROMPTS[1], rank=1 - rank, max_tokens=3)
        tokens.append(run.run()["s"])
    assert tokens[0] == tokens[1]
    greedy = generate.generate_greedy(lockstep.SOURCE, [lockstep.PROMPTS[2]], 12)[0]
    assert tokens[0] != greedy  # it did sample


def test_sample_token_depends_only_on_seed_and_position() -> None:
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0))
    params = step_mod.SamplingParams(temperature=1.0, seed=7)
    first = [sampling.sample_token(logits, params, n) for n in range(20)]
    again = [sampling.sample_token(logits.clone(), params, n) for n in range(20)]
    assert first == again
    assert len(set(first)) > 5
    narrow = step_mod.SamplingParams(temperature=1.0, top_p=1e-6, seed=7)
    assert sampling.sample_token(logits, narrow, 3) == int(torch.argmax(logits))


def test_bad_sequence_is_reported_and_peers_keep_stepping(
    executor_factory: Factory,
) -> None:
    ex = executor_factory(2)
    ex.start(lockstep.SOURCE, placement=lockstep.identity(2))
    bad = step_mod.SeqWork("bad", [1, 99999], 0, lockstep.GREEDY)
    good = step_mod.SeqWork("good", lockstep.PROMPTS[0], 0, lockstep.GREEDY)
    step = step_mod.StepInput(
        0, {0: step_mod.RankBatch(seqs=[bad]), 1: step_mod.RankBatch(seqs=[good])}
    )
    outs = ex.execute_step(step)
    assert outs[0].error is not None and "bad" in outs[0].error
    assert outs[1].error is None and "good" in outs[1].tokens


def test_injected_step_failure_is_returned_not_raised(
    executor_factory: Factory,
) -> None:
    ex = executor_factory(1)
    ex.start(lockstep.SOURCE, placement=lockstep.identity(1))
    ex.collective_rpc("fail_next", "execute_step")
    outs = ex.execute_step(step_mod.StepInput(0, {}))
    assert outs[0].error is not None and "InjectedFailure" in outs[0].error
    assert ex.execute_step(step_mod.StepInput(1, {}))[0].error is None


def test_injected_transfer_failure_raises_executor_error(
    executor_factory: Factory,
) -> None:
    ex = executor_factory(1)
    ex.start(lockstep.SOURCE, placement=lockstep.identity(1))
    new = ex.add_ranks(1)
    ex.collective_rpc(
        "load_weights",
        ranks=new,
        source=lockstep.SOURCE,
        rank=1,
        num_ranks=2,
        placement=None,
        placeholder=True,
    )
    ex.build_groups([0, *new], epoch=1)
    ex.collective_rpc("fail_next", "transfer_non_expert", ranks=new)
    with pytest.raises(base.ExecutorError, match="rank 1"):
        ex.collective_rpc("transfer_non_expert", 1, ranks=[0, *new], src_ranks=[0], dst_ranks=new)


def test_local_grow_then_shrink_keeps_tokens(
    reference: list[list[int]], executor_factory: Factory
) -> None:
    """1 -> 2 -> 1 ranks mid-generation with the resize primitives; tokens are unchanged."""
    ex = executor_factory(1)
    old = lockstep.identity(1)
    ex.start(lockstep.SOURCE, placement=old)
    run = lockstep.Lockstep(ex)
    for i, prompt in enumerate(lockstep.PROMPTS):
        run.add(str(i), prompt, rank=0, max_tokens=8)
    for _ in range(3):
        run.step()
    # grow: new rank with placeholders, groups, non-expert copy, expert staging, switch
    (new_rank,) = ex.add_ranks(1)
    ex.collective_rpc(
        "load_weights",
        ranks=[new_rank],
        source=lockstep.SOURCE,
        rank=1,
        num_ranks=2,
        placement=None,
        placeholder=True,
    )
    ex.build_groups([0, new_rank], epoch=1)
    run.step()  # still serving on epoch 0
    received = ex.collective_rpc(
        "transfer_non_expert", 1, ranks=[0, new_rank], src_ranks=[0], dst_ranks=[new_rank]
    )
    assert received[0] == 0 and received[1] > 0
    grown = lockstep.identity(2)
    plan = moves_mod.plan_moves(old, grown, old_num_ranks=1, new_num_ranks=2)
    ex.collective_rpc(
        "stage_experts",
        1,
        plan,
        grown,
        ranks=[0, new_rank],
        per_rank={0: {"new_rank": 0}, new_rank: {"new_rank": 1}},
        new_num_ranks=2,
    )
    run.step()
    ex.switch([0, new_rank], epoch=1, placement=grown)
    assert ex.ranks == [0, 1]
    run.migrate("1", 1)
    run.migrate("3", 1)
    run.step()
    # shrink: experts leave rank 1 first, its sequences re-prefill on rank 0, then switch
    shrunk = lockstep.identity(1)
    plan = moves_mod.plan_moves(grown, shrunk, old_num_ranks=2, new_num_ranks=1)
    ex.collective_rpc(
        "stage_experts",
        1,
        plan,
        shrunk,
        ranks=[0, 1],
        stage=2,
        per_rank={0: {"new_rank": 0}, 1: {"new_rank": None}},
        new_num_ranks=1,
    )
    run.migrate("1", 0)
    run.migrate("3", 0)
    ex.build_groups([0], epoch=2)
    run.step()
    ex.switch([0], epoch=2, placement=shrunk)
    infos = ex.remove_ranks([1])
    assert len(infos) == 1 and infos[0]["pod"]
    got = run.run()
    assert [got[str(i)] for i in range(len(lockstep.PROMPTS))] == reference


def test_rebalance_commits_at_a_step_boundary(
    reference: list[list[int]], executor_factory: Factory
) -> None:
    """EPLB on a fixed set of ranks: stage a new placement, commit it via StepInput.control."""
    cfg = lockstep.config()
    ex = executor_factory(2)
    old = lockstep.identity(2, cfg.num_experts + 2)
    ex.start(lockstep.SOURCE, placement=old)
    run = lockstep.Lockstep(ex)
    for i, prompt in enumerate(lockstep.PROMPTS):
        run.add(str(i), prompt, rank=i % 2, max_tokens=8)
    outs = run.step()
    load = sum(o.expert_load for o in outs)
    new = moves_mod.rebalance_for_resize(
        load, old, old_num_ranks=2, new_num_ranks=2, num_physical=cfg.num_experts + 2
    )
    plan = moves_mod.plan_moves(old, new, old_num_ranks=2, new_num_ranks=2)
    ex.collective_rpc(
        "stage_experts",
        0,
        plan,
        new,
        background=True,
        stage=5,
        per_rank={0: {"new_rank": 0}, 1: {"new_rank": 1}},
        new_num_ranks=2,
    )
    run.step(control={step_mod.CONTROL_EXPERT_EPOCH: 5})
    assert ex.worker(0).slots.placement is not None and ex.worker(0).slots.placement.equals(new)
    got = run.run()
    assert [got[str(i)] for i in range(len(lockstep.PROMPTS))] == reference


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param("nothing-staged", id="one-rank-staged-nothing"),
        pytest.param("vote-no", id="one-rank-fails-to-commit"),
    ],
)
def test_a_commit_one_rank_cannot_make_is_made_by_none(
    failure: str, executor_factory: Factory
) -> None:
    """The EPLB commit is voted on: when rank 1 cannot commit, rank 0 keeps the old placement
    too, both discard what they staged, and the step's batch still runs (no hang)."""
    cfg = lockstep.config()
    ex = executor_factory(2)
    old = lockstep.identity(2, cfg.num_experts + 2)
    ex.start(lockstep.SOURCE, placement=old)
    new = policy.Placement.from_phy2log(old.phy2log.flip(1), cfg.num_experts)
    plan = moves_mod.plan_moves(old, new, old_num_ranks=2, new_num_ranks=2)
    ranks = [0] if failure == "nothing-staged" else [0, 1]
    if failure == "vote-no":
        ex.collective_rpc("fail_next", "commit_staged", ranks=[1])
    ex.collective_rpc(
        "stage_experts",
        0,
        plan if len(ranks) == 2 else [],
        new if len(ranks) == 2 else old,
        ranks=ranks,
        background=True,
        per_rank={0: {"new_rank": 0}, 1: {"new_rank": 1}},
        new_num_ranks=2,
        stage=9,
    )
    work = step_mod.SeqWork("a", lockstep.PROMPTS[0], 0, lockstep.GREEDY)
    step = step_mod.StepInput(
        0, {0: step_mod.RankBatch(seqs=[work])}, {step_mod.CONTROL_EXPERT_EPOCH: 9}
    )
    outs = ex.execute_step(step)
    assert [o.committed for o in outs] == [None, None]
    assert outs[0].error is None and "a" in outs[0].tokens
    for r in (0, 1):
        w = ex.worker(r)
        assert w.slots.placement is not None and w.slots.placement.equals(old)
        assert w.slots.staged is None


def test_a_commit_every_rank_makes_can_be_reverted_until_retired(
    reference: list[list[int]], executor_factory: Factory
) -> None:
    cfg = lockstep.config()
    ex = executor_factory(2)
    old = lockstep.identity(2, cfg.num_experts + 2)
    ex.start(lockstep.SOURCE, placement=old)
    new = policy.Placement.from_phy2log(old.phy2log.flip(1), cfg.num_experts)
    plan = moves_mod.plan_moves(old, new, old_num_ranks=2, new_num_ranks=2)
    ex.collective_rpc(
        "stage_experts",
        0,
        plan,
        new,
        background=True,
        per_rank={0: {"new_rank": 0}, 1: {"new_rank": 1}},
        new_num_ranks=2,
        stage=7,
    )
    outs = ex.execute_step(step_mod.StepInput(0, {}, {step_mod.CONTROL_EXPERT_EPOCH: 7}))
    assert [o.committed for o in outs] == [7, 7]
    assert ex.collective_rpc("revert", 7) == [True, True]
    assert all(ex.worker(r).slots.placement.equals(old) for r in (0, 1))  # type: ignore[union-attr]
    assert ex.collective_rpc("revert", 7) == [False, False]  # nothing left to undo
    run = lockstep.Lockstep(ex)
    for i, prompt in enumerate(lockstep.PROMPTS):
        run.add(str(i), prompt, rank=i % 2, max_tokens=8)
    got = run.run()
    assert [got[str(i)] for i in range(len(lockstep.PROMPTS))] == reference


def test_failed_forward_leaves_kv_as_before_so_the_step_can_be_retried(
    reference: list[list[int]], executor_factory: Factory
) -> None:
    ex = executor_factory(1)
    ex.start(lockstep.SOURCE, placement=lockstep.identity(1))
    worker = ex.worker(0)
    run = lockstep.Lockstep(ex)
    run.add("0", lockstep.PROMPTS[0], rank=0, max_tokens=4)
    run.step()
    backend = worker.slots.backend
    assert backend is not None

    def broken(layer: int, *args: torch.Tensor) -> torch.Tensor:
        if layer == 2:
            raise RuntimeError("peer lost")
        return backend(layer, *args)

    worker.slots.backend = broken
    with pytest.raises(AssertionError, match="peer lost"):
        run.step()
    worker.slots.backend = backend
    assert run.run()["0"] == reference[0][:4]


def test_group_whose_member_never_comes_fails_at_its_timeout_naming_it(
    executor_factory: Factory,
) -> None:
    """The join ends with the group's own timeout (the call has none) and names the member
    that never came; the ranks keep no group of it and step on."""
    ex = executor_factory(2)
    ex.start(lockstep.SOURCE, placement=lockstep.identity(2))
    spec = group_mod.GroupSpec.local(3, epoch=1)  # a third member never joins
    with pytest.raises(base.ExecutorError, match=r"members \[2\] did not join"):
        ex.collective_rpc(
            "join_group", spec, per_rank={0: {"rank": 0}, 1: {"rank": 1}}, group_timeout=1.0
        )
    assert ex.collective_rpc("groups") == [[(0, "step"), (0, "transfer")]] * 2
    assert all(o.error is None for o in ex.execute_step(step_mod.StepInput(0, {})))


def test_a_batch_is_sampled_as_each_row_alone() -> None:
    """The batch sampler gives every row the token that row gets alone (greedy and seeded rows
    mixed; one host read for the batch)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g) * 3
    params = [
        step_mod.SamplingParams(temperature=t, top_p=p, seed=s)
        for t, p, s in [(0.0, 1.0, None), (0.8, 0.9, 1), (1.0, 1.0, 2), (0.0, 0.5, 3),
                        (1.3, 0.3, 4), (0.7, 1.0, 5)]
    ]  # fmt: skip
    counts = [0, 3, 7, 1, 2, 9]
    batch = sampling.sample(logits, params, counts)
    alone = [sampling.sample_token(logits[i], params[i], counts[i]) for i in range(6)]
    assert batch == alone
    assert batch[0] == int(torch.argmax(logits[0])) and batch[3] == int(torch.argmax(logits[3]))


def test_a_placeholder_takes_the_token_the_rank_sampled_in_its_last_step(
    reference: list[list[int]], executor_factory: Factory
) -> None:
    # Two steps in flight (docs/ENGINE.md): the engine sends a decode before the last step's
    # token came back; the rank fills it. A step that failed leaves nothing to fill.
    ex = executor_factory(1)
    ex.start(lockstep.SOURCE, placement=lockstep.identity(1))
    prompt = lockstep.PROMPTS[0]

    def step(step_id: int, work: step_mod.SeqWork) -> step_mod.StepOutput:
        return ex.execute_step(step_mod.StepInput(step_id, {0: step_mod.RankBatch(seqs=[work])}))[0]

    tokens = [step(1, step_mod.SeqWork("s", prompt, 0, lockstep.GREEDY)).tokens["s"]]
    for i in range(1, 8):
        work = step_mod.SeqWork(
            "s", [step_mod.PLACEHOLDER], len(prompt) + i - 1, lockstep.GREEDY, i
        )
        tokens.append(step(i + 1, work).tokens["s"])
    assert tokens == reference[0]
    ex.collective_rpc("fail_next", "execute_step")
    pos = len(prompt) + 7
    assert step(9, step_mod.SeqWork("s", [step_mod.PLACEHOLDER], pos, lockstep.GREEDY, 8)).error
    out = step(10, step_mod.SeqWork("s", [step_mod.PLACEHOLDER], pos, lockstep.GREEDY, 8))
    assert out.error is not None and "placeholder" in out.error and not out.tokens
