"""RankWorker through the LocalExecutor: generation equals the single-process model at 1 and 2
ranks, seeded sampling is rank-independent, step errors are reported (never raised), and the
elastic primitives (add, groups, transfers, staging, switch, commit) work without Ray."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from moe_runtime import sampling
from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import base, local
from moe_runtime.model import config as config_mod
from moe_runtime.model import generate
from moe_runtime.model import source as source_mod

SOURCE = "synthetic://tiny?seed=0"
PROMPTS = [[1, 5, 9, 23, 44], [1, 7, 7, 7], [1, 100, 200, 300, 400, 12], [1, 3]]
GREEDY = step_mod.SamplingParams()


@dataclasses.dataclass
class Seq:
    prompt: list[int]
    rank: int
    sampling: step_mod.SamplingParams
    max_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)
    in_kv: int = 0

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_tokens


class Lockstep:
    """A minimal engine: every step runs each unfinished sequence's new tokens on its rank."""

    def __init__(self, executor: base.Executor) -> None:
        self.executor = executor
        self.seqs: dict[str, Seq] = {}
        self.step_id = 0
        self.to_free: dict[int, list[str]] = {}

    def add(
        self,
        seq_id: str,
        prompt: list[int],
        *,
        rank: int,
        max_tokens: int,
        sampling: step_mod.SamplingParams = GREEDY,
    ) -> None:
        self.seqs[seq_id] = Seq(list(prompt), rank, sampling, max_tokens)

    def migrate(self, seq_id: str, rank: int) -> None:
        """Move a sequence to another rank: free it there, re-prefill prompt + generated."""
        seq = self.seqs[seq_id]
        self.to_free.setdefault(seq.rank, []).append(seq_id)
        seq.rank, seq.in_kv = rank, 0

    def step(self, control: dict[str, int] | None = None) -> list[step_mod.StepOutput]:
        batches: dict[int, step_mod.RankBatch] = {}
        for rank, ids in self.to_free.items():
            batches.setdefault(rank, step_mod.RankBatch()).free.extend(ids)
        self.to_free = {}
        for seq_id, seq in self.seqs.items():
            if seq.done:
                continue
            tokens = (seq.prompt + seq.generated)[seq.in_kv :]
            work = step_mod.SeqWork(seq_id, tokens, seq.in_kv, seq.sampling, len(seq.generated))
            batches.setdefault(seq.rank, step_mod.RankBatch()).seqs.append(work)
        step = step_mod.StepInput(self.step_id, batches, dict(control or {}))
        self.step_id += 1
        outs = self.executor.execute_step(step)
        for out in outs:
            assert out.error is None, f"rank {out.rank}: {out.error}"
            for seq_id, token in out.tokens.items():
                seq = self.seqs[seq_id]
                seq.in_kv = len(seq.prompt) + len(seq.generated)
                seq.generated.append(token)
                if seq.done:
                    self.to_free.setdefault(seq.rank, []).append(seq_id)
        return outs

    def run(self) -> dict[str, list[int]]:
        while not all(s.done for s in self.seqs.values()):
            self.step()
        return {k: s.generated for k, s in self.seqs.items()}


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    torch.set_num_threads(1)
    return generate.generate_greedy(SOURCE, PROMPTS, 8)


def _config() -> config_mod.ModelConfig:
    return source_mod.open_source(SOURCE).config


def identity(num_ranks: int, num_physical: int | None = None) -> policy.Placement:
    cfg = _config()
    phys = num_physical or cfg.num_experts
    return policy.identity(cfg.num_layers, cfg.num_experts, phys, num_ranks)


@pytest.fixture
def executor_factory() -> Iterator[type[local.LocalExecutor]]:
    made: list[local.LocalExecutor] = []

    class Made(local.LocalExecutor):
        def __init__(self, num_ranks: int) -> None:
            super().__init__(num_ranks)
            made.append(self)

    yield Made
    for ex in made:
        ex.shutdown()


@pytest.mark.parametrize("num_ranks", [1, 2], ids=["1-rank", "2-ranks"])
def test_local_generation_equals_single_process(
    num_ranks: int, reference: list[list[int]], executor_factory: type[local.LocalExecutor]
) -> None:
    ex = executor_factory(num_ranks)
    ex.start(SOURCE, placement=identity(num_ranks))
    run = Lockstep(ex)
    for i, prompt in enumerate(PROMPTS):
        run.add(str(i), prompt, rank=i % num_ranks, max_tokens=8)
    got = run.run()
    assert [got[str(i)] for i in range(len(PROMPTS))] == reference


def test_expert_load_counts_routed_tokens(executor_factory: type[local.LocalExecutor]) -> None:
    cfg = _config()
    ex = executor_factory(2)
    ex.start(SOURCE, placement=identity(2))
    run = Lockstep(ex)
    run.add("a", PROMPTS[0], rank=0, max_tokens=1)
    outs = run.step()
    load = outs[0].expert_load
    assert tuple(load.shape) == (cfg.num_layers, cfg.num_experts)
    assert load.sum(dim=1).tolist() == [len(PROMPTS[0]) * cfg.top_k] * cfg.num_layers
    assert outs[1].expert_load.sum().item() == 0  # the idle rank routed nothing


def test_seeded_sampling_is_the_same_on_rank_0_and_rank_1(
    executor_factory: type[local.LocalExecutor],
) -> None:
    sampling = step_mod.SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    tokens = []
    for rank in (0, 1):
        ex = executor_factory(2)
        ex.start(SOURCE, placement=identity(2))
        run = Lockstep(ex)
        run.add("s", PROMPTS[2], rank=rank, max_tokens=12, sampling=sampling)
        run.add("other", PROMPTS[1], rank=1 - rank, max_tokens=3)
        tokens.append(run.run()["s"])
    assert tokens[0] == tokens[1]
    greedy = generate.generate_greedy(SOURCE, [PROMPTS[2]], 12)[0]
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
    executor_factory: type[local.LocalExecutor],
) -> None:
    ex = executor_factory(2)
    ex.start(SOURCE, placement=identity(2))
    bad = step_mod.SeqWork("bad", [1, 99999], 0, GREEDY)
    good = step_mod.SeqWork("good", PROMPTS[0], 0, GREEDY)
    step = step_mod.StepInput(
        0, {0: step_mod.RankBatch(seqs=[bad]), 1: step_mod.RankBatch(seqs=[good])}
    )
    outs = ex.execute_step(step)
    assert outs[0].error is not None and "bad" in outs[0].error
    assert outs[1].error is None and "good" in outs[1].tokens


def test_injected_step_failure_is_returned_not_raised(
    executor_factory: type[local.LocalExecutor],
) -> None:
    ex = executor_factory(1)
    ex.start(SOURCE, placement=identity(1))
    ex.collective_rpc("fail_next", "execute_step")
    outs = ex.execute_step(step_mod.StepInput(0, {}))
    assert outs[0].error is not None and "InjectedFailure" in outs[0].error
    assert ex.execute_step(step_mod.StepInput(1, {}))[0].error is None


def test_injected_transfer_failure_raises_executor_error(
    executor_factory: type[local.LocalExecutor],
) -> None:
    ex = executor_factory(1)
    ex.start(SOURCE, placement=identity(1))
    new = ex.add_ranks(1)
    ex.collective_rpc(
        "load_weights",
        ranks=new,
        source=SOURCE,
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
    reference: list[list[int]], executor_factory: type[local.LocalExecutor]
) -> None:
    """1 -> 2 -> 1 ranks mid-generation with the resize primitives; tokens are unchanged."""
    ex = executor_factory(1)
    old = identity(1)
    ex.start(SOURCE, placement=old)
    run = Lockstep(ex)
    for i, prompt in enumerate(PROMPTS):
        run.add(str(i), prompt, rank=0, max_tokens=8)
    for _ in range(3):
        run.step()
    # grow: new rank with placeholders, groups, non-expert copy, expert staging, switch
    (new_rank,) = ex.add_ranks(1)
    ex.collective_rpc(
        "load_weights",
        ranks=[new_rank],
        source=SOURCE,
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
    grown = identity(2)
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
    shrunk = identity(1)
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
    assert [got[str(i)] for i in range(len(PROMPTS))] == reference


def test_rebalance_commits_at_a_step_boundary(
    reference: list[list[int]], executor_factory: type[local.LocalExecutor]
) -> None:
    """EPLB on a fixed set of ranks: stage a new placement, commit it via StepInput.control."""
    cfg = _config()
    ex = executor_factory(2)
    old = identity(2, cfg.num_experts + 2)
    ex.start(SOURCE, placement=old)
    run = Lockstep(ex)
    for i, prompt in enumerate(PROMPTS):
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
    assert ex.worker(0).placement is not None and ex.worker(0).placement.equals(new)
    got = run.run()
    assert [got[str(i)] for i in range(len(PROMPTS))] == reference


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param("nothing-staged", id="one-rank-staged-nothing"),
        pytest.param("vote-no", id="one-rank-fails-to-commit"),
    ],
)
def test_a_commit_one_rank_cannot_make_is_made_by_none(
    failure: str, executor_factory: type[local.LocalExecutor]
) -> None:
    """The EPLB commit is voted on: when rank 1 cannot commit, rank 0 keeps the old placement
    too, both discard what they staged, and the step's batch still runs (no hang)."""
    cfg = _config()
    ex = executor_factory(2)
    old = identity(2, cfg.num_experts + 2)
    ex.start(SOURCE, placement=old)
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
    work = step_mod.SeqWork("a", PROMPTS[0], 0, GREEDY)
    step = step_mod.StepInput(
        0, {0: step_mod.RankBatch(seqs=[work])}, {step_mod.CONTROL_EXPERT_EPOCH: 9}
    )
    outs = ex.execute_step(step)
    assert [o.committed for o in outs] == [None, None]
    assert outs[0].error is None and "a" in outs[0].tokens
    for r in (0, 1):
        w = ex.worker(r)
        assert w.placement is not None and w.placement.equals(old) and w._staged is None


def test_a_commit_every_rank_makes_can_be_reverted_until_retired(
    reference: list[list[int]], executor_factory: type[local.LocalExecutor]
) -> None:
    cfg = _config()
    ex = executor_factory(2)
    old = identity(2, cfg.num_experts + 2)
    ex.start(SOURCE, placement=old)
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
    assert all(ex.worker(r).placement.equals(old) for r in (0, 1))  # type: ignore[union-attr]
    assert ex.collective_rpc("revert", 7) == [False, False]  # nothing left to undo
    run = Lockstep(ex)
    for i, prompt in enumerate(PROMPTS):
        run.add(str(i), prompt, rank=i % 2, max_tokens=8)
    got = run.run()
    assert [got[str(i)] for i in range(len(PROMPTS))] == reference


def test_failed_forward_leaves_kv_as_before_so_the_step_can_be_retried(
    reference: list[list[int]], executor_factory: type[local.LocalExecutor]
) -> None:
    ex = executor_factory(1)
    ex.start(SOURCE, placement=identity(1))
    worker = ex.worker(0)
    run = Lockstep(ex)
    run.add("0", PROMPTS[0], rank=0, max_tokens=4)
    run.step()
    backend = worker._backend
    assert backend is not None

    def broken(layer: int, *args: torch.Tensor) -> torch.Tensor:
        if layer == 2:
            raise RuntimeError("peer lost")
        return backend(layer, *args)

    worker._backend = broken
    with pytest.raises(AssertionError, match="peer lost"):
        run.step()
    worker._backend = backend
    assert run.run()["0"] == reference[0][:4]


def test_group_whose_member_never_comes_fails_within_its_timeout(
    executor_factory: type[local.LocalExecutor],
) -> None:
    ex = executor_factory(2)
    ex.start(SOURCE, placement=identity(2))
    spec = group_mod.GroupSpec.local(3, epoch=1)  # a third member never joins
    started = time.monotonic()
    with pytest.raises(base.ExecutorError):
        ex.collective_rpc(
            "join_group", spec, per_rank={0: {"rank": 0}, 1: {"rank": 1}}, group_timeout=1.0
        )
    assert time.monotonic() - started < 30
    assert ex.collective_rpc("groups") == [[(0, "step"), (0, "transfer")]] * 2
    assert all(o.error is None for o in ex.execute_step(step_mod.StepInput(0, {})))
