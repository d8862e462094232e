"""The engine against a fake executor whose 'model' checks the KV cache the engine implies.

FakeExecutor keeps, per rank, the tokens of each sequence's KV cache; a SeqWork must continue
it exactly (start_pos == tokens held), else the step fails. The next token is a function of
the whole KV content (and of (seed, num_generated) when sampling), so a wrong re-prefill after
a migration, a lost chunk or a stale cache changes the answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from moe_runtime import step as step_types
from moe_runtime.engine import core, request, seam, text
from tests.support import engine_fakes as fakes
from tests.support import polling

DEADLINE = 10.0


@pytest.fixture
def engine1() -> Iterator[tuple[core.Engine, fakes.FakeExecutor]]:
    engine, executor = fakes.make_engine(1)
    with engine:
        yield engine, executor


def poll(condition: Callable[[], object], what: str, deadline: float = DEADLINE) -> None:
    polling.poll(condition, what, deadline, every=0.002)


# ---------------------------------------------------------------------------- basics


def test_greedy_generation_and_length_stop(engine1: tuple[core.Engine, fakes.FakeExecutor]) -> None:
    engine, _ = engine1
    done = engine.add_request(fakes.req("r1", "ab", max_tokens=4)).result(DEADLINE)
    assert done.text == "cdef"
    assert done.token_ids == [2, 3, 4, 5]
    assert done.finish_reason is request.FinishReason.LENGTH
    assert done.num_prompt_tokens == 2


@pytest.mark.parametrize(
    ("prompt", "stop", "ignore_eos", "expected_text", "reason"),
    [
        pytest.param("v", (), False, "wxy", request.FinishReason.STOP, id="eos"),
        pytest.param("v", (), True, "wxyz", request.FinishReason.LENGTH, id="ignore-eos"),
        pytest.param("a", ("de",), False, "bc", request.FinishReason.STOP, id="stop-string"),
        pytest.param("a", ("c", "xx"), False, "b", request.FinishReason.STOP, id="first-of-two"),
        pytest.param("a", ("dx",), False, "bcde", request.FinishReason.LENGTH, id="near-miss"),
    ],
)
def test_stop_conditions(
    engine1: tuple[core.Engine, fakes.FakeExecutor],
    prompt: str,
    stop: tuple[str, ...],
    ignore_eos: bool,
    expected_text: str,
    reason: request.FinishReason,
) -> None:
    engine, _ = engine1
    done = engine.add_request(
        fakes.req("r", prompt, max_tokens=4, stop=stop, ignore_eos=ignore_eos)
    ).result(DEADLINE)
    assert (done.text, done.finish_reason) == (expected_text, reason)


def test_context_full_ends_with_length() -> None:
    engine, _ = fakes.make_engine(1, max_model_len=6)
    with engine:
        done = engine.add_request(fakes.req("r", "abcd", max_tokens=100)).result(DEADLINE)
    assert done.text == "ef"
    assert done.finish_reason is request.FinishReason.LENGTH


def test_kv_freed_when_finished(engine1: tuple[core.Engine, fakes.FakeExecutor]) -> None:
    engine, executor = engine1
    engine.add_request(fakes.req("r", max_tokens=3)).result(DEADLINE)
    poll(lambda: "r" not in executor.kv[0], "the KV of r to be freed")


def test_idle_ranks_get_empty_batches() -> None:
    engine, executor = fakes.make_engine(3)
    with engine:
        engine.add_request(fakes.req("only", max_tokens=3)).result(DEADLINE)
    assert executor.steps
    for step in executor.steps:
        assert sorted(step.batches) == [0, 1, 2]
    assert sum(len(b.seqs) for b in executor.steps[0].batches.values()) == 1


def test_least_loaded_rank_assignment() -> None:
    engine, executor = fakes.make_engine(3)
    handles = [fakes.req(f"r{i}", max_tokens=3) for i in range(6)]
    # Queue all before the loop starts so they are admitted at the same boundary.
    hs = [engine.add_request(r) for r in handles]
    with engine:
        for h in hs:
            h.result(DEADLINE)
    first = executor.steps[0]
    assert [len(first.batches[r].seqs) for r in range(3)] == [2, 2, 2]


# ---------------------------------------------------------------------------- batching


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_requests_join_and_leave_the_running_batch(async_scheduling: bool) -> None:
    engine, executor = fakes.make_engine(1, async_scheduling=async_scheduling)
    joined: dict[str, int] = {}

    def at_step(outputs: list[step_types.StepOutput]) -> None:
        if outputs[0].step_id == 3:
            joined["b"] = 3
            engine.add_request(fakes.req("b", "k", max_tokens=2))

    engine.on_step(at_step)
    with engine:
        a = engine.add_request(fakes.req("a", "a", max_tokens=8))
        assert a.result(DEADLINE).text == "bcdefghi"
    batches = [executor.seqs_of(s, 0) for s in executor.steps]
    assert batches[-1] == []  # the last step only frees a's KV
    # b joined at the boundary after step 3; with async scheduling step 4 was prepared (and
    # launched) before step 3's callbacks ran, so b joins step 5.
    joined_at = 4 if async_scheduling else 3
    assert batches[:joined_at] == [["a"]] * joined_at
    assert batches[joined_at : joined_at + 2] == [["a", "b"]] * 2
    assert batches[joined_at + 2 : -1] == [["a"]] * (6 - joined_at)  # b left after 2 tokens


def test_prefill_is_chunked_by_the_token_budget() -> None:
    engine, executor = fakes.make_engine(1, max_tokens_per_step=8, max_num_seqs_per_rank=4)
    prompt = "abcdefghijklmnopqrst"  # 20 tokens
    with engine:
        done = engine.add_request(fakes.req("r", prompt, max_tokens=2)).result(DEADLINE)
    works = [w for s in executor.steps for w in s.batches[0].seqs]
    assert [(w.start_pos, len(w.token_ids)) for w in works] == [(0, 8), (8, 8), (16, 4), (20, 1)]
    assert done.text == "uv"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_decodes_go_first_within_the_budget(async_scheduling: bool) -> None:
    engine, executor = fakes.make_engine(
        1, max_tokens_per_step=8, max_num_seqs_per_rank=4, async_scheduling=async_scheduling
    )

    def at_step(outputs: list[step_types.StepOutput]) -> None:
        if outputs[0].step_id == 1:
            engine.add_request(fakes.req("long", "abcdefghijklmnop", max_tokens=1))

    engine.on_step(at_step)
    with engine:
        engine.add_request(fakes.req("short", "a", max_tokens=6)).result(DEADLINE)
    # long joins after step 1 (after step 2, prepared already, with async scheduling)
    joined = executor.steps[2 if async_scheduling else 1].batches[0].seqs
    assert [(w.seq_id, len(w.token_ids)) for w in joined] == [("short", 1), ("long", 7)]


# ---------------------------------------------------------------------------- streaming


def test_stream_deltas_in_order_and_equal_to_the_result(
    engine1: tuple[core.Engine, fakes.FakeExecutor],
) -> None:
    engine, _ = engine1
    handle = engine.add_request(fakes.req("r", "a", max_tokens=6, stop=("fgx",)))
    deltas = list(handle.iter_outputs(DEADLINE))
    assert [d.new_token_ids for d in deltas] == [[1], [2], [3], [4], [5], [6]]
    assert [d.num_generated_tokens for d in deltas] == [1, 2, 3, 4, 5, 6]
    # "f" and "fg" could start the stop string "fgx": held back, then released at the end.
    assert [d.new_text for d in deltas] == ["b", "c", "d", "e", "", "fg"]
    assert [d.finished for d in deltas] == [False] * 5 + [True]
    assert "".join(d.new_text for d in deltas) == handle.result(DEADLINE).text


def test_async_stream(engine1: tuple[core.Engine, fakes.FakeExecutor]) -> None:
    engine, _ = engine1

    async def consume() -> list[request.RequestOutput]:
        handle = engine.add_request(fakes.req("r", "a", max_tokens=4))
        return [out async for out in handle]

    outs = asyncio.run(consume())
    assert "".join(o.new_text for o in outs) == "bcde"
    assert outs[-1].finish_reason is request.FinishReason.LENGTH


def test_abort_frees_the_kv(engine1: tuple[core.Engine, fakes.FakeExecutor]) -> None:
    engine, executor = engine1
    started = threading.Event()
    engine.on_step(lambda outputs: started.set())
    handle = engine.add_request(fakes.req("r", max_tokens=10_000, ignore_eos=True))
    assert started.wait(DEADLINE)
    engine.abort("r")
    assert handle.result(DEADLINE).finish_reason is request.FinishReason.ABORT
    poll(lambda: "r" not in executor.kv[0], "the KV of r to be freed")


# ---------------------------------------------------------------------------- boundary operations


def test_call_at_boundary_pauses_stepping_while_requests_queue(
    engine1: tuple[core.Engine, fakes.FakeExecutor],
) -> None:
    engine, _ = engine1
    first = engine.add_request(fakes.req("a", max_tokens=50, ignore_eos=True))
    poll(lambda: engine.stats().step_count >= 2, "some steps")
    release = threading.Event()
    seen: dict[str, int] = {}

    def hold() -> str:
        seen["entry"] = engine.stats().step_count
        assert release.wait(DEADLINE)
        seen["exit"] = engine.stats().step_count
        return "held"

    future = engine.call_at_boundary(hold)
    poll(lambda: "entry" in seen, "the boundary call to start")
    late = engine.add_request(fakes.req("b", max_tokens=3))  # queued, never refused
    poll(lambda: engine.stats().num_waiting == 1, "b to wait in the queue")
    release.set()
    assert future.result(DEADLINE) == "held"
    assert seen["entry"] == seen["exit"]
    assert late.result(DEADLINE).text == "bcd"
    assert first.result(DEADLINE).finish_reason is request.FinishReason.LENGTH


def test_call_at_boundary_propagates_errors_and_keeps_serving(
    engine1: tuple[core.Engine, fakes.FakeExecutor],
) -> None:
    engine, _ = engine1

    def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        engine.call_at_boundary(boom).result(DEADLINE)
    assert engine.is_alive()
    assert engine.add_request(fakes.req("r", max_tokens=2)).result(DEADLINE).text == "bc"


def run_seeded(
    migrate_at: int | None,
) -> tuple[dict[str, list[int]], fakes.FakeExecutor, list[str]]:
    engine, executor = fakes.make_engine(2)
    moved: list[str] = []
    sampling = step_types.SamplingParams(temperature=0.8, top_p=0.9, seed=11)

    def at_step(outputs: list[step_types.StepOutput]) -> None:
        if migrate_at is not None and outputs[0].step_id == migrate_at:
            moved.extend(engine.migrate_from([1]).result(0))

    engine.on_step(at_step)
    hs = [
        engine.add_request(fakes.req(f"r{i}", "abc"[: i + 1], max_tokens=12, sampling=sampling))
        for i in range(3)
    ]
    with engine:
        results = {h.request_id: h.result(DEADLINE).token_ids for h in hs}
    return results, executor, moved


def test_migrate_from_reprefills_and_keeps_sampling() -> None:
    reference, _, _ = run_seeded(migrate_at=None)
    migrated, executor, moved = run_seeded(migrate_at=5)
    assert migrated == reference
    assert executor.violations == []
    assert moved == ["r1"]  # r0 -> rank 0, r1 -> rank 1, r2 -> rank 0
    step6 = executor.steps[5]
    assert step6.batches[1].free == ["r1"]
    (work,) = [w for w in step6.batches[0].seqs if w.seq_id == "r1"]
    assert (work.start_pos, work.num_generated) == (0, 5)
    assert len(work.token_ids) == 2 + 5  # prompt + generated so far
    assert all(executor.seqs_of(s, 1) == [] for s in executor.steps[5:])
    assert all(1 in s.batches for s in executor.steps[5:])  # draining ranks still step


def test_leaving_ranks_get_no_more_step_input() -> None:
    engine, executor = fakes.make_engine(3)
    endless = {"max_tokens": 100_000, "ignore_eos": True}
    with engine:
        hs = [engine.add_request(fakes.req(f"r{i}", **endless)) for i in range(3)]  # type: ignore[arg-type]
        poll(lambda: engine.stats().seqs_per_rank == {0: 1, 1: 1, 2: 1}, "one per rank")

        def switch() -> None:  # the coordinator's scale-down switch: migrate, switch, shrink
            engine.migrate_from([2]).result(0)
            engine.set_active_ranks([0, 1]).result(0)

        engine.call_at_boundary(switch).result(DEADLINE)
        steps = engine.stats().step_count
        poll(lambda: engine.stats().step_count > steps + 3, "steps after the switch")
        for h in hs:
            engine.abort(h.request_id)
        results = [h.result(DEADLINE) for h in hs]
    after = [s for s in executor.steps if s.step_id > steps]
    assert after and all(sorted(s.batches) == [0, 1] for s in after)
    assert all(r.error is None for r in results)


def test_draining_rank_takes_no_new_requests_until_reactivated() -> None:
    engine, executor = fakes.make_engine(2)
    with engine:
        engine.migrate_from([1]).result(DEADLINE)
        engine.add_request(fakes.req("x", max_tokens=2)).result(DEADLINE)
        engine.add_request(fakes.req("y", max_tokens=2)).result(DEADLINE)
        assert all(executor.seqs_of(s, 1) == [] for s in executor.steps)
        engine.set_active_ranks([0, 1]).result(DEADLINE)
        a = engine.add_request(fakes.req("a", max_tokens=3))
        b = engine.add_request(fakes.req("b", max_tokens=3))
        a.result(DEADLINE), b.result(DEADLINE)
    assert any(executor.seqs_of(s, 1) for s in executor.steps)


def test_set_active_ranks_grows_and_shrinks() -> None:
    executor = fakes.FakeExecutor(3)
    config = seam.EngineConfig(max_model_len=100_000)
    engine = core.Engine(executor, fakes.LetterTokenizer(), config, active_ranks=[0])
    endless = {"max_tokens": 100_000, "ignore_eos": True}
    with engine:
        engine.add_request(fakes.req("a", max_tokens=2)).result(DEADLINE)
        assert sorted(executor.steps[-1].batches) == [0]
        engine.set_active_ranks([0, 1, 2]).result(DEADLINE)
        hs = [engine.add_request(fakes.req(f"r{i}", **endless)) for i in range(3)]  # type: ignore[arg-type]
        poll(lambda: engine.stats().seqs_per_rank == {0: 1, 1: 1, 2: 1}, "one per rank")
        engine.set_active_ranks([0]).result(DEADLINE)  # shrink: sequences move to rank 0
        assert engine.stats().seqs_per_rank == {0: 3}
        steps = engine.stats().step_count
        poll(lambda: engine.stats().step_count > steps + 3, "steps after the shrink")
        for h in hs:
            engine.abort(h.request_id)
        results = [h.result(DEADLINE) for h in hs]
    assert sorted(executor.steps[-1].batches) == [0]
    assert executor.violations == []
    for r in results:
        assert r.finish_reason is request.FinishReason.ABORT
        assert r.token_ids == [(k + 1) % fakes.VOCAB for k in range(len(r.token_ids))]


def test_relabel_ranks_follows_the_workers() -> None:
    engine, executor = fakes.make_engine(3)
    endless = {"max_tokens": 100_000, "ignore_eos": True}
    with engine:
        hs = [engine.add_request(fakes.req(f"r{i}", **endless)) for i in range(3)]  # type: ignore[arg-type]
        poll(lambda: engine.stats().seqs_per_rank == {0: 1, 1: 1, 2: 1}, "one per rank")

        def switch() -> None:  # an executor switch renumbers its workers, then the engine follows
            executor.kv[0], executor.kv[2] = executor.kv[2], executor.kv[0]
            engine.relabel_ranks({0: 2, 2: 0}).result(0)  # on the engine thread: runs at once

        engine.call_at_boundary(switch).result(DEADLINE)
        steps = engine.stats().step_count
        poll(lambda: engine.stats().step_count > steps + 3, "steps after the relabel")
        for h in hs:
            engine.abort(h.request_id)
        results = [h.result(DEADLINE) for h in hs]
    assert executor.violations == []
    for r in results:
        assert r.error is None
        assert r.token_ids == [(k + 1) % fakes.VOCAB for k in range(len(r.token_ids))]


def test_step_control_reaches_the_next_step_even_when_idle(
    engine1: tuple[core.Engine, fakes.FakeExecutor],
) -> None:
    engine, executor = engine1
    outputs = engine.add_step_control({"expert_epoch": 3}).result(DEADLINE)
    assert outputs[0].step_id == executor.steps[-1].step_id
    assert executor.steps[-1].control == {"expert_epoch": 3}
    engine.add_request(fakes.req("r", max_tokens=2)).result(DEADLINE)
    assert executor.steps[-1].control == {}


def test_on_step_sees_every_step_and_last_token_time_advances(
    engine1: tuple[core.Engine, fakes.FakeExecutor],
) -> None:
    engine, executor = engine1
    seen: list[int] = []
    engine.on_step(lambda outputs: seen.append(outputs[0].step_id))
    before = time.monotonic()
    engine.add_request(fakes.req("r", max_tokens=3)).result(DEADLINE)
    # a step may be recorded by the executor before its callback runs: wait for both
    poll(lambda: len(seen) >= 3 and seen == [s.step_id for s in list(executor.steps)], "callbacks")
    last = engine.last_token_time
    assert last is not None and last >= before


# ---------------------------------------------------------------------------- failures


def test_transient_rank_error_is_retried_with_the_same_answer() -> None:
    engine, executor = fakes.make_engine(2)
    executor.fail_rank = lambda step_id, rank: "flaky" if (step_id, rank) == (3, 0) else None
    with engine:
        done = engine.add_request(fakes.req("r", "a", max_tokens=6)).result(DEADLINE)
    assert done.text == "bcdefg"
    assert done.error is None


def test_executor_exception_is_retried() -> None:
    engine, executor = fakes.make_engine(1)
    executor.raise_at = {2}
    with engine:
        done = engine.add_request(fakes.req("r", "a", max_tokens=4)).result(DEADLINE)
    assert done.text == "bcde"


def test_persistent_rank_error_fails_only_its_requests() -> None:
    engine, executor = fakes.make_engine(2, max_step_retries=1)
    executor.fail_rank = lambda step_id, rank: "rank is gone" if rank == 1 else None
    with engine:
        a = engine.add_request(fakes.req("a", max_tokens=3))
        b = engine.add_request(fakes.req("b", max_tokens=3))
        ra, rb = a.result(DEADLINE), b.result(DEADLINE)
        assert engine.is_alive()
    assert (ra.text, ra.error) == ("bcd", None)
    assert rb.finish_reason is request.FinishReason.ERROR
    assert rb.error is not None and "rank is gone" in rb.error


def test_failure_callback_can_repair_before_the_retry() -> None:
    engine, executor = fakes.make_engine(2, max_step_retries=1)
    executor.fail_rank = lambda step_id, rank: "rank 1 is gone" if rank == 1 else None
    failures: list[seam.StepFailure] = []

    def repair(failure: seam.StepFailure) -> None:  # a fault handler: drop the dead rank
        failures.append(failure)
        engine.set_active_ranks([0])  # on the engine thread: applied before the retry

    engine.on_step_failure(repair)
    with engine:
        a = engine.add_request(fakes.req("a", max_tokens=3))
        b = engine.add_request(fakes.req("b", max_tokens=3))
        ra, rb = a.result(DEADLINE), b.result(DEADLINE)
    assert (ra.text, ra.error, rb.text, rb.error) == ("bcd", None, "bcd", None)
    assert [f.ranks for f in failures] == [(1,)]
    assert failures[0].exception is None and "rank 1 is gone" in failures[0].message


def test_executor_exception_names_its_ranks() -> None:
    class RankDied(RuntimeError):
        ranks = [0]

    engine, executor = fakes.make_engine(1)
    failures: list[seam.StepFailure] = []
    engine.on_step_failure(failures.append)

    def execute_step(step: step_types.StepInput) -> list[step_types.StepOutput]:
        if step.step_id == 2:
            raise RankDied("rank 0 died")
        return fakes.FakeExecutor.execute_step(executor, step)

    executor.execute_step = execute_step  # type: ignore[method-assign]
    with engine:
        assert engine.add_request(fakes.req("r", max_tokens=3)).result(DEADLINE).text == "bcd"
    assert [(f.step_id, f.ranks) for f in failures] == [(2, (0,))]
    assert isinstance(failures[0].exception, RankDied)


def test_stop_ends_unfinished_requests_with_an_error() -> None:
    engine, _ = fakes.make_engine(1)
    engine.start()
    handle = engine.add_request(fakes.req("r", max_tokens=100_000, ignore_eos=True))
    poll(lambda: engine.stats().step_count > 0, "a step")
    engine.stop()
    done = handle.result(DEADLINE)
    assert done.finish_reason is request.FinishReason.ERROR
    assert not engine.is_alive()
    with pytest.raises(core.EngineStopped):
        engine.add_request(fakes.req("late"))
    with pytest.raises(core.EngineStopped):
        engine.call_at_boundary(lambda: None).result(DEADLINE)


def test_boundary_future_can_be_waited_from_another_thread(
    engine1: tuple[core.Engine, fakes.FakeExecutor],
) -> None:
    engine, _ = engine1

    def through_boundary(i: int) -> int:
        return engine.call_at_boundary(lambda: i).result(DEADLINE)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(through_boundary, i) for i in range(8)]
        assert sorted(f.result(DEADLINE) for f in futures) == list(range(8))


# ---------------------------------------------------------------------------- text


@pytest.mark.parametrize(
    ("pieces", "stop", "deltas"),
    [
        pytest.param(["a", "b", "c"], (), ["a", "b", "c"], id="plain"),
        pytest.param(["a", "\ufffd", "é"], (), ["a", "", "é"], id="incomplete-char-held"),
        pytest.param(["x", "ST", "OP", "y"], ("STOP",), ["x", "", ""], id="stop-across-tokens"),
        pytest.param(["x", "S", "a"], ("STOP",), ["x", "", "Sa"], id="false-alarm-released"),
    ],
)
def test_incremental_text(pieces: list[str], stop: tuple[str, ...], deltas: list[str]) -> None:
    class Pieces:
        def decode(self, ids: list[int]) -> str:
            out = "".join(pieces[i] for i in ids)
            # a replacement char followed by its continuation decodes to the full character
            return out.replace("\ufffdé", "é")

    inc = text.IncrementalText(Pieces(), stop=stop)
    got = []
    for i in range(len(pieces)):
        got.append(inc.append(i))
        if inc.stopped:
            break
    assert got == deltas
