"""A prefill step goes through a DP rank's pipeline stages as micro-batches
(`pipeline_group.micro_batches`, `split`; docs/PIPELINE-PARALLEL.md, "Micro-batches"): the
leader (stage 0, a `RankWorker`) sends micro-batch i to stage 1 and runs micro-batch i + 1
meanwhile. Over a real stage worker (in this process): the answers are transformers' and
those of the same steps sent whole, the prefill went as P micro-batches and the decodes whole;
the split is the same on every DP rank (each micro-batch is one round of the stages' expert
collectives)."""

from __future__ import annotations

import pathlib
import threading
from typing import Any

import pytest
import torch
import transformers

from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import policy
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import source as source_mod
from moe_runtime.rank import groups as groups_mod
from moe_runtime.rank import pipeline_group, stage_worker, worker
from tests.support import checkpoints

PROMPTS = [[1, 5, 9, 200, 3, 7, 11, 13], [1, 7, 2], [1, *range(40, 58)], [3, 4, 250, 6, 8]]
NEW_TOKENS = 6
GREEDY = step_mod.SamplingParams(temperature=0.0)


class _ChainedStages:
    """`pipeline_group.Stages` over `StageWorker`s in this process, recording each chain's
    sequences (calls run at once, in order)."""

    def __init__(self, workers: list[stage_worker.StageWorker]) -> None:
        self.workers = workers
        self.chains: list[list[str]] = []

    def send(self, method: str, *args: Any) -> list[Any]:
        return [getattr(w, method)(*args) for w in self.workers]

    def chain(
        self, epoch: int, frees: Any, batch: Any, hidden: Any, live: Any, sample: Any = None
    ) -> list[Any]:
        self.chains.append(list(batch.seq_ids))
        answers, prev = [], hidden
        for w in self.workers:
            prev = w.step(epoch, frees, batch, prev, live)
            answers.append(prev)
        return answers

    def wait(self, pending: Any, timeout: float | None) -> list[Any]:
        return list(pending)

    def alive(self) -> str | None:
        return None

    def abort(self, reason: str) -> None:
        for w in self.workers:
            w.abort(reason)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("mixtral")
    checkpoints.build(path)
    return path


def _leader(
    model_dir: pathlib.Path, stages: Any, size: int, micro_batch_tokens: int | None = None
) -> worker.RankWorker:
    """A `RankWorker` leading `stages` at pipeline size `size`, loaded from `model_dir`,
    serving alone (DP = 1, epoch 1)."""
    lead = worker.RankWorker(
        device="cpu",
        dtype="float32",
        pipeline=stages,
        pipeline_size=size,
        pipeline_micro_batch_tokens=micro_batch_tokens,
    )
    cfg = source_mod.open_source(str(model_dir)).config
    one = policy.identity(cfg.num_moe_layers, cfg.num_experts, cfg.num_experts, 1)
    lead.load_weights(source=str(model_dir), rank=0, num_ranks=1, placement=one)
    lead.groups.join_group(group_mod.GroupSpec.local(1, epoch=1), 0, role=groups_mod.STEP)
    lead.slots.activate(1, rank=0, num_ranks=1, placement=one)
    return lead


def _serve(model_dir: pathlib.Path, micro_batch_tokens: int) -> tuple[list[list[int]], Any]:
    """Greedy answers of `PROMPTS` from one DP rank at P = 2 (all prompts in one prefill step,
    then one decode step per token, each decode's token a placeholder the rank fills), and the
    stages' record of chains."""
    stages = _ChainedStages([stage_worker.StageWorker(stage=1, size=2, device="cpu")])
    lead = _leader(model_dir, stages, 2, micro_batch_tokens)
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    works = [step_mod.SeqWork(s, p, 0, GREEDY) for s, p in zip(ids, PROMPTS, strict=True)]
    answers: list[list[int]] = [[] for _ in PROMPTS]
    for n in range(NEW_TOKENS):
        out = lead.execute_step(step_mod.StepInput(n + 1, {0: step_mod.RankBatch(seqs=works)}))
        assert out.error is None, out.error
        for i, s in enumerate(ids):
            answers[i].append(out.tokens[s])
        works = [
            step_mod.SeqWork(s, [step_mod.PLACEHOLDER], len(p) + n, GREEDY, n + 1)
            for s, p in zip(ids, PROMPTS, strict=True)
        ]
    lead.shutdown()
    return answers, stages


def test_a_prefill_goes_as_micro_batches_and_the_answers_stay_transformers(
    model_dir: pathlib.Path,
) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
        )
        want.append(out[0, len(prompt) :].tolist())
    prefill = sum(len(p) for p in PROMPTS)  # 34 new tokens in the first step

    split, split_stages = _serve(model_dir, micro_batch_tokens=prefill)
    whole, whole_stages = _serve(model_dir, micro_batch_tokens=0)
    assert split == whole == want
    # the prefill as two micro-batches of whole sequences, about half the tokens each; the
    # decodes (4 new tokens each) whole
    assert split_stages.chains[:2] == [["s0", "s1"], ["s2", "s3"]]
    assert split_stages.chains[2:] == [["s0", "s1", "s2", "s3"]] * (NEW_TOKENS - 1)
    assert whole_stages.chains == [["s0", "s1", "s2", "s3"]] * NEW_TOKENS


def test_every_dp_rank_splits_a_step_into_as_many_micro_batches() -> None:
    # from every DP rank's batch (each rank sees all of them): P micro-batches once the
    # busiest rank has the threshold's tokens, never more than its most sequences
    assert pipeline_group.micro_batches(2, [[40, 30], []], 64) == 2
    assert pipeline_group.micro_batches(2, [[1, 1], [30]], 64) == 1  # decodes: whole
    assert pipeline_group.micro_batches(4, [[300], [1, 1]], 64) == 2  # no more than 2 seqs
    assert pipeline_group.micro_batches(2, [[400]], 0) == 1  # switched off
    assert pipeline_group.micro_batches(1, [[400, 400]], 64) == 1  # no stages
    # a rank with fewer sequences than micro-batches runs empty ones (its stages' rounds)
    batch = kv_mod.ForwardBatch(seq_ids=["a"], token_ids=[[1, 2]], start_pos=[0])
    parts = pipeline_group.split(batch, 2)
    assert [p.seq_ids for p in parts] == [["a"], []]
    assert [p.seq_ids for p in pipeline_group.split(kv_mod.ForwardBatch.empty(), 3)] == [[]] * 3
    many = kv_mod.ForwardBatch(
        seq_ids=list("abcde"), token_ids=[[1] * n for n in (10, 10, 10, 5, 5)], start_pos=[0] * 5
    )
    assert [p.seq_ids for p in pipeline_group.split(many, 2)] == [["a", "b"], ["c", "d", "e"]]


class _Recorded:
    """Stages that record each chain's (frees, sequences) and answer zero logits."""

    def __init__(self) -> None:
        self.chains: list[tuple[list[str], list[str]]] = []

    def chain(
        self, epoch: int, frees: Any, batch: Any, hidden: Any, live: Any, sample: Any = None
    ) -> list[Any]:
        self.chains.append((list(frees), list(batch.seq_ids)))
        return [{"out": torch.zeros(len(batch.seq_ids), 4), "loads": []}]

    def wait(self, pending: Any, timeout: float | None) -> list[Any]:
        return list(pending)

    def alive(self) -> str | None:
        return None

    def abort(self, reason: str) -> None:
        pass


class _Model:
    device = torch.device("cpu")

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def forward(self, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("stage 0 failed")
        return torch.zeros(sum(len(t) for t in batch.token_ids), 4)


def test_kv_frees_go_with_the_first_micro_batch_and_wait_when_stage_0_fails() -> None:
    stages = _Recorded()
    lead = pipeline_group.PipelineLeader(stages, size=2, device="cpu")
    batch = kv_mod.ForwardBatch(
        seq_ids=["a", "b"], token_ids=[[1] * 300, [2] * 300], start_pos=[0, 0]
    )
    step = dict(epoch=1, token=(1, 1, 0, 1), placement=None, expert_load=torch.zeros(1, 1))
    lead.free(["gone"])
    with pytest.raises(RuntimeError, match="stage 0 failed"):
        lead.send(_Model(fail=True), batch, None, None, parts=2, **step)
    assert stages.chains == []  # nothing sent: the frees wait for the next forward pass
    logits = lead.receive(lead.send(_Model(fail=False), batch, None, None, parts=2, **step))
    assert stages.chains == [(["gone"], ["a"]), ([], ["b"])]
    assert logits.shape == (2, 4)


@pytest.mark.parametrize("size", [2, 3], ids=["pp2", "pp3"])
def test_interleaved_steps_of_p_sets_answer_as_transformers(
    model_dir: pathlib.Path, size: int
) -> None:
    """`--pipeline-interleave` on the leader (`Stepper.begin`/`end`): the engine's order with
    P sets of sequences and P steps in flight (begin N + P - 1 before N ends, each set's
    next step begun once its last one ended, with real tokens): every answer is
    transformers', each step after the first began while the one before was not ended
    (`overlapped`), and a step that fills a placeholder waits for the steps begun before it
    to end (it needs their tokens)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = [
        hf.generate(
            torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
        )[0, len(p) :]
        for p in PROMPTS
    ]
    stages = _ChainedStages(
        [stage_worker.StageWorker(stage=s, size=size, device="cpu") for s in range(1, size)]
    )
    lead = _leader(model_dir, stages, size)
    # P sets, P steps in flight (the engine's with `RayExecutor.step_groups` = P)
    sets = [[0, 1], [2, 3]] if size == 2 else [[0], [1, 2], [3]]
    answers: list[list[int]] = [[] for _ in PROMPTS]

    def work(i: int) -> step_mod.SeqWork:
        n = len(answers[i])
        ids = PROMPTS[i] if n == 0 else [answers[i][-1]]
        start = 0 if n == 0 else len(PROMPTS[i]) + n - 1
        return step_mod.SeqWork(f"s{i}", ids, start, GREEDY, n)

    def begin(step_id: int, seqs: list[step_mod.SeqWork]) -> None:
        lead.stepper.begin(step_mod.StepInput(step_id, {0: step_mod.RankBatch(seqs=seqs)}))

    stepper, k = lead.stepper, len(sets)
    for step_id in range(1, k):
        begin(step_id, [work(i) for i in sets[step_id - 1]])
    overlapped = []
    steps = k * NEW_TOKENS
    for step_id in range(k, steps + k):
        if step_id <= steps:  # each set's next step once its last one ended
            begin(step_id, [work(i) for i in sets[(step_id - 1) % k]])
        out = stepper.end(step_id - k + 1)
        assert out.error is None, out.error
        overlapped.append(out.overlapped)
        for seq_id, token in out.tokens.items():
            answers[int(seq_id[1:])].append(token)
    assert answers == [w.tolist() for w in want]
    # every step but the first began while an earlier one was in the later stages
    assert overlapped == [False] + [True] * (steps - 1)

    # a placeholder of a step not ended yet: its begin waits for that end
    begin(100, [work(0)])
    filled = step_mod.SeqWork("s0", [step_mod.PLACEHOLDER], len(PROMPTS[0]) + NEW_TOKENS, GREEDY, 7)
    waiter = threading.Thread(target=begin, args=(101, [filled]))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # waits for step 100's tokens
    sampled = stepper.end(100).tokens["s0"]
    waiter.join(30)
    assert not waiter.is_alive()
    out = stepper.end(101)
    assert out.error is None and not out.overlapped, out
    want_next = hf.generate(
        torch.tensor([PROMPTS[0]]),
        max_new_tokens=NEW_TOKENS + 2,
        do_sample=False,
        min_new_tokens=NEW_TOKENS + 2,
    )[0, len(PROMPTS[0]) :].tolist()
    assert [sampled, out.tokens["s0"]] == want_next[NEW_TOKENS:]
    lead.shutdown()


class _SampledStages(_ChainedStages):
    """`_ChainedStages` whose last stage samples when the leader asks (`Stepper.start`), as
    its graph node does (`ray_pipeline._sampled`); its answers, one per micro-batch, kept as
    the step graph's lanes would bring them to the driver (`lanes`)."""

    def __init__(self, workers: list[stage_worker.StageWorker]) -> None:
        super().__init__(workers)
        self.answers: list[dict[str, Any]] = []

    def chain(
        self, epoch: int, frees: Any, batch: Any, hidden: Any, live: Any, sample: Any = None
    ) -> list[Any]:
        from moe_runtime.executor import ray_pipeline

        answers = super().chain(epoch, frees, batch, hidden, live)
        assert sample is not None, "a started step's last stage samples"
        self.answers.append(ray_pipeline._sampled(answers[-1], batch.seq_ids, sample))
        return []  # the leader never waits for them

    def lanes(self, step_id: int, count: int) -> list[Any]:
        from moe_runtime.executor import ray_pipeline

        taken, self.answers = self.answers, []
        lanes = [
            ray_pipeline.StageLane(step_id, k, answer=a, reads=a["reads"])
            for k, a in enumerate(taken)
        ]
        return lanes + [ray_pipeline.StageLane(step_id, k) for k in range(len(lanes), count)]


def test_a_started_step_is_sampled_by_its_last_stage_and_settled_when_it_fails(
    model_dir: pathlib.Path,
) -> None:
    """An interleaved step of the step graph (`Stepper.start`): the leader returns its part
    (no token, stage 0's expert load) without waiting for the stages; the last stage samples
    and the driver merges its tokens and loads (`ray_mesh.merged`): the answers are
    transformers'. A step whose stages failed is settled (`Stepper.settle`): the leader's KV
    cache is back to before it (the engine sends it again); a stage that lost a TP follower
    fails the rank."""
    from moe_runtime.executor import ray_mesh

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = [
        hf.generate(
            torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
        )[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    stages = _SampledStages([stage_worker.StageWorker(stage=1, size=2, device="cpu")])
    lead = _leader(model_dir, stages, 2, 8)  # the prefill as two micro-batches: two lanes
    stepper, answered = lead.stepper, {}
    answers: list[list[int]] = [[] for _ in PROMPTS]

    def start(step_id: int) -> step_mod.StepOutput:
        works = []
        for i, prompt in enumerate(PROMPTS):
            n = len(answers[i])
            ids, at = (prompt, 0) if n == 0 else ([answers[i][-1]], len(prompt) + n - 1)
            works.append(step_mod.SeqWork(f"s{i}", ids, at, GREEDY, n))
        out = stepper.start(step_mod.StepInput(step_id, {0: step_mod.RankBatch(seqs=works)}))
        assert out.error is None and out.tokens == {} and out.started_at > 0, out
        return out

    for step_id in range(1, NEW_TOKENS + 1):
        out = start(step_id)
        leader_load = int(out.expert_load.sum())
        assert leader_load > 0  # stage 0's MoE layers
        made = len(stages.answers)
        assert made == (2 if step_id == 1 else 1)  # the prefill as two micro-batches
        (merged,), failures = ray_mesh.merged([out, *stages.lanes(step_id, 2)], [0], [2], answered)
        assert failures == []
        assert int(merged.expert_load.sum()) > leader_load  # the stage's layers added
        assert merged.overlapped is False  # each step started after the last one answered
        for seq_id, token in merged.tokens.items():
            answers[int(seq_id[1:])].append(token)
    assert answers == want

    kv = lead.loaded.kv
    assert kv is not None
    held = [kv.num_tokens(f"s{i}") for i in range(len(PROMPTS))]
    start(50)
    assert [kv.num_tokens(f"s{i}") for i in range(len(PROMPTS))] == [h + 1 for h in held]
    assert stepper.settle(50, "GroupFailed: a peer left") == step_mod.FAILURE_GROUP
    assert [kv.num_tokens(f"s{i}") for i in range(len(PROMPTS))] == held
    # a stage lost a TP follower: the DP rank is lost
    assert stepper.settle(51, "FollowerLost: gone", lost=True) == step_mod.FAILURE_RANK
    lead.shutdown()


def test_the_driver_merges_a_started_step_and_names_the_ranks_whose_stages_failed() -> None:
    """`ray_mesh.merged`: each leader's part with its lanes' tokens, loads and reads; a rank
    with an error lane is named (with whether it lost a follower), its tokens left out; a
    step that began before the last stage answered the step before overlapped."""
    from moe_runtime.executor import ray_mesh, ray_pipeline

    def part(rank: int, at: float) -> step_mod.StepOutput:
        return step_mod.StepOutput(
            rank=rank, step_id=7, expert_load=torch.ones(2, 4, dtype=torch.int64), started_at=at
        )

    def lane(k: int, tokens: dict[str, int], at: float) -> Any:
        load = torch.full((1, 4), 2, dtype=torch.int64)
        answer = {"tokens": tokens, "loads": [(1, 2, load)], "reads": 1, "answered_at": at}
        return ray_pipeline.StageLane(7, k, answer=answer, reads=3)

    failed = ray_pipeline.StageLane(7, 0, error="FollowerLost: x", lost=True)
    answered = {0: 10.0, 1: 10.0}
    raw = [
        part(0, 9.0),
        part(1, 11.0),
        lane(0, {"a": 5}, 12.0),
        lane(1, {"b": 6}, 13.0),
        failed,
        ray_pipeline.StageLane(7, 1),
    ]
    outs, failures = ray_mesh.merged(raw, [0, 1], [2, 2], answered)
    assert outs[0].tokens == {"a": 5, "b": 6} and outs[0].source_reads == 6
    assert outs[0].expert_load.tolist() == [[1] * 4, [5] * 4]  # stage 1's layer: 1 + 2 + 2
    assert outs[0].overlapped and answered[0] == 13.0  # began at 9, the last answer at 10
    assert outs[0].seconds == 4.0  # to its last stage's answer
    assert failures == [ray_mesh.LaneFailure(1, "FollowerLost: x", True)]
    assert outs[1].tokens == {} and answered[1] == 10.0
