"""Interleaved step groups (`engine.step_groups`, `--pipeline-interleave`): the running
sequences in two sets, each step taking one set, the sets in turn, so that the step the
engine launches ahead of the one in flight holds none of its sequences (nothing to wait for:
the executor runs its first pipeline stage beside the later stages of the one in flight).
Nothing a consumer sees changes: tokens, texts, finish reasons, stops, seeded sampling."""

from __future__ import annotations

import dataclasses
from typing import Any

from moe_runtime import step as step_types
from moe_runtime.engine import request, step_groups
from tests.support import engine_fakes as fakes
from tests.unit import test_engine_steps_ahead as ahead


@dataclasses.dataclass
class _Seq:
    group: int


def test_a_new_sequence_joins_the_smaller_set() -> None:
    assert step_groups.join([], 2) == 0
    assert step_groups.join([_Seq(0)], 2) == 1
    assert step_groups.join([_Seq(0), _Seq(1)], 2) == 0
    assert step_groups.join([_Seq(1), _Seq(1), _Seq(0)], 2) == 0
    assert step_groups.join([_Seq(0), _Seq(0)], 1) == 0


def test_the_sets_are_taken_in_turn_skipping_one_without_work() -> None:
    a, b = _Seq(0), _Seq(1)
    both = [(a, 3, 4), (b, 3, 4)]
    assert step_groups.pick(both, 2, last=-1) == 0
    assert step_groups.pick(both, 2, last=0) == 1
    assert step_groups.pick(both, 2, last=1) == 0
    # only the set of the last step has work: it goes again (its placeholders wait)
    assert step_groups.pick([(a, 3, 4), (b, 4, 4)], 2, last=0) == 0
    assert step_groups.pick(both, 1, last=0) is None  # one set: every sequence
    assert step_groups.of(both, 1) == [(b, 3, 4)]
    assert step_groups.of(both, None) == both


class _GroupedExecutor(ahead.AheadExecutor):
    """Two steps in flight, and `step_groups` interleaved sets; records which set each
    sequence of each step was in when the ranks ran it."""

    def __init__(self, groups: int) -> None:
        super().__init__(2, seed=3)
        self.step_groups = groups
        self.engine: Any = None
        self.sets: list[set[int]] = []

    def _run(self, step: step_types.StepInput) -> list[step_types.StepOutput]:
        running = self.engine.scheduler.running
        seqs = [w.seq_id for b in step.batches.values() for w in b.seqs]
        self.sets.append({s.group for s in (running.get(i) for i in seqs) if s is not None})
        return super()._run(step)


def _serve(groups: int, *, placeholders: bool = True) -> tuple[dict[str, Any], _GroupedExecutor]:
    executor = _GroupedExecutor(groups)
    executor.step_placeholders = placeholders
    engine = ahead._engine(executor, max_num_seqs_per_rank=6, max_tokens_per_step=8)
    executor.engine = engine
    assert engine.scheduler.step_groups == groups
    results = fakes.serve_all(engine, ahead._requests())
    assert executor.violations == []
    return results, executor


def _waiting_on_the_step_in_flight(executor: _GroupedExecutor) -> int:
    """Steps sent with a placeholder: each waits on the ranks for the step before it."""
    return sum(
        any(w.token_ids[-1] == step_types.PLACEHOLDER for b in s.batches.values() for w in b.seqs)
        for s in executor.sent
    )


def _assert_same(grouped: dict[str, Any], whole: dict[str, Any]) -> None:
    assert grouped.keys() == whole.keys()
    for rid, done in grouped.items():
        other = whole[rid]
        assert (done.token_ids, done.text, done.finish_reason) == (
            other.token_ids,
            other.text,
            other.finish_reason,
        ), rid
    assert {r.finish_reason for r in grouped.values()} == {
        request.FinishReason.STOP,
        request.FinishReason.LENGTH,
    }


def test_two_sets_answer_the_same_and_the_step_ahead_needs_nothing_in_flight() -> None:
    grouped, two = _serve(2)
    whole, one = _serve(1)
    _assert_same(grouped, whole)
    assert two.most_in_flight == 2  # steps were launched ahead
    assert all(len(s) <= 1 for s in two.sets), two.sets  # one set per step
    assert {0, 1} <= set().union(*two.sets)
    # with one set nearly every step launched ahead fills placeholders; with two, only
    # those sent while the other set had no work
    assert _waiting_on_the_step_in_flight(two) * 3 < _waiting_on_the_step_in_flight(one)


def test_an_executor_whose_ranks_never_fill_placeholders_gets_none() -> None:
    """An interleaved step graph's leaders never sample (`RayExecutor.step_placeholders`
    False): the engine launches ahead only what needs nothing of the step in flight (the
    other set), the rest waits for it; the answers stay the same."""
    grouped, two = _serve(2, placeholders=False)
    whole, _ = _serve(1)
    _assert_same(grouped, whole)
    assert two.most_in_flight == 2  # the other set still went ahead
    assert _waiting_on_the_step_in_flight(two) == 0


def test_three_sets_keep_three_steps_in_flight_and_answer_the_same() -> None:
    """At pipeline size 3 the executor asks for three sets (`RayExecutor.step_groups` = P):
    the engine keeps a step of each in flight (one per stage), each holding one set, none of
    the sequences of another step in flight beyond the first one ahead (placeholders there
    only); the answers stay the same."""
    grouped, three = _serve(3)
    whole, _ = _serve(1)
    _assert_same(grouped, whole)
    assert three.most_in_flight == 3
    assert all(len(s) <= 1 for s in three.sets), three.sets  # one set per step
    assert {0, 1, 2} <= set().union(*three.sets)
    # the graph's rule too (its ranks never fill a placeholder): three in flight, none sent
    grouped, graph = _serve(3, placeholders=False)
    _assert_same(grouped, whole)
    assert graph.most_in_flight == 3 and _waiting_on_the_step_in_flight(graph) == 0
