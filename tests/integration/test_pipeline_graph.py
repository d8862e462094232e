"""The compiled step graph over a DP rank's pipeline stages (`executor.ray_mesh`, issue 22):
at pipeline size P > 1 every stage actor is a node of the graph, P micro-batch lanes of them
per DP rank (``leader.start_step -> stage 1 -> ...``), and the hidden states go
from stage to stage through the graph's channels instead of a Ray call per stage and
micro-batch, here by Ray's tensor transport (`MOE_STEP_GRAPH_TRANSPORT=shm`: through shared
memory on CPUs, its default on GPUs; on CPUs the lanes are pickled by default). The graph is
the interleaved one (`--pipeline-interleave`, the serve command's default): the last stage
samples, its lanes are outputs of the graph, and the leader's nodes never wait for it.

On a RayExecutor of two DP ranks at P = 2 (the tiny synthetic model; micro-batches from 8 new
tokens, so the prefill goes as two, the decodes whole): once the graph is live every forward
pass of the stages comes from their graph nodes (none from a plain call), the prefill's two
micro-batches from lanes 0 and 1, and the greedy and seeded tokens equal one process's; a
parked graph holds the stages and the leaders (each loop waits on its event, none reads a
channel) and the next step resumes the same graph with the same
tokens; two sets of sequences with two steps in flight (the engine's interleaved steps) run
one step's stage 0 beside the step before in stage 1, every token the same; right after a new step path is set (plain calls while the graph compiles) the stages
step from plain calls, and the graph takes over again. A prefill whose micro-batches outgrow a
graph channel's buffer sends its hidden states through Ray's object store (`ray_pipeline.
Shipper`), so the next switch's teardown does not hang and the graph comes back.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moe_runtime import step as step_mod
from moe_runtime.model import generate
from tests.support import lockstep, polling

pytestmark = pytest.mark.ray

PARK_AFTER = 0.5
MAX_TOKENS = 10
MICRO_BATCH_TOKENS = 8
SEEDED = step_mod.SamplingParams(temperature=0.8, top_p=0.9, seed=7)


def wait_for(condition: Any, what: str, timeout: float = 60.0) -> None:
    polling.poll(condition, what, timeout, every=0.05)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    torch.set_num_threads(1)
    return generate.generate_greedy(lockstep.SOURCE, lockstep.PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def pipeline(ray_session: None) -> Iterator[Any]:
    from moe_runtime.executor import ray_executor, ray_mesh

    with pytest.MonkeyPatch.context() as mp:  # read once, by the executor
        # Ray's tensor transport, as between GPUs (on CPUs through shared memory; this model's
        # lanes stay under the channels' buffer: `ray_mesh.TRANSPORT_ENV`)
        mp.setenv(ray_mesh.TRANSPORT_ENV, "shm")
        # interleaved steps in the graph, as on GPUs (on CPUs by plain calls by default)
        mp.setenv(ray_mesh.STAGES_ENV, "1")
        ex = ray_executor.RayExecutor(
            2,
            pp_size=2,
            pp_micro_batch_tokens=MICRO_BATCH_TOKENS,
            park_after=PARK_AFTER,
            pp_interleave=True,
        )
    assert not ex.step_placeholders  # the leaders never sample: no step sent ahead with one
    ex.start(lockstep.SOURCE, placement=lockstep.identity(2))
    yield ex
    ex.shutdown()


def counts(ex: Any) -> list[dict[str, Any]]:
    """Each DP rank's stage 1's step counts."""
    import ray

    stages = [m.handle.stages[0] for m in ex.roster.targets("step", None)]
    answer: list[dict[str, Any]] = ray.get([s.step_counts.remote() for s in stages], timeout=30)
    return answer


def leaders_holding(ex: Any) -> list[bool]:
    import ray

    leaders = [m.handle.actor for m in ex.roster.targets("step", None)]
    answer: list[bool] = ray.get([a.graph_holding.remote() for a in leaders], timeout=30)
    return answer


def generate_all(ex: Any, *, seeded: bool = False) -> list[list[int]]:
    """The prompts over both DP ranks (ranks 0, 1, 0, 1: rank 0's prefill has 11 new tokens,
    two micro-batches of one sequence each)."""
    run = lockstep.Lockstep(ex)
    for i, prompt in enumerate(lockstep.PROMPTS):
        sampling = SEEDED if seeded else lockstep.GREEDY
        run.add(f"g{i}", prompt, rank=i % 2, max_tokens=MAX_TOKENS, sampling=sampling)
    got = run.run()
    return [got[f"g{i}"] for i in range(len(lockstep.PROMPTS))]


def graph_passes(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[int]:
    return [a["graph"] - b["graph"] for b, a in zip(before, after, strict=True)]


def test_the_stages_step_from_their_nodes_of_the_graph(
    pipeline: Any, reference: list[list[int]]
) -> None:
    wait_for(pipeline.path.graph_live, "the step graph took over")
    assert pipeline.path.graph_nodes() == 4  # two leaders and their stage actors
    # the hidden states go by Ray's tensor transport: per DP rank, the leader's 2 lanes (the
    # last stage answers tokens, to the driver)
    assert pipeline.path.last_compile["tensor_nodes"] == 2 * 2
    before = counts(pipeline)
    assert generate_all(pipeline) == reference
    after = counts(pipeline)
    assert [a["plain"] for a in after] == [b["plain"] for b in before], "a plain call stepped"
    # every step goes through both DP ranks' stages (an idle rank's too: its stages join the
    # experts' collectives): the prefill as two micro-batches (lanes 0 and 1), then one per
    # decode step
    assert graph_passes(before, after) == [MAX_TOKENS + 1] * 2
    assert all(set(a["started"]) == {0, 1} for a in after)
    seeded = generate_all(pipeline, seeded=True)
    assert seeded == generate_all(pipeline, seeded=True)  # seeded sampling repeats itself
    assert [c["plain"] for c in counts(pipeline)] == [b["plain"] for b in before]


def test_two_sets_in_flight_run_in_both_stages_at_once(
    pipeline: Any, reference: list[list[int]]
) -> None:
    """The engine's interleaved steps over the graph: two sets of sequences, each step one
    set's, the next step sent before the last one's outputs are read. The leaders' loops
    run a step's stage 0 while their stages run the step before (the outputs say so), every
    pass from the graph, every token the same as one set alone."""
    wait_for(pipeline.path.graph_live, "the step graph took over")
    seeded = generate_all(pipeline, seeded=True)
    sets = [lockstep.Lockstep(pipeline), lockstep.Lockstep(pipeline)]
    for i, prompt in enumerate(lockstep.PROMPTS):
        sets[0].add(f"g{i}", prompt, rank=i % 2, max_tokens=MAX_TOKENS)
        sets[1].add(f"s{i}", prompt, rank=i % 2, max_tokens=MAX_TOKENS, sampling=SEEDED)
    before = counts(pipeline)
    ids = itertools.count(10_000)
    flying: collections.deque[tuple[lockstep.Lockstep, Any]] = collections.deque()
    for run in sets:
        flying.append((run, pipeline.submit_step(run.next_step(next(ids)))))
    overlapped = steps = 0
    while flying:
        run, sent = flying.popleft()
        outs = pipeline.collect_step(sent)
        run.apply(outs)
        steps += len(outs)
        overlapped += sum(o.overlapped for o in outs)
        if not all(s.done for s in run.seqs.values()):
            flying.append((run, pipeline.submit_step(run.next_step(next(ids)))))
    assert [sets[0].seqs[f"g{i}"].generated for i in range(len(reference))] == reference
    assert [sets[1].seqs[f"s{i}"].generated for i in range(len(reference))] == seeded
    after = counts(pipeline)
    assert [a["plain"] for a in after] == [b["plain"] for b in before], "a plain call stepped"
    assert graph_passes(before, after) == [2 * (MAX_TOKENS + 1)] * 2
    # most steps began on the leader before its stage answered the step before
    assert overlapped > steps // 2, (overlapped, steps)


def test_a_parked_graph_holds_the_stages_and_resumes(
    pipeline: Any, reference: list[list[int]]
) -> None:
    wait_for(pipeline.path.graph_live, "the step graph took over")
    generate_all(pipeline)
    wait_for(pipeline.path.parked, "the idle graph parked", timeout=30)
    # each stage's graph loop and each leader's waits on its event, idle, instead of spinning
    # on a channel read
    wait_for(
        lambda: [c["holding"] for c in counts(pipeline)] == [1, 1], "the stages wait in the hold"
    )
    wait_for(lambda: leaders_holding(pipeline) == [True, True], "the leaders wait in the hold")
    resumes, before = pipeline.path.resumes, counts(pipeline)
    assert generate_all(pipeline) == reference
    assert pipeline.path.resumes == resumes + 1  # the same graph, released
    after = counts(pipeline)
    assert graph_passes(before, after) == [MAX_TOKENS + 1] * 2
    assert [a["holding"] for a in after] == [0, 0]
    assert leaders_holding(pipeline) == [False, False]


def test_plain_calls_step_the_stages_until_the_graph_takes_over(
    pipeline: Any, reference: list[list[int]]
) -> None:
    pipeline._set_path()  # a new step path: plain calls at once, the graph compiled behind them
    before = counts(pipeline)
    run = lockstep.Lockstep(pipeline)
    for i, prompt in enumerate(lockstep.PROMPTS):
        run.add(f"g{i}", prompt, rank=i % 2, max_tokens=MAX_TOKENS)
    run.step()  # sent before the graph's compile (~0.2 s) can end: two micro-batches
    assert [c["plain"] - b["plain"] for c, b in zip(counts(pipeline), before, strict=True)] == [
        2,
        2,
    ]
    got = run.run()
    assert [got[f"g{i}"] for i in range(len(lockstep.PROMPTS))] == reference
    wait_for(pipeline.path.graph_live, "the step graph took over again")
    middle = counts(pipeline)
    generate_all(pipeline)
    after = counts(pipeline)
    assert [a["plain"] for a in after] == [m["plain"] for m in middle]
    assert graph_passes(middle, after) == [MAX_TOKENS + 1] * 2


def test_a_switch_after_a_prefill_over_a_channel_buffer_gets_the_graph_back(
    pipeline: Any, reference: list[list[int]]
) -> None:
    """A micro-batch whose hidden states outgrow a graph channel's buffer (1 MB) goes through
    Ray's object store, the lane carrying its reference (`ray_pipeline.Shipper`): a channel
    that grew would hang the next teardown for good (Ray 2.60), and the graph would never
    come back after the switch."""
    wait_for(pipeline.path.graph_live, "the step graph took over")
    run = lockstep.Lockstep(pipeline)
    prompt = [(7 * i + 3) % 250 + 1 for i in range(1800)]
    for i in range(12):  # 6 x 1800 tokens per DP rank: two micro-batches of 5400 tokens each,
        run.add(f"long{i}", prompt, rank=i % 2, max_tokens=2)  # [5400, 64] float32: 1.4 MB
    got = run.run()
    assert len({tuple(tokens) for tokens in got.values()}) == 1  # one prompt, one answer
    pipeline._set_path()  # a switch: the graph torn down, compiled again
    wait_for(pipeline.path.graph_live, "the step graph came back after the switch", timeout=60)
    assert generate_all(pipeline) == reference


def test_a_lane_ships_only_its_large_host_tensors_by_reference(ray_session: None) -> None:
    import ray

    from moe_runtime.executor import ray_pipeline

    shipper = ray_pipeline.Shipper()
    assert shipper.inline_bytes == 250_000  # a quarter of Ray's default channel buffer
    small, large = torch.ones(16, 64), torch.arange(1024 * 64, dtype=torch.float32).view(1024, 64)
    assert shipper.ship(small) is small
    shipped = shipper.ship({"out": large, "loads": [(0, 2, small)]})
    assert isinstance(shipped["out"], ray.ObjectRef) and shipped["loads"][0][2] is small
    landed = ray_pipeline.Shipper.land(shipped)
    assert torch.equal(landed["out"], large) and landed["loads"] == shipped["loads"]
    assert ray_pipeline.Shipper.land(small) is small
