"""Two steps in flight (`EngineConfig.overlap_steps`, `prepare.launch_ahead`): with an executor
that takes a step before the last one's outputs came back, the engine launches step N+1 while
N runs, the ranks fill its placeholders with the tokens they sampled, and nothing a consumer
sees changes: tokens, texts, finish reasons, stops, aborts, retries after a failed step, and
boundary calls still run with no step in flight."""

from __future__ import annotations

import concurrent.futures
import random
import time
from typing import Any

import pytest

from moe_runtime import step as step_types
from moe_runtime.engine import core, request, seam
from tests.support import engine_fakes as fakes

DEADLINE = 10.0


class AheadExecutor(fakes.FakeExecutor):
    """The fake ranks behind one ordered thread (as a rank actor runs its calls in the order
    they were sent): `submit_step` returns at once. Like `rank.stepper.Stepper`, a rank fills
    each placeholder with the token it sampled for that sequence in its last step (a step
    takes its sequences' entries, so the step after a failed one finds none and its rank
    reports an error), and a start position below what its KV holds cuts the KV there (as
    `KVCache.reserve`). Steps last a random 0-3 ms; `hook(step)` runs before each."""

    def __init__(self, num_ranks: int, *, seed: int = 0) -> None:
        super().__init__(num_ranks)
        self._rng = random.Random(seed)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fake-ranks")
        self.sampled: dict[int, dict[str, int]] = {r: {} for r in range(num_ranks)}
        self.hook: Any = lambda step: None
        #: Every step as the engine sent it (`steps`: as the ranks ran it, placeholders filled).
        self.sent: list[step_types.StepInput] = []
        self.in_flight = 0
        #: The most steps sent and not yet collected at once; positions cut from the KV.
        self.most_in_flight = 0
        self.cut = 0
        #: (seq_id, KV positions it held after each step): no step runs past a length finish.
        self.held: dict[str, int] = {}

    def submit_step(self, step: step_types.StepInput) -> concurrent.futures.Future[Any]:
        with self.lock:
            self.sent.append(step)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return self._pool.submit(self._run, step)

    def collect_step(self, sent: Any) -> list[step_types.StepOutput]:
        try:
            outputs: list[step_types.StepOutput] = sent.result()
            return outputs
        finally:
            with self.lock:
                self.in_flight -= 1

    def execute_step(self, step: step_types.StepInput) -> list[step_types.StepOutput]:
        return self.collect_step(self.submit_step(step))

    def _run(self, step: step_types.StepInput) -> list[step_types.StepOutput]:
        self.hook(step)
        time.sleep(self._rng.random() * 0.003)  # a step's duration, not a wait for anything
        batches: dict[int, step_types.RankBatch] = {}
        unfilled: dict[int, str] = {}
        for rank, batch in step.batches.items():
            seqs = []
            for w in batch.seqs:
                sampled = self.sampled[rank].pop(w.seq_id, None)
                ids = list(w.token_ids)
                if ids[-1] == step_types.PLACEHOLDER:
                    if sampled is None:
                        unfilled[rank] = f"{w.seq_id}: no token sampled to fill its placeholder"
                        continue
                    ids[-1] = sampled
                held = self.kv[rank].get(w.seq_id)
                if held is not None and w.start_pos < len(held):
                    del held[w.start_pos :]
                    self.cut += 1
                seqs.append(
                    step_types.SeqWork(w.seq_id, ids, w.start_pos, w.sampling, w.num_generated)
                )
            batches[rank] = step_types.RankBatch(seqs=seqs, free=list(batch.free))
        fail = self.fail_rank
        self.fail_rank = lambda step_id, rank: unfilled.get(rank) or fail(step_id, rank)
        try:
            outputs = super().execute_step(
                step_types.StepInput(step.step_id, batches, step.control)
            )
        finally:
            self.fail_rank = fail
        for out in outputs:
            self.sampled[out.rank].update(out.tokens)
            for seq_id in out.tokens:
                self.held[seq_id] = max(self.held.get(seq_id, 0), len(self.kv[out.rank][seq_id]))
        return outputs


def _engine(executor: fakes.FakeExecutor, **config: Any) -> core.Engine:
    return core.Engine(
        executor, fakes.LetterTokenizer(), seam.EngineConfig(max_model_len=64, **config)
    )


def _requests() -> list[request.Request]:
    return [
        fakes.req(
            f"r{i}",
            "abcdefghijklmnopqrstuvwxy"[i % 25 :][: 1 + i % 5] or "wxy",
            max_tokens=3 + i % 11,
            stop=("kl",) if i % 4 == 0 else (),
            sampling=step_types.SamplingParams(temperature=1.0, seed=i) if i % 3 == 0 else None,
        )
        for i in range(28)
    ]


def _serve(overlap: bool) -> tuple[dict[str, request.RequestOutput], list[str], AheadExecutor]:
    requests = _requests()
    aborted = [r.request_id for r in requests[2::6]]
    executor = AheadExecutor(2, seed=5)
    engine = _engine(
        executor, overlap_steps=overlap, max_num_seqs_per_rank=6, max_tokens_per_step=8
    )

    def hook(step: step_types.StepInput) -> None:
        if step.step_id == 4:
            for rid in aborted:
                engine.abort(rid)

    executor.hook = hook
    results = fakes.serve_all(engine, requests)
    assert executor.violations == []
    return results, aborted, executor


def test_mixed_streams_are_the_same_with_two_steps_in_flight() -> None:
    ahead, aborted, executor = _serve(True)
    one, _, single = _serve(False)
    assert executor.most_in_flight == 2  # steps really overlapped
    assert single.most_in_flight == 1
    fakes.assert_same_answers(ahead, one, aborted)
    # A stop token ends a sequence whose next token the step launched ahead already ran: not
    # applied, not streamed (the texts above are equal), its KV freed later.
    eos = [rid for rid, r in ahead.items() if r.token_ids and r.token_ids[-1] == fakes.EOS]
    assert eos


def test_no_step_runs_a_sequence_past_its_length_limit() -> None:
    executor = AheadExecutor(1)
    engine = _engine(executor)
    endless = {"ignore_eos": True}
    with engine:
        hs = [
            engine.add_request(fakes.req(f"r{n}", "ab", max_tokens=n, **endless))  # type: ignore[arg-type]
            for n in (1, 2, 5, 9)
        ]
        results = [h.result(DEADLINE) for h in hs]
    assert [len(r.token_ids) for r in results] == [1, 2, 5, 9]
    assert executor.most_in_flight == 2
    # prompt 2 + n generated: the last generated token is sampled, never run through the KV
    assert {rid: executor.held[rid] for rid in ("r1", "r2", "r5", "r9")} == {
        "r1": 2,
        "r2": 3,
        "r5": 6,
        "r9": 10,
    }


@pytest.mark.parametrize("failure", ["raises", "rank-error"])
def test_a_failed_step_drops_the_step_launched_ahead_and_retries(failure: str) -> None:
    def run(fail: bool) -> tuple[dict[str, list[int]], AheadExecutor]:
        executor = AheadExecutor(2)
        if fail:
            fakes.inject(executor, failure, 5)
        return fakes.run_four(_engine(executor), max_tokens=8), executor

    reference, _ = run(False)
    results, executor = run(True)
    assert results == reference
    assert executor.violations == []
    assert executor.most_in_flight == 2
    ahead = executor.sent[5]  # step 6: launched while step 5 ran, dropped
    assert any(
        w.token_ids[-1] == step_types.PLACEHOLDER for b in ahead.batches.values() for w in b.seqs
    )
    retry = executor.sent[6]  # step 7: scheduled afresh, no placeholder
    assert all(t >= 0 for b in retry.batches.values() for w in b.seqs for t in w.token_ids)
    failed_ranks = {0, 1} if failure == "raises" else {1}
    for rank in failed_ranks:
        works = retry.batches[rank].seqs
        assert works and all(w.start_pos == 0 for w in works)  # re-prefilled


def test_a_boundary_call_waits_for_both_steps_in_flight() -> None:
    executor = AheadExecutor(3)
    engine = _engine(executor)
    seen: list[int] = []

    def hook(step: step_types.StepInput) -> None:
        if step.step_id == 4:
            engine.call_at_boundary(lambda: seen.append(executor.in_flight))
            engine.set_active_ranks([0, 1])

    executor.hook = hook
    lengths = fakes.run_endless(engine)
    assert seen == [0]
    assert executor.most_in_flight == 2
    first = next(i for i, s in enumerate(executor.steps) if set(s.batches) == {0, 1})
    assert all(set(s.batches) == {0, 1} for s in executor.steps[first:])
    assert lengths == [12] * 3
    assert executor.violations == []
