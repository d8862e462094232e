"""Async scheduling (`engine.prepare`, `EngineConfig.async_scheduling`): step N+1 is admitted
and prepared while the ranks run step N, and nothing a consumer sees changes: tokens, stops,
aborts, retries after a failed step, boundary calls with no step in flight."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

from moe_runtime import step as step_types
from moe_runtime.engine import core, prepare, request, seam
from tests.support import engine_fakes as fakes

DEADLINE = 10.0


def _engine(executor: fakes.FakeExecutor, async_scheduling: bool, **config: Any) -> core.Engine:
    return core.Engine(
        executor,
        fakes.LetterTokenizer(),
        seam.EngineConfig(max_model_len=64, async_scheduling=async_scheduling, **config),
    )


class HookedExecutor(fakes.FakeExecutor):
    """Calls `hook(step)` at the start of every step; `running`: a step is executing."""

    def __init__(self, num_ranks: int) -> None:
        super().__init__(num_ranks)
        self.hook: Any = lambda step: None
        self.running = False

    def execute_step(self, step: step_types.StepInput) -> list[step_types.StepOutput]:
        self.running = True
        try:
            self.hook(step)
            return super().execute_step(step)
        finally:
            self.running = False


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_next_step_is_admitted_and_prepared_while_a_step_runs(
    async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Step 2 (a decode of "a") submits "b" and waits until a preparation holding b's prefill
    # was made: the engine thread can only make it while the step runs with async scheduling.
    prepared: list[set[str]] = []
    made = threading.Event()

    def recording(scheduler: Any, inflight: Any) -> prepare.Prepared:
        out = prepare_fn(scheduler, inflight)
        prepared.append({e.seq.seq_id for e in out.entries})
        if "b" in prepared[-1]:
            made.set()
        return out

    prepare_fn = prepare.prepare
    monkeypatch.setattr(prepare, "prepare", recording)
    executor = HookedExecutor(1)
    engine = _engine(executor, async_scheduling)
    seen: dict[str, bool] = {}

    def hook(step: step_types.StepInput) -> None:
        if step.step_id == 2:
            b = engine.add_request(fakes.req("b", "k", max_tokens=2))
            seen["b"] = made.wait(DEADLINE if async_scheduling else 0.3)
            seen["admitted"] = engine.stats().num_running == 2
            del b

    executor.hook = hook
    with engine:
        a = engine.add_request(fakes.req("a", "a", max_tokens=5))
        assert a.result(DEADLINE).text == "bcdef"
    assert seen == {"b": async_scheduling, "admitted": async_scheduling}
    # b's prefill runs in the step after step 2 either way: prepared, or scheduled at once.
    assert executor.seqs_of(executor.steps[2], 0) == ["a", "b"]
    assert executor.violations == []


class JitteryExecutor(fakes.FakeExecutor):
    """Steps of random duration; aborts `abort_ids` while step `abort_at` runs."""

    def __init__(self, seed: int, abort_at: int, abort_ids: list[str]) -> None:
        super().__init__(2)
        self._rng = random.Random(seed)
        self.abort_at = abort_at
        self.abort_ids = abort_ids
        self.engine: core.Engine | None = None

    def execute_step(self, step: step_types.StepInput) -> list[step_types.StepOutput]:
        if step.step_id == self.abort_at and self.engine is not None:
            for rid in self.abort_ids:
                self.engine.abort(rid)
        time.sleep(self._rng.random() * 0.003)  # a step's duration, not a wait for anything
        return super().execute_step(step)


def _serve(async_scheduling: bool) -> tuple[dict[str, request.RequestOutput], list[str]]:
    requests = [
        fakes.req(
            f"r{i}",
            "abcdefghijklmnopqrstuvwxy"[i % 25] * (1 + i % 5),
            max_tokens=3 + i % 11,
            stop=("kl",) if i % 4 == 0 else (),
            sampling=step_types.SamplingParams(temperature=1.0, seed=i) if i % 3 == 0 else None,
        )
        for i in range(28)
    ]
    aborted = [r.request_id for r in requests[2::6]]
    executor = JitteryExecutor(5, abort_at=4, abort_ids=aborted)
    engine = _engine(executor, async_scheduling, max_num_seqs_per_rank=6, max_tokens_per_step=8)
    executor.engine = engine
    results = fakes.serve_all(engine, requests)
    assert executor.violations == []
    return results, aborted


def test_mixed_streams_are_the_same_with_and_without_async_scheduling() -> None:
    ahead, aborted = _serve(True)
    inline, _ = _serve(False)
    fakes.assert_same_answers(ahead, inline, aborted)


@pytest.mark.parametrize("failure", ["raises", "rank-error"])
def test_a_failed_step_drops_the_prepared_step_and_retries(failure: str) -> None:
    def run(fail: bool) -> tuple[dict[str, list[int]], fakes.FakeExecutor]:
        executor = fakes.FakeExecutor(2)
        if fail:
            fakes.inject(executor, failure, 3)
        return fakes.run_four(_engine(executor, True), max_tokens=6), executor

    reference, _ = run(False)
    results, executor = run(True)
    assert results == reference
    assert executor.violations == []
    retry = executor.steps[3]  # step 4: scheduled afresh, not the one prepared during step 3
    failed_ranks = {0, 1} if failure == "raises" else {1}
    for rank in failed_ranks:
        works = retry.batches[rank].seqs
        assert works and all(w.start_pos == 0 for w in works)  # re-prefilled
        assert all(len(w.token_ids) > 1 for w in works)
        assert sorted(retry.batches[rank].free) == sorted(w.seq_id for w in works)
    for rank in {0, 1} - failed_ranks:  # the rank that stepped goes on decoding
        assert all(len(w.token_ids) == 1 for w in retry.batches[rank].seqs)


def test_a_boundary_call_made_while_a_step_runs_waits_for_no_step_in_flight() -> None:
    executor = HookedExecutor(3)
    engine = _engine(executor, True)
    in_flight: list[bool] = []

    def hook(step: step_types.StepInput) -> None:
        if step.step_id == 3:
            engine.call_at_boundary(lambda: in_flight.append(executor.running))
            engine.set_active_ranks([0, 1])

    executor.hook = hook
    lengths = fakes.run_endless(engine)
    assert in_flight == [False]
    assert [set(s.batches) for s in executor.steps[:3]] == [{0, 1, 2}] * 3
    assert all(set(s.batches) == {0, 1} for s in executor.steps[3:])  # the very next step
    moved = executor.steps[3].batches
    assert any(w.start_pos == 0 and len(w.token_ids) > 2 for b in moved.values() for w in b.seqs)
    assert lengths == [12] * 3
    assert executor.violations == []
