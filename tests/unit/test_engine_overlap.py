"""Async output processing (`engine.delivery`): a step's outputs are detokenised and streamed
while the ranks run the next step, and nothing a consumer sees changes (order, stops, text)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from moe_runtime import step as step_types
from moe_runtime.engine import core, request, seam
from tests.support import engine_fakes as fakes

DEADLINE = 10.0


class GatedTokenizer(fakes.LetterTokenizer):
    """Decoding a text that holds `gate_token` waits (at most `wait` s) for `opened`, which the
    executor sets when it starts a step after `after_step`; `overlapped` tells whether it came
    while the decode waited."""

    def __init__(self, gate_token: int, wait: float) -> None:
        self.gate_token = gate_token
        self.wait = wait
        self.opened = threading.Event()
        self.overlapped: bool | None = None

    def decode(self, token_ids: list[int]) -> str:
        if self.gate_token in token_ids and self.overlapped is None:
            self.overlapped = self.opened.wait(self.wait)
        return super().decode(token_ids)


class SignallingExecutor(fakes.FakeExecutor):
    def __init__(self, event: threading.Event, after_step: int) -> None:
        super().__init__(1)
        self.event = event
        self.after_step = after_step

    def execute_step(self, step: step_types.StepInput) -> list[step_types.StepOutput]:
        if step.step_id > self.after_step:
            self.event.set()
        return super().execute_step(step)


@pytest.mark.parametrize("async_outputs", [True, False], ids=["async", "sync"])
def test_step_outputs_are_detokenised_while_the_next_step_runs(async_outputs: bool) -> None:
    # Prompt "a": step 1 samples "b" (1). Its text is made while step 2 executes only when the
    # outputs are processed off the step path; in the synchronous loop step 2 waits for it.
    tok = GatedTokenizer(gate_token=1, wait=DEADLINE if async_outputs else 0.3)
    executor = SignallingExecutor(tok.opened, after_step=1)
    engine = core.Engine(
        executor, tok, seam.EngineConfig(max_model_len=64, async_outputs=async_outputs)
    )
    with engine:
        done = engine.add_request(fakes.req("r", "a", max_tokens=4)).result(DEADLINE)
    assert (done.text, done.finish_reason) == ("bcde", request.FinishReason.LENGTH)
    assert tok.overlapped is async_outputs


def test_no_token_past_a_stop_string_is_computed_or_streamed() -> None:
    engine, executor = fakes.make_engine(1)
    with engine:
        handle = engine.add_request(fakes.req("r", "a", max_tokens=10, stop=("de",)))
        done = handle.result(DEADLINE)
        engine.add_request(fakes.req("after", "p", max_tokens=3)).result(DEADLINE)
    assert (done.text, done.finish_reason) == ("bc", request.FinishReason.STOP)
    assert done.token_ids == [1, 2, 3, 4]  # b c d e: "e" completes the stop string
    steps_with_r = [s for s in executor.steps if "r" in executor.seqs_of(s, 0)]
    assert len(steps_with_r) == 4  # prefill + 3 decodes: none after the stop


class JitteryTokenizer(fakes.LetterTokenizer):
    """Decodes at a random pace, so the output thread lags the steps by varying amounts."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def decode(self, token_ids: list[int]) -> str:
        with self._lock:
            pause = self._rng.random() * 0.002
        time.sleep(pause)
        return super().decode(token_ids)


def _serve(async_outputs: bool) -> tuple[dict[str, list[request.RequestOutput]], list[str]]:
    executor = fakes.FakeExecutor(2)
    engine = core.Engine(
        executor,
        JitteryTokenizer(7),
        seam.EngineConfig(max_model_len=64, max_num_seqs_per_rank=8, async_outputs=async_outputs),
    )
    requests = [
        fakes.req(
            f"r{i}",
            "abcdefghijklmnopqrstuvwxy"[i % 25],
            max_tokens=3 + i % 9,
            stop=("kl",) if i % 4 == 0 else (),
            sampling=step_types.SamplingParams(temperature=1.0, seed=i) if i % 3 == 0 else None,
        )
        for i in range(24)
    ]
    with engine:
        handles = [engine.add_request(r) for r in requests]
        aborted = [h.request_id for h in handles[5::7]]
        for rid in aborted:
            engine.abort(rid)
        streams = {h.request_id: list(h.iter_outputs(DEADLINE)) for h in handles}
    for h in handles:  # nothing after the finished output
        assert h.result(0).finish_reason is streams[h.request_id][-1].finish_reason
        assert sum(o.finished for o in h._outputs) == 1 and h._outputs[-1].finished
    return streams, aborted


def test_streams_are_the_same_with_and_without_the_output_thread() -> None:
    threaded, aborted = _serve(True)
    inline, _ = _serve(False)
    for rid, outs in threaded.items():
        if rid in aborted:
            continue  # where an abort lands depends on timing in both loops
        assert [(o.new_token_ids, o.new_text, o.finish_reason) for o in outs] == [
            (o.new_token_ids, o.new_text, o.finish_reason) for o in inline[rid]
        ], rid


class FailingTokenizer(fakes.LetterTokenizer):
    def decode(self, token_ids: list[int]) -> str:
        if 3 in token_ids:
            raise UnicodeError("cannot decode d")
        return super().decode(token_ids)


def test_a_failed_detokenisation_ends_only_its_request() -> None:
    engine = core.Engine(fakes.FakeExecutor(1), FailingTokenizer(), seam.EngineConfig(64))
    with engine:
        bad = engine.add_request(fakes.req("bad", "a", max_tokens=6))
        good = engine.add_request(fakes.req("good", "m", max_tokens=3))
        assert good.result(DEADLINE).text == "nop"
        done = bad.result(DEADLINE)
    assert done.finish_reason is request.FinishReason.ERROR
    assert sum(o.finished for o in bad._outputs) == 1 and bad._outputs[-1].finished
